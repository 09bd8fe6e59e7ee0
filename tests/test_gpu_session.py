"""scripts/gpu_session.sh, the prepared GPU session, at its toy size on the CPU (TINY=1): the stages that train,
compare several recipes at once and analyse run to the end and leave the files a device call brings back, so a
short GPU window is not spent on a broken script (README, "Reproducing the paper's tables")."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

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
