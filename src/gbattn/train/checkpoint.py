"""Run directories and checkpoints.

A run directory describes itself::

    config.json      model config, training config, data and tokenizer reference, versions
    tokenizer.json   the tokenizer (so a run directory alone can encode and decode text)
    checkpoint.pt    latest state: weights, optimizer, step, RNG states, best validation so far
    best.pt          weights of the best-validation model
    metrics.jsonl    one JSON event per line (train, eval, test, resume, stop)
    result.json      the final record (written last: its presence means "finished")

Every file is written to a temporary name and renamed, so a crash mid-write leaves the
previous file intact; a truncated or corrupted checkpoint gives a :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from gbattn.errors import CheckpointError

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"
METRICS = "metrics.jsonl"
RESULT = "result.json"


def atomic_torch_save(obj: Any, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_json(obj: Any, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint file, turning a missing, truncated or corrupted file into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupted ({type(e).__name__}: {str(e).splitlines()[0][:100]}); "
            f"delete it to start over, or restore a copy"
        ) from None
    if not isinstance(obj, dict) or "model" not in obj:
        raise CheckpointError(f"checkpoint {path} is not a gbattn checkpoint (no model weights in it)")
    return obj


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found: is {path.parent} a gbattn run directory?")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupted ({e})") from None


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return out


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop events logged after the checkpoint's step (they will be logged again)."""
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step and r.get("event") != "stop"]
    tmp = Path(str(path) + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
