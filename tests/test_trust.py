"""Trust: no code runs from a run directory, one writer per run directory, provenance
checks, compare reuses only runs it checked, no debris, the data layouts users have, and one
line with exit status 2 for every bad input (a table of them, run through the CLI)."""

from __future__ import annotations

import collections
import contextlib
import errno
import gzip
import hashlib
import io
import json
import math
import os
import pickle
import re
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gbattn import files, rundir
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import cache_dir
from gbattn.errors import UserError
from gbattn.train.trainer import train
from helpers import (
    LFS_MESSAGE,
    LFS_POINTER,
    TINY,
    fails_if_blocked,
    hold_lock,
    run_cli,
    strict_json,
    tiny_configs,
    write_corpus,
    write_text,
)

GBATTN = [sys.executable, "-m", "gbattn.cli"]


# The trusted run: tiny_configs' GBA run, 4 steps, one thread.
SHORT = {"max_steps": 4, "eval_every": 2, "warmup_steps": 1, "threads": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny finished run (char tokenizer) and its corpus, trained once for the module."""
    root = tmp_path_factory.mktemp("trust")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GBATTN_CACHE", str(root / "cache"))
        data = write_corpus(root / "corpus")
        train(root / "run", *tiny_configs(data, **SHORT), quiet=True, preset="paper-small")
    return {"root": root, "run": root / "run", "data": data, "cache": root / "cache"}


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != rundir.LOCK}


def one_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --------------------------------------------------------------------------------------
# 1. Safe loading: a checkpoint whose pickle would run code is refused everywhere
# --------------------------------------------------------------------------------------


class _Plant:
    """Unpickling this creates the marker file (what arbitrary code in a checkpoint could do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump({"model": {"wte.weight": torch.zeros(1)}, "x": _Plant(str(marker))}, f, protocol=2)


def test_a_checkpoint_that_would_run_code_is_refused_by_every_command(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()  # so that --resume reads the checkpoint
    marker = tmp_path / "marker"
    for name in (rundir.CHECKPOINT, rundir.BEST):
        plant(run / name, marker)
    with pytest.raises(pickle.UnpicklingError):  # the plant is real: weights_only refuses it ...
        torch.load(run / rundir.BEST, weights_only=True)
    commands = [["eval", run], ["generate", run, "--prompt", "the", "--max-new-tokens", "2"],
                ["analyze", run, "--out", tmp_path / "a", "--quiet"], ["train", "--resume", "--out", run, "--quiet"]]
    for argv in commands:
        code, _, err = run_cli(capsys, argv)
        line = one_line(code, err)
        assert "Python objects beyond tensors" in line and "refused" in line, line
        assert not marker.exists(), f"{argv[0]} ran code from the checkpoint"


# --------------------------------------------------------------------------------------
# 2. One writer per run directory (two real processes)
# --------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_a_killed_one_releases_the_lock(trained, tmp_path):
    env = dict(os.environ, GBATTN_CACHE=str(trained["cache"]), OMP_NUM_THREADS="1")
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    before = snapshot(run)
    holder = hold_lock(run)
    try:
        for argv in (["train", "--resume", "--out", run], ["train", "--out", run, "--data", trained["data"],
                                                           "--restart"]):
            proc = subprocess.run([*GBATTN, *map(str, argv), "--quiet"], capture_output=True, text=True, env=env)
            assert proc.returncode == 2 and "in use by another gbattn process" in proc.stderr, proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1
        assert snapshot(run) == before  # the refused writers changed nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 released the lock: the run resumes at once
    proc = subprocess.run([*GBATTN, "train", "--resume", "--out", str(run), "--quiet"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert (run / rundir.RESULT).exists()


def test_a_real_training_process_holds_its_run_and_compare_its_directory(trained, tmp_path):
    env = dict(os.environ, GBATTN_CACHE=str(trained["cache"]), OMP_NUM_THREADS="1")
    run = tmp_path / "long"
    sets = [*sum((["--set", f"{k}={v}"] for k, v in TINY.items()), []), "--set", "max_steps=100000",
            "--set", "train_tokens=null", "--set", "eval_tokens=null"]
    first = subprocess.Popen([*GBATTN, "train", "--out", str(run), "--data", str(trained["data"]),
                              "--tokenizer", "char", "--threads", "1", "--quiet", *sets],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until it holds the lock and has written its config
            if (run / rundir.CONFIG).exists():
                break
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.1)
        second = subprocess.run([*GBATTN, "train", "--resume", "--out", str(run), "--quiet"], capture_output=True,
                                text=True, env=env)
        assert second.returncode == 2 and "in use by another gbattn process" in second.stderr
        for _ in range(600):  # until it trains (its stop flag is set up)
            if (run / rundir.METRICS).exists():
                break
            time.sleep(0.1)
        first.send_signal(signal.SIGTERM)  # checkpoint, one line, and SIGTERM's exit status 143
        _, err = first.communicate(timeout=120)
        assert first.returncode == 143 and err.strip().splitlines()[-1].startswith("gbattn: error: terminated at step")
        assert (run / rundir.CHECKPOINT).exists()
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
        first.wait()
    cmp = tmp_path / "cmp"
    holder = hold_lock(cmp)
    try:
        proc = subprocess.run([*GBATTN, "compare", "--recipe", "cpu-char", "--out", str(cmp), "--quiet"],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and "in use by another gbattn process" in proc.stderr, proc.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_run_lock_writes_its_pid_removes_only_an_empty_directory_it_made_and_is_taken_again(tmp_path):
    """The lock file holds this pid, what it writes and a random token (torchrun's other processes look for it there:
    test_parallel; a longer stale pid is overwritten); release removes the
    directory only if the lock made it and nothing else is in it; a lock taken again after release
    is held (another process is refused)."""
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / rundir.LOCK).write_text("123456789012\n")
    with rundir.RunLock(existing) as lock:
        assert (existing / rundir.LOCK).read_text() == f"{os.getpid()}\nrun\n{lock.token}\n"
        assert re.fullmatch("[0-9a-f]{16}", lock.token) and rundir.RunLock.token_in(existing) == lock.token
        assert rundir.RunLock(existing).token == lock.token  # (taken again by its holder: the same lock)
    assert rundir.RunLock.token_in(tmp_path) is None  # (no lock file)
    assert existing.is_dir()  # not made by the lock: kept
    # a new lock file gets the umask's permissions, as every file gbattn writes (0o644 kept the other members of a
    # group's shared folder from locking it: "cannot be opened as the lock file")
    fresh = tmp_path / "fresh"
    umask = os.umask(0o002)
    try:
        with rundir.RunLock(fresh):
            (fresh / "kept").write_text("")
            assert (fresh / rundir.LOCK).stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(umask)
    made = tmp_path / "made"
    with rundir.RunLock(made):
        pass
    assert not made.exists()
    with rundir.RunLock(made):
        (made / rundir.CONFIG).write_text("{}")
    assert sorted(p.name for p in made.iterdir()) == [rundir.LOCK, rundir.CONFIG]
    code = f"from gbattn.rundir import RunLock; RunLock({str(made)!r})"
    with rundir.RunLock(made):  # taken again in this process after the release: held, not assumed held
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode != 0 and "in use by another gbattn process" in proc.stderr, proc.stderr
        with rundir.RunLock(made):  # this process already holds it: no refusal of itself as "another process" ...
            pass
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # ... and the inner
                              env=dict(os.environ, OMP_NUM_THREADS="1"))  # release left the outer lock held
        assert proc.returncode != 0 and "in use by another gbattn process" in proc.stderr, proc.stderr


def test_a_lock_whose_folder_is_deleted_or_whose_file_cannot_be_written_says_the_works_error(tmp_path, monkeypatch):
    """The folder deleted while the work ran (or no descriptor left to list it): releasing raised its own
    "No such file or directory", which the CLI said in place of the work's error, and left the lock file open. A lock
    file on a full disk was "No space left on device", naming nothing, with a stray --out folder holding an empty
    .lock: now one line naming the lock file, and the folder the lock made removed."""
    fds = set(os.listdir("/proc/self/fd"))
    gone = tmp_path / "gone"
    with pytest.raises(UserError, match="the work's own error"), rundir.RunLock(gone):
        shutil.rmtree(gone)
        raise UserError("the work's own error")
    assert set(os.listdir("/proc/self/fd")) == fds and not gone.exists()
    real_write = os.write

    def full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(rundir.LOCK):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    new = tmp_path / "parent" / "new"
    with pytest.raises(UserError, match=rf"^could not write the lock file {re.escape(str(new / rundir.LOCK))} \(No "
                                        rf"space left on device\)$"):
        rundir.RunLock(new)
    monkeypatch.undo()
    assert not (tmp_path / "parent").exists() and set(os.listdir("/proc/self/fd")) == fds
    with rundir.RunLock(new):  # (not left held by this process)
        pass


def test_a_lock_another_process_holds_is_refused_in_this_one_and_its_file_closed(tmp_path):
    """The refusal in the process asking (a Python sweep retrying runs would otherwise keep one descriptor per
    refused attempt open)."""
    holder = hold_lock(tmp_path / "run")
    try:
        fds = set(os.listdir("/proc/self/fd"))
        with pytest.raises(UserError, match="is in use by another gbattn process"):
            rundir.RunLock(tmp_path / "run")
        assert set(os.listdir("/proc/self/fd")) == fds
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_lock_refusal_names_what_the_holder_writes_or_nothing(tmp_path):
    """The refusal named the asking process's kind (an export refused by a training: "its export is being
    written"); it names what the holder writes, as its lock file says, and nothing where that says nothing (a gbattn
    before it did, or a lock file written by hand)."""
    holder = hold_lock(tmp_path / "run", "comparison")
    try:
        with pytest.raises(UserError, match=r"run is in use by another gbattn process \(its comparison is being "
                                            r"written\); wait for it to finish or choose another --out$"):
            rundir.RunLock(tmp_path / "run", "export")
        for written in ("123\n", "", "123\n\x00\x01 junk\n", "123\n" + "x" * 300):
            (tmp_path / "run" / rundir.LOCK).write_text(written)
            with pytest.raises(UserError, match=r"run is in use by another gbattn process; wait for it to finish"):
                rundir.RunLock(tmp_path / "run", "export")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


# --------------------------------------------------------------------------------------
# 3. Provenance
# --------------------------------------------------------------------------------------


def test_resume_and_eval_refuse_other_data(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    model_cfg, train_cfg = tiny_configs(data, **SHORT)
    train(run, model_cfg, train_cfg, quiet=True)
    recorded = json.loads((run / rundir.CONFIG).read_text())["data"]["fingerprint"]
    # The same corpus by another path (here: relative to another working directory) is the same data.
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, ["eval", run, "--data", "corpus"])
    assert code == 0 and "test perplexity" in out and "other_data" not in out and "not the data" not in out
    (data / "wiki.test.tokens").write_text("the cat sat on the mat .\n" * 300)  # same characters, other text
    code, _, err = run_cli(capsys, ["eval", run])
    line = one_line(code, err)
    assert "is not the data the run was trained on" in line and "--allow-other-data" in line
    assert f"(fingerprint {recorded[:16]} recorded, {load_corpus(str(data)).fingerprint[:16]} now)" in line
    # a run trained on a hub dataset, scored on a local copy of it: the two fingerprints are of two kinds (it said
    # only that the data differed, where the text may be the same)
    config = json.loads((run / rundir.CONFIG).read_text())
    config["data"]["fingerprint"] = "hf:0123456789abcdef:fedcba9876543210:0011223344556677"
    (run / rundir.CONFIG).write_text(json.dumps(config))
    code, _, err = run_cli(capsys, ["eval", run, "--data", data])
    assert "now; the hub's datasets are fingerprinted by `datasets`, local files by their content, so a hub dataset " \
           "and a local copy of it never match); pass --allow-other-data" in one_line(code, err)
    config["data"]["fingerprint"] = recorded
    (run / rundir.CONFIG).write_text(json.dumps(config))
    # not typed now: named as the run's record, with where it is (it read "--data PATH", as if typed)
    assert line.startswith(f"gbattn: error: the data {run} recorded ({data}) is not the data the run was trained on")
    assert f"; that is the path {run} recorded (a relative path is relative to where the run was trained)" in line
    code, out, _ = run_cli(capsys, ["eval", run, "--allow-other-data"])
    assert code == 0 and "test perplexity" in out
    # Allowed, the figure says it is not of the run's own data (it was printed and recorded as if it were).
    said = f"not the data the run was trained on (fingerprint {recorded[:16]} recorded, "
    line, result = out.strip().splitlines()
    assert said in line and said in json.loads(result)["other_data"]
    code, out, _ = run_cli(capsys, ["analyze", run, "--allow-other-data", "--out", tmp_path / "an", "--max-rows", "2",
                                    "--quiet"])
    assert code == 0 and said in out
    assert any(said in note for note in json.loads((tmp_path / "an" / "summary.json").read_text())["notes"])
    code, _, err = run_cli(capsys, ["analyze", run, "--out", tmp_path / "an", "--max-rows", "2"])
    assert "is not the data the run was trained on" in one_line(code, err)
    (run / rundir.RESULT).unlink()
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run])
    line = one_line(code, err)
    assert "has changed since this run started" in line and recorded[:16] in line
    # A new character in the changed data: still the fingerprint's line, not the tokenizer's.
    (data / "wiki.test.tokens").write_text("a new character: ~\n" * 300)
    code, _, err = run_cli(capsys, ["eval", run])
    assert "is not the data the run was trained on" in one_line(code, err)


def test_other_data_is_read_with_the_runs_own_tokenizer(trained, tmp_path, monkeypatch):
    """``--allow-other-data``: the corpus is tokenized by the run's tokenizer, whose ids the model was trained on,
    not by one trained for it (a char tokenizer of its fewer characters numbers them otherwise)."""
    from gbattn.data.prepare import prepare_run_data

    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    other.mkdir()
    for split, line in (("train", "the cat sat .\n"), ("valid", "a cat ran .\n"), ("test", "the mat .\n")):
        (other / f"wiki.{split}.tokens").write_text(line * 40)
    run = rundir.load_run(trained["run"])
    for split in ("valid", "test"):
        data = prepare_run_data(run, str(other), allow_other_data=True, split=split)
        assert run.tokenizer.decode(data.splits[split].tolist()) == (other / f"wiki.{split}.tokens").read_text()


def test_eval_of_a_split_shorter_than_one_row_is_one_line(trained, tmp_path, capsys, monkeypatch):
    """Other data (--allow-other-data) whose test split holds fewer tokens than one row of seq_len + 1: one line
    naming the split and the row, no traceback of evaluate's ValueError and no perplexity of nothing."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    other.mkdir()
    for split, text in (("train", "the cat sat .\n" * 40), ("valid", "a cat ran .\n" * 40), ("test", "the mat .\n")):
        (other / f"wiki.{split}.tokens").write_text(text)
    code, _, err = run_cli(capsys, ["eval", trained["run"], "--data", other, "--allow-other-data"])
    line = one_line(code, err)
    seq_len = rundir.load_run(trained["run"]).seq_len
    assert "has 10 tokens: fewer than one row of" in line and f"{seq_len + 1}, so there is nothing to evaluate" in line
    # at the boundary: seq_len tokens are still no row (one line); seq_len + 1 are one, scoring seq_len tokens
    for length, scored in ((seq_len, None), (seq_len + 1, seq_len)):
        (other / "wiki.test.tokens").write_text("m" * (length - 1) + "\n")
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--data", other, "--allow-other-data"])
        if scored is None:
            assert f"has {seq_len} tokens: fewer than one row of {seq_len + 1}" in one_line(code, err)
        else:
            assert code == 0, err
            assert json.loads(out.splitlines()[-1])["tokens"] == scored


def test_eval_of_a_run_without_best_weights_names_the_last_and_counts_its_rows(trained, tmp_path, capsys, monkeypatch):
    """A run without best.pt is scored on its last checkpoint (load_run's fallback): the line and the record say
    "last", not the "best" asked for by default; the progress bar's total is the rows evaluate scores."""
    from gbattn import progress
    from gbattn.data.prepare import prepare_run_data
    from gbattn.data.tokens import num_rows

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.BEST).unlink()
    bars = []

    class Recorded(progress.Progress):
        def close(self):
            bars.append((self.total, self.n))
            super().close()

    monkeypatch.setattr(progress, "Progress", Recorded)
    code, out, err = run_cli(capsys, ["eval", run])
    assert code == 0, err
    record = json.loads(out.splitlines()[-1])
    assert record["checkpoint"] == "last" and f"last weights at step {record['step']}" in out.splitlines()[0]
    loaded = rundir.load_run(run)
    rows = num_rows(prepare_run_data(loaded, None, False, "test").splits["test"], loaded.seq_len)
    assert bars == [(rows, rows)] and record["tokens"] == rows * loaded.seq_len


def test_a_run_that_records_no_corpus_is_evaluated_on_the_data_given(trained, tmp_path, monkeypatch):
    """A run without a corpus of its own (upcycled from a Hugging Face checkpoint) needs --data, and takes it."""
    import dataclasses

    from gbattn.data.prepare import prepare_run_data
    from gbattn.errors import UserError

    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    run = rundir.load_run(trained["run"])
    bare = dataclasses.replace(run, train_cfg=run.train_cfg.replace(data=""))
    with pytest.raises(UserError, match="records no corpus: pass --data"):
        prepare_run_data(bare, None, allow_other_data=False, split="test")
    data = prepare_run_data(bare, str(trained["data"]), allow_other_data=False, split="test")
    assert data.corpus_fingerprint == run.data_fingerprint and len(data.splits["test"]) > 0


def test_a_run_started_elsewhere_finds_its_data_by_another_path(trained, tmp_path, capsys, monkeypatch):
    """A run trained on a relative --data path, used from another working directory: eval says how
    to name the corpus, as train --resume and --init-from do, and eval --data and train --resume --data take another
    path to it."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus")
    model_cfg, train_cfg = tiny_configs("corpus", **SHORT)
    train(tmp_path / "run", model_cfg, train_cfg.replace(max_steps=2), quiet=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_cli(capsys, ["eval", tmp_path / "run"])
    assert "pass --data PATH where the corpus is now" in one_line(code, err)
    code, out, _ = run_cli(capsys, ["eval", tmp_path / "run", "--data", tmp_path / "corpus"])
    assert code == 0, out
    (tmp_path / "run" / rundir.RESULT).unlink()
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", tmp_path / "run", "--quiet"])
    assert "that is the path" in err and "pass --data PATH where the corpus is now" in one_line(code, err)
    code, _, err = run_cli(capsys, ["train", "--init-from", tmp_path / "run", "--out", tmp_path / "again", "--quiet"])
    assert f"that is the path {tmp_path / 'run'} recorded" in one_line(code, err)  # --init-from's default data
    from gbattn.errors import DataNotFound
    from gbattn.train.trainer import Trainer

    with pytest.raises(DataNotFound, match="'nowhere'") as raised:  # a path given now is not the run's recorded one
        Trainer(tmp_path / "run", resume=True, quiet=True, overrides={"data": "nowhere"}).run()
    assert "recorded" not in str(raised.value)
    code, out, err = run_cli(capsys, ["train", "--resume", "--out", tmp_path / "run", "--data", tmp_path / "corpus",
                                      "--quiet"])
    assert code == 0, err
    # --set data=PATH, the same field given the other way (it was refused as an option changing the run), with the
    # corpus moved again (read where it is now)
    (tmp_path / "run" / rundir.RESULT).unlink()
    (tmp_path / "corpus").rename(tmp_path / "moved")
    code, out, err = run_cli(capsys, ["train", "--resume", "--out", tmp_path / "run", "--set", "data=../moved",
                                      "--quiet"])
    assert code == 0, err
    (tmp_path / "moved").rename(tmp_path / "corpus")
    other = write_corpus(tmp_path / "other", seed=1)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", tmp_path / "run", "--data", other])
    assert "--data" in one_line(code, err)  # another corpus is still refused
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", tmp_path / "run", "--set", f"data={other}"])
    assert f"these options would change it: --set data={other} (recorded: " in one_line(code, err)
    # the same corpus by another path excuses --data alone: another option given with it is still refused
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", tmp_path / "run", "--data", tmp_path / "corpus",
                                    "--seed", "7"])
    assert "--seed 7 (recorded: 42)" in one_line(code, err)


def test_resume_refuses_options_that_would_change_the_run(trained, capsys, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = trained["run"]
    before = snapshot(run)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--attn", "standard", "--seed", "7", "--set",
                                    "lr=0.5", "--set", "d_model=64", "--preset", "cpu-proxy", "--data", "elsewhere",
                                    "--compile"])
    line = one_line(code, err)
    for part in ("--attn standard (recorded: boosted)", "--seed 7 (recorded: 42)", "--set lr=0.5 (recorded: 0.003)",
                 "--set d_model=64 (recorded: 32)", "--preset cpu-proxy (recorded: paper-small)", "--data elsewhere",
                 "--compile, or the --set compile or device that means it (recorded: trained eager; with dropout"):
        assert part in line, part
    # values equal to the recorded ones change nothing and are accepted (the run is finished: returns its result)
    code, out, err = run_cli(capsys, ["train", "--resume", "--out", run, "--attn", "boosted", "--set", "lr=0.003",
                                      "--set", "d_model=32", "--no-compile"])
    assert code == 0 and '"steps": 4' in out, err
    assert snapshot(run) == before
    # The vocabulary the command asked for, which the run replaced by its tokenizer's, is the command's again:
    # resuming with the same --set vocab_size is no change (it was refused as one); another value still is.
    config = json.loads((run / rundir.CONFIG).read_text())
    asked = config["vocab_size_asked"]
    assert asked != config["model"]["vocab_size"]
    code, out, _ = run_cli(capsys, ["train", "--resume", "--out", run, "--set", f"vocab_size={asked}"])
    assert code == 0 and '"steps": 4' in out
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--set", f"vocab_size={asked + 1}"])
    assert f"--set vocab_size={asked + 1} (recorded: {config['model']['vocab_size']})" in one_line(code, err)


def test_resume_applies_every_result_neutral_set(trained, tmp_path, capsys, monkeypatch):
    """Each field of TrainConfig.RESULT_NEUTRAL given with --set on --resume reaches the resumed run."""
    from gbattn.config import TrainConfig
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    new = {"device": "cpu", "compile": False, "activation_checkpointing": True, "checkpoint_minutes": 7.5,
           "log_every": 3, "threads": 1, "eval_batch_size": 5}
    assert set(new) == set(TrainConfig.RESULT_NEUTRAL)
    recorded = rundir.read_configs(json.loads((run / rundir.CONFIG).read_text()), run)[1]
    assert recorded.checkpoint_minutes != 7.5 and recorded.log_every != 3 and recorded.eval_batch_size != 5
    seen = []
    summary = dict.fromkeys(("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s"))
    monkeypatch.setattr(Trainer, "run", lambda self: seen.append(self.train_cfg) or summary)
    sets = sum((["--set", f"{k}={json.dumps(v).strip(chr(34))}"] for k, v in new.items()), [])
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet", *sets])
    assert code == 0, err
    assert {k: getattr(seen[0], k) for k in new} == new


def test_resume_refuses_another_tokenizer_or_residual_stream(trained, capsys, monkeypatch):
    """--tokenizer and --residual select the run as --attn and --seed do: on --resume another value is refused."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = trained["run"]
    before = snapshot(run)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--tokenizer", "bpe", "--residual",
                                    "attnres-full"])
    line = one_line(code, err)
    assert "--tokenizer bpe (recorded: char)" in line and "--residual attnres-full (recorded: plain)" in line
    assert snapshot(run) == before


def test_resume_refuses_a_preset_for_a_run_made_without_one(trained, tmp_path, capsys, monkeypatch):
    """A run made from configs alone (Python's train(), upcycle) recorded no preset: --preset X on --resume
    names another run's recipe and is refused, as --init-from refuses it; no --preset still resumes."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = json.loads((run / rundir.CONFIG).read_text())
    (run / rundir.CONFIG).write_text(json.dumps({**config, "preset": None}))
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--preset", "paper-small"])
    assert "--preset paper-small (recorded: none)" in one_line(code, err)
    code, out, err = run_cli(capsys, ["train", "--resume", "--out", run])
    assert code == 0 and '"steps": 4' in out, err


def test_resume_refuses_a_compile_switch_only_where_dropout_draws_masks(trained, tmp_path, monkeypatch):
    """--set compile=true is --compile: with dropout, switching a run trained eager is refused; with no
    dropout (or no dropout site) compiled and eager draw nothing, and the switch is accepted."""
    from gbattn.cli import build_parser
    from gbattn.train.cli import resume_conflicts

    saved = json.loads((trained["run"] / rundir.CONFIG).read_text())
    model_cfg, train_cfg = rundir.read_configs(saved, trained["run"])
    assert model_cfg.dropout > 0 and model_cfg.dropout_sites
    parser = build_parser()
    for argv in (["--compile"], ["--set", "compile=true"]):
        args = parser.parse_args(["train", "--resume", "--out", str(trained["run"]), *argv])
        (conflict,) = resume_conflicts(args, saved, model_cfg, train_cfg)
        assert conflict.startswith("--compile, or the --set compile or device that means it (recorded: trained "
                                   "eager"), conflict
        for quiet in (model_cfg.replace(dropout=0.0), model_cfg.replace(dropout_sites=[])):
            assert resume_conflicts(args, saved, quiet, train_cfg) == []
    # Nothing asked switches nothing, also for a run recorded compiled.
    args = parser.parse_args(["train", "--resume", "--out", str(trained["run"])])
    assert resume_conflicts(args, saved, model_cfg, train_cfg.replace(compile=True)) == []
    # The device a run names decides its default: device=auto on a machine with CUDA trains as CUDA does.
    from gbattn.train import trainer

    monkeypatch.setattr(trainer, "COMPILE_BY_DEFAULT", {"cpu": False, "cuda": True})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    recorded = train_cfg.replace(device="auto", compile=None)
    assert trainer.compile_switch(model_cfg, recorded, recorded.replace(compile=False)).startswith(
        "--no-compile, or the --set compile or device that means it (recorded: trained compiled")
    assert trainer.compile_switch(model_cfg, recorded, recorded.replace(device="cuda")) is None
    assert trainer.compile_switch(model_cfg, recorded, recorded.replace(device="cpu")).startswith("--no-compile")
    monkeypatch.undo()
    # Activation checkpointing switched in a compiled run with dropout: compiled Twicing drew other masks with its
    # blocks recomputed (measured: step 1's loss 4.1718 against 4.1794), and the switch was taken as result-neutral
    compiled = train_cfg.replace(compile=True)
    for recorded, resumed in ((compiled, compiled.replace(activation_checkpointing=True)),
                              (compiled.replace(activation_checkpointing=True), compiled)):
        assert trainer.compile_switch(model_cfg, recorded, resumed).startswith(
            f"--set activation_checkpointing={str(resumed.activation_checkpointing).lower()} (recorded: ")
        assert trainer.compile_switch(model_cfg.replace(dropout=0.0), recorded, resumed) is None
        eager = (recorded.replace(compile=False), resumed.replace(compile=False))
        assert trainer.compile_switch(model_cfg, *eager) is None  # eager: the same masks drawn again
    # From Python (and `compare --jobs 1`, which resumes with its --set compile=...) too: it resumed compiled.
    from gbattn.train.trainer import Trainer

    with pytest.raises(UserError, match=r"this would change it: --compile, or the --set compile or device that means "
                                        r"it \(recorded: trained eager.*--restart\)$"):
        Trainer(trained["run"], resume=True, overrides={"compile": True})
    # A comparison's run (compare resumes it with its --set compile=...): compare's words, no train --restart
    run = tmp_path / "compared"
    shutil.copytree(trained["run"], run)
    saved = json.loads((run / rundir.CONFIG).read_text())
    (run / rundir.CONFIG).write_text(json.dumps({**saved, "extra": {"label": "standard"}}))
    with pytest.raises(UserError, match=r"--set compile or device that means it \(recorded: trained eager.*\. Leave it "
                                        r"out of the `gbattn compare` command, or compare into another --out$"):
        Trainer(run, resume=True, overrides={"compile": True})
    assert Trainer(trained["run"], resume=True, overrides={"compile": False}).train_cfg.compile is False


def test_resume_conflicts_name_a_variant_options_recorded_value_and_keep_vocab_size_apart(trained):
    """A conflicting --set attn.X names the run's value of that variant option (attn.X is attn_options.X), not
    None; and only vocab_size is compared with the vocabulary the command asked for: another model --set of that
    number is a conflict."""
    from gbattn.cli import build_parser
    from gbattn.train.cli import resume_conflicts

    saved = json.loads((trained["run"] / rundir.CONFIG).read_text())
    model_cfg, train_cfg = rundir.read_configs(saved, trained["run"])
    gated = model_cfg.replace(attn_options={"gate": "scalar"})
    asked = saved["vocab_size_asked"]
    parser = build_parser()

    def conflicts(model, *sets):
        args = parser.parse_args(["train", "--resume", "--out", str(trained["run"]), *sets])
        return resume_conflicts(args, saved, model, train_cfg)

    assert conflicts(gated, "--set", "attn.gate=vector") == ["--set attn.gate=vector (recorded: scalar)"]
    assert conflicts(model_cfg, "--set", f"d_model={asked}") == [f"--set d_model={asked} (recorded: 32)"]


def test_run_options_reach_the_training_config_of_a_new_and_a_resumed_run(trained, tmp_path, capsys, monkeypatch):
    """--seed, --tokenizer, --device, --threads and --no-compile of a new run, and the result-neutral
    --device, --threads and --no-compile of a resumed one, are what the trainer trains with; a new run without
    --attn and --preset is standard attention with paper-small's recipe. The JSON line printed is the result's summary,
    its test split included."""
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    seen, made = [], []
    summary = {**dict.fromkeys(("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s")),
               "test_split": "valid"}  # (the data has no test split)
    monkeypatch.setattr(Trainer, "run", lambda self: seen.append(self.train_cfg)
                        or made.append((self.model_cfg.attn, self.preset, self.quiet)) or summary)
    options = ["--device", "cpu", "--threads", "2", "--no-compile", "--quiet"]
    code, out, err = run_cli(capsys, ["train", "--out", tmp_path / "new", "--data", trained["data"], "--tokenizer",
                                      "char", "--seed", "7", *options])
    assert code == 0, err
    assert json.loads(out) == summary
    assert (seen[0].seed, seen[0].tokenizer, seen[0].device, seen[0].threads, seen[0].compile) == (7, "char", "cpu", 2,
                                                                                                   False)
    assert made == [("standard", "paper-small", True)]
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    recorded = rundir.read_configs(json.loads((run / rundir.CONFIG).read_text()), run)[1]
    assert (recorded.device, recorded.threads, recorded.compile) != ("cpu", 2, False)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, *options])
    assert code == 0, err
    assert (seen[1].seed, seen[1].device, seen[1].threads, seen[1].compile) == (42, "cpu", 2, False)
    assert made[1] == ("boosted", "paper-small", True)


def test_init_from_trains_on_the_data_given(trained, tmp_path, capsys, monkeypatch):
    """--data of an --init-from run is the corpus it trains on (the source run's is only the default)."""
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    seen = []
    summary = dict.fromkeys(("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s"))
    monkeypatch.setattr(Trainer, "run", lambda self: seen.append(self.train_cfg) or summary)
    other = write_corpus(tmp_path / "other", seed=3)
    for argv, data in (([], str(trained["data"])), (["--data", other], str(other))):
        code, _, err = run_cli(capsys, ["train", "--init-from", trained["run"], "--out", tmp_path / f"o{len(seen)}",
                                        "--quiet", *argv])
        assert code == 0, err
        assert (seen[-1].data, seen[-1].init_from, seen[-1].tokenizer) == (data, str(trained["run"]), "char")


def test_init_from_keeps_the_source_runs_split_and_windows(trained, tmp_path, capsys, monkeypatch):
    """A run started --init-from trains on the source run's split and windows (seq_len), not its preset's, and records
    the source among its extras; the source's tokenizer and split given again change nothing and are accepted, and
    --restart reaches the trainer."""
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    source = tmp_path / "source"
    shutil.copytree(trained["run"], source)
    config = json.loads((source / rundir.CONFIG).read_text())
    config["train"].update(seq_len=16, split=[0.8, 0.1, 0.1])
    (source / rundir.CONFIG).write_text(json.dumps(config))
    seen = []
    summary = dict.fromkeys(("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s"))
    monkeypatch.setattr(Trainer, "run", lambda self: seen.append(self) or summary)
    code, _, err = run_cli(capsys, ["train", "--init-from", source, "--out", tmp_path / "new", "--quiet", "--restart",
                                    "--tokenizer", "char", "--set", "split=[0.8,0.1,0.1]"])
    assert code == 0, err
    (trainer,) = seen
    assert (trainer.train_cfg.seq_len, list(trainer.train_cfg.split), trainer.train_cfg.init_from) == (
        16, [0.8, 0.1, 0.1], str(source))
    # (its extras go into result.json, which holds no path of this machine: the source by its last part; config.json's
    # train.init_from keeps the path a resume reads)
    assert (trainer.extra, trainer.restart) == ({"init_from": "source"}, True)
    # The split as the comma form (refused: "0.8,0.1,0.1" was compared character by character), and the source as
    # --set init_from=RUN, the field --init-from sets (it was "leave out --preset, --attn and model --set values")
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "new2", "--quiet", "--set", f"init_from={source}",
                                    "--set", "split=0.8,0.1,0.1"])
    assert code == 0, err
    assert (seen[-1].train_cfg.init_from, list(seen[-1].train_cfg.split)) == (str(source), [0.8, 0.1, 0.1])


def test_a_run_started_init_from_resumes_from_its_own_checkpoint_without_its_source(trained, tmp_path, capsys,
                                                                                     monkeypatch):
    """--init-from takes the source's weights (and tokenizer) once, at the start: a run with a checkpoint of its own
    resumes from that, and needs its source no more (deleted or moved since); taking the source again on resume
    would refuse the run as one with no checkpoint yet, whose --init-from is not a directory."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))  # (its windows' entry stays out of the module's)
    source, run = shutil.copytree(trained["run"], tmp_path / "source"), tmp_path / "run"
    code, _, err = run_cli(capsys, ["train", "--init-from", source, "--out", run, "--quiet", "--set", "max_steps=2",
                                    "--set", "eval_every=2", "--threads", "1"])
    assert code == 0, err
    finished = json.loads((run / rundir.RESULT).read_text())
    (run / rundir.RESULT).unlink()  # killed writing its result: its checkpoint is at the last step
    shutil.rmtree(source)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert code == 0, err
    assert json.loads((run / rundir.RESULT).read_text())["test_loss"] == finished["test_loss"]


def test_a_new_run_without_a_preset_is_paper_small(trained, tmp_path, capsys, monkeypatch):
    """``train`` without --preset trains paper-small, with its recipe, and records that preset."""
    from gbattn.config import PRESETS
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    seen = []
    summary = dict.fromkeys(("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s"))
    monkeypatch.setattr(Trainer, "run", lambda self: seen.append(self) or summary)
    code, _, err = run_cli(capsys, ["train", "--data", trained["data"], "--out", tmp_path / "new", "--quiet"])
    assert code == 0, err
    paper_small = PRESETS["paper-small"]
    assert seen[0].preset == "paper-small" and seen[0].model_cfg.d_model == paper_small.model["d_model"]
    assert seen[0].train_cfg.lr == paper_small.train["lr"]


def test_init_from_takes_the_recipe_of_the_source_runs_preset(trained, tmp_path, capsys, monkeypatch):
    """A run started from another's weights has that run's preset, and its recipe (here cpu-char's, not the
    paper-small default's)."""
    from gbattn.config import PRESETS
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    source = Path(shutil.copytree(trained["run"], tmp_path / "source"))
    config = json.loads((source / rundir.CONFIG).read_text())
    (source / rundir.CONFIG).write_text(json.dumps({**config, "preset": "cpu-char"}))
    seen = []
    summary = dict.fromkeys(("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s"))
    monkeypatch.setattr(Trainer, "run", lambda self: seen.append(self) or summary)
    code, _, err = run_cli(capsys, ["train", "--init-from", source, "--out", tmp_path / "new", "--quiet"])
    assert code == 0, err
    assert PRESETS["cpu-char"].train["lr"] != PRESETS["paper-small"].train["lr"]
    assert (seen[0].preset, seen[0].train_cfg.lr) == ("cpu-char", PRESETS["cpu-char"].train["lr"])


# --------------------------------------------------------------------------------------
# 4. compare trusts nothing it did not check
# --------------------------------------------------------------------------------------


def test_compare_refuses_a_run_recorded_with_another_config(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    cmp = tmp_path / "cmp"
    (cmp / "standard").mkdir(parents=True)
    shutil.copytree(trained["run"], cmp / "standard" / "seed42")  # a boosted char run where standard goes
    code, _, err = run_cli(capsys, ["compare", "--recipe", "cpu-char", "--out", cmp, "--quiet", "--only", "standard",
                                    "--data", trained["data"]])
    line = one_line(code, err)
    assert f"{cmp / 'standard' / 'seed42'} holds another run than this recipe asks for" in line
    assert "model.attn: recorded 'boosted', asked 'standard'" in line


# --------------------------------------------------------------------------------------
# 6. No debris; 7. data layouts
# --------------------------------------------------------------------------------------


def test_temporary_files_of_a_killed_write_are_removed_when_the_run_is_opened(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / "checkpoint.pt.tmp999999999").write_bytes(b"half a checkpoint")  # (no process has this id)
    (run / "result.json.tmp999999999@another-host").write_text("{")  # another machine's, the run's lock now here
    (run / "notes.tmpfile").write_text("mine")  # not a gbattn temporary file: kept
    (run / "drafts.tmp2024").mkdir()  # a folder named like one: no file gbattn writes, kept (not an error)
    # A live process's of this host is kept: a reader writing beside the run (eval --per-token RUN/losses.txt) or
    # probing it lost its file mid-write whenever a train --resume took the lock.
    live = [run / f"losses.txt{files.building_suffix()}", run / f".write-test.tmp{os.getpid()}"]
    for path in live:
        path.write_text("being written")
    with rundir.RunLock(run):
        pass
    assert not (run / "checkpoint.pt.tmp999999999").exists() and (run / "notes.tmpfile").exists()
    assert not (run / "result.json.tmp999999999@another-host").exists()
    assert (run / "drafts.tmp2024").is_dir() and all(path.read_text() == "being written" for path in live)


class _FullDisk(io.FileIO):
    """A real file on a disk with ``room`` bytes left: a write beyond them is cut short, and the next
    one fails with ENOSPC, as the operating system reports a full disk."""

    room = 5000

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = super().write(memoryview(data)[: self.room])
        self.room -= written
        return written


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / rundir.CHECKPOINT
    rundir.save_checkpoint({"model": {"w": torch.ones(2)}}, path)
    monkeypatch.setattr(files, "open", lambda name, mode: io.BufferedWriter(_FullDisk(name, "w")), raising=False)
    big = {"model": {"w": torch.zeros(1 << 20)}}  # 4 MB: the disk fills in the middle of it
    with pytest.raises(UserError, match="No space left on device.*previous checkpoint.pt is kept"):
        rundir.save_checkpoint(big, path)
    monkeypatch.undo()
    assert torch.equal(rundir.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == [rundir.CHECKPOINT]


def test_disk_full_while_writing_a_first_checkpoint_claims_no_previous_one(tmp_path, monkeypatch):
    """A new run's first checkpoint on a full disk said "the previous checkpoint.pt is kept", where there was none;
    now the line says what could not be written, and nothing more."""
    path = tmp_path / rundir.CHECKPOINT
    monkeypatch.setattr(files, "open", lambda name, mode: io.BufferedWriter(_FullDisk(name, "w")), raising=False)
    with pytest.raises(UserError) as caught:
        rundir.save_checkpoint({"model": {"w": torch.zeros(1 << 20)}}, path)
    assert str(caught.value) == f"could not write {path} (No space left on device)"
    assert list(tmp_path.iterdir()) == []


def test_memory_running_out_while_a_checkpoint_is_built_is_out_of_memory_and_keeps_the_previous_one(tmp_path,
                                                                                                   monkeypatch):
    """torch.save into the in-memory buffer reports the buffer's MemoryError as a RuntimeError ("unexpected pos"), a
    traceback of the CLI (`ulimit -v` below a checkpoint's size): it is a MemoryError, the CLI's out-of-memory line,
    and the previous checkpoint stays."""
    path = tmp_path / rundir.CHECKPOINT
    rundir.save_checkpoint({"model": {"w": torch.ones(2)}}, path)

    class Scarce(io.BytesIO):
        def write(self, data) -> int:
            if len(memoryview(data)) > 10_000:
                raise MemoryError
            return super().write(data)

    monkeypatch.setattr(rundir.io, "BytesIO", Scarce)
    with pytest.raises(MemoryError, match=r"^the checkpoint checkpoint.pt could not be built in memory to be written; "
                                          r"the previous one is kept$"):
        rundir.save_checkpoint({"model": {"w": torch.zeros(1 << 20)}}, path)
    monkeypatch.undo()
    assert torch.equal(rundir.load_checkpoint(path)["model"]["w"], torch.ones(2))


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """This process's files may grow to ``nbytes`` (`ulimit -f`): a write beyond fails with EFBIG (Python ignores
    SIGXFSZ), as a file-size quota or a file over FAT's 4 GiB does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_metrics_line_that_cannot_be_appended_leaves_no_half_line_and_names_the_file(tmp_path):
    """A full disk (here the file-size limit) under metrics.jsonl's append was "No space left on device", naming
    nothing, with the first part of the line left in the file: the line is written whole or not at all."""
    rundir.append_event(tmp_path, {"event": "train", "step": 1, "loss": 2.5})
    path = tmp_path / rundir.METRICS
    before = path.read_bytes()
    with _file_size_limit(len(before) + 10), pytest.raises(UserError) as caught:
        rundir.append_event(tmp_path, {"event": "train", "step": 2, "loss": 2.25, "note": "x" * 100})
    assert str(caught.value) == f"could not append to {path} (File too large); its earlier lines are kept"
    assert path.read_bytes() == before
    rundir.append_event(tmp_path, {"event": "train", "step": 2, "loss": 2.25})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_files_written_together_are_replaced_together_or_said_otherwise(tmp_path, monkeypatch):
    """atomic_write_all (results.json with results.md, lm-eval's results with their samples): a full disk under the
    second file leaves both previous files (the first was new beside the second's previous); a rename failing after
    another (rare: a rename needs no room) names the files already replaced instead of claiming none was."""
    first, second = tmp_path / "results.json", tmp_path / "results.md"
    files.atomic_write_all([(first, "old json"), (second, "old md")])
    with _file_size_limit(1000), pytest.raises(UserError) as caught:
        files.atomic_write_all([(first, "new json"), (second, "x" * 5000)])
    assert str(caught.value) == (f"could not write {second} (File too large); it and the 1 other file(s) written "
                                 f"with it are as they were")
    assert (first.read_text(), second.read_text()) == ("old json", "old md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]  # (no temporary file left)
    real_replace, calls = os.replace, []

    def read_only_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", read_only_second)
    with pytest.raises(UserError) as caught:
        files.atomic_write_all([(first, "new json"), (second, "new md")])
    assert str(caught.value) == (f"could not write {second} (Read-only file system); 1 of the 2 files written "
                                 f"together were replaced before it: results.json")
    monkeypatch.undo()
    # a report and its rendering (a comparison's, denoise's and bench's): bench.json was written, then bench.md apart
    report = tmp_path / "bench.json"
    files.write_report(report, {"old": True}, "old md")
    with _file_size_limit(1000), pytest.raises(UserError, match="bench.md \\(File too large\\); it and the 1 other"):
        files.write_report(report, {"new": True}, "x" * 5000)
    assert (json.loads(report.read_text()), report.with_suffix(".md").read_text()) == ({"old": True}, "old md")


def test_a_full_disk_is_found_behind_the_errors_that_wrap_it():
    """An export's tokenizer written by atomic_write (its one line, raised from None over the OSError), datasets'
    DatasetGenerationError over OSError 28, and datasets' own disk-space check (an OSError of no errno): each was
    taken for another failure (the staging folder named, or the task's YAML blamed)."""
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise UserError("could not write .export.tmp1@h/tokenizer_config.json (No space left on device)") from None
    except UserError as wrapped:
        assert files.full_disk_reason(wrapped) == "No space left on device"
    generation = RuntimeError("An error occurred while generating the dataset")
    generation.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert files.full_disk_reason(generation) == "No space left on device"
    assert files.full_disk_reason(OSError("Not enough disk space. Needed: Unknown size")) == "Not enough disk space"
    assert files.full_disk_reason(ValueError("bad YAML")) is None
    assert files.full_disk_reason(OSError(errno.ENOENT, "No such file or directory")) is None


def test_a_checkpoint_over_the_file_size_limit_is_one_line_naming_it(tmp_path):
    """A checkpoint larger than a file may be (`ulimit -f`, a quota, FAT) was `gbattn: error: File too large`,
    naming no file; now it is a full disk's line: the file, the reason, and the previous one kept (where there was
    one)."""
    path = tmp_path / rundir.CHECKPOINT
    big = {"model": {"w": torch.zeros(1 << 20)}}  # 4 MB
    with _file_size_limit(100_000), pytest.raises(UserError) as caught:
        rundir.save_checkpoint(big, path)
    assert str(caught.value) == f"could not write {path} (File too large)"
    rundir.save_checkpoint({"model": {"w": torch.ones(2)}}, path)
    with _file_size_limit(100_000), pytest.raises(UserError) as caught:
        rundir.save_checkpoint(big, path)
    assert str(caught.value) == f"could not write {path} (File too large); the previous checkpoint.pt is kept"
    assert torch.equal(rundir.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == [rundir.CHECKPOINT]


def test_eval_per_token_files_hold_one_loss_per_scored_token(trained, tmp_path, capsys, monkeypatch):
    """``eval --per-token F`` (.txt: one loss per line; .npy: a flat array): as many losses as the
    tokens scored, whose mean is the loss printed, each the token's own loss (evaluate's, every digit of it in text
    too: six decimals changed the perplexity from its 9th digit and wrote a loss under 5e-7 as 0; a .NPY name is an
    array too, not text np.load refuses); the JSON record names the file."""
    import numpy as np

    from gbattn.data.prepare import prepare_run_data
    from gbattn.eval.perplexity import evaluate

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = rundir.load_run(trained["run"])
    want = evaluate(run.model, prepare_run_data(run, None, False, "test").splits["test"], run.seq_len, per_token=True)
    for name, read in (("losses.txt", np.loadtxt), ("new-folder/losses.npy", np.load),  # its folder is made
                       ("losses.NPY", np.load)):
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--per-token", tmp_path / name])
        assert code == 0, err
        record = json.loads(out.strip().splitlines()[-1])
        assert record["per_token_file"] == str(tmp_path / name)
        losses = read(tmp_path / name)
        assert losses.shape == (record["tokens"],)
        assert losses.mean() == pytest.approx(record["loss"], rel=1e-5)
        np.testing.assert_array_equal(losses.astype(want.per_token.dtype), want.per_token, err_msg=name)


def test_eval_per_token_may_take_a_run_files_name_outside_the_run(trained, tmp_path, capsys, monkeypatch):
    """Only the run's own files are protected: a losses file named like one, elsewhere, is written."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    code, out, err = run_cli(capsys, ["eval", trained["run"], "--per-token", tmp_path / rundir.BEST])
    assert code == 0 and (tmp_path / rundir.BEST).is_file(), err


def test_eval_per_token_leaves_every_model_directory_alone(trained, tmp_path, capsys):
    """--per-token onto a file of another run, of an exported directory or of a transformers
    checkpoint (its optimizer.pt: any .pt, .bin or .safetensors there) is refused before any work (it
    replaced that run's best weights), as one onto the evaluated run's own files is; a new file of
    another name in such a directory is fine (tested above: elsewhere, any name)."""
    other, export, saved = tmp_path / "other-run", tmp_path / "export", tmp_path / "transformers-checkpoint"
    for folder, names in ((other, (rundir.CONFIG, rundir.BEST, rundir.CHECKPOINT)),
                          (export, (rundir.CONFIG, rundir.SAFETENSORS, "generation_config.json")),
                          (saved, (rundir.CONFIG, rundir.SAFETENSORS, "optimizer.pt", "training_args.bin",
                                   "model-00001-of-00002.safetensors"))):
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"weights")
    own = trained["run"] / rundir.CHECKPOINT
    before = own.read_bytes()
    for target in (other / rundir.BEST, other / rundir.CONFIG, export / rundir.SAFETENSORS,
                   export / "generation_config.json", saved / "optimizer.pt", saved / "training_args.bin",
                   saved / "model-00001-of-00002.safetensors", own):
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--per-token", target])
        assert code == 2 and out == "" and err.strip().splitlines() == [
            f"gbattn: error: --per-token {target} is a file of the model directory {target.parent}: write it "
            f"elsewhere"], err
    assert all(p.read_bytes() == b"weights" for folder in (other, export, saved) for p in folder.iterdir())
    assert own.read_bytes() == before


def test_an_output_file_name_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """`eval --per-token NAME` with a 246-character NAME: refused only after the whole evaluation, by the temporary
    file's name (NAME.tmp<pid>@<host>, past the 255-byte limit). "pt dir/" of a folder not there wrote a file named
    "pt dir"; an output under a file named its parent as if it were the option's value."""
    from gbattn.files import building_suffix, check_writable_file

    monkeypatch.chdir(tmp_path)
    room = os.pathconf(tmp_path, "PC_NAME_MAX") - len(building_suffix())
    check_writable_file("p" * (room - 4) + ".npy", "--per-token")  # the longest that fits
    with pytest.raises(UserError, match=rf"^--per-token p+\.npy: the file name is too long \({room + 1} bytes; at "
                                        rf"most {room} here"):
        check_writable_file("p" * (room - 3) + ".npy", "--per-token")
    with pytest.raises(UserError, match="^--per-token pt dir/ names a folder"):
        check_writable_file("pt dir/", "--per-token")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="^--per-token afile/sub/x.npy: afile is a file, not a folder$"):
        check_writable_file("afile/sub/x.npy", "--per-token")


def test_an_output_file_named_as_any_file_gbattn_reads_in_a_model_directory_is_refused(tmp_path):
    """Every file gbattn reads in a run or exported directory, gbattn's own tokenizer of an export too (its name ends
    neither in config.json nor in a weights suffix), is refused as an output there: --per-token
    EXPORT/gbattn-tokenizer.json would replace the tokenizer the export is read with."""
    export = tmp_path / "export"
    export.mkdir()
    for name in (rundir.CONFIG, rundir.SAFETENSORS):
        (export / name).write_text("x")
    for name in ("config.json", "tokenizer.json", "checkpoint.pt", "best.pt", "metrics.jsonl", "result.json", ".lock",
                 "model.safetensors", "gbattn-tokenizer.json", "model.safetensors.index.json"):
        with pytest.raises(UserError, match=f"^--per-token {re.escape(str(export / name))} is a file of the model "
                                            f"directory {re.escape(str(export))}: write it elsewhere$"):
            rundir.check_output_file(export / name, "--per-token")
    rundir.check_output_file(export / "losses.npy", "--per-token")  # another name there is fine


def test_an_output_file_never_replaces_a_report_gbattn_wrote(tmp_path):
    """--per-token COMPARISON/results.json replaced a comparison's report with losses, silently (the run evaluated
    sits in that comparison, one folder down): an existing report of each kind is refused; a new file of such a name,
    or an existing file of another name, is fine."""
    folder = tmp_path / "comparison"
    folder.mkdir()
    for name in rundir.REPORT_FILES:
        rundir.check_output_file(folder / name, "--per-token")  # none there yet
        (folder / name).write_text("{}")
        with pytest.raises(UserError, match=f"^--per-token {re.escape(str(folder / name))} would replace a report "
                                            r"gbattn writes \(compare, denoise, bench, analyze\): write it elsewhere$"):
            rundir.check_output_file(folder / name, "--per-token")
    (folder / "losses.txt").write_text("1.0")
    rundir.check_output_file(folder / "losses.txt", "--per-token")
    assert set(rundir.REPORT_FILES) >= {"results.json", "results.md", "recipe.json", "bench.json", "bench.md"}


def test_eval_per_token_never_writes_over_the_data_it_reads(trained, tmp_path, capsys, monkeypatch):
    """--per-token naming a corpus file replaced it with losses, silently; a new file in the corpus folder can change
    which files its splits are read from: both refused (a copy of the run's data, passed by --data)."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    data = tmp_path / "data copy"
    shutil.copytree(trained["data"], data)
    before = snapshot(data)
    for target in (data / "wiki.test.tokens", data / "test-losses.txt"):
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--data", data, "--per-token", target])
        assert one_line(code, err) == (f"gbattn: error: --per-token {target} is a file of the data being read "
                                       f"(--data {data}): write it elsewhere")
    assert snapshot(data) == before
    # ... also as ~/... (the corpus's name, which the check was given, stays unexpanded) and as a local folder named
    # like a hub corpus (./wikitext-2-v1, named wikitext-2-v1): the losses replaced the split
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(data, tmp_path / "wikitext-2-v1")
    for given, folder in (("~/data copy", data), ("./wikitext-2-v1", tmp_path / "wikitext-2-v1")):
        target = folder / "wiki.valid.tokens"
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--data", given, "--per-token", target])
        assert one_line(code, err).endswith(f"is a file of the data being read (--data {given}): write it elsewhere")
    assert snapshot(data) == before and snapshot(tmp_path / "wikitext-2-v1") == before


def test_an_output_file_that_is_the_corpus_file_itself_is_refused(tmp_path, monkeypatch):
    """--data naming one file and --per-token naming that same file (by any spelling of its path) would replace the
    corpus with losses; the test above covers a folder's files only. A file beside it is fine."""
    corpus = tmp_path / "input.txt"
    corpus.write_text("to be or not to be\n")
    monkeypatch.chdir(tmp_path)
    for target in (corpus, "input.txt", "./input.txt"):
        with pytest.raises(UserError, match=rf"^--per-token {re.escape(str(target))} is the data being read "
                                            rf"\(--data {re.escape(str(corpus))}\): write it elsewhere$"):
            rundir.check_output_outside_data(target, str(corpus), "--per-token")
    rundir.check_output_outside_data(tmp_path / "losses.txt", str(corpus), "--per-token")
    assert corpus.read_text() == "to be or not to be\n"
    # A folder here named as the bundled corpus is not what --data tiny-shakespeare reads (the bundled copy is)
    (tmp_path / "tiny-shakespeare").mkdir()
    rundir.check_output_outside_data("tiny-shakespeare/losses.txt", "tiny-shakespeare", "--per-token")


def test_eval_scores_the_split_it_names(trained, capsys, monkeypatch):
    """``eval --split valid`` and ``--split test`` each report their own split's loss over its tokens
    (what evaluate gives on that split), and name it in the JSON record, with the weights scored when no
    --checkpoint is given (the best)."""
    from gbattn.data.prepare import prepare_run_data
    from gbattn.eval.perplexity import evaluate

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = rundir.load_run(trained["run"])
    splits = {split: prepare_run_data(run, None, False, split).splits[split] for split in ("valid", "test")}
    losses = {}
    for split in ("valid", "test"):
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--split", split])
        assert code == 0, err
        record = json.loads(out.strip().splitlines()[-1])
        want = evaluate(run.model, splits[split], run.seq_len)
        assert record["split"] == split and record["tokens"] == want.tokens, split
        assert (record["checkpoint"], record["step"]) == ("best", run.step), split
        assert record["loss"] == pytest.approx(want.loss, rel=1e-5), split
        losses[split] = record["loss"]
    assert losses["valid"] != losses["test"]


def test_eval_line_and_record_give_the_perplexity_of_the_loss_and_the_weights_scored(trained, capsys, monkeypatch):
    """The printed line and the JSON record of ``eval`` (and ``--checkpoint last``) give the perplexity as exp of
    the loss, the loss and token count of those weights (what evaluate gives with them), and name the weights
    scored: the record's ppl and the line's weights were read by no test."""
    import math

    from gbattn.data.prepare import prepare_run_data
    from gbattn.eval.perplexity import evaluate

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    for which in ("best", "last"):
        run = rundir.load_run(trained["run"], which)
        want = evaluate(run.model, prepare_run_data(run, None, False, "test").splits["test"], run.seq_len)
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--checkpoint", which])
        assert code == 0, err
        line, record = out.strip().splitlines()
        record = json.loads(record)
        assert (record["checkpoint"], record["step"], record["tokens"]) == (which, run.step, want.tokens)
        assert record["loss"] == pytest.approx(want.loss, rel=1e-6)
        assert record["ppl"] == pytest.approx(math.exp(want.loss), rel=1e-6)
        assert line == (f"test perplexity {record['ppl']:.3f} (loss {record['loss']:.4f} nats) over "
                        f"{want.tokens:,} tokens, {which} weights at step {run.step}")


def test_eval_runs_batches_of_its_batch_size_on_its_threads(trained, capsys, monkeypatch):
    """``eval --batch-size 3 --threads 2``: every forward pass holds 3 rows (the last the rows left), as many passes as
    the rows need, on 2 threads; the loss is the default batch size's (to float rounding)."""
    from gbattn.data.prepare import prepare_run_data
    from gbattn.data.tokens import num_rows
    from gbattn.model.gpt import GPT

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = rundir.load_run(trained["run"])
    rows = num_rows(prepare_run_data(run, None, False, "test").splits["test"], run.seq_len)
    code, out, err = run_cli(capsys, ["eval", trained["run"]])
    assert code == 0, err
    default = json.loads(out.strip().splitlines()[-1])
    torch.set_num_threads(1)
    sizes = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: sizes.append(len(args[0])) if isinstance(module, GPT) else None)
    try:
        code, out, err = run_cli(capsys, ["eval", trained["run"], "--batch-size", "3", "--threads", "2"])
    finally:
        hook.remove()
    assert code == 0, err
    assert rows > 3 and sizes == [3] * (rows // 3) + ([rows % 3] if rows % 3 else []), (rows, sizes)
    assert torch.get_num_threads() == 2
    assert json.loads(out.strip().splitlines()[-1])["loss"] == pytest.approx(default["loss"], rel=1e-5)


def test_a_damaged_token_cache_is_rebuilt_and_the_run_still_works(trained, tmp_path, capsys, monkeypatch):
    """Each damage of the cache entry eval reads is found, the entry rebuilt, and eval's line the same. The cache
    starts empty, so it holds eval's entry alone (a copy of the module's held the entries other tests' runs added,
    which eval never reads, so they stayed damaged)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("GBATTN_CACHE", str(cache))
    code, expected, err = run_cli(capsys, ["eval", trained["run"]])
    assert code == 0 and "test perplexity" in expected, err
    entries = [p for p in (cache / "tokens").iterdir() if p.is_dir()]
    assert entries
    def out_of_vocabulary(entry):  # an id no tokenizer of the run gives: the model's ValueError was a traceback
        ids = np.fromfile(entry / "test.bin", dtype=np.uint16)
        ids[len(ids) // 2] = np.iinfo(np.uint16).max
        ids.tofile(entry / "test.bin")

    damages = [lambda e: (e / "meta.json").write_text('{"dtype": "uint16", "counts": '),
               lambda e: (e / "test.bin").write_bytes((e / "test.bin").read_bytes()[:-2]), out_of_vocabulary,
               lambda e: (e / "meta.json").write_text("[" * 100_000)]  # was a RecursionError traceback
    for damage in damages:
        for entry in entries:
            damage(entry)
        code, out, err = run_cli(capsys, ["eval", trained["run"]])
        assert code == 0 and out == expected, err
        entries = [p for p in (cache / "tokens").iterdir() if p.is_dir()]  # the damaged one removed, eval's built
        assert all(json.loads((e / "meta.json").read_text())["counts"]["test"] > 0 for e in entries)


def test_a_run_that_diverged_before_its_first_checkpoint_restarts_in_place(tmp_path, capsys, monkeypatch):
    data = write_corpus(tmp_path / "corpus")
    argv = ["train", "--out", tmp_path / "run", "--data", data, "--tokenizer", "char", "--threads", "1", "--quiet",
            *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), []), "--set", "max_steps=4",
            "--set", "train_tokens=null", "--set", "eval_tokens=null"]
    code, _, err = run_cli(capsys, [*argv, "--set", "lr=1e30", "--set", "warmup_steps=0"])
    assert code == 3 and "before the first checkpoint" in err and "--restart" in err
    code, _, err = run_cli(capsys, argv)
    assert code == 2 and "already holds a run" in err and "--restart" in err
    code, out, err = run_cli(capsys, [*argv, "--restart"])
    assert code == 0 and '"steps": 4' in out, err


def test_restart_discards_every_file_of_the_run_and_nothing_else(tmp_path):
    """--restart deletes the run's own files, its best weights too (the restarted run, evaluated
    never yet, would otherwise load the replaced run's best.pt as its own); other files stay."""
    own = ("config.json", "tokenizer.json", "checkpoint.pt", "best.pt", "metrics.jsonl", "result.json")
    for name in (*own, "notes.txt"):
        (tmp_path / name).write_text("x")
    removed = rundir.discard_run(tmp_path)
    assert sorted(removed) == sorted(own) and removed[-1] == "config.json"  # last: a kill before it leaves a run
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    # What `gbattn analyze RUN` wrote into RUN/analysis describes the discarded weights: it goes too (it stayed, and
    # its gates.png read as the new run's); the folder's other files stay.
    analysis = tmp_path / "analysis"
    analysis.mkdir()
    drawn = ("summary.json", "gates.png", "entropy.pdf", "norms.png")
    for name in (*drawn, "my-notes.md", "gates.svg"):
        (analysis / name).write_text("x")
    (analysis / "summary.json").write_text(json.dumps(dict.fromkeys(rundir.ANALYSIS_SUMMARY_KEYS)))  # analyze's own
    # and so does what `gbattn lm-eval RUN` wrote into RUN/lm-eval (results, samples)
    scores = tmp_path / rundir.LM_EVAL_DIR
    scores.mkdir()
    for name in ("results-toy.json", "samples-toy-toy.jsonl", "results.json", "notes.jsonl"):
        (scores / name).write_text("x")
    assert sorted(rundir.discard_run(tmp_path)) == sorted([*(f"analysis/{name}" for name in drawn),
                                                           "lm-eval/results-toy.json", "lm-eval/samples-toy-toy.jsonl"])
    assert sorted(p.name for p in analysis.iterdir()) == ["gates.svg", "my-notes.md"]
    assert sorted(p.name for p in scores.iterdir()) == ["notes.jsonl", "results.json"]


def test_restart_discards_every_figure_analyze_draws_in_the_run(tmp_path):
    """Each figure `gbattn analyze RUN` may draw in RUN/analysis, as PNG and PDF, describes the discarded weights:
    loss_diff and examples (drawn with --against), which the test above does not draw, would otherwise stay after a
    restart or an export over an earlier one and read as the new weights'."""
    analysis = tmp_path / "analysis"
    analysis.mkdir()
    figures = [f"{name}.{ext}" for name in ("gates", "entropy", "norms", "loss_diff", "examples")
               for ext in ("png", "pdf")]
    for name in figures:
        (analysis / name).write_text("x")
    (analysis / "summary.json").write_text(json.dumps(dict.fromkeys(rundir.ANALYSIS_SUMMARY_KEYS)))
    assert sorted(rundir.discard_derived(tmp_path)) == sorted(f"analysis/{name}" for name in [*figures, "summary.json"])
    assert list(analysis.iterdir()) == []
    # a folder analyze did not write (no summary.json of its own): the user's gates.png and summary.json were
    # deleted as analyze's, as analyze itself no longer does (it refuses such a folder as its --out)
    for name in ("gates.png", "summary.json"):
        (analysis / name).write_text("mine")
    assert rundir.discard_derived(tmp_path) == []
    assert sorted(p.name for p in analysis.iterdir()) == ["gates.png", "summary.json"]


@pytest.mark.parametrize("names", [
    ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
    ("train.txt.gz", "val.txt", "test.txt"),
    ("corpus-train.raw", "corpus-dev.raw", "corpus-test.raw"),
])
def test_directory_layouts(tmp_path, names):
    d = tmp_path / "d"
    d.mkdir()
    for name, text in zip(names, ("train text\n", "valid text\n", "test text\n")):
        write_text(d / name, text)
    corpus = load_corpus(str(d))
    assert [next(iter(corpus.lines(s))) for s in ("train", "valid", "test")] == ["train text\n", "valid text\n",
                                                                              "test text\n"]


# --------------------------------------------------------------------------------------
# 5 and 8. Every bad input: exit 2, one line, no traceback, nothing in the run directory changed
# --------------------------------------------------------------------------------------


def _bad_files(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    (root / "binary.txt").write_bytes(b"hello\x00world" * 10)
    (root / "latin1.txt").write_bytes(b"ok line\n" * 5 + "caf\xe9\n".encode("latin-1"))
    (root / "fake.txt.gz").write_text("not gzip at all\n")
    with gzip.open(root / "cut.txt.gz", "wb") as f:
        f.write(b"some text\n" * 1000)
    (root / "cut.txt.gz").write_bytes((root / "cut.txt.gz").read_bytes()[:40])
    (root / "empty.txt").write_bytes(b"")
    (root / "nosplits").mkdir(exist_ok=True)
    (root / "nosplits" / "readme.md").write_text("x")
    (root / "twotrain").mkdir(exist_ok=True)
    for name in ("a.train.txt", "b.train.txt", "valid.txt", "test.txt"):
        (root / "twotrain" / name).write_text("text\n")
    (root / "binsplit").mkdir(exist_ok=True)
    (root / "binsplit" / "train.txt").write_bytes(b"\x00\x01\x02")
    (root / "binsplit" / "valid.txt").write_text("v\n")
    (root / "binsplit" / "test.txt").write_text("t\n")
    (root / "a-file").write_text("x")
    (root / "dirsplit" / "train.txt").mkdir(parents=True, exist_ok=True)
    (root / "dirsplit" / "valid.txt").write_text("v\n")
    (root / "dirsplit" / "test.txt").write_text("t\n")
    for name in ("binary.txt", "latin1.txt", "fake.txt.gz", "cut.txt.gz", "empty.txt", "nosplits", "twotrain",
                 "binsplit", "a-file", "dirsplit"):
        files[name] = root / name
    return files


def _broken_runs(trained, root: Path) -> dict[str, Path]:
    """Copies of the trained run, each with one broken file."""
    runs = {}

    def copy(name: str) -> Path:
        target = root / name
        shutil.copytree(trained["run"], target)
        runs[name] = target
        return target

    blob = (trained["run"] / rundir.BEST).read_bytes()
    (copy("truncated") / rundir.BEST).write_bytes(blob[: len(blob) // 2])
    state = rundir.load_checkpoint(trained["run"] / rundir.CHECKPOINT)
    bad_rng = copy("bad-rng")
    (bad_rng / rundir.RESULT).unlink(missing_ok=True)  # so that --resume reads the checkpoint
    torch.save({**state, "rng_per_rank": ["not an RNG state"]}, bad_rng / rundir.CHECKPOINT)
    bad_curve = copy("bad-curve")
    (bad_curve / rundir.RESULT).unlink(missing_ok=True)
    torch.save({**state, "curve": "not a list of points"}, bad_curve / rundir.CHECKPOINT)
    torch.save([1, 2, 3], copy("not-a-dict") / rundir.BEST)
    (copy("bad-tokenizer") / rundir.TOKENIZER).write_text("{this is not json")
    tok = json.loads((trained["run"] / rundir.TOKENIZER).read_text())
    payload = json.loads(tok["payload"])
    payload["chars"] = payload["chars"][:-1]
    (copy("small-tokenizer") / rundir.TOKENIZER).write_text(json.dumps({**tok, "payload": json.dumps(payload)}))
    payload["chars"] = json.loads(tok["payload"])["chars"][::-1]  # as many tokens, each id naming another one
    reordered = copy("reordered-tokenizer")
    (reordered / rundir.TOKENIZER).write_text(json.dumps({**tok, "payload": json.dumps(payload)}))
    (reordered / rundir.RESULT).unlink(missing_ok=True)  # so that --resume reads the tokenizer
    (copy("bad-config") / rundir.CONFIG).write_text("{ not json")
    (copy("no-sections") / rundir.CONFIG).write_text(json.dumps({"hello": 1}))
    config = json.loads((trained["run"] / rundir.CONFIG).read_text())
    config["model"]["d_model"] = "abc"
    (copy("typed-config") / rundir.CONFIG).write_text(json.dumps(config))
    config = json.loads((trained["run"] / rundir.CONFIG).read_text())
    for name, key, value in (("data-not-object", "data", "oops"), ("extra-not-object", "extra", [1]),
                             ("seq-len-zero", "seq_len", 0), ("fingerprint-number", "data", {"fingerprint": 5})):
        target = copy(name)
        (target / rundir.RESULT).unlink(missing_ok=True)  # so that --resume reads the config
        (target / rundir.CONFIG).write_text(json.dumps({**config, key: value}))
    best = rundir.load_checkpoint(trained["run"] / rundir.BEST)
    torch.save({**best, "model": {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                                  for k, v in best["model"].items()}}, copy("nan-weights") / rundir.BEST)
    one_gain = next(k for k, v in best["model"].items() if v.dim() == 1 and k.endswith("weight"))  # a norm's gain
    gain = best["model"][one_gain].clone()
    gain[0] = float("inf")
    torch.save({**best, "model": {**best["model"], one_gain: gain}}, copy("inf-norm-gain") / rundir.BEST)
    (copy("text-best") / rundir.BEST).write_text("0.1 0.2\n")
    flip_one_bit(copy("flipped-bit") / rundir.BEST)
    meta = {k: torch.empty_like(v, device="meta") if v.dim() == 2 else v for k, v in best["model"].items()}
    torch.save({**best, "model": meta}, copy("meta-best") / rundir.BEST)
    torch.save({**best, "model": {k: v > 0 for k, v in best["model"].items()}}, copy("bool-best") / rundir.BEST)
    (copy("passwd-best") / rundir.BEST).write_text("root:x:0:0:root:/root:/bin/bash\n")  # a link to /etc/passwd
    no_weights = copy("no-weights")  # killed before its first save
    for name in (rundir.BEST, rundir.CHECKPOINT):
        (no_weights / name).unlink()
    (copy("deep-config") / rundir.CONFIG).write_text('{"a":' + "[" * 100_000 + "]" * 100_000 + "}")
    for name in ("metrics-dir", "metrics-link"):
        target = copy(name)
        (target / rundir.RESULT).unlink(missing_ok=True)
        (target / rundir.METRICS).unlink()
    (runs["metrics-dir"] / rundir.METRICS).mkdir()
    (root / "elsewhere").mkdir(parents=True, exist_ok=True)  # a link to a file not there yet: it was created
    (runs["metrics-link"] / rundir.METRICS).symlink_to(root / "elsewhere" / "metrics.jsonl")
    resume_state = rundir.load_checkpoint(trained["run"] / rundir.CHECKPOINT)
    # A resume checkpoint lacking a weight (set_state_dict's strict=True let it keep its initial value).
    lacking = {k: v for k, v in resume_state["model"].items() if k != "ln_f.weight"}
    nan_weights = {k: torch.full_like(v, float("nan")) for k, v in resume_state["model"].items()}
    # A tied model (paper-small's tie_embeddings) whose head differs from its embedding: the one loaded last won.
    other_head = {**resume_state["model"], "lm_head.weight": torch.randn_like(resume_state["model"]["wte.weight"])}
    for name, changed in (("negative-step", {"step": -10}), ("lacking-weight", {"model": lacking}),
                          ("step-beyond", {"step": 10**6}), ("text-step", {"step": "2"}),
                          ("nan-resume", {"model": nan_weights}), ("nan-best-valid", {"best_valid": float("nan")}),
                          ("best-valid-off-curve", {"best_valid": 0.5}), ("other-format", {"format": 3}),
                          ("best-stepless", {"best_step": None}),  # a finite best loss of no step
                          ("best-not-lowest", {"best_step": 2, "best_valid": 5.0, "curve": [
                              {**point, "valid_loss": {2: 5.0, 4: 4.0}[point["step"]]}
                              for point in resume_state["curve"]]}),
                          ("untied-head-resume", {"model": other_head}), ("laughs-resume", {"best_valid": _laughs()})):
        target = copy(name)
        (target / rundir.RESULT).unlink(missing_ok=True)
        torch.save({**resume_state, **changed}, target / rundir.CHECKPOINT)
    # best.pt with no step (reported as "best weights at step 0"), a step past the run's last, an untied head
    stepless = {k: v for k, v in best.items() if k != "step"}
    for name, damaged in (("stepless-best", stepless), ("step-beyond-best", {**best, "step": 10**6}),
                          ("laughs-best", {**best, "step": _laughs()}),
                          ("untied-head-best", {**best, "model": {**best["model"], "lm_head.weight": torch.randn_like(
                              best["model"]["wte.weight"])}})):
        torch.save(damaged, copy(name) / rundir.BEST)
    # The optimizer's state: a NaN moment (the loss became NaN at the next step), a negative step count (a
    # RuntimeError traceback at the next step: complex bias corrections), no parameter groups (a traceback)
    for name, damage in (("nan-moment", lambda o: next(iter(o["state"].values()))["exp_avg"].fill_(float("nan"))),
                         ("negative-moment-step", lambda o: next(iter(o["state"].values())).update(
                             step=torch.tensor(-5.0))),
                         ("no-param-groups", lambda o: o.update(param_groups=[]))):
        state = rundir.load_checkpoint(trained["run"] / rundir.CHECKPOINT)
        damage(state["optimizer"])
        target = copy(name)
        (target / rundir.RESULT).unlink(missing_ok=True)
        torch.save(state, target / rundir.CHECKPOINT)
    return runs


def _laughs() -> list:
    """100 references to 100 references ... six deep: 3 KB pickled (its memo), 10**12 items to print whole."""
    value = [0]
    for _ in range(6):
        value = [value] * 100
    return value


def test_shown_bounds_the_repr_of_a_value_read_from_a_file():
    """errors.shown: repr's text for small values, bounded in length and work for values a pickle can hold: one
    nested 3,000 deep (repr: a RecursionError traceback) and a list of references expanding to 10**12 items."""
    from gbattn.errors import shown

    deep = [0]
    for _ in range(3000):
        deep = [deep]
    assert shown(deep) == "[[[[...]]]]" and shown(_laughs()).startswith("[[[[...], [...], [...], [...], ...],")
    # an OrderedDict (torch's safe loader reads one) took the built-in repr, unbounded (of _laughs(): 1.2 GB after
    # 30 s; here a value of 10**4 items, which that repr writes out whole)
    some = [[[[0] * 10] * 10] * 10] * 10
    assert shown(collections.OrderedDict(a=some)) == ("{'a': [[[...], [...], [...], [...], ...], [[...], [...], [...], "
                                                      "[...], ...], ...")
    assert len(shown(_laughs())) == 80 and len(shown("x" * 10**6, 40)) == 40
    assert len(shown(["y" * 40] * 2)) == 80  # (a repr of 88 characters, a little over the width, was kept whole)
    small = (5, "2", None, 1.5, [1, 2], {"a": 1})
    assert [shown(v) for v in small] == [repr(v) for v in small]


def bad_inputs(trained, tmp_path) -> list[tuple[str, list, str]]:
    """(name, argv, a piece of the one line) for more than 100 bad inputs (the README says so)."""
    f = _bad_files(tmp_path / "files")
    broken = _broken_runs(trained, tmp_path / "broken")
    run, data = trained["run"], trained["data"]
    short_test = tmp_path / "short-test"  # the run's corpus with a test split of 3 characters
    shutil.copytree(data, short_test)
    (short_test / "wiki.test.tokens").write_text((data / "wiki.test.tokens").read_text()[:3])
    foreign_text = tmp_path / "foreign-text"  # the run's corpus with a character its char tokenizer never saw
    shutil.copytree(data, foreign_text)
    (foreign_text / "wiki.test.tokens").write_text((data / "wiki.test.tokens").read_text() + "\u00a7\n")
    new_run = ["train", "--out", tmp_path / "new", "--data", data, "--tokenizer", "char", "--quiet"]
    comparison = tmp_path / "comparison"  # compare's layout: LABEL/seedN run directories
    for label in ("gba", "standard"):
        shutil.copytree(run, comparison / label / "seed42")
    denoise = tmp_path / "denoise"  # what `gbattn denoise` writes: tables, no model
    denoise.mkdir()
    (denoise / "results.json").write_text(json.dumps({"protocol": {}, "tables": {}, "runs": []}))
    planned = tmp_path / "planned"  # a comparison's folder holding its recipe.json and no run yet
    planned.mkdir()
    (planned / "recipe.json").write_text("{}")
    cases = [
        ("binary data file", ["train", "--out", tmp_path / "o1", "--data", f["binary.txt"]],
         "NUL byte at byte offset 5"),
        ("non-UTF-8 data file", ["train", "--out", tmp_path / "o2", "--data", f["latin1.txt"]],
         "not UTF-8 text (invalid byte at byte offset 43"),
        ("fake .gz data file", ["train", "--out", tmp_path / "o3", "--data", f["fake.txt.gz"]],
         "not complete gzip data"),
        ("truncated .gz data file", ["train", "--out", tmp_path / "o4", "--data", f["cut.txt.gz"]],
         "not complete gzip data"),
        ("empty data file", ["train", "--out", tmp_path / "o5", "--data", f["empty.txt"]], "empty.txt is empty"),
        ("directory without splits", ["train", "--out", tmp_path / "o6", "--data", f["nosplits"]],
         "files seen: readme.md"),
        ("a split that is a directory", ["train", "--out", tmp_path / "o12", "--data", f["dirsplit"]],
         "files seen: test.txt, train.txt (a directory), valid.txt"),
        ("two train files", ["train", "--out", tmp_path / "o7", "--data", f["twotrain"]],
         "several files could be the train split"),
        ("binary split file", ["train", "--out", tmp_path / "o8", "--data", f["binsplit"]], "train.txt looks binary"),
        ("missing data", ["train", "--out", tmp_path / "o9", "--data", tmp_path / "nope"], "no such file or directory"),
        ("empty --data", ["train", "--out", tmp_path / "o10", "--data", ""], "--data"),
        ("--out is a file", ["train", "--out", f["a-file"], "--data", data], "is a file, not a directory"),
        ("--out under a file", ["train", "--out", f["a-file"] / "sub", "--data", data], "not writable"),
        ("--per-token under a file", ["eval", run, "--per-token", f["a-file"] / "x.npy"], "a-file is a file"),
        ("--per-token is a directory", ["eval", run, "--per-token", tmp_path], "is a directory"),
        ("truncated checkpoint", ["eval", broken["truncated"]], "truncated or corrupted"),
        ("checkpoint not a dict", ["eval", broken["not-a-dict"]], "not a gbattn checkpoint"),
        ("checkpoint with malformed RNG states", ["train", "--resume", "--out", broken["bad-rng"], "--quiet"],
         "random number generator states are malformed"),
        ("checkpoint with a malformed validation curve", ["train", "--resume", "--out", broken["bad-curve"], "--quiet"],
         "validation curve is malformed"),
        ("invalid tokenizer.json", ["eval", broken["bad-tokenizer"]], "not a valid gbattn tokenizer file"),
        ("tokenizer of another model", ["generate", broken["small-tokenizer"], "--prompt", "a"],
         "does not belong to this model (or the model's embeddings were resized past it"),
        *((f"tokenizer of the model's size but not the run's ({command[0]})", command,
           "tokenizer.json is not the tokenizer the run was trained with")
          for command in (["eval", broken["reordered-tokenizer"]],
                          ["generate", broken["reordered-tokenizer"], "--prompt", "a"],
                          ["train", "--resume", "--out", broken["reordered-tokenizer"], "--quiet"])),
        ("invalid config.json", ["eval", broken["bad-config"]], "is not valid JSON"),
        ("config.json without sections", ["eval", broken["no-sections"]], "no model and train sections"),
        ("config.json wrong type", ["eval", broken["typed-config"]], "d_model='abc' must be an integer"),
        ("config.json data not an object", ["eval", broken["data-not-object"]], "data='oops' must be a JSON object"),
        ("config.json extra not an object", ["train", "--resume", "--out", broken["extra-not-object"], "--quiet"],
         "extra=[1] must be a JSON object"),
        ("config.json seq_len 0", ["analyze", broken["seq-len-zero"]], "seq_len=0 must be >= 1"),
        ("config.json fingerprint a number", ["generate", broken["fingerprint-number"], "--prompt", "a"],
         "(data): fingerprint=5 must be a string"),
        ("run that saved no weights yet", ["generate", broken["no-weights"], "--prompt", "a"],
         "holds no weights: its training has not saved a checkpoint yet"),
        ("checkpoint with NaN weights", ["generate", broken["nan-weights"], "--prompt", "a"],
         "hold NaN or infinite values"),
        ("checkpoint with one infinite norm gain", ["eval", broken["inf-norm-gain"]], "hold NaN or infinite values"),
        ("checkpoint that is a text file", ["eval", broken["text-best"]], "is not a torch.save file"),
        ("checkpoint with one bit of a weight flipped", ["eval", broken["flipped-bit"]],
         "fails the CRC-32 check that torch.save stored with it"),
        # torch's safe unpickler ran "r" (LONG_BINPUT) on an empty stack: an IndexError traceback
        ("checkpoint that is a password file", ["generate", broken["passwd-best"], "--prompt", "a"],
         "truncated or corrupted (IndexError"),
        ("config.json nested too deeply", ["eval", broken["deep-config"]], "nested too deeply"),
        ("config.json nested too deeply, exported", ["export", broken["deep-config"], "--out", tmp_path / "e1"],
         "nested too deeply"),  # was a RecursionError traceback
        ("checkpoint with a negative step", ["train", "--resume", "--out", broken["negative-step"], "--quiet"],
         "step=-10"),
        ("checkpoint lacking a weight", ["train", "--resume", "--out", broken["lacking-weight"], "--quiet"],
         "do not match its config (Missing key(s) in state_dict: \"ln_f.weight\""),
        # A finished run resumed at a step past its end wrote its result at once; "2" was read as 2:
        ("checkpoint with a step beyond the run", ["train", "--resume", "--out", broken["step-beyond"], "--quiet"],
         "step=1000000 and tokens_seen=1024 must be integers, 0 <= step <= 4 (the run's steps)"),
        ("checkpoint with a text step", ["train", "--resume", "--out", broken["text-step"], "--quiet"],
         "step='2' and tokens_seen=1024 must be integers"),
        ("checkpoint with NaN weights, resumed", ["train", "--resume", "--out", broken["nan-resume"], "--quiet"],
         "hold NaN or infinite values"),  # was resumed (and, at its last step, finished with them)
        ("checkpoint with a NaN best validation loss", ["train", "--resume", "--out", broken["nan-best-valid"],
                                                        "--quiet"], "its best validation loss is NaN"),
        # A best validation loss lower than its curve's was the run's reported valid loss (ppl 1.65 where the curve
        # said 46.1), and the later, better evaluation was not kept as best:
        ("checkpoint whose best validation is not its curve's", ["train", "--resume", "--out",
                                                                 broken["best-valid-off-curve"], "--quiet"],
         "its best validation (loss 0.5 at step 4) is not its validation curve's lowest loss"),
        ("checkpoint whose best validation is not its curve's lowest", ["train", "--resume", "--out",
                                                                        broken["best-not-lowest"], "--quiet"],
         "its best validation (loss 5.0 at step 2) is not its validation curve's lowest loss"),
        ("checkpoint with a best validation loss of no step", ["train", "--resume", "--out", broken["best-stepless"],
                                                               "--quiet"],
         "at step None) is not its validation curve's lowest loss"),
        ("checkpoint of another format", ["train", "--resume", "--out", broken["other-format"], "--quiet"],
         "its format is 3; this gbattn reads format 2"),
        # A tied head of other values than the embedding replaced it (test perplexity 1.4e14), silently:
        ("checkpoint whose tied head differs from its embedding", ["train", "--resume", "--out",
                                                                   broken["untied-head-resume"], "--quiet"],
         "hold wte.weight and lm_head.weight, one parameter of the model (tied), with different values"),
        ("best weights whose tied head differs from the embedding", ["eval", broken["untied-head-best"]],
         "hold wte.weight and lm_head.weight, one parameter of the model (tied), with different values"),
        ("best weights whose tied head differs, exported",
         ["export", broken["untied-head-best"], "--out", tmp_path / "e-untied"], "one parameter of the model (tied)"),
        ("best weights without a step", ["eval", broken["stepless-best"]], "step=None must be an integer in [0, 4]"),
        # values whose repr never ends (a list of 100 references to ..., six deep) were printed whole: 6 GB, minutes
        ("best weights whose step expands when printed", ["eval", broken["laughs-best"]],
         "step=[[[[...], [...], [...], [...], ...], [[...], [...], [...], [...], ...], [[...... must be an integer in "
         "[0, 4]"),
        ("checkpoint whose best loss expands when printed", ["train", "--resume", "--out", broken["laughs-resume"],
                                                            "--quiet"], "its best validation loss [[[[...], [...], "),
        ("best weights of a step past the run's last", ["generate", broken["step-beyond-best"], "--prompt", "a"],
         "step=1000000 must be an integer in [0, 4] (the weights' training step, at most the run's steps, which "),
        # (a config.json whose steps were edited down: only best.pt was blamed, "the file is damaged")
        ("best weights past the steps config.json says", ["eval", broken["step-beyond-best"]],
         "config.json says are 4): one of the two files is damaged or was edited"),
        ("checkpoint with a NaN optimizer moment", ["train", "--resume", "--out", broken["nan-moment"], "--quiet"],
         "the optimizer's exp_avg of wte.weight holds torch.float32 values that are not finite floating-point numbers"),
        ("checkpoint with a negative optimizer step", ["train", "--resume", "--out", broken["negative-moment-step"],
                                                       "--quiet"], "step count of wte.weight is tensor(-5.)"),
        ("checkpoint without parameter groups", ["train", "--resume", "--out", broken["no-param-groups"], "--quiet"],
         "its optimizer's parameter groups are not this model's"),
        # A meta tensor was a RuntimeError traceback (isfinite of no data); bool weights were read as 0 and 1:
        ("checkpoint with meta tensors", ["eval", broken["meta-best"]], "are not floating-point numbers (wte.weight: "
                                                                        "torch.float32 on meta"),
        ("checkpoint with bool weights", ["generate", broken["bool-best"], "--prompt", "a"],
         "are not floating-point numbers (wte.weight: torch.bool"),
        # The resume event was appended into a directory (IsADirectoryError) or through a link, outside the run:
        ("metrics.jsonl is a directory", ["train", "--resume", "--out", broken["metrics-dir"], "--quiet"],
         "metrics.jsonl is a directory, not a regular file: put the file itself there"),
        ("metrics.jsonl is a link", ["train", "--resume", "--out", broken["metrics-link"], "--quiet"],
         "metrics.jsonl cannot be opened to append to (Too many levels of symbolic links;"),
        ("eval --per-token onto the run's checkpoint", ["eval", run, "--per-token", run / rundir.BEST],
         "is a file of the model directory"),
        ("eval of a split shorter than one row", ["eval", run, "--data", short_test, "--allow-other-data"],
         f"the test split of --data {short_test} has 3 tokens: fewer than one row"),
        ("eval of text with characters the char tokenizer never saw",
         ["eval", run, "--data", foreign_text, "--allow-other-data"],
         "foreign-text (test split): characters not in the tokenizer's vocabulary: ['\u00a7']"),
        ("generate from a prompt with characters the char tokenizer lacks", ["generate", run, "--prompt", "a\u00a7"],
         "gbattn: error: --prompt: characters not in the tokenizer's vocabulary: ['\u00a7']"),
        ("run dir is a file", ["eval", f["a-file"]], "is not a directory"),
        ("eval of a comparison's directory", ["eval", comparison],
         f"{comparison} is not a run directory but holds 2: give one of them, e.g. {comparison}/gba/seed42"),
        ("generate of one model's seeds in a comparison", ["generate", comparison / "standard", "--prompt", "a"],
         f"{comparison}/standard is not a run directory but holds one: {comparison}/standard/seed42"),
        # A denoise output was "config.json not found: is it a gbattn run directory?":
        ("analyze of a denoise output", ["analyze", denoise, "--quiet"],
         f"{denoise} holds a `gbattn denoise` output, not a run directory (nor one written by `gbattn export`)"),
        ("eval of a denoise output", ["eval", denoise], f"{denoise} holds a `gbattn denoise` output, not a run"),
        ("eval of a comparison holding no run yet", ["eval", planned],
         f"{planned} holds a `gbattn compare` comparison, not a run directory"),
        ("resume without a run", ["train", "--resume", "--out", tmp_path / "empty-dir"],
         "holds no run to resume (no config.json"),
        ("--resume and --restart", ["train", "--resume", "--restart", "--out", run], "give one of them"),
        ("--resume and --init-from", ["train", "--resume", "--init-from", run, "--out", run],
         "--init-from starts a new run: it does not go with --resume"),
        ("generate --max-new-tokens -1", ["generate", run, "--prompt", "a", "--max-new-tokens", "-1"], "must be >= 0"),
        ("generate --top-k 0", ["generate", run, "--prompt", "a", "--top-k", "0"], "must be >= 1"),
        ("generate --num-samples 0", ["generate", run, "--prompt", "a", "--num-samples", "0"], "must be >= 1"),
        ("generate --temperature -1", ["generate", run, "--prompt", "a", "--temperature", "-1"], "must be a finite"),
        ("generate --temperature nan", ["generate", run, "--prompt", "a", "--temperature", "nan"], "must be a finite"),
        ("generate --temperature inf", ["generate", run, "--prompt", "a", "--temperature", "inf"], "must be a finite"),
        ("generate unknown characters", ["generate", run, "--prompt", "Ω"], "characters not in the tokenizer"),
        ("eval --batch-size 0", ["eval", run, "--batch-size", "0"], "must be >= 1"),
        ("--set lr=NaN", [*new_run, "--set", "lr=NaN"], "lr='NaN' must be a number"),
        ("--set lr=abc", [*new_run, "--set", "lr=abc"], "lr='abc' must be a number"),
        ("--set lr=0", [*new_run, "--set", "lr=0"], "lr=0.0 must be > 0"),
        ("--set beta1=1", [*new_run, "--set", "beta1=1"], "beta1=1.0 must be in [0, 1)"),
        ("--set beta2=-0.1", [*new_run, "--set", "beta2=-0.1"], "beta2=-0.1 must be in [0, 1)"),
        ("--set weight_decay=-1", [*new_run, "--set", "weight_decay=-1"], "weight_decay=-1.0 must be >= 0"),
        ("--set seq_len=0", [*new_run, "--set", "seq_len=0"], "seq_len=0 must be an integer >= 1"),
        ("--set block_size=1", [*new_run, "--set", "block_size=1"], "block_size=1 leaves no input tokens per row"),
        ("--set seq_len above block_size", [*new_run, "--set", "seq_len=65", "--set", "block_size=64"],
         "seq_len=65 exceeds block_size=64"),
        ("--set threads=0", [*new_run, "--set", "threads=0"], "threads=0 must be an integer in [1, 1024]"),
        # More threads than the OS allows crashed OpenMP on the first operation (40,000: a segfault).
        ("--set threads=40000", [*new_run, "--set", "threads=40000"], "threads=40000 must be an integer in [1, 1024]"),
        ("generate --threads 40000", ["generate", run, "--prompt", "a", "--threads", "40000"], "must be <= 1024"),
        ("denoise --threads 40000", ["denoise", "--threads", "40000", "--out", tmp_path / "d"], "must be <= 1024"),
        ("denoise --eval-queries 10**9", ["denoise", "--eval-queries", "1000000000", "--out", tmp_path / "d"],
         "must be <= 1000000"),
        ("compare --threads 40000", ["compare", "--recipe", "cpu-char", "--threads", "40000", "--out", tmp_path / "c2"],
         "must be <= 1024"),
        ("--set d_model=128.5", [*new_run, "--set", "d_model=128.5"], "d_model=128.5 must be an integer"),
        ("--set d_model=abc", [*new_run, "--set", "d_model=abc"], "d_model='abc' must be an integer"),
        ("--set eval_every=0", [*new_run, "--set", "eval_every=0"], "eval_every=0 must be an integer >= 1"),
        ("--set batch_size=x", [*new_run, "--set", "batch_size=x"], "batch_size='x' must be an integer"),
        ("--set dropout=1.5", [*new_run, "--set", "dropout=1.5"], "dropout=1.5 must be in [0, 1)"),
        ("--set attn.rounds=two", [*new_run, "--set", "attn.rounds=two", "--attn", "boosted"],
         "attn.rounds='two' must be an integer"),
        ("--set n_heads=true", [*new_run, "--set", "n_heads=true"], "n_heads=True must be an integer"),
        ("--set unknown field", [*new_run, "--set", "colour=red"], "--set colour: unknown field"),
        ("--set warmup_steps=-5", [*new_run, "--set", "warmup_steps=-5"], "warmup_steps=-5 must be an integer >= 0"),
        ("--set max_steps=0", [*new_run, "--set", "max_steps=0"], "max_steps=0 must be an integer >= 1"),
        ("--set epochs=0", [*new_run, "--set", "epochs=0"], "epochs=0.0 must be > 0"),
        ("--set grad_clip=-1", [*new_run, "--set", "grad_clip=-1"], "grad_clip=-1.0 must be >= 0"),
        ("--set split", [*new_run, "--set", "split=[0.5,0.6,0]"], "summing to 1"),
        ("--set tokenizer=5", ["train", "--out", tmp_path / "o14", "--data", data, "--set", "tokenizer=5"],
         "tokenizer=5 must be a string"),
        ("--set without =", [*new_run, "--set", "lr"], "expected key=value"),
        ("--seed negative", [*new_run, "--seed", "-5"], "argument --seed: -5 must be >= 0"),
        ("generate --seed beyond 2**63", ["generate", run, "--prompt", "a", "--seed", "1" + "0" * 22],
         "must be <= 9223372036854775807"),
        ("--set seed=1e30", [*new_run, "--set", "seed=1e30"], "is out of range (at most 2**63 - 1)"),
        ("--set block_size=1e9", ["params", "cpu-char", "--set", "block_size=1e9"],
         "block_size=1000000000 must be an integer in [1, 16777216]"),
        ("generate --threads 3e9", ["generate", run, "--prompt", "a", "--threads", "3000000000"],
         "must be <= 1024"),
        ("unknown preset", [*new_run, "--preset", "huge"], "preset='huge' is not allowed"),
        ("unknown attention", ["params", "--attn", "nope"], "attn='nope' is not allowed"),
        ("--attn with bench's options", ["params", "--attn", "boosted:rounds=3"],
         "attn='boosted:rounds=3': give the variant alone and its options apart, e.g. --attn boosted --set "
         "attn.rounds=3"),
        ("unknown recipe", ["compare", "--recipe", "nope", "--out", tmp_path / "c"], "recipe='nope' is not allowed"),
        ("compare --model without a variant", ["compare", "--recipe", "cpu-char", "--out", tmp_path / "c",
                                               "--model", "mine"], "--model mine: expected LABEL=VARIANT"),
        ("compare --model of an unknown variant", ["compare", "--recipe", "cpu-char", "--out", tmp_path / "c",
                                                   "--model", "mine=boostd"], "attn='boostd' is not allowed"),
        ("compare --model with a label of the recipe", ["compare", "--recipe", "cpu-char", "--out", tmp_path / "c",
                                                        "--model", "twicing=boosted"],
         "--model twicing=boosted: recipe 'cpu-char' has a model 'twicing' already"),
        # (two folders, twicing/ and Twicing/: one on macOS or Windows, where a row silently reused the other's run)
        ("compare --model with a label of the recipe in other case", ["compare", "--recipe", "cpu-char", "--out",
                                                                      tmp_path / "c", "--model", "Twicing=boosted"],
         "--model Twicing=boosted: differs from model 'twicing' only in case, and a case-insensitive file system"),
        ("compare --model labels differing in case", ["compare", "--recipe", "cpu-char", "--out", tmp_path / "c",
                                                      "--model", "mine=boosted", "--model", "MINE=twicing"],
         "--model MINE=twicing: differs from model 'mine' only in case"),
        ("compare --matched an unknown model", ["compare", "--recipe", "cpu-char", "--out", tmp_path / "c",
                                                "--matched", "mine"], "--matched mine: no such model"),
        # A comparison was trained into the run directory (recipe.json, results, LABEL/seedN runs beside its files).
        ("compare --out a run directory", ["compare", "--recipe", "cpu-char", "--out", run, "--set", "max_steps=1"],
         f"--out {run} holds a run, not a comparison: choose another --out"),
        ("compare --out one model's seeds in a comparison",
         ["compare", "--recipe", "cpu-char", "--out", comparison / "standard", "--set", "max_steps=1"],
         f"--out {comparison}/standard holds run directories (seed42), not a comparison: choose another --out"),
        ("unknown tokenizer", ["train", "--out", tmp_path / "o11", "--data", data, "--tokenizer", "words"],
         "tokenizer='words' is not allowed"),
        ("odd kv heads for differential", ["params", "--attn", "differential", "--set", "n_kv_heads=1"],
         "must be even"),
        ("bad device", [*new_run, "--device", "tpu"], "device='tpu' is not allowed"),
        ("bench --repeats 0", ["bench", "--preset", "cpu-char", "--repeats", "0"], "0 must be >= 1"),
        ("bench --threads 0", ["bench", "--preset", "cpu-char", "--threads", "0"], "0 must be >= 1"),
        ("bench --decode 0", ["bench", "--preset", "cpu-char", "--decode", "0"], "0 must be >= 1"),
        ("bench --decode beyond the block size", ["bench", "--preset", "cpu-char", "--decode", "64"],
         "--decode 64 leaves no room for a prompt within the block size 64"),
        ("bench --seq-len beyond the block size", ["bench", "--preset", "cpu-char", "--seq-len", "65"],
         "--seq-len 65 exceeds the block size 64"),
        ("bench --out is a file", ["bench", "--preset", "cpu-char", "--out", f["a-file"]],
         "is a file, not a directory"),
        ("empty --out", ["train", "--out", "", "--data", data, "--tokenizer", "char"], "--out: is empty"),
        # An empty value is an unset shell variable, never "the default": `--attn ""` trained standard.
        ("empty --attn", [*new_run, "--attn", ""], "argument --attn: is empty"),
        ("blank --out of export", ["export", run, "--out", " "], "argument --out: is empty"),
        ("empty --per-token", ["eval", run, "--per-token", ""], "argument --per-token: is empty"),
        ("empty --preset of bench", ["bench", "--preset="], "argument --preset: is empty"),
        # `gbattn eval ""` read the current directory as the run.
        ("empty run directory", ["eval", ""], "argument run_dir: is empty"),
        ("blank run directory of generate", ["generate", " ", "--prompt", "a"], "argument run_dir: is empty"),
        ("--data is a device", ["train", "--out", tmp_path / "o11", "--data", "/dev/null"],
         "is neither a regular file nor a directory"),
        # An option and a --set of the same field: both given and different is refused, not one chosen silently.
        ("--tokenizer and --set tokenizer differ", [*new_run, "--set", "tokenizer=bpe"],
         "--tokenizer char and --set tokenizer=bpe disagree"),
        ("--attn and --set attn differ", ["params", "--attn", "boosted", "--set", "attn=standard"],
         "--attn boosted and --set attn=standard disagree"),
        ("--data and --set data differ", [*new_run, "--set", f"data={short_test}"], "disagree: give one of them"),
        ("--compile and --set compile differ", [*new_run, "--compile", "--set", "compile=false"],
         "--compile and --set compile=false disagree"),  # it read "--compile True and --set compile=False"
        ("--no-compile and --set compile differ", [*new_run, "--no-compile", "--set", "compile=true"],
         "--no-compile and --set compile=true disagree"),
        ("--init-from with --set tokenizer", ["train", "--init-from", run, "--out", tmp_path / "o13", "--set",
                                              "tokenizer=bpe"], "trains with the tokenizer of"),
        ("--init-from with --attn", ["train", "--init-from", run, "--out", tmp_path / "o13", "--attn", "standard"],
         "--init-from trains the model of"),
        # the options given are named, not all that could have been, and upcycle only for the attention (it named
        # --attn, --residual and --preset, and upcycle, for --set d_model=64)
        ("--init-from with a model --set", ["train", "--init-from", run, "--out", tmp_path / "o13", "--set",
                                            "d_model=64"],
         f"--init-from trains the model of {run} as it is: leave out --set d_model (model settings other than "
         f"dropout and dropout_sites change its parameters)"),
        ("--init-from with another --preset", ["train", "--init-from", run, "--out", tmp_path / "o13", "--preset",
                                               "cpu-proxy"], "as it is: leave out --preset cpu-proxy (model settings"),
        ("--init-from with --residual", ["train", "--init-from", run, "--out", tmp_path / "o13", "--residual",
                                         "attnres-full"],  # refused with a message that did not name --residual
         "as it is: leave out --residual (model settings"),
        ("--init-from with --attn", ["train", "--init-from", run, "--out", tmp_path / "o13", "--attn", "boosted"],
         "as it is: leave out --attn (model settings other than dropout and dropout_sites change its parameters); "
         "upcycle first to add correction rounds: `gbattn upcycle`"),
        ("--init-from with another split", ["train", "--init-from", run, "--out", tmp_path / "o13", "--set",
                                            "split=[0.8,0.1,0.1]"],  # was trained on the run's split silently
         f"--init-from trains on the split of {run} (recorded: [0.9, 0.05, 0.05]): leave out --set split"),
        ("--init-from and --set init_from differ", ["train", "--init-from", run, "--out", tmp_path / "o13", "--set",
                                                    "init_from=elsewhere"],  # trained from --init-from silently
         f"--init-from {run} and --set init_from=elsewhere disagree: give one of them"),
        ("--set compile=no on resume", ["train", "--resume", "--out", run, "--set", "compile=no"],
         "compile='no' must be true or false or null"),  # was "would change it: --compile (recorded: trained eager"
        ("--threads and --set threads differ on resume", ["train", "--resume", "--out", run, "--threads", "1", "--set",
                                                          "threads=2"],  # --threads was taken silently
         "--threads 1 and --set threads=2 disagree: give one of them"),
        # --restart deleted the weights it was to start from, then failed:
        ("--init-from its own --out, restarted", ["train", "--init-from", run, "--out", run, "--restart"],
         f"--init-from {run} is --out: a run started from its weights goes to another --out"),
        ("--init-from its own --out by another path", ["train", "--init-from", f"{run}/../{run.name}", "--out", run,
                                                       "--restart"], f"--init-from {run}/../{run.name} is --out: "),
        ("--set split of a corpus in split files", [*new_run, "--set", "split=[0.8,0.1,0.1]"],  # was ignored
         f"--set split cuts a single text file by characters; --data {data} is a folder, read as one file per "
         f"split (train, valid and test): leave split out, or give one text file"),
        ("compare --set split of a corpus in split files", ["compare", "--recipe", "cpu-char", "--data", data, "--out",
                                                            tmp_path / "c2", "--set", "split=[0.8,0.1,0.1]"],
         f"--set split cuts a single text file by characters; --data {data} is a folder, read as one file per "
         f"split (train, valid and test): leave split out, or give one text file"),
        ("compare --set attn", ["compare", "--recipe", "cpu-char", "--data", data, "--out", tmp_path / "c2", "--set",
                                "attn=boosted"], "the recipe chooses each model's"),
        # compare trained on --set data while recipe.json recorded --data; --threads overrode --set threads.
        ("compare --data and --set data differ", ["compare", "--recipe", "cpu-char", "--data", data, "--out",
                                                  tmp_path / "c3", "--set", f"data={short_test}", "--set",
                                                  "max_steps=1", "--quiet"], "disagree: give one of them"),
        ("compare --threads and --set threads differ", ["compare", "--recipe", "cpu-char", "--data", data, "--out",
                                                        tmp_path / "c3", "--threads", "1", "--set", "threads=2",
                                                        "--set", "max_steps=1", "--quiet"],
         "--threads 1 and --set threads=2 disagree: give one of them"),
        ("compare --set threads=0", ["compare", "--recipe", "cpu-char", "--data", data, "--out", tmp_path / "c3",
                                     "--set", "threads=0"], "threads=0 must be an integer in [1, 1024]"),
        ("compare --set data= (empty)", ["compare", "--recipe", "cpu-char", "--out", tmp_path / "c3", "--set", "data=",
                                         "--set", "max_steps=1", "--only", "standard", "--quiet"],
         "--set 'data=': the value is empty"),
        ("bench --set attn", ["bench", "--preset", "cpu-char", "--set", "attn=boosted"],
         "name the variants with --attn"),
    ]
    return cases


def test_every_bad_input_is_one_line_with_status_2(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    cases = bad_inputs(trained, tmp_path)
    assert len(cases) > 100  # the README: "more than 100"
    (tmp_path / "empty-dir").mkdir()
    # A case that wrongly succeeds (an empty --out meaning "here") writes into this folder, never the repository.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    before = snapshot(trained["run"])
    report = []
    for name, argv, expected in cases:
        code, out, err = run_cli(capsys, argv)
        assert code == 2, f"{name}: exit {code}: {err or out}"
        line = one_line(code, err)
        assert expected in line, f"{name}: {line}"
        report.append(f"{name}: {line}")
    assert snapshot(trained["run"]) == before  # nothing in the run directory changed
    assert not (tmp_path / "broken" / "elsewhere" / "metrics.jsonl").exists()  # nothing written through a link
    # A new run that failed before writing anything leaves no directory behind (a typo in --data).
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 15)), sorted(tmp_path.glob("o*"))
    (tmp_path / "bad-inputs.txt").write_text("\n".join(report) + "\n")


@pytest.mark.parametrize("layout", ["single file", "single .gz file", "split file in a folder"])
def test_a_corpus_file_that_is_a_git_lfs_pointer_is_refused_in_one_line(layout, tmp_path, capsys, monkeypatch):
    """A clone without Git LFS holds a pointer in place of the corpus: read as text, its three lines were trained
    on. The file's own bytes are checked, so a pointer named .gz is one too (not 'not complete gzip data')."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    if layout == "split file in a folder":
        pointer = write_corpus(tmp_path / "corpus") / "wiki.valid.tokens"
        data = pointer.parent
    else:
        data = pointer = tmp_path / ("input.txt.gz" if layout == "single .gz file" else "input.txt")
    pointer.write_text(LFS_POINTER)
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "o", "--data", data, "--tokenizer", "char"])
    assert one_line(code, err) == f"gbattn: error: --data file {pointer} {LFS_MESSAGE} in its repository to fetch it"
    assert not (tmp_path / "o").exists()


def test_unwritable_cache_directory_is_one_line(trained, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "a-file" / "cache"))
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "o", "--data", trained["data"], "--tokenizer", "char"])
    assert "cache directory" in one_line(code, err) and "GBATTN_CACHE" in err
    monkeypatch.setenv("GBATTN_CACHE", "")  # was the working directory, silently
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "o", "--data", trained["data"], "--tokenizer", "char"])
    assert "GBATTN_CACHE is set but empty" in one_line(code, err) and not (tmp_path / "tokens").exists()


def test_a_token_cache_error_of_eval_and_analyze_gives_no_advice_about_data(trained, tmp_path, capsys, monkeypatch):
    """eval and analyze add "pass --data PATH where the corpus is now" to the recorded corpus not being found; they
    added it to every data error, a token cache that cannot be written too, whose corpus was found and is fine."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tokens").write_text("in the way")
    monkeypatch.setenv("GBATTN_CACHE", str(cache))
    for command in (["eval", trained["run"]], ["analyze", trained["run"], "--out", tmp_path / "analysis"]):
        code, _, err = run_cli(capsys, command)
        line = one_line(code, err)
        assert line.startswith("gbattn: error: could not write the token cache under ") and "--data" not in line, line
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))  # the recorded corpus gone: the advice is given
    moved = tmp_path / "run"
    shutil.copytree(trained["run"], moved, ignore=shutil.ignore_patterns(rundir.LOCK))
    config = json.loads((moved / rundir.CONFIG).read_text())
    config["train"]["data"] = str(tmp_path / "gone")
    (moved / rundir.CONFIG).write_text(json.dumps(config))
    code, _, err = run_cli(capsys, ["eval", moved])
    assert "pass --data PATH where the corpus is now" in one_line(code, err)


@pytest.mark.parametrize("unbuffered", [False, True])
def test_output_piped_into_head_ends_quietly(trained, unbuffered):
    """Block-buffered stdout (a user's default) writes at the end: the flush is still in the command,
    not at the interpreter's exit ("Exception ignored ... BrokenPipeError", status 120)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(GBATTN_CACHE=str(trained["cache"]), **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    proc = subprocess.Popen([*GBATTN, "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader left before anything was written (like `| head -0`)
    _, err = proc.communicate()
    assert b"Traceback" not in err and err == b"", err
    assert proc.returncode == 141  # SIGPIPE's status, as `yes | head` ends


def test_a_closed_or_ascii_only_stdout_is_written_as_it_can_be(tmp_path):
    """A character stdout's encoding lacks (PYTHONIOENCODING=ascii; LC_ALL=C without UTF-8 mode) was a
    UnicodeEncodeError traceback, after the work (lm-eval's results were lost): it is written escaped, as stderr
    writes it. A closed stdout (`gbattn list >&-`) was "'NoneType' object has no attribute 'flush'": the output goes
    nowhere, and the command ends as it would."""
    env = dict(os.environ, PYTHONIOENCODING="ascii", GBATTN_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([*GBATTN, "params", "cpu-char"], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    assert done.stdout.startswith(b"cpu-char \\xb7 attn=standard \\xb7"), done.stdout[:80]
    for streams in ([1], [1, 2]):
        closed = subprocess.run([*GBATTN, "list"], capture_output=True, env=env, timeout=120,
                                preexec_fn=lambda streams=streams: [os.close(fd) for fd in streams])
        assert closed.returncode == 0, closed


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(trained, tmp_path, capsys, monkeypatch):
    """The lock is opened without following links: a .lock symlink got the process id written into
    whatever file it pointed at."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / rundir.LOCK).unlink(missing_ok=True)
    (run / rundir.LOCK).symlink_to(victim)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert "cannot be opened as the lock file" in one_line(code, err)
    assert victim.read_text() == "precious\n"


def test_a_runs_own_folders_planted_as_links_are_refused_and_their_targets_untouched(trained, tmp_path, capsys,
                                                                                      monkeypatch):
    """A run received with analysis/ or lm-eval/ as links to folders elsewhere: analyze replaced the summary there,
    lm-eval wrote its scores there, and `train --restart` or an export over it deleted the figures and scores
    there; a metrics.jsonl link had its target's lines copied into the resumed run. Each is refused in one line,
    the targets untouched; an --out given by the user is used as given."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.LOCK).unlink(missing_ok=True)
    mine = tmp_path / "mine"
    for folder, names in ((rundir.ANALYSIS_DIR, ("summary.json", "gates.png")),
                          (rundir.LM_EVAL_DIR, ("results-x.json", "samples-x.jsonl"))):
        (mine / folder).mkdir(parents=True)
        for name in names:
            (mine / folder / name).write_text("mine\n")
        (run / folder).symlink_to(mine / folder)
    before = {p: p.read_text() for p in mine.rglob("*") if p.is_file()}
    with pytest.raises(UserError, match=r"analysis is a link to .*: gbattn writes \(and deletes\) analyze's files "
                                        r"only into a folder of its own there, never through a link"):
        rundir.discard_derived(run)  # train --restart, an export over an earlier one
    code, _, err = run_cli(capsys, ["analyze", run, "--quiet"])
    assert one_line(code, err) == (f"gbattn: error: {run / 'analysis'} is a link to {mine / 'analysis'}: gbattn "
                                   f"writes an analysis only into a folder of its own there, never through a link (it "
                                   f"can lead anywhere); remove the link, or give --out")
    code, _, err = run_cli(capsys, ["lm-eval", run, "--tasks", "gbattn_toy_mc"])
    assert one_line(code, err).endswith(f"{run / 'lm-eval'} is a link to {mine / 'lm-eval'}: gbattn writes "
                                        f"lm-eval's scores only into a folder of its own there, never through a link "
                                        f"(it can lead anywhere); remove the link, or give --output")
    (run / rundir.ANALYSIS_DIR).unlink()
    with pytest.raises(UserError, match=r"lm-eval is a link to"):
        rundir.discard_derived(run)
    assert {p: p.read_text() for p in mine.rglob("*") if p.is_file()} == before

    log = tmp_path / "mylog.jsonl"
    log.write_text('{"event": "train", "step": 1, "private": "mine"}\n')
    (run / rundir.RESULT).unlink()
    (run / rundir.METRICS).unlink()
    (run / rundir.METRICS).symlink_to(log)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert one_line(code, err) == (f"gbattn: error: {run / rundir.METRICS} is a link to {log}: a run's "
                                   f"{rundir.METRICS} is its own file, never read or written through a link; remove "
                                   f"the link")
    assert (run / rundir.METRICS).is_symlink()
    assert log.read_text() == '{"event": "train", "step": 1, "private": "mine"}\n'


def test_checking_weights_against_their_config_builds_no_values_and_imports_no_compiler():
    """The check builds the model on the meta device: torch's meta random draws import torch._dynamo, a second of
    every eval, generate and analyze. None is drawn now; a mismatch is still refused."""
    code = textwrap.dedent("""
        import sys
        from gbattn.config import preset_config
        from gbattn.errors import CheckpointError
        from gbattn.model.gpt import GPT
        from gbattn.rundir import check_weights_fit
        for attn in ("standard", "differential", "boosted"):
            cfg = preset_config("cpu-char", attn, {"residual": "attnres-block", "d_model": 32, "n_heads": 2})
            weights = GPT(cfg).state_dict()
            check_weights_fit(cfg, weights, "here")
            try:
                check_weights_fit(preset_config("cpu-char", attn, {"d_model": 64, "n_heads": 2,
                                                                   "residual": "attnres-block"}), weights, "here")
            except CheckpointError as e:
                print("REFUSED", str(e)[:40])
        print("DYNAMO", "torch._dynamo" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.splitlines() == ["REFUSED the weights in here do not match its con"] * 3 + ["DYNAMO False"], (
        proc.stdout + proc.stderr[-2000:])


def test_a_tokenizer_with_unused_ids_counts_up_to_its_largest_id(tmp_path, capsys, monkeypatch):
    """A vocabulary of 3 entries with ids 0, 1 and 100: the model needs 101 rows (its size counted 3,
    so id 100 indexed past the embedding, and token storage overflowed); a tiny run trains with it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 100}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "gaps.json"
    path.write_text(hf.to_str())
    from gbattn.data.tokenizer import Tokenizer

    tok = Tokenizer("hf", hf.to_str())
    assert tok.vocab_size == 101 and tok.encode("a b c") == [0, 1, 100]
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text("a b c a b\n" * 400)
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "run", "--data", tmp_path / "text.txt", "--tokenizer",
                                    f"hf={path}", "--preset", "cpu-char", "--set", "max_steps=2", "--set",
                                    "d_model=16", "--set", "n_layers=1", "--set", "n_heads=2", "--set", "seq_len=8",
                                    "--threads", "1", "--quiet"])
    assert code == 0, err


def test_unused_ids_count_the_ids_below_the_vocabulary_size_that_name_no_token():
    """``unused_ids`` (the run plan's "ids name no token" line): a vocabulary of ids 0, 1 and 100 has 101 ids, 98 of
    them naming no token; a char tokenizer has none."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from gbattn.data.tokenizer import Tokenizer

    gaps = Tokenizer("hf", HFTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 100}, unk_token="<unk>")).to_str())
    assert (gaps.vocab_size, gaps.unused_ids) == (101, 98)
    chars = Tokenizer("char", json.dumps({"chars": ["a", "b"]}))
    assert (chars.vocab_size, chars.unused_ids) == (2, 0)
    # two tokens of one id (a hand-edited file the Python constructor would not write): refused, not counted (it
    # encoded both words to one id, silently)
    shared = json.loads(HFTokenizer(models.WordLevel({"a": 0, "<unk>": 2}, unk_token="<unk>")).to_str())
    shared["model"]["vocab"]["b"] = 0
    with pytest.raises(ValueError, match="its tokens 'a' and 'b' have one id, 0"):
        Tokenizer("hf", json.dumps(shared))

def test_a_char_tokenizer_listing_a_lone_surrogate_is_refused_on_reading(trained, tmp_path, capsys):
    """A char tokenizer.json may spell a lone surrogate ("\\ud800"), which no UTF-8 text holds: generate printed it
    (a UnicodeEncodeError traceback) and export handed it to the tokenizers library (another). It is refused as
    the damaged file it is, by every command reading it."""
    from gbattn.data.tokenizer import _fingerprint

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    chars = json.loads(json.loads((run / rundir.TOKENIZER).read_text())["payload"])["chars"]
    payload = json.dumps({"chars": [*chars[:-1], "\ud800"]})
    (run / rundir.TOKENIZER).write_text(json.dumps({"kind": "char", "payload": payload}))
    config = json.loads((run / rundir.CONFIG).read_text())
    config["data"]["tokenizer"] = _fingerprint("char", payload)  # the run's own, as far as its config says
    (run / rundir.CONFIG).write_text(json.dumps(config))
    for argv in (["generate", run, "--prompt", "the", "--max-new-tokens", "2", "--seed", "1"],
                 ["export", run, "--out", tmp_path / "exported"]):
        code, _, err = run_cli(capsys, argv)
        assert ("is not a valid gbattn tokenizer file (ValueError: a char tokenizer's payload must list distinct "
                "single characters (of UTF-8 text))") in one_line(code, err), err


def test_a_tokenizer_whose_regex_backtracks_past_its_limit_is_one_data_error():
    """A tokenizer.json whose pre-tokenizer regex backtracks without end makes the tokenizers library panic
    (a BaseException): that was a traceback from generate's prompt and eval's corpus, now a DataError; so are
    its other failures on a damaged file."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from gbattn.data.tokenizer import Tokenizer
    from gbattn.errors import DataError

    hostile = HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    hostile.pre_tokenizer = pre_tokenizers.Split(Regex(r"^(\w+\s?)*$"), behavior="isolated")
    tok = Tokenizer("hf", hostile.to_str())
    assert tok.encode("a") == [0]  # short text: no panic
    for encode in (tok.encode, lambda text: tok.encode_batch([text])):
        with pytest.raises(DataError, match="retry-limit-in-match over .the tokenizer failed while encoding"):
            encode("a" * 40 + "!")
    # A merge making a token the vocabulary lacks panicked when read (through Tokenizer.load too: a traceback);
    # an unknown token missing from the vocabulary was a plain Exception's traceback at the first unknown text.
    # (tokenizers 0.23 panics, "range end index 2 ..."; 0.22, which transformers 4.57 installs, raises "Token `ab` out
    # of vocabulary ...")
    merges = {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}
    with pytest.raises(DataError, match="(range end index 2|Token .ab. out of vocabulary) .* .the tokenizer failed "
                                        "while reading its file"):
        Tokenizer("hf", json.dumps({**json.loads(hostile.to_str()), "pre_tokenizer": None, "model": merges}))
    # ... and names the text it has no token for (gbattn's own export of a character-level tokenizer is such a
    # WordLevel: "its tokenizer.json is damaged" blamed a sound file)
    no_unknown = HFTokenizer(models.WordLevel({"a": 0, " ": 1}, unk_token="<unk>"))
    no_unknown.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    lacking = Tokenizer("hf", no_unknown.to_str())
    for encode in (lacking.encode, lambda text: lacking.encode_batch([text])):
        with pytest.raises(DataError, match=re.escape("'b', '#' are not in the tokenizer's vocabulary, which has no "
                                                      "unknown token (a character-level tokenizer knows only the "
                                                      "characters of the corpus it was built from; the tokenizers "
                                                      "library: "
                                                      "Missing [UNK] token from the vocabulary)")):
            encode("a b#b")
    no_unknown.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a word of 300,000 characters was named whole
    with pytest.raises(DataError, match=r"^'z{17}\.\.\.z{18}' is not in the tokenizer's vocabulary, which has no "):
        Tokenizer("hf", no_unknown.to_str()).encode("a " + "z" * 300_000)


def test_the_text_a_tokenizer_lacks_is_named_as_it_encodes_it_and_at_most_five_pieces():
    """The pieces a tokenizer without an unknown token has no token for are named as it cuts them: they were cut
    from the text before its normalizer (a lowercasing tokenizer's 'A' named), an added token was named as unknown,
    and a batch of texts named every unknown piece of every text, without bound."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    from gbattn.data.tokenizer import Tokenizer
    from gbattn.errors import DataError

    def without_unknown(normalizer=None, added=()):
        hf = HFTokenizer(models.WordLevel({"a": 0, " ": 1}, unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        if normalizer is not None:
            hf.normalizer = normalizer
        hf.add_tokens(list(added))
        return Tokenizer("hf", hf.to_str())

    with pytest.raises(DataError, match=r"^'b' is not in the tokenizer's vocabulary"):
        without_unknown(normalizers.Lowercase()).encode("A b")
    with pytest.raises(DataError, match=r"^'zz' is not in the tokenizer's vocabulary"):
        without_unknown(added=["<sep>"]).encode("a <sep> zz")
    with pytest.raises(DataError, match=r"^'w0', 'w1', 'w2', 'w3', 'w4' are not in the tokenizer's vocabulary"):
        without_unknown().encode_batch([f"a w{i}" for i in range(8)])


def test_an_interrupted_tokenization_leaves_no_cache_debris(tmp_path, monkeypatch):
    """Ctrl-C while the token cache is built removes the half-written entry; one abandoned by a
    process that no longer exists (kill -9) is removed by the next build. Both stayed forever."""
    from gbattn.data import tokens
    from gbattn.data.corpus import load_corpus
    from gbattn.data.tokenizer import Tokenizer

    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    corpus = load_corpus(str(data))
    tok = Tokenizer("char", json.dumps({"chars": sorted(set((data / "wiki.train.tokens").read_text())
                                                          | set((data / "wiki.valid.tokens").read_text())
                                                          | set((data / "wiki.test.tokens").read_text()))}))
    real = tokens._encode_split

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokens, "_encode_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokens.tokenize_corpus(corpus, tok, progress=False)
    cache = tmp_path / "cache" / "tokens"
    assert list(cache.iterdir()) == []
    import socket

    abandoned = cache / f"0123456789abcdef0123.tmp999999999@{socket.gethostname()}"  # no process has this id
    abandoned.mkdir()
    elsewhere = cache / "0123456789abcdef0123.tmp999999999@another-host"  # a build on a machine sharing the cache
    elsewhere.mkdir()
    (abandoned / "train.bin").write_bytes(b"\0" * 10)
    # One left by a killed process whose id this one has now (a container's process starts with the same id every
    # time): it is this build's own folder, taken over (it was "could not write the token cache ... File exists").
    from gbattn.files import building_suffix

    entry = tokens._entry_directory(tokens._entry_key(corpus, tok, dict.fromkeys(("train", "valid", "test"))))
    own = entry.with_name(entry.name + building_suffix())
    own.mkdir()
    (own / "train.bin").write_bytes(b"\0" * 10)
    monkeypatch.setattr(tokens, "_encode_split", real)
    splits = tokens.tokenize_corpus(corpus, tok, progress=False)
    assert [p.name for p in cache.iterdir() if ".tmp" in p.name] == [elsewhere.name]
    assert tok.decode(splits["train"][:40].tolist()) == (data / "wiki.train.tokens").read_text()[:40]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_disk_while_building_the_token_cache_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys,
                                                                                   code):
    """The token cache of a large corpus can fill the disk: one line naming the cache and
    GBATTN_CACHE, status 2, and no half-written entry (it was a traceback)."""
    from gbattn.data import tokens

    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    real = tokens._encode_split

    def disk_fills(corpus, split, tokenizer, cap, path, progress):
        real(corpus, split, tokenizer, cap, path, progress)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tokens, "_encode_split", disk_fills)
    code_, _, err = run_cli(capsys, ["train", "--out", tmp_path / "run", "--data", write_corpus(tmp_path / "c"),
                                     "--tokenizer", "char", "--quiet", "--set", "max_steps=1"])
    assert "could not write the token cache under" in one_line(code_, err) and "GBATTN_CACHE" in err
    assert list((tmp_path / "cache" / "tokens").iterdir()) == []


def test_a_token_cache_entry_this_user_cannot_read_is_one_line_before_any_encoding(tmp_path, monkeypatch, capsys):
    """Another user's entry in a shared cache, made under umask 077: the corpus was encoded again, then "cannot be
    read back after writing it; delete it", which this user cannot. One line now, before encoding (the tests run as
    root, whom permissions do not stop: os.access stands in for another user's). An entry this user can read but not
    write (another user's, made under umask 022) is used as it is; asking for write access refused it."""
    from gbattn.data import tokens

    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    argv = ["train", "--out", tmp_path / "run", "--data", write_corpus(tmp_path / "c"), "--tokenizer", "char",
            "--quiet", "--set", "max_steps=1"]
    assert run_cli(capsys, argv)[0] == 0
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "meta.json" and real_access(path, mode))
    monkeypatch.setattr(tokens, "_encode_split", lambda *a: pytest.fail("encoded again"))
    code, _, err = run_cli(capsys, [*argv[:2], tmp_path / "run2", *argv[3:]])
    assert one_line(code, err) == (f"gbattn: error: the token cache entry {entry} cannot be read by this user (another "
                                   f"user's, in a shared cache?): set GBATTN_CACHE to a directory of your own, or ask "
                                   f"its owner to make it readable")

    def read_only(path, mode):  # the entry readable, not writable
        return not (mode & os.W_OK and Path(path).is_relative_to(entry)) and real_access(path, mode)

    monkeypatch.setattr(os, "access", read_only)
    code, _, err = run_cli(capsys, [*argv[:2], tmp_path / "run3", *argv[3:]])
    assert code == 0, err


def test_the_token_cache_over_the_file_size_limit_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A token cache file over the file-size limit (`ulimit -f`, a quota; a full disk alike) printed numpy's own
    words, `gbattn: error: 104077 requested and 10240 written` (its OSError holds no errno, so it was not told from
    any other error); now the full disk's line naming the cache, and no half-written entry."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "c")  # a train split of about 60 KB as char ids
    with _file_size_limit(20_000):
        code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "run", "--data", data, "--tokenizer", "char",
                                        "--quiet", "--set", "max_steps=1"])
    assert one_line(code, err) == (f"gbattn: error: could not write the token cache under {tmp_path}/cache/tokens "
                                   f"(File too large); free some space or set GBATTN_CACHE to another directory")
    assert list((tmp_path / "cache" / "tokens").iterdir()) == []


@pytest.mark.parametrize("name", [rundir.TOKENIZER, rundir.BEST, rundir.METRICS])
def test_a_resumed_run_with_a_directory_for_a_file_it_reads_later_is_one_line_before_it_trains(trained, tmp_path,
                                                                                                capsys, monkeypatch,
                                                                                                name):
    """A resumed run reads its tokenizer.json, best.pt and metrics.jsonl (or replaces them) only after setup: a
    directory there ran the whole run to exit 0 and left one no command could read (tokenizer.json), or trained until
    its first evaluation and failed then naming a temporary file, the steps since the checkpoint lost (best.pt)."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    (run / name).unlink()
    (run / name).mkdir()
    before = snapshot(run)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert one_line(code, err) == f"gbattn: error: {run / name} is a directory, not a regular file: put the file " \
                                  f"itself there"
    assert snapshot(run) == before


def test_a_finished_runs_curve_with_values_no_run_writes_is_refused_where_it_is_read(tmp_path):
    """read_result checked a curve's types only: a perplexity of 0 (or a loss of -1) went into compare's table as a
    result, and plot then called the comparison's results.json damaged, whose advice rewrote the same file. The
    curve's values are now checked as read_report checks them, at the run's result.json."""
    from gbattn.errors import CheckpointError

    result = dict.fromkeys(("d_model", "parameters", "steps", "train_tokens_seen"), 1)
    result.update(attn="standard", attn_options={}, flops_per_token_train=1.0, tokens_per_parameter=1.0,
                  train_flops=1.0, wall_clock_s=1.0, train_tokens_per_s=1.0, device="cpu", test_ppl=2.0,
                  valid_ppl=2.0, valid_loss=0.7)
    for point, wrong in (({"valid_ppl": 0}, "valid_ppl=0 at step 2, which must be a perplexity"),
                         ({"valid_loss": -1.0}, "valid_loss=-1.0 at step 2, which must be a loss")):
        curve = [{"step": 2, "tokens": 8, "epoch": None, "valid_loss": 0.7, "valid_ppl": 2.0, **point}]
        files.write_json({**result, "curve": curve}, tmp_path / rundir.RESULT)
        with pytest.raises(CheckpointError, match=f"result.json: its validation curve has {wrong}"):
            rundir.read_result(tmp_path / rundir.RESULT)


def test_records_with_non_finite_values_and_older_tokenizers_still_load(tmp_path):
    """What the stricter readers must keep accepting: a finished run whose perplexities were infinite
    (write_json stores them as null), a curve point with a NaN loss, sparse weights refused in one
    line (not a traceback from the NaN check), and a run whose tokenizer has unused ids, trained
    when sizes were counted (its model has as many rows as the tokenizer has entries)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from gbattn.data.tokenizer import Tokenizer
    from gbattn.errors import CheckpointError, DataError

    result = dict.fromkeys(("d_model", "parameters", "steps", "train_tokens_seen"), 1)
    result.update(attn="standard", attn_options={}, flops_per_token_train=1.0, tokens_per_parameter=1.0,
                  train_flops=1.0, wall_clock_s=1.0, train_tokens_per_s=1.0, device="cpu", test_ppl=float("inf"),
                  valid_ppl=float("inf"), valid_loss=float("nan"),
                  curve=[{"step": 1, "tokens": 8, "epoch": None, "valid_loss": float("nan"),
                          "valid_ppl": float("inf")}])
    rundir.write_result(tmp_path, result)  # (no "compiled": a run of a gbattn from before it was kept)
    assert rundir.read_result(tmp_path / rundir.RESULT)["test_ppl"] is None
    rundir.write_result(tmp_path, {**result, "compiled": "yes"})
    with pytest.raises(CheckpointError, match="result.json: compiled='yes' must be true or false"):
        rundir.read_result(tmp_path / rundir.RESULT)
    rundir.write_result(tmp_path, {**result, "compiled": True})
    assert rundir.read_result(tmp_path / rundir.RESULT)["compiled"] is True
    for key in set(result) - {"test_ppl", "valid_ppl", "valid_loss"}:  # every other field a comparison reads
        files.write_json({k: v for k, v in result.items() if k != key}, tmp_path / rundir.RESULT)
        with pytest.raises(CheckpointError, match=f"has no '{key}': not a complete gbattn record"):
            rundir.read_result(tmp_path / rundir.RESULT)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"not floating-point numbers \(weight: torch.float32, "
                                                  r"torch.sparse_coo, not dense\)"):
        rundir.load_weights(model, {"weight": torch.eye(2).to_sparse(), "bias": torch.zeros(2)}, "x")
    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 100}, unk_token="<unk>"))
    path = tmp_path / "tokenizer.json"
    path.write_text(Tokenizer("hf", hf.to_str()).to_json())
    assert Tokenizer.load(path, expected_vocab=3).vocab_size == 3 and Tokenizer.load(path).vocab_size == 101
    boundary = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 3}, unk_token="<unk>"))  # id 2 unused
    (tmp_path / "boundary.json").write_text(Tokenizer("hf", boundary.to_str()).to_json())
    with pytest.raises(DataError, match=r"^the tokenizer encodes this text to id 3, past the model's 3 ids"):
        Tokenizer.load(tmp_path / "boundary.json", expected_vocab=3).encode("a c")  # the first id past them
    legacy = Tokenizer.load(path, expected_vocab=3)  # its model has 3 rows: id 100 (<unk>) has none
    assert legacy.encode("a") == [0] and legacy.encode_batch(["b", "a"]) == [[1], [0]]
    for encode in (legacy.encode, lambda text: legacy.encode_batch(["a", text])):  # was an index past the table
        with pytest.raises(DataError, match=r"^the tokenizer encodes this text to id 100, past the model's 3 ids: its "
                                            r"ids go up to 100 with some unused"):
            encode("a c")
    for other in (2, 50, 200):  # neither its entries nor up to its largest id: another model's tokenizer
        with pytest.raises(CheckpointError, match=f"has 101 tokens but the model's vocabulary is {other}"):
            Tokenizer.load(path, expected_vocab=other)


def test_the_json_lines_of_train_and_eval_are_strict_json_with_an_infinite_perplexity(trained, tmp_path, capsys,
                                                                                      monkeypatch):
    """An infinite perplexity (a diverged model's) printed Infinity in train's final JSON line and eval's, which is
    no JSON (and train printed null for the same run once read back from result.json): null in both."""
    import dataclasses

    from gbattn.eval import perplexity
    from gbattn.train.trainer import Trainer

    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    evaluate = perplexity.evaluate
    monkeypatch.setattr(perplexity, "evaluate", lambda *a, **k: dataclasses.replace(evaluate(*a, **k), loss=math.inf))
    code, out, err = run_cli(capsys, ["eval", run])
    assert code == 0, err
    assert strict_json(out.splitlines()[-1])["ppl"] is None
    result = rundir.read_result(run / rundir.RESULT)
    monkeypatch.setattr(Trainer, "run", lambda self: {**result, "valid_ppl": math.inf, "test_ppl": math.inf})
    code, out, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert code == 0, err
    summary = strict_json(out.splitlines()[-1])
    assert summary["valid_ppl"] is None and summary["test_ppl"] is None and summary["steps"] == result["steps"]


def test_a_float_field_of_400_digits_is_one_line(trained, tmp_path, capsys, monkeypatch):
    """A config.json whose norm_eps is an integer of 400 digits (JSON reads it as a Python int), and the same as a
    --set value: one line naming the field, exit 2 (both were an OverflowError traceback from the finiteness check)."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = (run / rundir.CONFIG).read_text()
    (run / rundir.CONFIG).write_text(re.sub(r'"norm_eps": [^,}]+', '"norm_eps": ' + "9" * 400, config, count=1))
    for command in (["eval", run], ["analyze", run, "--max-rows", "2"]):
        code, _, err = run_cli(capsys, command)
        assert "norm_eps=" + "9" * 400 + " must be a finite number" in one_line(code, err)
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "new", "--data", trained["data"], "--preset",
                                    "cpu-char", "--set", "lr=" + "9" * 400, "--quiet"])
    assert "lr=" + "9" * 400 + " must be a finite number" in one_line(code, err)


def test_a_config_whose_seq_len_exceeds_the_block_size_is_one_line(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = json.loads((run / rundir.CONFIG).read_text())
    config["seq_len"] = config["model"]["block_size"] + 1
    (run / rundir.CONFIG).write_text(json.dumps(config))
    with pytest.raises(rundir.CheckpointError, match="exceeds the model's block_size"):
        rundir.load_run(run)
    code, _, err = run_cli(capsys, ["eval", run])
    assert f"seq_len={config['seq_len']} exceeds the model's block_size" in one_line(code, err)


def test_a_config_whose_seq_len_is_the_block_size_loads(trained, tmp_path):
    """seq_len equal to block_size is a run's full context (training refuses only a longer one): refused as damage,
    a run trained with --set seq_len=BLOCK_SIZE could not be evaluated, generated from or exported."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = json.loads((run / rundir.CONFIG).read_text())
    config["seq_len"] = config["model"]["block_size"]
    (run / rundir.CONFIG).write_text(json.dumps(config))
    assert rundir.load_run(run).seq_len == config["model"]["block_size"]


def test_a_recorded_warmup_that_gbattn_did_not_write_is_refused_on_resume(trained, tmp_path, capsys, monkeypatch):
    """config.json's warmup_steps (the warmup the run used) edited from 1 to 1,000,000 was taken by `train --resume`
    silently, its learning rate near 0 from then on, and the resume still said exact. A resumed run keeps a recorded
    warmup that is the config's or what gbattn's fitting gives for the run (today's rule or the earlier one): any
    other is one line naming the file, every file as it was."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()  # killed during its test: --resume reads the checkpoint and tests
    config = json.loads((run / rundir.CONFIG).read_text())
    assert (config["train"]["warmup_steps"], config["warmup_steps"]) == (1, 1)
    config["warmup_steps"] = 1_000_000
    (run / rundir.CONFIG).write_text(json.dumps(config))
    before = snapshot(run)
    assert one_line(*run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])[::2]) == (
        f"gbattn: error: {run / rundir.CONFIG}: warmup_steps=1,000,000 is not a warmup gbattn wrote for this run (its "
        f"warmup_steps=1 over 4 steps gives 1): the file is damaged or was edited; restore a copy of it")
    assert snapshot(run) == before
    config["warmup_steps"] = 1
    (run / rundir.CONFIG).write_text(json.dumps(config))
    assert run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])[0] == 0


def test_a_run_directory_with_a_stray_safetensors_file_is_still_a_run(trained, tmp_path):
    """A model.safetensors beside a run's weights leaves it a run, loaded from best.pt; so does one beside best.pt
    alone, as an upcycled run has it before its training (it was read as an export: "config.json has no gbattn
    section")."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.SAFETENSORS).write_bytes(b"weights someone saved beside the run")
    original = rundir.load_run(trained["run"])
    for removed in (None, rundir.CHECKPOINT):
        if removed:
            (run / removed).unlink()
        assert not rundir.is_exported(run) and rundir.folder_holds(run) == rundir.RUN
        loaded = rundir.load_run(run)
        assert loaded.checkpoint == "best" and loaded.step == original.step
        assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(),
                                                     original.model.state_dict().values()))

def test_what_a_directory_holds_is_told_by_its_files(tmp_path):
    """An exported directory is one of model_type gbattn (or with model.safetensors) and no checkpoint.pt;
    with transformers' trainer files beside it, it is a transformers checkpoint of a gbattn model; another
    model_type is a Hugging Face checkpoint, never an export."""
    d = tmp_path / "d"
    d.mkdir()
    assert rundir.foreign_model(d) is None and not rundir.is_exported(d)
    (d / rundir.CONFIG).write_text(json.dumps({"model_type": "gbattn"}))
    assert rundir.is_exported(d)
    with pytest.raises(rundir.CheckpointError, match="config.json has no gbattn section: not a directory exported by"):
        rundir.load_run(d)  # transformers' config alone, without the run's own: one line, not a traceback
    assert rundir.foreign_model(d) == "a transformers checkpoint of a gbattn model"  # no gbattn tokenizer file
    (d / rundir.EXPORTED_TOKENIZER).write_text("{}")
    assert rundir.foreign_model(d) == "a gbattn export"
    (d / "optimizer.pt").write_bytes(b"")
    assert rundir.foreign_model(d) == "a transformers checkpoint of a gbattn model"
    (d / rundir.CHECKPOINT).write_bytes(b"")
    assert not rundir.is_exported(d)  # a run directory
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / rundir.CONFIG).write_text(json.dumps({"model_type": "llama"}))
    assert rundir.foreign_model(llama) == "a Hugging Face checkpoint (llama)" and not rundir.is_exported(llama)
    best_only = tmp_path / "best-only"  # a run's best weights alone, without its last checkpoint or config
    best_only.mkdir()
    (best_only / rundir.BEST).write_bytes(b"")
    assert rundir.folder_holds(best_only) == rundir.RUN
    partial = tmp_path / "partial"  # a results.json with only some of the keys gbattn denoise writes
    partial.mkdir()
    (partial / "results.json").write_text(json.dumps({"protocol": {}}))
    assert rundir.folder_holds(partial) == "a results.json that neither `gbattn compare` nor `gbattn denoise` wrote"
    with pytest.raises(UserError, match="holds a Hugging Face checkpoint \\(llama\\), not a gbattn run"):
        rundir.check_out(llama, (rundir.RUN,), "a gbattn run")


def test_a_damaged_config_a_lone_safetensors_file_and_a_folder_of_runs_are_told_as_such(tmp_path):
    """A folder whose config.json is damaged is a run's; model.safetensors alone is a model directory; a run's
    config.json beside an export's staging folder is a run, not an unfinished export; run folders are named up
    to three, then "..."."""
    def folder(name: str) -> Path:
        (tmp_path / name).mkdir()
        return tmp_path / name

    damaged = folder("damaged")
    (damaged / rundir.CONFIG).write_text("{not json")
    assert rundir.folder_holds(damaged) == rundir.RUN
    weights = folder("weights")
    (weights / rundir.SAFETENSORS).write_bytes(b"")
    assert rundir.folder_holds(weights) == f"a model directory ({rundir.SAFETENSORS})"
    run = folder("run")
    (run / rundir.CONFIG).write_text(json.dumps({"model": {}, "train": {}}))
    (run / f"{rundir.EXPORT_STAGING}.tmp1@host").mkdir()
    assert rundir.foreign_model(run) is None and rundir.folder_holds(run) == rundir.RUN
    seeds = folder("seeds")
    for seed in ("seed1", "seed2", "seed3"):
        (seeds / seed).mkdir()
        (seeds / seed / rundir.CONFIG).write_text("{}")
    assert rundir.folder_holds(seeds) == "run directories (seed1, seed2, seed3)"
    (seeds / "seed4").mkdir()
    (seeds / "seed4" / rundir.CONFIG).write_text("{}")
    assert rundir.folder_holds(seeds) == "run directories (seed1, seed2, seed3, ...)"
    # an analyze output (its summary.json beside its figures): train, upcycle and export wrote a model there, its
    # figures and summary then read as the new model's; analyze itself, and plot, still write there
    figures = folder("figures")
    (figures / rundir.ANALYSIS_SUMMARY).write_text(json.dumps(dict.fromkeys(rundir.ANALYSIS_SUMMARY_KEYS)))
    (figures / "gates.png").write_bytes(b"")
    assert rundir.folder_holds(figures) == rundir.ANALYSIS_OUTPUT == "a `gbattn analyze` output"
    for own, output in (((rundir.RUN,), "a gbattn run"), ((rundir.EXPORT,), "a gbattn export")):
        with pytest.raises(UserError, match=f"^--out {re.escape(str(figures))} holds a `gbattn analyze` output, not "
                                            f"{output}: choose another --out$"):
            rundir.check_out(figures, own, output)
    from gbattn.analysis.cli import check_figures_out

    assert check_figures_out(figures, create=False) == figures


def test_load_run_and_eval_of_a_hugging_face_checkpoint_say_to_upcycle_it(tmp_path, capsys):
    """A transformers checkpoint (its model_type another library's, its weights in model.safetensors) given where a
    run is read: the line says what it is and how to convert it, not that its config.json "has no gbattn section"."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / rundir.CONFIG).write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (llama / rundir.SAFETENSORS).write_bytes(b"")
    advice = f"{llama} is a Hugging Face checkpoint (llama), not a gbattn run: convert it first with `gbattn upcycle"
    with pytest.raises(UserError, match=re.escape(advice)):
        rundir.load_run(llama)
    code, _, err = run_cli(capsys, ["eval", llama])
    assert one_line(code, err).startswith(f"gbattn: error: {advice}"), err


def test_a_checkpoint_without_a_model_dict_is_refused_in_one_line(tmp_path):
    """A torch.save file of plain values but no ``model`` dict of weights is no gbattn checkpoint."""
    from gbattn.errors import CheckpointError

    for name, state in (("none.pt", {"step": 1}), ("list.pt", {"model": [torch.zeros(1)]})):
        torch.save(state, tmp_path / name)
        with pytest.raises(CheckpointError, match="is not a gbattn checkpoint \\(no model weights in it\\)"):
            rundir.load_checkpoint(tmp_path / name)


def test_appending_never_writes_through_a_link_nor_into_a_device(tmp_path):
    """A metrics file planted as a link is refused and its target left as it was; a directory and a FIFO
    without a reader (which would block) are refused as such; a device is refused too."""
    target, link = tmp_path / "elsewhere.jsonl", tmp_path / "metrics.jsonl"
    target.write_text("kept\n")
    link.symlink_to(target)
    with pytest.raises(UserError, match="a link, a directory or a FIFO is refused"):
        files.append_jsonl(link, {"step": 1})
    assert target.read_text() == "kept\n"
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with fails_if_blocked("opening a FIFO without a reader blocked"):
        for refused in (tmp_path, fifo):
            with pytest.raises(UserError, match="a link, a directory or a FIFO is refused"):
                files.append_jsonl(refused, {"step": 1})
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(UserError, match="is not a regular file: remove it"):
        files.open_to_append(os.devnull)
    assert set(os.listdir("/proc/self/fd")) == fds  # the device's descriptor is closed


def every_file(directory: Path) -> dict[str, bytes]:
    """Each file under ``directory`` (its lock file too) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_every_writing_command_refuses_an_out_holding_what_it_did_not_write(trained, tmp_path, capsys, monkeypatch):
    """Each writing command wrote beside or over what another left in its --out: train wrote a run into a
    comparison, a denoise output or beside a results.md; compare replaced a results.md or an unreadable
    results.json; denoise wrote its results beside a run, an export or a Hugging Face checkpoint; export and
    upcycle wrote a model into a comparison (which compare then refused as its own). Now one rule
    (rundir.check_out): an --out holding anything but the command's own output is refused with one line naming
    what it holds, exit 2, before any work, every file as it was and no lock file left; its own is taken."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    data, run = trained["data"], trained["run"]
    standard = tmp_path / "standard-run"  # upcycle's source: a standard-attention run
    train(standard, *tiny_configs(data, "standard", max_steps=1, eval_every=1, warmup_steps=0, threads=1), quiet=True,
          preset="paper-small")
    kinds = {}

    def folder(name: str, held: str | None, files: dict[str, str], runs=()) -> None:
        path = tmp_path / "kinds" / name
        path.mkdir(parents=True)
        for file, text in files.items():
            (path / file).write_text(text)
        for sub in runs:
            shutil.copytree(run, path / sub)
        kinds[path] = held

    kinds[shutil.copytree(run, tmp_path / "kinds" / "run")] = rundir.RUN
    folder("comparison", rundir.COMPARISON, {"recipe.json": '{"recipe": "cpu-char"}', "results.json": '{"models": []}',
                                             "results.md": "# cpu-char"}, runs=["standard/seed42"])
    folder("comparison-results", rundir.COMPARISON, {"results.json": '{"models": []}'})
    folder("comparison-started", rundir.COMPARISON, {"recipe.json": '{"recipe": "cpu-char"}'})  # no run finished yet
    folder("seeds", "run directories (seed42)", {}, runs=["seed42"])
    folder("denoise", rundir.DENOISE, {"results.json": '{"protocol": {}, "tables": {}, "runs": {}}',
                                       "results.md": "# denoise"})
    folder("export", rundir.EXPORT, {rundir.CONFIG: '{"model_type": "gbattn"}', rundir.EXPORTED_TOKENIZER: "{}"})
    folder("unfinished-export", rundir.UNFINISHED_EXPORT, {rundir.EXPORTED_TOKENIZER: "{}"})
    folder("gpt2", "a Hugging Face checkpoint (gpt2)", {rundir.CONFIG: '{"model_type": "gpt2"}'})
    folder("other-results", "a results.json that neither `gbattn compare` nor `gbattn denoise` wrote",
           {"results.json": '{"x": 1}'})
    folder("unreadable-results", "a results.json that gbattn cannot read (it is not valid JSON (Expecting property "
           "name enclosed in double quotes: line 1 column 2 (char 1)))", {"results.json": "{"})
    folder("notes", "a results.md without the results.json gbattn writes beside it", {"results.md": "# notes"})
    folder("other-files", None, {"notes.txt": "mine"})
    assert {path: rundir.folder_holds(path) for path in kinds} == kinds

    tiny = ["--set", "max_steps=1", *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), [])]
    new_run = ["train", "--data", data, "--tokenizer", "char", "--quiet", *tiny]
    commands = {  # the command, before its --out; what it writes into (its own); what it writes, in its refusal
        "train": (new_run, (rundir.RUN,), "a gbattn run"),
        "train --restart": ([*new_run, "--restart"], (rundir.RUN,), "a gbattn run"),
        "compare": (["compare", "--recipe", "cpu-char", "--data", data, "--only", "standard", "--seeds", "42",
                     "--quiet", *tiny], (rundir.COMPARISON,), "a comparison"),
        "denoise": (["denoise", "--quick", "--experiments", "deq", "--steps", "1", "--seeds", "0", "--quiet"],
                    (rundir.DENOISE,), "a `gbattn denoise` output"),
        "export": (["export", run], (rundir.EXPORT, rundir.UNFINISHED_EXPORT), "a gbattn export"),
        "upcycle": (["upcycle", standard, "--attn", "gated"], (), "a folder for a new run"),
    }
    for name, (argv, own, output) in commands.items():
        for path, held in kinds.items():
            if held is None or held in own:  # taken (what each command does with its own: the tests of each)
                assert rundir.check_out(path, own, output) == held
                continue
            before = every_file(path)
            line = one_line(*run_cli(capsys, [*argv, "--out", path])[::2])
            expected = (f"{path} already holds a run; choose another --out" if held == rundir.RUN and name == "upcycle"
                        else f"--out {path} holds {held}, not {output}: choose another --out")
            assert line == f"gbattn: error: {expected}", name
            assert every_file(path) == before, (name, path.name)


def test_an_out_whose_files_cannot_be_looked_at_is_one_line(tmp_path, monkeypatch):
    """An --out without search permission hides what it holds (its files' stat fails with EACCES): check_out says
    it cannot be read, one line, not a PermissionError traceback. Simulated: root may search any folder."""
    def denied(directory):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(rundir, "foreign_model", denied)
    with pytest.raises(UserError, match=rf"^--out {re.escape(str(tmp_path))} cannot be read \(Permission denied\)$"):
        rundir.check_out(tmp_path, (rundir.RUN,), "a run")


def test_weights_without_a_config_are_neither_trained_over_nor_deleted(trained, tmp_path, capsys, monkeypatch):
    """A folder holding best.pt but no config.json (an upcycle killed before its last write) counted as train's
    own run: `train --out` trained over the weights and `--restart` deleted them, while upcycle refused the same
    folder. Now both refuse it as upcycle does, every file as it was, and so do the commands that read a run; and
    --restart removes config.json last, so that a kill inside it never leaves such a folder."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    shutil.copy(Path(trained["run"]) / rundir.BEST, orphan / rundir.BEST)
    tiny = ["--set", "max_steps=1", *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), [])]
    for extra in ([], ["--restart"], ["--resume"]):  # --resume: it is no run to resume either
        before = every_file(orphan)
        line = one_line(*run_cli(capsys, ["train", "--data", trained["data"], "--tokenizer", "char", "--quiet", *tiny,
                                          *extra, "--out", orphan])[::2])
        assert line == (f"gbattn: error: {orphan} holds best.pt but no config.json (written last): an upcycle or a run "
                        f"stopped before it finished; delete {orphan} or choose another --out"), extra
        assert every_file(orphan) == before, extra
    # Read as a run (eval, generate, export, a start for --init-from) it was "config.json not found: is it a gbattn
    # run directory?": now what it is and what to do.
    for argv in (["eval", orphan], ["generate", orphan, "--prompt", "a"], ["export", orphan, "--out", tmp_path / "ex"],
                 ["train", "--init-from", orphan, "--data", trained["data"], "--out", tmp_path / "new"]):
        assert one_line(*run_cli(capsys, argv)[::2]) == (
            f"gbattn: error: {orphan} holds best.pt but no config.json (written last): an upcycle or a run stopped "
            f"before it finished; it cannot be loaded: delete it, then upcycle or train it again"), argv[0]
    assert every_file(orphan) == before and not (tmp_path / "new").exists() and not (tmp_path / "ex").exists()
    removed = []
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: removed.append(self.name))
    copy = shutil.copytree(trained["run"], tmp_path / "copy")
    rundir.discard_run(copy)
    assert removed[-1] == rundir.CONFIG and {rundir.BEST, rundir.CHECKPOINT} <= set(removed), removed


def test_an_upcycled_model_is_not_resumed_over_but_trained_with_init_from(trained, tmp_path, capsys, monkeypatch):
    """`train --resume --out UP` on `gbattn upcycle`'s output (best.pt and a config.json of 0 steps, no
    checkpoint.pt) said "no checkpoint.pt yet: training starts at step 0", trained a randomly initialised model and
    replaced the upcycled best.pt; `train --out UP` advised --resume. Now both are one line pointing to `train
    --init-from UP` (README, "Upcycling a trained model"), every file as it was; that command trains it."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    data = trained["data"]
    standard = tmp_path / "standard-run"  # upcycle's source: a standard-attention run
    train(standard, *tiny_configs(data, "standard", max_steps=1, eval_every=1, warmup_steps=0, threads=1), quiet=True,
          preset="paper-small")
    up = tmp_path / "up"
    assert run_cli(capsys, ["upcycle", standard, "--attn", "boosted", "--out", up])[0] == 0
    before = snapshot(up)
    held = (f"{up} holds an upcycled model that no run has trained yet (best.pt, a config.json of 0 steps, no "
            f"checkpoint.pt)")
    how = (f"`gbattn train --init-from {files.shell_path(up)} --out NEW_DIR` (from Python: train_cfg.init_from) "
           f"trains it into a new run")
    assert one_line(*run_cli(capsys, ["train", "--resume", "--out", up, "--threads", "1"])[::2]) == (
        f"gbattn: error: {held}: nothing to resume; {how}, its weights kept")
    assert snapshot(up) == before
    tiny = ["--set", "max_steps=1", "--set", "threads=1", *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), [])]
    assert one_line(*run_cli(capsys, ["train", "--data", data, "--quiet", *tiny, "--out", up])[::2]) == (
        f"gbattn: error: {held}; {how}, --restart (restart=True) replaces it, or choose another --out")
    assert snapshot(up) == before
    with pytest.raises(UserError, match=re.escape(f"{held}: nothing to resume")):
        train(up, resume=True, quiet=True)
    assert snapshot(up) == before
    code, out, err = run_cli(capsys, ["train", "--init-from", up, "--data", data, "--quiet", "--set", "max_steps=1",
                                      "--set", "threads=1", "--out", tmp_path / "new"])
    assert code == 0, err
    assert json.loads((tmp_path / "new" / rundir.CONFIG).read_text())["extra"]["init_from_step"] == 0
    assert snapshot(up) == before


def test_a_tokenizer_without_a_config_is_refused_as_an_out_but_read_as_no_run(tmp_path):
    """A tokenizer.json without config.json is refused as an --out (a new run would keep or replace it); given as a
    run to read it is simply no run directory, not told to choose another --out."""
    folder = tmp_path / "tokenizer-only"
    folder.mkdir()
    (folder / rundir.TOKENIZER).write_text("{}")
    with pytest.raises(UserError, match="holds tokenizer.json but no config.json"):
        rundir.refuse_weights_without_config(folder)
    with pytest.raises(rundir.CheckpointError, match="config.json not found: is .* a gbattn run directory"):
        rundir.load_run(folder)


def flip_one_bit(path: Path, record: str | None = None) -> str:
    """Flip one bit in the middle of a record of the torch.save zip file at ``path`` (its largest, or the one
    whose name ends with ``record``), as a bad disk or transfer would; the record's name."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    info = max(infos, key=lambda i: i.file_size) if record is None else \
        next(i for i in infos if i.filename.endswith(record))
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length + info.file_size // 2] ^= 0x01
    path.write_bytes(data)
    return info.filename


def test_a_flipped_bit_in_a_checkpoint_is_refused_not_loaded(tmp_path):
    """torch.load does not check the CRC-32 that torch.save stores with each record: a flipped bit in a weight
    loads as another weight. read_torch_file checks them, in the weights and in the pickle, and names the record."""
    weights = {"w": torch.arange(64, dtype=torch.float32)}
    for record in ("data/0", "data.pkl"):
        path = tmp_path / f"{record.replace('/', '-')}.pt"
        torch.save({"model": weights, "step": 3}, path)
        name = flip_one_bit(path, record)
        if record == "data/0":  # what torch.load alone makes of it: one weight changed, no error
            loaded = torch.load(path, weights_only=True)
            assert int((loaded["model"]["w"] != weights["w"]).sum()) == 1
        with pytest.raises(rundir.CheckpointError) as caught:
            rundir.read_torch_file(path)
        assert str(caught.value) == (f"{path} is corrupted: its record {name} fails the CRC-32 check that torch.save "
                                     "stored with it; restore a copy of it")
    intact = tmp_path / "intact.pt"
    torch.save({"model": weights}, intact)
    assert torch.equal(rundir.read_torch_file(intact)["model"]["w"], weights["w"])


def test_checkpoint_records_that_could_expand_past_the_file_are_refused_unread(tmp_path):
    """A record compressed (a bzip2 record of 1 GiB of zeros takes a few KB; reading every record for its CRC ran
    for minutes at 2.3 GB), listed twice (one record listed 200 times was read 200 times), or records declaring
    more bytes than the file holds: each refused in one line before any record is read."""
    path = tmp_path / "ck.pt"
    torch.save({"model": {"w": torch.zeros(4096)}, "step": 3}, path)
    with zipfile.ZipFile(path) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    weights = next(info.filename for info, _ in records if info.filename.endswith("data/0"))

    def rewritten(name, compress=None, twice=False):
        out = tmp_path / name
        with zipfile.ZipFile(out, "w") as archive, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (zipfile's "Duplicate name")
            for info, data in records:
                archive.writestr(info.filename, data, compress_type=compress if info.filename == weights
                                 else zipfile.ZIP_STORED)
                if twice and info.filename == weights:
                    archive.writestr(info.filename, data)
        return out

    assert torch.equal(rundir.read_torch_file(rewritten("stored.pt"))["model"]["w"], torch.zeros(4096))
    for method, number in ((zipfile.ZIP_DEFLATED, 8), (zipfile.ZIP_BZIP2, 12)):
        bomb = rewritten(f"{number}.pt", method)
        with pytest.raises(rundir.CheckpointError, match=re.escape(
                f"{bomb}: its record {weights} is compressed (method {number}), which torch.save never does (a "
                f"compressed record can expand far past the file): refused; save the weights again with torch.save")):
            rundir.read_torch_file(bomb)
    twice = rewritten("twice.pt", twice=True)
    with pytest.raises(rundir.CheckpointError, match=re.escape(f"{twice} lists its record {weights} twice")):
        rundir.read_torch_file(twice)
    data = bytearray(path.read_bytes())  # the central directory's sizes of the weights' record, made 1 GiB
    entry = data.rfind(b"PK\x01\x02", 0, data.rfind(weights.encode()))
    data[entry + 20:entry + 28] = struct.pack("<II", 2**30, 2**30)
    (tmp_path / "sizes.pt").write_bytes(data)
    with pytest.raises(rundir.CheckpointError, match=r"sizes.pt: its records declare 1,07\d,\d{3},\d{3} bytes, more "
                                                     r"than the file's [\d,]+: the file is damaged"):
        rundir.read_torch_file(tmp_path / "sizes.pt")


def test_a_checkpoint_saved_without_checksums_loads(tmp_path):
    """torch.save with compute_crc32=False (faster for large files) stores CRC 0 for every record: such a file is
    read as before (its records unchecked), not refused as corrupted."""
    from torch.utils.serialization import config

    # (set and put back by hand: monkeypatch's undo deleted the setting from torch's config, and every later
    # torch.save failed)
    path = tmp_path / "unchecked.pt"
    weights = {"w": torch.arange(64, dtype=torch.float32)}
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save({"model": weights}, path)
    finally:
        config.save.compute_crc32 = before
    with zipfile.ZipFile(path) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    assert torch.equal(rundir.read_torch_file(path)["model"]["w"], weights["w"])


def test_every_damaged_torch_file_is_one_checkpoint_error(tmp_path):
    """Damaged bytes make torch's safe unpickler raise what its code happens to raise; each is one line
    naming the file (fuzzing 1,200 damaged files gave 61 IndexErrors, 6 AssertionErrors, 7 struct.errors)."""
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(3)}}, buffer, _use_new_zipfile_serialization=False)
    legacy = bytearray(buffer.getvalue())
    key_list = legacy.rfind(b"]q\x00X")  # the storage keys the legacy format lists after its pickles
    legacy[key_list + 9] = ord("Z")  # a key that names no storage read before it
    for name, data, detail in (("passwd", b"root:x:0:0:root:/root:/bin/bash\n", "IndexError"),
                               ("bad-key", bytes(legacy), "AssertionError"),
                               ("cut", pickle.dumps({"model": {}}, protocol=2)[:9], "error: unpack requires")):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        with pytest.raises(rundir.CheckpointError, match=f"truncated or corrupted \\({detail}"):
            rundir.read_torch_file(path)
    lfs = tmp_path / "lfs.pt"  # a clone without Git LFS: named as such, not "not a torch.save file"
    lfs.write_text(LFS_POINTER)
    with pytest.raises(rundir.CheckpointError) as caught:
        rundir.read_torch_file(lfs)
    assert str(caught.value) == f"{lfs} {LFS_MESSAGE} in its repository to fetch it"


def test_a_config_nested_too_deeply_or_a_fifo_tells_no_directory_kind_and_waits_for_nothing(tmp_path):
    """is_exported and foreign_model read config.json as every reader does (files.read_json): a config
    nested too deeply was a RecursionError traceback (`gbattn export`), a FIFO waited forever for a writer."""
    deep, fifo = tmp_path / "deep", tmp_path / "fifo"
    deep.mkdir()
    (deep / rundir.CONFIG).write_text('{"a":' + "[" * 100_000 + "]" * 100_000 + "}")
    fifo.mkdir()
    os.mkfifo(fifo / rundir.CONFIG)
    with fails_if_blocked("reading a FIFO config.json blocked"):
        for d in (deep, fifo):
            assert not rundir.is_exported(d) and rundir.foreign_model(d) is None


def test_a_recorded_count_of_zero_is_read_and_only_a_negative_one_refused(trained):
    """config.json's step (an export's), steps and warmup_steps: 0 is a real value (no warmup; an upcycled run before
    its training), -1 is damage."""
    config = json.loads((trained["run"] / rundir.CONFIG).read_text())
    for count in ("step", "steps", "warmup_steps"):
        assert rundir.check_config({**config, count: 0}, "config.json")[count] == 0
        with pytest.raises(rundir.CheckpointError, match=f"^config.json: {count}=-1 must be >= 0$"):
            rundir.check_config({**config, count: -1}, "config.json")


def test_a_config_field_of_another_type_is_refused_in_a_run_and_in_an_exported_gbattn_section(tmp_path):
    for config, message in (({"step": "5"}, "step='5' must be an integer"),
                            ({"seq_len": 0}, "seq_len=0 must be >= 1"),
                            ({"seq_len": True}, "seq_len=True must be an integer"),  # a bool is no count
                            ({"step": -3}, "step=-3 must be >= 0"),  # eval reported "weights at step -3"
                            ({"step": -1}, "step=-1 must be >= 0"),  # the first value refused
                            # compare's reuse check printed "the warmup over its -1 steps: recorded -5, asked 0"
                            ({"steps": -1}, "steps=-1 must be >= 0"),
                            ({"warmup_steps": -5}, "warmup_steps=-5 must be >= 0"),
                            ({"data": {"fingerprint": 7}}, "fingerprint=7 must be a string"),
                            # the tokenizer's fingerprint (load_run compares it) and an export's section, each checked
                            ({"data": {"tokenizer": 7}}, "tokenizer=7 must be a string"),
                            ({"gbattn": []}, r"gbattn=\[\] must be a JSON object"),
                            # compare's check_run computes the warmup over these: a TypeError traceback
                            ({"steps": "180"}, "steps='180' must be an integer"),
                            ({"warmup_steps": 1.5}, "warmup_steps=1.5 must be an integer"),
                            # an export's step past its run's steps: eval and lm-eval reported "step 1000000"
                            ({"step": 1_000_000, "steps": 5}, "step=1,000,000 is past the run's steps=5 \\(the "
                                                              "weights' training step")):
        with pytest.raises(rundir.CheckpointError, match=message):
            rundir.check_config(config, tmp_path / rundir.CONFIG)
        with pytest.raises(rundir.CheckpointError, match=message):
            rundir.gbattn_section({"model_type": "gbattn", "gbattn": config}, tmp_path / rundir.CONFIG)


def test_a_model_field_every_run_records_is_never_a_default(trained, tmp_path, capsys):
    """A config.json without model.n_heads ran 2-head weights as 4 heads (the default), exit 0: a field
    every gbattn run has recorded since the first version is damage when missing, in every command
    that reads the run. A field added later (n_kv_heads, norm_type, ...) keeps its old meaning."""
    import json

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = json.loads((run / rundir.CONFIG).read_text())
    recorded = dict(config["model"])
    # Recorded together since they were added: a section holding some of them is damaged (norm_type left out ran
    # LayerNorm over an RMSNorm model's weights, exit 0)
    for later in ("n_kv_heads", "norm_type", "norm_eps", "ffn", "ffn_hidden"):
        config["model"].pop(later)
        if config["model"].keys() & {"n_kv_heads", "norm_type", "norm_eps", "ffn", "ffn_hidden"}:
            (run / rundir.CONFIG).write_text(json.dumps(config))
            with pytest.raises(rundir.CheckpointError, match=rf"its model section has no [a-z_, ]*\b{later}\b"):
                rundir.load_run(run)
    (run / rundir.CONFIG).write_text(json.dumps(config))
    assert rundir.load_run(run).model_cfg == rundir.load_run(trained["run"]).model_cfg
    assert recorded.keys() - config["model"].keys() == {"n_kv_heads", "norm_type", "norm_eps", "ffn", "ffn_hidden"}
    del config["model"]["n_heads"]
    (run / rundir.CONFIG).write_text(json.dumps(config))
    for argv in (["eval", run], ["generate", run, "--prompt", "the", "--max-new-tokens", "2"],
                 ["analyze", run, "--out", tmp_path / "a", "--quiet"], ["train", "--resume", "--out", run, "--quiet"]):
        code, _, err = run_cli(capsys, argv)
        assert "its model section has no n_heads" in one_line(code, err), err


def test_a_config_larger_than_its_weights_is_refused_before_the_model_takes_memory(trained, tmp_path, capsys):
    """A config.json edited to sizes its weights do not have built that model first: d_model=2**20 tried to
    allocate terabytes and was told as "out of memory: choose smaller sizes" (d_model=8192 took gigabytes first).
    The weights are compared with a model on the meta device, which takes no memory."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = json.loads((run / rundir.CONFIG).read_text())
    config["model"]["d_model"] = 2**20
    (run / rundir.CONFIG).write_text(json.dumps(config))
    code, _, err = run_cli(capsys, ["eval", run])
    assert f"the weights in {run} do not match its config (size mismatch for wte.weight" in one_line(code, err), err
    # train --resume built the model of the edited config before reading its checkpoint
    torch.save({**rundir.load_checkpoint(run / rundir.BEST), "step": 1}, run / rundir.CHECKPOINT)
    (run / rundir.RESULT).unlink()
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert (f"the weights in {run / rundir.CHECKPOINT} do not match its config (size mismatch for wte.weight"
            in one_line(code, err)), err
    # n_layers edited to the largest a config takes: its layers are counted before a meta model is built (which
    # took minutes for 2,000 layers)
    config["model"].update(d_model=json.loads((trained["run"] / rundir.CONFIG).read_text())["model"]["d_model"],
                           n_layers=4096)
    (run / rundir.CONFIG).write_text(json.dumps(config))
    code, _, err = run_cli(capsys, ["eval", run])
    assert f"the weights in {run} do not match its config (n_layers=4096; the weights hold " in one_line(code, err), err


def test_weights_missing_many_names_are_one_line_cut_after_a_whole_name():
    """torch lists every missing weight on one line after its heading: the error keeps its first 240 characters, cut
    after a whole name, and says more follow (without the cut, a model of many layers listed every weight)."""
    from gbattn.config import ModelConfig
    from gbattn.model import GPT

    model = GPT(ModelConfig(vocab_size=20, block_size=8, d_model=16, n_layers=4, n_heads=2))
    with pytest.raises(rundir.CheckpointError) as refused:
        rundir.load_weights(model, {}, "w.pt")
    (line,) = str(refused.value).splitlines()
    detail = line.removeprefix("the weights in w.pt do not match its config (").removesuffix(")")
    assert detail.startswith('Missing key(s) in state_dict: "wte.weight"') and detail.endswith('", ...'), line
    assert len(detail) <= 240 + len(", ..."), line


def test_a_nested_weight_is_refused_in_one_line_not_a_traceback(trained, tmp_path, capsys):
    """weights_only=True reads a nested tensor (layout strided, like a dense one): its NaN check raised
    NotImplementedError, a traceback through every command that reads weights."""
    import warnings

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    best = rundir.load_checkpoint(run / rundir.BEST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([best["model"]["wte.weight"][:2], best["model"]["wte.weight"][:3]])
    torch.save({**best, "model": {**best["model"], "wte.weight": nested}}, run / rundir.BEST)
    code, _, err = run_cli(capsys, ["eval", run])
    assert "not floating-point numbers (wte.weight: torch.float32, nested, not dense)" in one_line(code, err), err


def test_an_expanded_weight_is_refused_before_its_values_are_checked(trained, tmp_path, capsys):
    """torch.save keeps an expanded tensor as its one stored value and its strides: a weight of 10**12 values from
    one stored made the NaN check allocate a terabyte, told as "out of memory: choose smaller sizes"."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    best = rundir.load_checkpoint(run / rundir.BEST)
    torch.save({**best, "model": {**best["model"], "wte.weight": torch.zeros(1).expand(10**6, 10**6)}},
               run / rundir.BEST)
    code, _, err = run_cli(capsys, ["eval", run])
    assert ("not floating-point numbers (wte.weight: torch.float32, 1,000,000,000,000 values from 1 stored, not dense)"
            in one_line(code, err)), err
    # twice the values stored is refused as well; a view of fewer values than its storage holds is no expansion
    with pytest.raises(rundir.CheckpointError, match=r"\(w: torch.float32, 6 values from 3 stored, not dense\)"):
        rundir.check_finite({"w": torch.zeros(3).expand(2, 3)}, "w.pt")
    rundir.check_finite({"w": torch.zeros(10)[:2]}, "w.pt")


def test_a_checkpoint_whose_weights_are_not_named_tensors_is_refused(tmp_path):
    """weights_only=True reads lists and integer keys too: such weights are one line naming the file,
    not an AttributeError later (a gate's logit is reshaped on load)."""
    for weights in ({"blocks.0.attn.gate.logit": [0.5]}, {0: torch.zeros(2)}):
        torch.save({"model": weights, "step": 1}, tmp_path / rundir.CHECKPOINT)
        with pytest.raises(rundir.CheckpointError, match="its weights are not named tensors"):
            rundir.load_checkpoint(tmp_path / rundir.CHECKPOINT)


def test_a_weight_name_holding_escape_sequences_is_shown_escaped_never_sent_to_the_terminal(trained, tmp_path,
                                                                                             capsys):
    """The one line names a damaged weight as the file spells it: a hostile name's terminal escape sequence
    (here: switch to red) and a right-to-left override were written to stderr as they were."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    best = rundir.load_checkpoint(run / rundir.BEST)
    torch.save({**best, "model": {**best["model"], "x\x1b[31m\u202ey\nz": torch.zeros(2, dtype=torch.bool)}},
               run / rundir.BEST)
    code, _, err = run_cli(capsys, ["eval", run])
    line = one_line(code, err)
    assert "x\\x1b[31m\\u202ey z: torch.bool" in line and err.isascii(), line


def test_a_run_evaluated_never_yet_loads_its_last_checkpoint_as_best(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.BEST).unlink()  # killed before its first evaluation
    loaded, last = rundir.load_run(run), rundir.load_run(trained["run"], "last")
    assert loaded.step == last.step and all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(),
                                                                              last.model.state_dict().values()))
    assert loaded.checkpoint == "last"  # named for what they are (eval printed "best weights", export recorded best)
    with pytest.raises(UserError, match="checkpoint='newest' is not allowed; choose one of best, last"):
        rundir.load_run(run, "newest")  # not the last weights under another name
    (run / rundir.CHECKPOINT).unlink()  # killed before it saved anything: said "no such file: .../checkpoint.pt"
    for which in (None, "best", "last"):
        with pytest.raises(rundir.CheckpointError, match="holds no weights: its training has not saved a checkpoint"):
            rundir.load_run(run, which)
    # still preparing its data (or planned by compare --jobs): no tokenizer.json either, which was blamed ("not
    # found: is it a gbattn run directory?")
    (run / rundir.TOKENIZER).unlink()
    with pytest.raises(rundir.CheckpointError, match="holds no weights: its training has not saved a checkpoint"):
        rundir.load_run(run)


def test_a_loaded_run_reports_the_step_its_weights_were_saved_at(trained):
    """load_run(...).step is the step of the checkpoint it loaded (eval and export report it: "weights at step N"):
    the test above compares two loads with each other, which a step always read as 0 would pass."""
    for which, name in (("last", rundir.CHECKPOINT), ("best", rundir.BEST)):
        saved = rundir.load_checkpoint(trained["run"] / name)["step"]
        assert rundir.load_run(trained["run"], which).step == saved
    assert rundir.load_run(trained["run"], "last").step == SHORT["max_steps"]


@pytest.mark.parametrize("step", [-1, "4", True, 2**70])
def test_a_checkpoint_step_that_is_no_count_of_steps_is_refused_not_reported(trained, tmp_path, capsys, step):
    """A best.pt whose step was -1, "4" or true was evaluated, generated from and upcycled as "best weights at step -1",
    "step 0" and "step 1"; export wrote that step into a config.json its own reader then refused (a config.json's
    step is checked: >= 0, at most 2**63 - 1)."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    torch.save({**rundir.load_checkpoint(run / rundir.BEST), "step": step}, run / rundir.BEST)
    with pytest.raises(rundir.CheckpointError, match=f"{run / rundir.BEST}: step="):
        rundir.load_run(run)
    code, _, err = run_cli(capsys, ["export", run, "--out", tmp_path / "export"])
    assert "step=" in one_line(code, err) and not (tmp_path / "export").exists()


def test_load_run_leaves_the_callers_random_stream_where_it_was(trained):
    """load_run built its model at a random init (replaced at once by the weights) from the global stream, so
    torch.manual_seed(0); load_run(RUN); torch.randn(...) drew other numbers than without the load."""
    torch.manual_seed(0)
    expected = torch.randn(4)
    torch.manual_seed(0)
    run = rundir.load_run(trained["run"])
    assert torch.equal(torch.randn(4), expected)
    assert not run.model.training


def test_a_loaded_tied_model_keeps_its_head_and_embedding_one_tensor(trained):
    """Weights are checked on a meta model with assign=True before the real model loads them. Given a model's
    state_dict() itself (a source built from a loaded run: convert.Source.build_model), that check marks the dict's
    _metadata and the real load assigns too: the head and the token embedding become two tensors, which an upcycled
    or fine-tuned model would then train and save apart."""
    run = rundir.load_run(trained["run"])
    assert run.model_cfg.tie_embeddings and run.model.lm_head.weight is run.model.wte.weight
    weights = run.model.state_dict()  # what a source built from a loaded run holds (convert.Source.build_model)
    for _ in range(2):  # and built again from the same dict
        model = rundir.model_holding(run.model_cfg, weights, "x")
        assert model.lm_head.weight is model.wte.weight


def test_load_run_on_cuda_without_cuda_says_so_not_that_the_checkpoint_is_damaged(trained, monkeypatch):
    """gbattn.load_run(RUN, device="cuda") on a machine without CUDA said "best.pt is truncated or
    corrupted ...; restore a copy of it" (torch.load's error on map_location), about a sound file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", torch.device("cuda:1")):
        with pytest.raises(UserError, match=r"^device='cuda(:1)?' but CUDA is not available here; use cpu$"):
            rundir.load_run(trained["run"], device=device)
    assert rundir.load_run(trained["run"], device="cpu").checkpoint == "best"


def test_a_cuda_device_this_machine_lacks_is_named_not_read_as_damage(trained, monkeypatch):
    """device="cuda:3" on a machine with one GPU got torch.load's "Attempting to deserialize object on CUDA device 3"
    read as "best.pt is truncated or corrupted ...; restore a copy of it" (load_run, and every command's --device),
    about a sound file. Now a UserError that says how many CUDA devices there are."""
    from gbattn.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = r"^device='cuda:3' but this machine has 1 CUDA device \(cuda:0\)"
    for device in ("cuda:3", torch.device("cuda", 3)):
        with pytest.raises(UserError, match=message):
            rundir.load_run(trained["run"], device=device)
    with pytest.raises(UserError, match=message):
        resolve_device("cuda:3")
    with pytest.raises(UserError, match=message):
        resolve_device("cuda", local_rank=3)  # torchrun with more processes than GPUs
    with pytest.raises(UserError, match=r"^device='cuda:1' but this machine has 1 CUDA device \(cuda:0\)"):
        resolve_device("cuda", local_rank=1)  # the first index past the last GPU
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def test_load_run_on_a_device_it_cannot_use_says_so_not_that_the_checkpoint_is_damaged(trained):
    """device="mps" or "xpu" (absent here), "meta" and even "cpu:0" got "best.pt is truncated or corrupted ...;
    restore a copy of it" or "the weights ... are not floating-point numbers: the file is damaged", about a sound
    file; a name torch does not know, torch's RuntimeError. Now a UserError naming the devices gbattn runs on;
    cpu:0 is the CPU; mps (a Mac's GPU) is taken where it is available, and said to be absent elsewhere."""
    from gbattn.runtime import resolve_device

    for device in ("xpu", "meta", "bogus", torch.device("meta"), 3.5, None):
        with pytest.raises(UserError, match=r"^device=\S+ is not allowed; choose auto, cpu, cuda, cuda:N or mps$"):
            rundir.load_run(trained["run"], device=device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.backends.mps, "is_available", lambda: False)
        with pytest.raises(UserError, match=r"^device='mps' but MPS \(Apple GPUs\) is not available here; use cpu$"):
            rundir.load_run(trained["run"], device="mps")
    for device in ("cpu:0", "auto", torch.device("cpu")):  # auto: as every command's --device takes it
        run = rundir.load_run(trained["run"], device=device)
        assert next(run.model.parameters()).device == torch.device("cpu") and not run.model.training
    # One parser: a command's --device and load_run said other things of the same bad name ('cudax': "CUDA is not
    # available here; use --device cpu" and "is not allowed; choose cpu, cuda, cuda:N or mps"; 'cuda' without CUDA:
    # "device='cuda:0' ..." and "device='cuda' ..."); now the same line, less mps, which only load_run takes.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        for device in ("cudax", "xpu", "cuda", "cuda:1", None):
            lines = []
            for load in (resolve_device, lambda d: rundir.load_run(trained["run"], device=d)):
                with pytest.raises(UserError) as caught:
                    load(device)
                lines.append(str(caught.value))
            assert lines[0] == lines[1].replace(" or mps", ""), lines


def test_load_run_docstring_names_every_device_it_takes():
    """load_run's docstring listed cpu, cuda, cuda:N and mps but not auto, which it takes (resolve_device, whose
    refusal lists them all): it now names each one."""
    import re

    from gbattn.runtime import resolve_device

    with pytest.raises(UserError) as caught:
        resolve_device("bogus", mps=True)
    allowed = str(caught.value).split("choose ", 1)[1].replace(" or ", ", ").split(", ")
    assert allowed == ["auto", "cpu", "cuda", "cuda:N", "mps"]
    doc = " ".join(rundir.load_run.__doc__.split())
    assert [d for d in allowed if not re.search(rf"\b{re.escape(d)}\b", doc)] == []


def test_a_shard_index_naming_a_file_outside_its_directory_is_refused(tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / rundir.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(rundir.CheckpointError, match="names shard '../outside.safetensors', which is not a file in"):
        rundir.read_shards(exported, rundir.SAFETENSORS_INDEX, lambda shard: {"w": torch.zeros(1)})
    # a shard named by something other than a file name (a damaged index): one line, not a TypeError
    (exported / rundir.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"w": 5}}))
    with pytest.raises(rundir.CheckpointError, match="has no weight_map of tensor names to shard files"):
        rundir.read_shards(exported, rundir.SAFETENSORS_INDEX, lambda shard: {"w": torch.zeros(1)})
    # a tensor the index names that its shard does not hold: named, not left to a mismatch with the config
    (exported / "shard.safetensors").write_bytes(b"")
    (exported / rundir.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"w": "shard.safetensors",
                                                                                "v": "shard.safetensors"}}))
    with pytest.raises(rundir.CheckpointError, match="the shards lack v$"):
        rundir.read_shards(exported, rundir.SAFETENSORS_INDEX, lambda shard: {"w": torch.zeros(1)})


def test_a_shard_holding_a_tensor_the_index_assigns_elsewhere_is_refused(tmp_path):
    """A tensor held by two shards, or by a shard the index does not assign it to, took the values of whichever
    shard was read last (an export evaluated at ppl 295.983 instead of 296.033, silently): the shard is named."""
    shards = {"a.safetensors": {"w": torch.zeros(1), "v": torch.ones(1)}, "b.safetensors": {"v": torch.full((1,), 2.)}}
    for shard in shards:
        (tmp_path / shard).write_bytes(b"")
    index = {"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}
    (tmp_path / rundir.SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(rundir.CheckpointError, match=re.escape(
            f"{tmp_path / 'a.safetensors'} holds v, which {rundir.SAFETENSORS_INDEX} does not assign to it: the files "
            f"are damaged or from different saves; restore a copy of them")):
        rundir.read_shards(tmp_path, rundir.SAFETENSORS_INDEX, lambda path: shards[path.name])
    shards["a.safetensors"] = {"w": torch.zeros(1)}  # each tensor where the index says: read
    assert rundir.read_shards(tmp_path, rundir.SAFETENSORS_INDEX, lambda path: shards[path.name]) == {
        "w": shards["a.safetensors"]["w"], "v": shards["b.safetensors"]["v"]}


def test_a_shard_index_without_a_weight_map_object_is_one_line(tmp_path):
    """An index with no weight_map, or one that is a list or null (a damaged or hand-made file), gets the one line a
    weight_map of other values gets: read as an object, it would end in an AttributeError traceback ("'list' object
    has no attribute 'values'")."""
    for index in ({}, {"weight_map": ["model-00001-of-00001.safetensors"]}, {"weight_map": None}):
        (tmp_path / rundir.SAFETENSORS_INDEX).write_text(json.dumps(index))
        with pytest.raises(rundir.CheckpointError, match="has no weight_map of tensor names to shard files"):
            rundir.read_shards(tmp_path, rundir.SAFETENSORS_INDEX, lambda shard: {})


def test_export_weights_lose_the_transformers_prefix_only_when_every_name_has_it():
    """The wrapper's ``model.`` prefix is dropped where every name has it (a transformers save). A file mixing prefixed
    and bare names is damaged: its names are left as they are, to be refused against the config, rather than
    stripped, where ``model.wte.weight`` and ``wte.weight`` would become one name and either could be loaded."""
    a, b = torch.zeros(1), torch.ones(1)
    assert rundir.gpt_weights({"model.wte.weight": a, "model.lm_head.weight": b}, False, "x") == {"wte.weight": a,
                                                                                                 "lm_head.weight": b}
    mixed = {"model.wte.weight": a, "wte.weight": b}
    assert rundir.gpt_weights(dict(mixed), False, "x") == mixed


def test_a_resume_checkpoint_cannot_change_the_optimizers_settings(trained, tmp_path, monkeypatch):
    """AdamW's settings come from the run's config, not the checkpoint's param_groups: eps="x" and amsgrad=true
    were tracebacks at the next step, maximize=true (gradient ascent) and betas of 2 trained on silently (and a
    weight decay of 100 would)."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    state = rundir.load_checkpoint(trained["run"] / rundir.CHECKPOINT)
    state.update(step=2, curve=[p for p in state["curve"] if p["step"] <= 2], best_step=2,  # 2 steps left to train
                 tokens_seen=state["tokens_seen"] // state["step"] * 2)
    state["best_valid"] = state["curve"][-1]["valid_loss"]
    results = {}
    for name, damage in (("clean", {}), ("eps", {"eps": "x"}), ("amsgrad", {"amsgrad": True}),
                         ("ascent", {"maximize": True, "betas": (2.0, 0.5)}), ("decay", {"weight_decay": 100.0})):
        run = tmp_path / name
        shutil.copytree(trained["run"], run)
        (run / rundir.RESULT).unlink()
        groups = [{**g, **damage} for g in state["optimizer"]["param_groups"]]
        torch.save({**state, "optimizer": {**state["optimizer"], "param_groups": groups}}, run / rundir.CHECKPOINT)
        results[name] = train(run, resume=True, quiet=True)["test_ppl"]
    assert len(set(results.values())) == 1, results


@pytest.mark.parametrize("damage", [{"elapsed": float("nan")}, {"train_seconds": -1.0}, {"best_step": True},
                                    {"elapsed": True}, {"train_seconds": float("inf")}, {"tokens_seen": -8},
                                    {"train_window": [float("nan"), 1]}, {"train_window": [1.0]},
                                    {"rng_per_rank": []}, {"best_valid": -1.0}, {"best_valid": True},
                                    {"best_step": 10**6}, {"tokens_seen": 10**30}, {"train_window": [1000.0, 0]},
                                    {"train_window": [8.3, 0.5]}, {"train_window": [8.0, 50]},
                                    "step-beyond-the-run", "curve-tokens-not-a-number"])
def test_a_resume_checkpoint_with_malformed_bookkeeping_is_one_line(trained, tmp_path, capsys, monkeypatch, damage):
    """A NaN elapsed time resumed and finished with wall_clock_s null in result.json, which compare then refuses
    as incomplete; negative or infinite seconds, a best step of true and seconds of true (1 s to float()) were
    taken as they were too. A negative count of tokens seen, a NaN training-loss window, a window of one number
    and no random streams at all are refused the same way. A negative best validation loss (or true, 1.0) kept
    every later evaluation from counting as better: the run finished with that loss as its result (valid ppl 0.37)
    and its old best.pt; a best step after the checkpoint's own step was reported as the best one's. A count of
    tokens seen other than the steps' (10**30 went into result.json's tokens and FLOPs), and a training-loss window
    of no steps but a sum of 1000, or of 0.5 steps, (a training loss of 170.7 logged where it was 4.1) too; so is a
    window of more steps than were trained, a step past the run's last with the tokens of that step (a 4-step run
    resumed at step 1000 reported its tokens and FLOPs), and a curve point whose tokens are no count."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    state = rundir.load_checkpoint(run / rundir.CHECKPOINT)
    if damage == "step-beyond-the-run":
        damage = {"step": 1000, "tokens_seen": state["tokens_seen"] // state["step"] * 1000}
    elif damage == "curve-tokens-not-a-number":
        damage = {"curve": [{**point, "tokens": "many"} for point in state["curve"]]}
    torch.save({**state, **damage}, run / rundir.CHECKPOINT)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert "is malformed or does not match this run" in one_line(code, err)
    assert not (run / rundir.RESULT).exists()


@pytest.mark.parametrize("damage", ["missing", "unexpected", "transposed", "nan", "integer"])
def test_a_damaged_best_checkpoint_read_as_a_resumed_run_finishes_is_one_line(trained, tmp_path, capsys, monkeypatch,
                                                                             damage):
    """A resumed run at its last step tests its best.pt's weights, read only then: a missing or unexpected weight was
    a ValueError traceback, a transposed one torch's size-mismatch traceback, a NaN one a NaN test perplexity, and an
    integer one was cast silently (another test perplexity)."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()
    best = rundir.load_checkpoint(run / rundir.BEST)
    weights = dict(best["model"])
    if damage == "missing":
        del weights["ln_f.bias"]
    elif damage == "unexpected":
        weights["blocks.9.extra.weight"] = torch.zeros(2)
    elif damage == "transposed":
        weights["wte.weight"] = weights["wte.weight"].t().contiguous()
    elif damage == "nan":
        weights["ln_f.weight"] = torch.full_like(weights["ln_f.weight"], float("nan"))
    else:
        weights["blocks.0.mlp.fc.weight"] = weights["blocks.0.mlp.fc.weight"].to(torch.int64)
    torch.save({**best, "model": weights}, run / rundir.BEST)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert str(run / rundir.BEST) in one_line(code, err)
    assert not (run / rundir.RESULT).exists()


def test_resuming_a_finished_run_whose_result_lacks_its_perplexities_prints_them_as_null(trained, tmp_path, capsys,
                                                                                         monkeypatch):
    """read_result takes a result.json without test_ppl or valid_ppl; the summary line was a KeyError traceback."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    result = json.loads((run / rundir.RESULT).read_text())
    lacking = {k: v for k, v in result.items() if k not in ("test_ppl", "valid_ppl")}
    (run / rundir.RESULT).write_text(json.dumps(lacking))
    code, out, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])
    assert summary["test_ppl"] is None and summary["valid_ppl"] is None and summary["steps"] == result["steps"]


def test_a_result_lacking_its_perplexities_is_read_with_them_as_null_by_compare(trained, tmp_path):
    """read_result takes a result.json without test_ppl, valid_ppl or valid_loss, or a curve point without its
    valid_ppl, as null; compare's table then indexed them: a KeyError traceback. Each reads as null."""
    result = json.loads((trained["run"] / rundir.RESULT).read_text())
    lacking = {k: v for k, v in result.items() if k not in ("test_ppl", "valid_ppl", "valid_loss")}
    lacking["curve"] = [{k: v for k, v in point.items() if k != "valid_ppl"} for point in result["curve"]]
    (tmp_path / rundir.RESULT).write_text(json.dumps(lacking))
    read = rundir.read_result(tmp_path / rundir.RESULT)
    assert read["test_ppl"] is None and read["valid_ppl"] is None and read["valid_loss"] is None
    assert all(point["valid_ppl"] is None for point in read["curve"]) and read["curve"]  # as results.md reads them
    from gbattn.experiments.recipes import get_recipe
    from gbattn.experiments.report import aggregate

    recipe = get_recipe("cpu-char")
    spec = next(s for s in recipe.models if s.label == "standard")
    row = aggregate(recipe, [spec], {"standard": {42: read}})[0]
    assert row["test_ppl_mean"] is None and row["valid_loss"] == {"42": None}
    # a row's devices each once: a resumed run names every leg of it ("A; B"), beside a seed that ran on A alone
    one, two = "cpu (1 thread, x86_64)", "cpu (2 threads, x86_64)"
    row = aggregate(recipe, [spec], {"standard": {42: {**read, "device": one}, 7: {**read, "device": f"{one}; {two}"}}})
    assert row[0]["device"] == f"{one}; {two}"


def test_old_records_keep_their_meaning_and_a_results_curve_is_checked(trained, tmp_path):
    """eval_every=0 in a run from before it meant "every epoch only" (None now); result.json's
    validation curve is checked point by point."""
    config = json.loads((trained["run"] / rundir.CONFIG).read_text())
    config["train"]["eval_every"] = 0
    assert rundir.read_configs(config, trained["run"])[1].eval_every is None
    result = json.loads((trained["run"] / rundir.RESULT).read_text())
    assert rundir.read_result(trained["run"] / rundir.RESULT)["curve"] == result["curve"]
    for point in ({"step": True, "tokens": 1}, {"step": 1, "tokens": "many"}, {"step": 1, "tokens": 1.5}):
        result["curve"] = [{**point, "valid_loss": 1.0, "valid_ppl": 2.7}]
        (tmp_path / rundir.RESULT).write_text(json.dumps(result))
        with pytest.raises(rundir.CheckpointError, match="validation curve is malformed"):
            rundir.read_result(tmp_path / rundir.RESULT)


def test_a_recorded_dropout_site_list_is_read_as_recorded_and_only_a_missing_one_takes_the_old_sites(trained):
    """The old meaning of dropout_sites (every site) fills only a config written before the field existed. Put over
    a recorded list, a run trained with the authors' sites would resume, evaluate and export with dropout at sites it
    never had."""
    config = json.loads((trained["run"] / rundir.CONFIG).read_text())
    config["model"]["dropout_sites"] = ["embedding"]
    assert rundir.read_configs(config, trained["run"])[0].dropout_sites == ["embedding"]
    del config["model"]["dropout_sites"]
    assert rundir.read_configs(config, trained["run"])[0].dropout_sites == ["embedding", "attention", "attn-output",
                                                                            "ffn-output"]


def test_recorded_warmup_switches_are_read_as_recorded_and_only_missing_ones_are_off(trained):
    """warmup_from_zero and fit_warmup (the paper-exact warmup) are off only in a config written before they existed.
    Put over recorded values, a paper-exact run would resume on another learning-rate schedule than it started on."""
    config = json.loads((trained["run"] / rundir.CONFIG).read_text())
    config["train"].update(warmup_from_zero=True, fit_warmup=True)
    train_cfg = rundir.read_configs(config, trained["run"])[1]
    assert (train_cfg.warmup_from_zero, train_cfg.fit_warmup) == (True, True)
    del config["train"]["warmup_from_zero"], config["train"]["fit_warmup"]
    train_cfg = rundir.read_configs(config, trained["run"])[1]
    assert (train_cfg.warmup_from_zero, train_cfg.fit_warmup) == (False, False)


def test_a_result_with_a_value_no_run_can_record_is_refused(trained, tmp_path):
    """A perplexity below 1, a negative count, a NaN or an infinity (write_json writes neither: null; 1e400 reads as
    inf, and a compute-matched run's steps from it were an OverflowError traceback) in a result.json was published
    in compare's table as measured; the trained run's own values are accepted."""
    result = json.loads((trained["run"] / rundir.RESULT).read_text())
    rundir.read_result(trained["run"] / rundir.RESULT)
    for key, value, message in (("test_ppl", 0.5, "test_ppl=0.5 must be a finite number >= 1"),
                                ("valid_ppl", float("nan"), "valid_ppl=nan must be a finite number >= 1"),
                                ("valid_loss", -0.1, "valid_loss=-0.1 must be a finite number >= 0"),
                                ("parameters", 0, "parameters=0 must be a finite number >= 1"),
                                ("d_model", 0, "d_model=0 must be a finite number >= 1"),
                                ("train_flops", -1.0, "train_flops=-1.0 must be a finite number >= 0"),
                                ("train_flops", "1e400", "train_flops=inf must be a finite number >= 0"),
                                ("steps", -2, "steps=-2 must be a finite number >= 0")):
        text = json.dumps({**result, key: value})
        (tmp_path / rundir.RESULT).write_text(text.replace('"1e400"', "1e400"))
        with pytest.raises(rundir.CheckpointError, match=re.escape(message)):
            rundir.read_result(tmp_path / rundir.RESULT)


def test_a_lock_file_that_is_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / rundir.LOCK)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(UserError, match="is not a regular file: remove it"):
        rundir.RunLock(fifo)
    assert set(os.listdir("/proc/self/fd")) == fds  # the FIFO's descriptor is closed


def test_a_missing_data_path_given_is_not_blamed_on_the_runs_record(trained, tmp_path):
    """Only when no --data is given does a missing corpus get the hint that the run recorded its path."""
    from gbattn.data.prepare import prepare_run_data
    from gbattn.errors import DataNotFound

    with pytest.raises(DataNotFound) as error:
        prepare_run_data(rundir.load_run(trained["run"]), str(tmp_path / "nope"), allow_other_data=False,
                         split="test")
    assert "recorded" not in str(error.value)


def test_all_finite_checks_every_value_where_the_sum_overflows():
    """rundir.all_finite takes a tensor's sum first (a NaN or an infinity makes it non-finite) and checks every value
    where the sum is not finite: finite values whose sum overflows (float32 3e38 + 3e38, float16 60000 + 60000) are
    finite; NaN, an infinity, and infinities of both signs (a NaN sum) are not; float8 and an empty tensor work."""
    from gbattn.rundir import all_finite

    nan, inf = float("nan"), float("inf")
    finite = [torch.tensor([3e38, 3e38]), torch.tensor([6e4, 6e4], dtype=torch.float16), torch.zeros(0),
              torch.ones(4, dtype=torch.float8_e4m3fn), torch.randn(5, 5, dtype=torch.float64)]
    damaged = [torch.tensor([1.0, nan]), torch.tensor([3e38, inf]), torch.tensor([1.0, -inf, inf]),
               torch.tensor([nan], dtype=torch.bfloat16)]
    assert [all_finite(t) for t in finite] == [True] * 5 and [all_finite(t) for t in damaged] == [False] * 4


def test_json_writers_store_no_nan_and_jsonl_readers_keep_objects_only(tmp_path):
    """write_json stores NaN and infinities as null inside tuples as well as lists (JSON has no NaN),
    and read_jsonl keeps only objects: a line holding a list, a number or a string is skipped, and so is one nested
    too deeply to read (a RecursionError); a missing file, or a directory in its place, holds none."""
    files.write_json({"curve": (1.0, float("nan")), "best": [float("inf")]}, tmp_path / "r.json")
    assert strict_json((tmp_path / "r.json").read_text()) == {
        "curve": [1.0, None], "best": [None]}
    (tmp_path / "m.jsonl").write_text('{"a": 1}\n[1, 2]\n3\n"x"\n' + "[" * 100_000 + '\n{"b": 2}\n')  # too deep to read
    assert files.read_jsonl(tmp_path / "m.jsonl") == [{"a": 1}, {"b": 2}]
    assert files.read_jsonl(tmp_path / "none.jsonl") == files.read_jsonl(tmp_path) == []  # no file: no records


def test_read_jsonl_reads_past_a_blank_line_and_keeps_a_record_with_a_byte_that_is_not_utf8(tmp_path):
    """A blank line ended the reading: the records after it were lost. A record holding a byte that is not UTF-8 (a
    line damaged on disk) was dropped whole; the byte is read as U+FFFD and the record kept."""
    (tmp_path / "m.jsonl").write_text('{"a": 1}\n\n{"b": 2}\n')
    assert files.read_jsonl(tmp_path / "m.jsonl") == [{"a": 1}, {"b": 2}]
    (tmp_path / "m.jsonl").write_bytes(b'{"a": "\xff"}\n{"b": 2}\n')
    assert files.read_jsonl(tmp_path / "m.jsonl") == [{"a": "\ufffd"}, {"b": 2}]


def test_read_jsonl_reads_a_line_at_a_time(tmp_path):
    """A metrics file under the size limit that is a sparse file of zeros (4 KB on disk) is read a bounded line at a
    time: it was read whole and decoded (2.1 GB of memory for 1 GiB); a line longer than any record is skipped, to
    its end (the tail of one that ends in a record, after 64 KiB of spaces, was read as a record)."""
    import tracemalloc

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"a": 1}\n' + "x" * (files.MAX_JSONL_LINE + 10) + '\n' + " " * (files.MAX_JSONL_LINE + 10)
                    + '{"z": 9}\n{"b": 2}\n')
    with open(path, "ab") as f:
        f.truncate(64 * 2**20)  # 64 MiB: zeros, no line end
        f.seek(0, 2)
        f.write(b'\n{"c": 3}\n')
    tracemalloc.start()
    try:
        assert files.read_jsonl(path) == [{"a": 1}, {"b": 2}, {"c": 3}]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # (the whole file read: over 128 MiB)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG])
def test_a_full_disk_quota_or_read_only_filesystem_is_one_line_and_keeps_the_file(tmp_path, monkeypatch, code):
    path = tmp_path / "results.json"
    path.write_text("old")

    def failing_replace(src, dst):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(UserError, match=r"could not write .*results\.json .*; the previous results\.json is kept"):
        files.atomic_write(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_atomic_write_leaves_no_temporary_file_on_an_interrupt_and_passes_other_errors_on(tmp_path, monkeypatch):
    """A Ctrl-C during the rename (KeyboardInterrupt is no Exception) keeps the old file and removes the
    temporary one; an error other than a full disk reaches the caller as it is."""
    path = tmp_path / "results.json"
    path.write_text("old")
    for error in (KeyboardInterrupt(), OSError(errno.EIO, os.strerror(errno.EIO))):
        def failing_replace(src, dst, error=error):
            raise error

        monkeypatch.setattr(files.os, "replace", failing_replace)
        with pytest.raises(type(error)) as caught:
            files.atomic_write(path, "new")
        monkeypatch.undo()
        assert caught.value is error
        assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_truncate_metrics_reads_and_writes_a_line_at_a_time_and_keeps_the_file_on_a_failure(tmp_path, monkeypatch):
    """Resume's truncation of metrics.jsonl held every line at once (a million lines, 150 MB of file: 1.55 GB); it
    now writes each kept line as it reads it, through atomic_write's pieces, and a failure midway keeps the file."""
    from gbattn import rundir

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "event": e}) + "\n" for s, e in ((1, "train"), (2, "eval"), (3, "train"),
                                                                      (2, "test"), (4, "train"))]
    path.write_text("".join(lines))
    read, written = [], []
    iterate, write = files.iter_jsonl, files.atomic_write

    def counting(p):
        for record in iterate(p):
            read.append(record["step"])
            yield record

    def watched(p, content):  # each piece as atomic_write takes it, with how many lines were read by then
        write(p, ((written.append((len(read), piece)), piece)[1] for piece in content))

    monkeypatch.setattr(rundir, "iter_jsonl", counting)
    monkeypatch.setattr(rundir, "atomic_write", watched)
    rundir.truncate_metrics(path, 2)
    assert path.read_text() == lines[0] + lines[1]  # the test event and the steps past 2 dropped
    # each kept line written once read, before the next was read: the file is never held whole
    assert [n for n, _ in written] == [1, 2] and read == [1, 2, 3, 2, 4]
    monkeypatch.undo()

    def failing(p):
        yield {"step": 1}
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    path.write_text("".join(lines))
    monkeypatch.setattr(rundir, "iter_jsonl", failing)
    with pytest.raises(OSError):
        rundir.truncate_metrics(path, 2)
    assert path.read_text() == "".join(lines) and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_atomic_write_names_the_file_of_a_failed_write(tmp_path, monkeypatch, capsys):
    """A write error other than a full disk (an I/O error from fsync) reached the CLI naming no file
    (`gbattn: error: Input/output error`); now the error names the file it was writing."""
    path = tmp_path / "results.json"

    def failing_fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(files.os, "fsync", failing_fsync)
    monkeypatch.setattr("gbattn.cli.cmd_list", lambda args: files.atomic_write(path, "new"))
    code, _, err = run_cli(capsys, ["list"])
    assert one_line(code, err) == f"gbattn: error: {path}: Input/output error"
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    """A shared run directory can hold NAME.tmp<pid> links, for every pid, to files elsewhere: the temporary
    file (and the probe file of a writable --out) was opened through the link, creating or overwriting (truncating)
    its target; now the link is replaced."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("not gbattn's")
    run = tmp_path / "run"
    run.mkdir()
    for name, target in (("config.json", outside / "created"), ("result.json", outside / "kept")):
        (run / f"{name}{files.building_suffix()}").symlink_to(target)
        files.write_json({"a": 1}, run / name)
        assert json.loads((run / name).read_text()) == {"a": 1}
    assert sorted(p.name for p in outside.iterdir()) == ["kept"] and (outside / "kept").read_text() == "not gbattn's"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "result.json"]
    # The probe proving --out writable (train, resume, export, ...) truncated a file a link at its name led to.
    (run / f".write-test{files.building_suffix()}").symlink_to(outside / "kept")
    files.check_writable_dir(run)
    assert (outside / "kept").read_text() == "not gbattn's"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "result.json"]


def test_sync_directory_closes_what_it_opens_and_passes_on_an_unexpected_error(tmp_path, monkeypatch):
    """A filesystem that cannot sync a directory (EINVAL, EBADF, EACCES), or a directory that cannot be opened, is
    left as it is; an I/O error is not hidden; the directory's descriptor is closed either way."""
    def open_fds() -> set:
        return set(os.listdir("/proc/self/fd"))

    before = open_fds()
    files.sync_directory(tmp_path)
    assert open_fds() == before
    for code, raises in ((errno.EINVAL, False), (errno.EBADF, False), (errno.EACCES, False), (errno.EIO, True)):
        def failing_fsync(fd, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(files.os, "fsync", failing_fsync)
        if raises:
            with pytest.raises(OSError):
                files.sync_directory(tmp_path)
        else:
            files.sync_directory(tmp_path)
        monkeypatch.undo()
        assert open_fds() == before

    def unopenable(path, flags):  # a directory its user may write in but not read (mode 0o300)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(files.os, "open", unopenable)
    files.sync_directory(tmp_path)  # left as it is: the rename it follows is done


def test_a_directory_given_as_a_link_to_nothing_is_named_as_such(tmp_path, monkeypatch):
    """--out or $GBATTN_CACHE a link whose target is gone: creating it failed with EEXIST, and the line said the
    directory "is not writable (File exists)", naming neither the link nor its missing target."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone" / "run")
    gone = re.escape(f"is a link to {tmp_path / 'gone' / 'run'}, which does not exist")
    with pytest.raises(UserError, match=f"^--out {re.escape(str(link))} {gone}$"):
        files.check_writable_dir(link)
    monkeypatch.setenv("GBATTN_CACHE", str(link))
    with pytest.raises(UserError, match=f"^the cache directory {re.escape(str(link))} {gone}; set GBATTN_CACHE to "
                                        f"another directory$"):  # (the hint was inside the sentence, before the path)
        cache_dir()
    assert not (tmp_path / "gone").exists()  # nothing created through the link
    (tmp_path / "gone" / "run").mkdir(parents=True)  # a link to a directory that is there is a directory
    assert files.check_writable_dir(link) == link and cache_dir() == link


def test_an_output_file_that_is_a_pipe_is_refused_not_replaced(trained, tmp_path, capsys, monkeypatch):
    """`eval --per-token FIFO` (or a device: /dev/null, run as root) exited 0 having put a regular file in its place
    (atomic_write renames over what is there); now one line, and the pipe is left as it was."""
    monkeypatch.setenv("GBATTN_CACHE", str(trained["cache"]))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out, err = run_cli(capsys, ["eval", trained["run"], "--per-token", fifo])
    assert (code, err) == (2, f"gbattn: error: --per-token {fifo} is a device or a pipe, which gbattn would replace "
                              f"with a file; give a file name\n")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_metrics_lines_store_no_nan_and_the_writable_probe_leaves_nothing(tmp_path, monkeypatch):
    """append_jsonl writes NaN and infinities as null like write_json; proving --out writable leaves no
    probe file; a blank --out or a directory given for a file is one line, and nothing is created."""
    files.append_jsonl(tmp_path / "m.jsonl", {"loss": float("nan"), "ppl": float("inf"), "step": 1})
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    assert strict_json(line) == {"loss": None, "ppl": None, "step": 1}
    assert files.check_writable_dir(tmp_path / "out") == tmp_path / "out"
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.chdir(tmp_path / "out")
    with pytest.raises(UserError, match="--out is empty: name a directory"):
        files.check_writable_dir("  ")
    with pytest.raises(UserError, match="is a directory; give a file name"):
        files.check_writable_file(tmp_path, "--per-token")
    # a file in folders not there yet: the nearest existing one is probed, none is created by the check
    per_token = tmp_path / "out" / "new" / "x.npy"
    assert files.check_writable_file(per_token, "--per-token") == per_token
    assert list((tmp_path / "out").iterdir()) == []
    # a file where one of those folders would be is named, not "not writable (File exists)" of the folder
    (tmp_path / "notes").write_text("")
    with pytest.raises(UserError, match=r"--per-token .*/notes/new/x.npy: .*/notes is a file, not a folder$"):
        files.check_writable_file(tmp_path / "notes" / "new" / "x.npy", "--per-token")
    # A folder that is gone is not "a link, a directory or a FIFO" to remove (what the message said of any error)
    with pytest.raises(UserError, match=r"gone/m.jsonl cannot be opened to append to \(No such file or directory\)$"):
        files.append_jsonl(tmp_path / "gone" / "m.jsonl", {"step": 1})


def test_a_new_metrics_file_gets_the_umasks_permissions(tmp_path):
    """metrics.jsonl is created with the umask's permissions, as result.json and config.json are (atomic_write):
    under umask 002 (a group's shared folder) it is group-writable; it was created 0644 whatever the umask."""
    umask = os.umask(0o002)
    try:
        files.append_jsonl(tmp_path / "metrics.jsonl", {"step": 1})
        files.atomic_write(tmp_path / "result.json", "{}")
    finally:
        os.umask(umask)
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("metrics.jsonl", "result.json")}
    assert modes == {"metrics.jsonl": 0o664, "result.json": 0o664}


def test_read_json_turns_every_bad_file_into_one_line_naming_it(tmp_path):
    """A list, invalid UTF-8, JSON nested too deeply to parse and an integer too long to convert are
    CheckpointErrors naming the file; a metrics file keeps its good lines around a line with a bad byte,
    nested too deeply or with an integer too long."""
    from gbattn.errors import CheckpointError

    path = tmp_path / "results.json"
    for content, expected in ((b"[1, 2]", "holds list, expected a JSON object"),
                              (b'{"a": "\xff"}', "is not valid JSON"),
                              (b"[" * 100_000, "its JSON is nested too deeply to read"),
                              # more digits than Python converts: its ValueError was a traceback through every command
                              (b'{"seq_len": ' + b"1" * 5000 + b"}", "is not valid JSON (Exceeds the limit"),
                              # a clone without Git LFS: named as such, not "not valid JSON"
                              (LFS_POINTER.encode(), LFS_MESSAGE)):
        path.write_bytes(content)
        with pytest.raises(CheckpointError) as caught:
            files.read_json(path)
        assert str(path) in str(caught.value) and expected in str(caught.value)
    with open(path, "wb") as f:  # a sparse file larger than any gbattn JSON: refused before it is read
        f.truncate(files.MAX_JSON_BYTES + 1)
    with pytest.raises(CheckpointError, match=r"is 256 MiB: larger than any JSON file gbattn reads"):
        files.read_json(path)
    # a file that cannot be read (no permission; here a folder, as tests run as root may read any file)
    with pytest.raises(CheckpointError, match=r"cannot be read \(Is a directory\)"):
        files.read_json_bytes(tmp_path)
    (tmp_path / "m.jsonl").write_bytes(b'{"a": 1}\n{"b": "\xff"}\n' + b"[" * 100_000 + b'\n{"c": 3}\n'
                                       + b'{"step": ' + b"1" * 5000 + b"}\n")
    assert files.read_jsonl(tmp_path / "m.jsonl") == [{"a": 1}, {"b": "\ufffd"}, {"c": 3}]


def test_a_metrics_file_above_its_size_cap_is_refused_unread_by_resume_and_plot(trained, tmp_path, capsys):
    """read_jsonl read a metrics.jsonl whole: a sparse file of 20 GiB filled the memory, then was told as "out of
    memory: choose smaller sizes". Above MAX_JSONL_BYTES it is one line naming the file, for every reader."""
    from gbattn.errors import CheckpointError

    path = tmp_path / rundir.METRICS
    with open(path, "wb") as f:
        f.truncate(files.MAX_JSONL_BYTES + 1)
    with pytest.raises(CheckpointError, match=f"{path} is 1,024 MiB: larger than any metrics file gbattn reads "
                                              r"\(1024 MiB at most\); not read"):
        files.read_jsonl(path)
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.RESULT).unlink()  # so that --resume reads the metrics
    os.replace(path, run / rundir.METRICS)
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", run, "--quiet"])
    assert "larger than any metrics file gbattn reads" in one_line(code, err), err


def test_a_directory_device_or_pipe_where_a_file_is_read_is_named_as_such_not_as_missing(trained, tmp_path, capsys):
    """A config.json, tokenizer.json or checkpoint that is a directory, a link to a device or a FIFO was told as
    "not found" (or "no such file"): the user looked for a missing file. Each reader names what is there instead,
    without reading it (a FIFO would wait for a writer)."""
    from gbattn.data.tokenizer import Tokenizer
    from gbattn.errors import CheckpointError

    for name, read in ((rundir.CONFIG, files.read_json), (rundir.TOKENIZER, Tokenizer.load),
                       (rundir.BEST, rundir.read_torch_file)):
        directory, device, fifo = (tmp_path / kind / name for kind in ("directory", "device", "fifo"))
        directory.mkdir(parents=True)
        device.parent.mkdir()
        device.symlink_to("/dev/zero")
        fifo.parent.mkdir()
        os.mkfifo(fifo)
        for path, what in ((directory, "a directory"), (device, "a device or a pipe (a link to /dev/zero)"),
                           (fifo, "a device or a pipe")):
            with pytest.raises(CheckpointError) as caught:
                read(path)
            assert str(caught.value) == f"{path} is {what}, not a regular file: put the file itself there"
        shutil.rmtree(tmp_path / "directory")
        shutil.rmtree(tmp_path / "device")
        shutil.rmtree(tmp_path / "fifo")
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    (run / rundir.CONFIG).unlink()
    (run / rundir.CONFIG).mkdir()
    code, _, err = run_cli(capsys, ["eval", run])
    assert one_line(code, err) == f"gbattn: error: {run / rundir.CONFIG} is a directory, not a regular file: put the " \
                                  f"file itself there"


def test_every_reader_that_looks_for_a_file_names_a_directory_there_as_such(trained, tmp_path, capsys):
    """An export's gbattn-tokenizer.json or model.safetensors, an upcycled source's config.json or a comparison's
    results.json that is a directory was told as missing ("has no ...", "no finished run yet"), as read_json,
    Tokenizer.load and read_torch_file told theirs: each names what is there instead."""
    exported = tmp_path / "exported"
    assert run_cli(capsys, ["export", trained["run"], "--out", exported])[0] == 0
    comparison = tmp_path / "comparison"
    comparison.mkdir()
    (comparison / "recipe.json").write_text("{}")
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    for argv, path in ((["eval", exported], exported / rundir.EXPORTED_TOKENIZER),
                       (["eval", exported], exported / rundir.SAFETENSORS),
                       (["upcycle", run, "--attn", "boosted", "--out", tmp_path / "up"], run / rundir.CONFIG),
                       (["plot", comparison], comparison / "results.json")):
        kept = path.with_name(path.name + ".kept")
        if path.exists():
            path.rename(kept)
        path.mkdir()
        code, _, err = run_cli(capsys, argv)
        assert one_line(code, err) == f"gbattn: error: {path} is a directory, not a regular file: put the file " \
                                      f"itself there", err
        path.rmdir()
        if kept.exists():
            kept.rename(path)
    # none at all (what transformers' save_pretrained leaves): named as missing, with where to find it
    (exported / rundir.EXPORTED_TOKENIZER).unlink()
    code, _, err = run_cli(capsys, ["eval", exported])
    assert f"{exported} has no {rundir.EXPORTED_TOKENIZER} (gbattn's own tokenizer file" in one_line(code, err), err


def test_every_tokenizer_file_is_refused_unread_above_the_json_size_cap(tmp_path, monkeypatch):
    """A run's tokenizer.json, a --tokenizer hf=PATH file and an HF directory's tokenizer.json are read under
    the cap every JSON file has: a 1 GiB sparse tokenizer.json was read whole (2.3 GB of memory, then 'not a
    valid gbattn tokenizer file'), and a larger one could exhaust the memory before any error."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from gbattn.convert import hf_tokenizer
    from gbattn.data.tokenizer import Tokenizer, get_tokenizer
    from gbattn.errors import CheckpointError

    hf_json = HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str()
    run_file, hf_dir = tmp_path / "tokenizer.json", tmp_path / "hf"
    run_file.write_text(Tokenizer("hf", hf_json).to_json())
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_text(hf_json)
    monkeypatch.setattr(files, "MAX_JSON_BYTES", len(hf_json) - 1)  # a valid file, just larger than the cap
    too_large = r"is 0 MiB: larger than any JSON file gbattn reads \(0 MiB at most\); not read"
    for read in (lambda: Tokenizer.load(run_file), lambda: get_tokenizer(f"hf={hf_dir / 'tokenizer.json'}", None),
                 lambda: hf_tokenizer(hf_dir, 2)):
        with pytest.raises(CheckpointError, match=too_large):
            read()
    monkeypatch.setattr(files, "MAX_JSON_BYTES", (hf_dir / "tokenizer.json").stat().st_size)
    assert hf_tokenizer(hf_dir, 2).vocab_size == 2  # a file of exactly the cap is read


def test_a_file_named_through_its_parent_folder_keeps_its_name_alone_and_the_root_stays_dot(tmp_path, monkeypatch):
    """``../input.txt`` (a file above the working directory) becomes ``input.txt``: its folder's name ``..`` says
    nothing of the corpus. relative_path gives the root, which has no parts, as ``.``, never an empty name."""
    (tmp_path / "input.txt").write_text("To be or not to be\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert files.portable_path("../input.txt") == "input.txt"
    assert files.relative_path("/", tmp_path) == "."


def test_portable_paths_and_error_details_hold_nothing_of_this_machine_or_the_traceback(tmp_path):
    """An absolute path, or one climbing out anywhere in it, becomes its last component (a file its folder
    and name); an error's detail is its first line, cut at the limit, with its type when asked, and
    'malformed' when empty."""
    from gbattn.experiments.report import other_setting, published_value

    assert files.portable_path("/home/me/data/wikitext-2") == "wikitext-2"
    assert files.portable_path("/") == "/"  # not "" (a `--out /` was recorded as '')
    run = tmp_path / "runs" / "gba"
    assert files.relative_path(run / "seed1", tmp_path) == "runs/gba/seed1"  # inside: relative to the base
    assert files.relative_path(run, run) == "runs/gba"  # the base itself: its last two parts, never "."
    assert files.portable_path("data/../../corpora/wikitext-2") == "wikitext-2"
    assert files.portable_path("data/wikitext-2") == "data/wikitext-2"
    # a trailing slash (tab completion) or ./: the folder that the path without them, or its absolute path, names
    # (a comparison recorded with --data splits/ refused --data splits and --data $PWD/splits/)
    assert files.portable_path("splits/") == files.portable_path("./splits") == "splits"
    assert files.portable_path("./data/wikitext-2/") == "data/wikitext-2"
    assert files.portable_path(str(tmp_path / "splits") + "/") == "splits"
    # a quoted ~ (the shell left it): a path of this machine's home, recorded by its last parts as the expanded one
    (tmp_path / "home" / "data").mkdir(parents=True)
    (tmp_path / "home" / "data" / "shake.txt").write_text("To be\n")
    with pytest.MonkeyPatch.context() as patched:
        patched.setenv("HOME", str(tmp_path / "home"))
        assert files.portable_path("~/data/shake.txt") == "data/shake.txt" == files.portable_path(
            str(tmp_path / "home" / "data" / "shake.txt"))
        assert files.portable_path("~/corpora") == "corpora"
    # cpu-char's own file by its absolute path: "input.txt" alone made the report say these runs trained on other
    # data than tiny-shakespeare, and leave out nanoGPT's published number.
    corpus = tmp_path / "tiny-shakespeare" / "input.txt"
    corpus.parent.mkdir()
    corpus.write_text("To be or not to be\n")
    assert files.portable_path(str(corpus)) == "tiny-shakespeare/input.txt"
    # a folder of a corpus's name is recorded as a path: its bare name is the corpus gbattn ships or fetches, and the
    # command run again trained on that (results.md's command, results.json's data, the run's corpus)
    from gbattn.data.corpus import load_corpus
    from gbattn.runtime import portable_argument

    assert files.portable_path("tiny-shakespeare") == "tiny-shakespeare"  # the name itself: the shipped corpus
    for given in ("./tiny-shakespeare", "tiny-shakespeare/", str(corpus.parent)):
        assert files.portable_path(given) == portable_argument(given) == "./tiny-shakespeare"
    assert files.portable_path("/srv/corpora/wikitext-2-v1/") == "./wikitext-2-v1"
    assert portable_argument("--data=./wikitext-103-raw-v1") == "--data=./wikitext-103-raw-v1"
    assert portable_argument("--data=tiny-shakespeare/") == "--data=./tiny-shakespeare"  # (the slash is a folder's)
    with pytest.MonkeyPatch.context() as patched:
        patched.chdir(tmp_path)
        (corpus.parent / "input.txt").rename(corpus.parent / "train.txt")
        for split in ("valid", "test"):
            (corpus.parent / f"{split}.txt").write_text(f"{split} text\n")
        assert load_corpus("./tiny-shakespeare").name == load_corpus("tiny-shakespeare/").name == "./tiny-shakespeare"
        assert load_corpus("tiny-shakespeare").name == "tiny-shakespeare"  # still the shipped one
        (corpus.parent / "train.txt").rename(corpus)
    report = {"recipe": "cpu-char", "description": "(2,000 steps)", "data": files.portable_path(str(corpus)),
              "sets": {}}
    assert other_setting(report) is None
    assert published_value(report, {"published": [6.55, None], "steps": 2000}) == [6.55, None]
    error = ValueError("x" * 100 + "\nsecond line")
    assert files.error_detail(error) == "x" * 79 + "…"
    assert files.error_detail(error, 5, with_type=True) == "ValueError: xxxx…"
    assert files.error_detail(ValueError("x" * 80)) == "x" * 80  # whole: no mark
    assert files.error_detail(ValueError()) == "malformed"
    assert files.error_detail(ValueError("first line\nsecond line")) == "first line"  # a short one too


@pytest.mark.parametrize("field, value, expected", [
    ("preset", "word", "preset='word' is not a preset gbattn has"),
    ("preset", "", "preset='' is not a preset gbattn has"),  # (--init-from trained on paper-small's recipe)
    ("train.device", "word", "device='word' is not allowed; choose auto, cpu, cuda, cuda:N"),
    ("train.device", "mps", "device='mps' is not allowed"),
    ("train.tokenizer", "word", "tokenizer='word' is not allowed; choose one of bpe, char"),
])
def test_a_config_json_naming_no_preset_device_or_tokenizer_gbattn_has_is_damaged(trained, tmp_path, capsys,
                                                                                 field, value, expected):
    """config.json's preset, device and tokenizer were free text: eval and generate took "word", resume refused it
    naming no file (as if --device had been typed), and --init-from copied tokenizer "word" into its new run."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = json.loads((run / rundir.CONFIG).read_text())
    section, _, key = field.rpartition(".")
    (config[section] if section else config)[key] = value
    (run / rundir.CONFIG).write_text(json.dumps(config))
    for argv in (["eval", run], ["generate", run, "--prompt", "a", "--max-new-tokens", "1"],
                 ["train", "--init-from", run, "--out", tmp_path / "new", "--data", trained["data"]]):
        code, out, err = run_cli(capsys, argv)
        assert code == 2 and err.startswith(f"gbattn: error: {run}") and expected in err, (argv, err)
    assert not (tmp_path / "new").exists()
