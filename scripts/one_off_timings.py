"""The README's one-off timings behind four design choices, measured again on this machine.

    python scripts/one_off_timings.py [--repeats 2] [--hub]

Prints, for each, the seconds of each repeat:

- ``token digest``: the SHA-256 that checks a token cache entry at every open (``data/tokens.py``), over 100M ids
  of uint16;
- ``checkpoint CRC``: the CRC-32 check of a checkpoint's records (``rundir.py``) against ``torch.load`` itself, for a
  512 MiB checkpoint of float32 tensors already in the page cache;
- ``fresh zeros``: a fresh 128 MB ``torch.zeros`` against zeroing the same tensor in place (why the loss is chunked);
- ``hub retries`` (with ``--hub``, on a machine whose hub host has no address): how long the hub's client takes to
  fail when not told it is offline, against ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gbattn.data.tokens import _ids_digest
from gbattn.rundir import _check_records

IDS = 100_000_000  # token ids hashed
MATRICES = 128  # 4 MiB tensors in the checkpoint
ZEROS = 32 * 1024 * 1024  # float32 elements allocated


def seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def timed(name: str, function, repeats: int) -> None:
    print(f"{name}: " + ", ".join(f"{seconds(function):.3f} s" for _ in range(repeats)), flush=True)


def hub_failure_seconds(offline: bool) -> float:
    """Seconds for a fresh process to fail to fetch a hub file, told it is offline or not."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = ("import time, huggingface_hub as h; s = time.perf_counter()\n"
            "try: h.hf_hub_download('Salesforce/wikitext', 'README.md', repo_type='dataset')\n"
            "except Exception: pass\n"
            "print(time.perf_counter() - s)")
    with tempfile.TemporaryDirectory() as cache:
        env["HF_HOME"] = cache  # (an empty cache: nothing to answer from)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hub", action="store_true", help="also time the hub's client failing (needs no network)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")

    ids = np.random.default_rng(0).integers(0, 2**16, IDS, dtype=np.uint16)
    timed(f"token digest, {IDS:,} uint16 ids", lambda: _ids_digest(ids), args.repeats)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        torch.save({f"w{i}": torch.randn(1024, 1024) for i in range(MATRICES)}, path)
        path.read_bytes()  # in the page cache
        timed(f"checkpoint CRC check, {4 * MATRICES} MiB", lambda: _check_records(path), args.repeats)
        timed("torch.load of it", lambda: torch.load(path, weights_only=True), args.repeats)

    timed(f"fresh torch.zeros, {4 * ZEROS / 2**20:.0f} MiB", lambda: torch.zeros(ZEROS), args.repeats)
    tensor = torch.zeros(ZEROS)
    timed("zero_ of the same tensor in place", tensor.zero_, args.repeats)

    if args.hub:
        print("hub failure, not offline: " + ", ".join(f"{hub_failure_seconds(False):.1f} s"
                                                     for _ in range(args.repeats)))
        print("hub failure, HF_HUB_OFFLINE=1: " + ", ".join(f"{hub_failure_seconds(True):.1f} s"
                                                          for _ in range(args.repeats)))


if __name__ == "__main__":
    main()
