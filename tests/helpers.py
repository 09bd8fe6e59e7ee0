"""Helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import importlib.util
import random
import signal
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package), for a test of its functions."""
    spec = importlib.util.spec_from_file_location(name, REPOSITORY / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "far",
    "near",
    "house",
    "tree",
    "bird",
    "sang",
    "loud",
    "soft",
    "red",
    "blue",
    "green",
    "small",
    "big",
]


def write_text(path: Path, text: str) -> None:
    """``text`` to ``path``, gzip-compressed when its name ends in ``.gz``."""
    if path.name.lower().endswith(".gz"):
        import gzip

        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def write_corpus(directory: Path, lines_per_split=(600, 60, 60), seed=0) -> Path:
    """A small WikiText-layout corpus of random sentences, made here (no downloads)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in zip(("train", "valid", "test"), lines_per_split):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + " .\n" for _ in range(n)]
        (directory / f"wiki.{split}.tokens").write_text("".join(lines))
    return directory


# A Git LFS pointer (what a clone without Git LFS holds in place of a large file) and gbattn's line about one
LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n")
LFS_MESSAGE = "is a Git LFS pointer, not the file itself (cloned without Git LFS): run `git lfs pull`"

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "block_size": 33, "log_every": 1, "eval_batch_size": 16}


def stand_in_run(directory: Path) -> Path:
    """A folder that ``rundir.folder_holds`` reads as a run (a config.json and a checkpoint.pt), nothing loadable."""
    import json

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model": {}, "train": {}}))
    (directory / "checkpoint.pt").write_bytes(b"")
    return directory


def bpe_with_unknown_words(directory: Path):
    """A 60-token BPE tokenizer trained on a corpus that writes an unknown word as WikiText v1 does, ``<unk>``."""
    from gbattn.data.corpus import load_corpus
    from gbattn.data.tokenizer import get_tokenizer

    directory.mkdir()
    for split in ("train", "valid", "test"):
        # (valid and test shorter: a split holding the train file's very text is refused)
        (directory / f"{split}.txt").write_text("the cat sat on the <unk> mat\n" * (20 if split == "train" else 10))
    return get_tokenizer("bpe", load_corpus(str(directory)), vocab_size=60, verbose=False)


def give_run_tokenizer(run_dir: Path, record: dict) -> None:
    """Make ``record`` (a tokenizer file's ``kind`` and ``payload``) the tokenizer of the run in ``run_dir``, its
    fingerprint recorded in config.json too: a run trained with it, not a file swapped in (which loading refuses)."""
    import json

    from gbattn.data.tokenizer import Tokenizer

    (run_dir / "tokenizer.json").write_text(json.dumps(record))
    config = json.loads((run_dir / "config.json").read_text())
    config["data"]["tokenizer"] = Tokenizer.from_json(json.dumps(record)).fingerprint
    (run_dir / "config.json").write_text(json.dumps(config))


def tiny_configs(data, attn="boosted", **sets):
    """(model, train) configs of a tiny character-level run of ``paper-small`` on ``data`` (TINY's
    sizes, 12 steps, dropout 0.1); ``sets``: further ``--set`` values."""
    from gbattn.config import build_configs

    s = dict(TINY, tokenizer="char", batch_size=8, max_steps=12, eval_every=4, warmup_steps=3, lr=3e-3,
             dropout=0.1, train_tokens=None, eval_tokens=None)
    s.update(sets)
    return build_configs("paper-small", attn, str(data), s)


def left_pad(prompts, mask_dtype=None):
    """A left-padded batch of 1-D token tensors, padded with 0: (tokens (B, W), mask (B, W), True on real tokens;
    ``mask_dtype=torch.long`` for transformers' 1/0 ``attention_mask``)."""
    import torch

    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=mask_dtype or torch.bool)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):], mask[i, width - len(p):] = p, True
    return batch, mask


@contextlib.contextmanager
def killed_at(step: int, monkeypatch):
    """Every training inside stops with a simulated kill (RuntimeError "simulated kill") at the start of its
    ``step``, leaving whatever a killed run leaves; the trainer's step is restored afterwards."""
    from gbattn.train.trainer import Trainer

    original = Trainer._train_step

    def crash(self, s):
        if s == step:
            raise RuntimeError("simulated kill")
        return original(self, s)

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "_train_step", crash)
        yield


def train_killed_at(step: int, run_dir: Path, model_cfg, train_cfg, monkeypatch) -> None:
    """Train into ``run_dir`` until a simulated kill at the start of ``step`` (:func:`killed_at`)."""
    import pytest

    from gbattn.train.trainer import train

    with killed_at(step, monkeypatch), pytest.raises(RuntimeError, match="simulated kill"):
        train(run_dir, model_cfg, train_cfg, quiet=True)


def signal_during_step(step: int, monkeypatch, *signums: int) -> None:
    """Make the trainer send this process ``signums`` (default SIGINT: Ctrl-C) during its training step ``step``
    (0-based), as a user or a scheduler would while it trains."""
    import os
    import signal

    from gbattn.train.trainer import Trainer

    original = Trainer._train_step

    def signalled(self, s):
        if s == step:
            for signum in signums or (signal.SIGINT,):
                os.kill(os.getpid(), signum)
        return original(self, s)

    monkeypatch.setattr(Trainer, "_train_step", signalled)


def train_losses(run_dir: Path) -> list[float]:
    """The training losses a run logged, in order (metrics.jsonl)."""
    import json

    events = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [e["loss"] for e in events if e["event"] == "train"]


# Fields of result.json and metrics.jsonl that measure time, not the computation.
TIMING_FIELDS = {"elapsed", "tok_s", "wall_clock_s", "train_tokens_per_s"}


def run_record(run_dir: Path) -> tuple[dict, list[dict]]:
    """What a run computed, without its timings: (result.json, the metrics events other than a
    resume's or an interruption's own)."""
    import json

    def untimed(record: dict) -> dict:
        return {k: v for k, v in record.items() if k not in TIMING_FIELDS}

    result = untimed(json.loads((run_dir / "result.json").read_text()))
    result["curve"] = [untimed(p) for p in result["curve"]]
    events = [untimed(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, [e for e in events if e["event"] not in ("resume", "interrupted")]


def strict_json(text: str):
    """``json.loads`` that fails on NaN, Infinity and -Infinity (the project writes strict JSON: null instead)."""
    import json

    def refuse(constant: str):
        raise AssertionError(f"{constant} written into JSON: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def run_cli(capsys, argv) -> tuple[int, str, str]:
    """``gbattn ARGV`` in this process (arguments may be paths): exit status, stdout, stderr."""
    from gbattn.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def hold_lock(directory: Path, what: str = "run") -> subprocess.Popen:
    """Another process holding the directory's lock (gbattn.rundir.RunLock) until it is killed, writing ``what``."""
    code = (f"from gbattn.rundir import RunLock; import time; lock = RunLock({str(directory)!r}, {what!r}); "
            f"print('locked', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def in_use(directory: Path, what: str) -> list[str]:
    """The one line a command writing into ``directory`` while another process holds its lock (writing ``what``)
    prints."""
    return [f"gbattn: error: {directory} is in use by another gbattn process (its {what} is being written); wait "
            f"for it to finish or choose another --out"]


@contextlib.contextmanager
def fails_if_blocked(message: str, seconds: int = 10):
    """A test failing with ``message`` after ``seconds``, where a regression (a FIFO opened or read without a peer)
    would block and hang the suite."""
    import pytest

    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(message))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
