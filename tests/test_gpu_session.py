"""scripts/gpu_session.sh, the prepared GPU session, at its toy size on the CPU (TINY=1): the stages that train,
compare several recipes at once and analyse run to the end and leave the files a device call brings back, so a
short GPU window is not spent on a broken script (README, "Reproducing the paper's tables")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_session_script_runs_its_stages_at_a_toy_size(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "TINY": "1", "STAGES": "smoke check extra analysis", "WORK": str(work), "PY": sys.executable,
           "INSTALL": "0", "GBATTN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    log = (out / "log.txt").read_text(encoding="utf-8")
    assert proc.returncode == 0, log + proc.stderr[-2000:]
    for stage in ("smoke-train", "smoke-compare", "extra", "analysis"):
        assert f"end {stage} (exit 0)" in log, log
    assert sorted(p.name for p in out.iterdir()) == ["analysis-gba-m2-seed42.tar.gz", "extra-runs.tar.gz", "log.txt"]
    with tarfile.open(out / "extra-runs.tar.gz") as archive:
        names = archive.getnames()
    assert not [n for n in names if n.endswith((".pt", ".safetensors"))]  # too large to come back
    for recipe in ("paper-postln", "gba-design-paper", "depth-paper"):
        assert f"./{recipe}/results.json" in names, names
    for seed in (42, 123, 7):
        assert f"./gba-design-paper/gba-m3/seed{seed}/result.json" in names
    with tarfile.open(out / "analysis-gba-m2-seed42.tar.gz") as archive:
        assert "analysis/summary.json" in archive.getnames()


def test_a_stage_skipped_for_its_budget_is_not_reported_as_failing(tmp_path):
    """A budget spent before the smoke or resume stage skips them (status 200): the smoke stage said "smoke failed:
    stopping" and exited 3, the resume stage "RESUME FAILS on this device", though neither ran."""
    env = {**os.environ, "TINY": "1", "STAGES": "smoke resume", "BUDGET": "20", "WORK": str(tmp_path / "work"),
           "PY": sys.executable, "INSTALL": "0", "GBATTN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    log = (tmp_path / "out" / "log.txt").read_text(encoding="utf-8")
    assert proc.returncode == 0, log + proc.stderr[-2000:]
    assert "skip smoke-train: budget spent" in log and "skip resume-start: budget spent" in log, log
    assert "resume not tested: budget spent" in log and "FAIL" not in log and "failed" not in log, log


def _session(tmp_path, env: dict, *args: str, cwd=None, wait: bool = True):
    """scripts/gpu_session.sh at its toy size with ``env`` added: the finished process (or, ``wait=False``, the
    running one)."""
    env = {**os.environ, "TINY": "1", "PY": sys.executable, "INSTALL": "0", "GBATTN_CACHE": str(tmp_path / "cache"),
           **env}
    argv = ["bash", str(ROOT / "scripts" / "gpu_session.sh"), *args]
    if not wait:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _failing_python(tmp_path, command: str, then: str = "exit 1") -> str:
    """A PY that runs ``then`` for gbattn's ``command`` (or any of several, space-separated) and is this Python
    otherwise."""
    wrapper = tmp_path / "py"
    wrapper.write_text(f'#!/usr/bin/env bash\nfor a; do for c in {command}; do [ "$a" = "$c" ] && {then}; done; done\n'
                       f'exec "{sys.executable}" "$@"\n', encoding="utf-8")
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.parametrize("env, line", [
    ({"BUDGET": "20s"}, "gpu_session.sh: BUDGET=20s is not a number of seconds"),  # (the budget was off: bash errors)
    ({"STAGES": "smoke nope"}, "gpu_session.sh: STAGES names 'nope', which is no stage: choose from smoke resume"),
    ({"STAGES": ""}, "gpu_session.sh: STAGES is empty: name some of smoke resume"),  # (ran every default stage)
])
def test_a_bad_budget_or_stage_name_is_one_line_before_anything_runs(tmp_path, env, line):
    proc = _session(tmp_path, {"WORK": str(tmp_path / "work"), **env}, "", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.startswith(line), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_failed_stage_brings_back_no_earlier_files_and_paths_given_are_the_callers(tmp_path):
    """The bench stage failed, and the bench.json an earlier call left in WORK came back as this call's; so did the
    paper stage's archive of the run directories. OUT and WORK given relative are read from the caller's folder
    (they landed in the repository). BUDGET=08 is 8 s (bash read it as octal and failed: "value too great")."""
    for earlier in ("bench-paper-small/bench.json", "paper-wt103/results.json", "paper-wt103/standard/seed42/x"):
        (tmp_path / "work" / earlier).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "work" / earlier).write_text("{}", encoding="utf-8")
    proc = _session(tmp_path, {"STAGES": "bench paper", "WORK": "work",
                               "PY": _failing_python(tmp_path, "bench compare")}, "", "out", cwd=tmp_path)
    log = (tmp_path / "out" / "log.txt").read_text(encoding="utf-8")
    assert proc.returncode == 0, log + proc.stderr
    assert "end bench-paper-small (exit 1)" in log and "no new bench-paper-small/bench.json: not copied" in log, log
    assert "end paper-wt103 (exit 1)" in log and "nothing new in paper-wt103: paper-wt103-runs.tar.gz not made" in log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["log.txt"]
    # a comparison that trains nothing still rewrites its results files (and takes its lock): not this call's runs
    touch = f"touch {tmp_path}/work/paper-wt103/results.json {tmp_path}/work/paper-wt103/.lock; exit 0"
    proc = _session(tmp_path, {"STAGES": "paper", "WORK": "work", "PY": _failing_python(tmp_path, "compare", touch)},
                    "", "out-again", cwd=tmp_path)
    log = (tmp_path / "out-again" / "log.txt").read_text(encoding="utf-8")
    assert "end paper-wt103 (exit 0)" in log and "paper-wt103-runs.tar.gz not made" in log, log
    proc = _session(tmp_path, {"STAGES": "bench", "WORK": "work", "BUDGET": "08"}, "", "out8", cwd=tmp_path)
    log = (tmp_path / "out8" / "log.txt").read_text(encoding="utf-8")
    assert proc.returncode == 0 and proc.stderr == "" and "skip bench-paper-small: budget spent" in log, proc.stderr


def test_smoke_cut_short_by_the_budget_is_not_called_failing(tmp_path):
    """A budget that leaves the smoke stage less than its limit, spent while it trains (exit 124): "smoke failed:
    stopping", exit 3, though nothing failed."""
    proc = _session(tmp_path, {"STAGES": "smoke", "BUDGET": "70", "WORK": str(tmp_path / "work"),
                               "PY": _failing_python(tmp_path, "train", "exec sleep 600")}, "", str(tmp_path / "out"))
    log = (tmp_path / "out" / "log.txt").read_text(encoding="utf-8")
    assert proc.returncode == 0, log + proc.stderr
    assert "end smoke-train (exit 124)" in log and "smoke cut short by the budget" in log, log
    assert "smoke failed" not in log, log


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_killed_session_stops_its_stages(tmp_path, signum, status):
    """SIGTERM to the script: its stages ran on (each timeout in its own process group), and a rerun found their
    run directories in use. Now the running stage is stopped too, and the script exits as the shell reports the
    signal (143, or 130 for Ctrl-C)."""
    work = tmp_path / "work"
    proc = _session(tmp_path, {"STAGES": "resume", "WORK": str(work)}, "", str(tmp_path / "out"), wait=False)
    log = tmp_path / "out" / "log.txt"
    deadline = time.monotonic() + 120
    while not (log.exists() and "start resume-start" in log.read_text(encoding="utf-8")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == status
    assert "stopped by a signal: stopping the running stages" in log.read_text(encoding="utf-8")
    left = [cmdline for cmdline in _command_lines() if str(work) in cmdline]
    assert left == [], left


def _command_lines() -> list[str]:
    """Every process's command line, as one string each."""
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # not a process, or gone
            continue
    return lines
