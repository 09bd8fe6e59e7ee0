"""Token ids as numpy memmaps, cached by (corpus content, tokenizer, caps) and reused by later
runs; and the batches the trainer and evaluator read from them.

Training reads either the paper's non-overlapping rows of ``seq_len + 1`` tokens, shuffled per
epoch (``rows``), or nanoGPT's random windows (``random``). Both are pure functions of
(seed, epoch or step), so a resumed run sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from gbattn.data.corpus import SPLITS, Corpus
from gbattn.data.tokenizer import Tokenizer, cache_dir, cut_before_spaces, refuse_unread_entry
from gbattn.errors import CheckpointError, DataError
from gbattn.files import FULL_DISK, building_suffix, read_json, remove_abandoned, write_json
from gbattn.progress import Progress

FLUSH_CHARS = 1 << 20  # characters encoded at a time, about (:func:`_encode_split`)


def tokens_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def encoded_lines(lines: Iterable[str], tokenizer: Tokenizer) -> Iterator[str]:
    """The lines of a text that a split's token ids hold: every tokenizer but char leaves blank lines (paragraph
    breaks) out (README, "Data")."""
    return (line for line in lines if tokenizer.kind == "char" or line.strip())


def _encode_split(corpus: Corpus, split: str, tokenizer: Tokenizer, cap: int | None, path: Path, progress: bool) -> int:
    """Stream-encode ``split`` into ``path`` (raw ids), stopping at ``cap`` tokens (0: the split is not read)."""
    dtype = tokens_dtype(tokenizer.vocab_size)
    if cap == 0:  # a split the caller does not need (tokenize_corpus)
        open(path, "wb").close()
        return 0
    n = 0
    bar = Progress(cap, desc=f"tokenizing {split}", unit="token", disable=not progress)
    with open(path, "wb") as f:
        batch: list[str] = []
        chars = 0

        def flush() -> bool:
            nonlocal n, chars
            try:
                ids = [i for seq in tokenizer.encode_batch(batch) for i in seq]
            except DataError as e:  # a char tokenizer given another corpus: name the text it cannot read
                raise DataError(f"{corpus.name} ({split} split): {e}") from None
            if cap is not None:
                ids = ids[: cap - n]
            f.write(np.asarray(ids, dtype=dtype).tobytes())  # tofile's OSError of a full disk holds no errno
            n += len(ids)
            bar.update(len(ids))
            batch.clear()
            chars = 0
            return cap is not None and n >= cap

        def pieces(lines: Iterable[str]) -> Iterator[str]:
            """A long line in pieces of about FLUSH_CHARS where that gives the same ids: a char tokenizer's anywhere
            (an id per character), gbattn's ``bpe`` before a space or tab (its Whitespace pre-tokenizer keeps no
            token across one). A file's tokenizer (its pre-tokenizer and normalizer unknown) encodes the line whole."""
            for line in lines:
                if tokenizer.kind == "char" and len(line) > FLUSH_CHARS:
                    yield from (line[i:i + FLUSH_CHARS] for i in range(0, len(line), FLUSH_CHARS))
                elif tokenizer.kind == "bpe" and len(line) > FLUSH_CHARS:
                    yield from cut_before_spaces(line, FLUSH_CHARS)
                else:
                    yield line

        # Batches of 4,096 lines or about FLUSH_CHARS characters: a corpus of one long line (text8, 100M characters)
        # was encoded whole before the cap cut its ids (a 50 MB line peaked at 1.09 GB with char, 392 MB now).
        for line in pieces(encoded_lines(corpus.lines(split), tokenizer)):
            batch.append(line)
            chars += len(line)
            if (len(batch) >= 4096 or chars >= FLUSH_CHARS) and flush():
                break
        else:
            if batch:
                flush()
    bar.close()
    return n


def _entry_key(corpus: Corpus, tokenizer: Tokenizer, caps: dict[str, int | None]) -> str:
    """What a token cache entry holds: ``corpus`` encoded by ``tokenizer`` with ``caps``. Its ``meta.json`` records
    it, checked on reading (an entry copied, swapped or linked into another's place was read as that one's tokens)."""
    # "lines-only": corpus lines encoded without special tokens (caches from before it may hold a start token per line).
    return f"{corpus.fingerprint}|{tokenizer.fingerprint}|{json.dumps(caps, sort_keys=True)}|lines-only"


def _entry_directory(key: str) -> Path:
    """The token cache entry of :func:`_entry_key` ``key``."""
    return cache_dir() / "tokens" / hashlib.sha256(key.encode()).hexdigest()[:20]


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: Tokenizer,
    caps: dict[str, int | None] | None = None,
    progress: bool = True,
    needed: tuple[str, ...] = SPLITS,
) -> dict[str, np.memmap]:
    """Token ids of every split as read-only memmaps (built once, then read from the cache).

    ``caps`` limits tokens per split (the paper: train 10M, valid/test 1M), taken from the start.
    ``needed``: the splits the caller reads (eval: the one it scores), the only ones checked in a cached entry. A cached
    entry of every split serves as it is; otherwise the others are not read, and empty in an entry of their own (their
    cap 0).
    """
    caps = {s: (caps or {}).get(s) for s in SPLITS}
    key = _entry_key(corpus, tokenizer, caps)
    directory = _entry_directory(key)
    dtype = np.dtype(tokens_dtype(tokenizer.vocab_size))
    cached = _cached(directory, dtype, tokenizer.vocab_size, key, needed)
    if cached is None and set(needed) != set(SPLITS):
        caps = {s: caps[s] if s in needed else 0 for s in SPLITS}
        key = _entry_key(corpus, tokenizer, caps)
        directory = _entry_directory(key)
        cached = _cached(directory, dtype, tokenizer.vocab_size, key, needed)
    if cached is not None:
        return cached
    remove_abandoned(directory.parent)
    tmp = directory.with_name(directory.name + building_suffix())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:  # "tokens" is a file, say
        raise DataError(f"could not write the token cache under {directory.parent} ({e.strerror or e}); delete what "
                        f"is there, or set GBATTN_CACHE to another directory") from None
    try:
        counts = {s: _encode_split(corpus, s, tokenizer, caps[s], tmp / f"{s}.bin", progress) for s in SPLITS}
        digests = {s: _ids_digest(_split_ids(tmp / f"{s}.bin", dtype, counts[s])) for s in SPLITS}
        meta = {"dtype": dtype.name, "counts": counts, "sha256": digests, "caps": caps, "corpus": corpus.name,
                "tokenizer": tokenizer.fingerprint, "key": key}
        write_json(meta, tmp / "meta.json")
    except BaseException as e:  # Ctrl-C, a bad file, a full disk: no half-written entry stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in FULL_DISK:
            raise DataError(f"could not write the token cache under {directory.parent} ({e.strerror}); free some "
                            f"space or set GBATTN_CACHE to another directory") from None
        raise
    try:
        os.replace(tmp, directory)
    except OSError:
        if not directory.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # Another process (another rank of a torchrun job) finished the same entry first: it stays, ours goes.
    shutil.rmtree(tmp, ignore_errors=True)
    cached = _read_cache(directory, dtype, tokenizer.vocab_size, key)
    if cached is None:
        raise DataError(f"the token cache {directory} cannot be read back after writing it; delete it and try again")
    return cached


def _cached(directory: Path, dtype: np.dtype, vocab_size: int, key: str,
            needed: tuple[str, ...] = SPLITS) -> dict[str, np.ndarray] | None:
    """The cache entry at ``directory`` (:func:`_read_cache`, its ``needed`` splits checked), or None: none there, or a
    damaged one, removed (its splits are built again), be it a folder, a file, a link (to nothing) or a pipe in the
    entry's place."""
    # (nothing there: nothing to remove; removing "it" anyway deleted another process's entry renamed into place
    # between the two)
    exists = directory.exists()
    if exists and directory.is_dir() and not all(os.access(path, os.R_OK) for path in (
            directory, *(directory / name for name in ("meta.json", *(f"{s}.bin" for s in SPLITS))
                         if (directory / name).exists()))):
        # (another user's entry in a shared cache, made under umask 077: it was encoded again, then "cannot be read
        # back after writing it; delete it", which this user cannot)
        raise DataError(f"the token cache entry {directory} cannot be read by this user (another user's, in a shared "
                        f"cache?): set GBATTN_CACHE to a directory of your own, or ask its owner to make it readable")
    cached = _read_cache(directory, dtype, vocab_size, key, needed) if exists else None
    if cached is None and (exists or directory.is_symlink()):
        if directory.is_dir() and not directory.is_symlink():
            shutil.rmtree(directory, ignore_errors=True)
        else:  # a file, a link, a FIFO (rmtree opened it, and waited for a writer forever)
            directory.unlink(missing_ok=True)
    return cached


def _split_ids(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """A split's cached ids as a read-only memmap (an empty array for none)."""
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype=dtype)


def _ids_digest(ids: np.ndarray) -> str:
    """SHA-256 of a split's cached ids, as ``meta.json`` records it."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(ids)).cast("B")).hexdigest()


def _read_cache(directory: Path, dtype: np.dtype, vocab_size: int, key: str,
                needed: tuple[str, ...] = SPLITS) -> dict[str, np.ndarray] | None:
    """The token ids of a cache entry as read-only memmaps, or None when the entry is damaged: its
    ``meta.json`` unreadable, not what this module writes, or of another entry (its ``key``), a split's file not
    of the size it records or, for the ``needed`` splits, not the content (SHA-256) it records (an entry from before
    digests were recorded is built again), or an id outside the tokenizer's vocabulary (the model would fail on it
    mid-run with a traceback, or read another token's row on a GPU, which does not check). Two passes over the ids:
    the digest, then the range. The other splits are not read (`eval` of a test split hashed the whole training
    split: 54M ids for 1.3M scored); a caller that needs them asks again, and checks them then."""
    try:
        meta = read_json(directory / "meta.json")
        if meta["dtype"] != dtype.name or meta.get("key") != key:  # (an entry from before keys were recorded: built
            return None  # again)
        out = {}
        for s in SPLITS:
            count, path = meta["counts"][s], directory / f"{s}.bin"
            if type(count) is not int or count < 0 or path.stat().st_size != count * dtype.itemsize:
                return None
            out[s] = _split_ids(path, dtype, count)
            if s not in needed:
                continue
            if _ids_digest(out[s]) != meta["sha256"][s] or (count and int(out[s].max()) >= vocab_size):
                return None
        return out
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:  # read_json: any unreadable meta.json
        # What ran out is no damage: a good entry was deleted and built again (`ulimit -n`), then "cannot be read back
        # after writing it"
        refuse_unread_entry(e, f"the token cache entry {directory}")
        return None


# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------


def num_rows(tokens: np.ndarray, seq_len: int) -> int:
    """Non-overlapping rows of ``seq_len + 1`` tokens (inputs and targets shifted by one)."""
    return len(tokens) // (seq_len + 1)


def rows_batch(tokens: np.ndarray, seq_len: int, row_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``row_ids`` as (inputs, targets), each (len(row_ids), seq_len) int64."""
    L = seq_len + 1
    data = np.stack([np.asarray(tokens[r * L : (r + 1) * L], dtype=np.int64) for r in row_ids])
    data_t = torch.from_numpy(data)
    return data_t[:, :-1], data_t[:, 1:]


def epoch_permutation(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of an epoch: a pure function of (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def random_windows(
    tokens: np.ndarray, seq_len: int, batch: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's sampling: ``batch`` windows at random offsets; a pure function of (seed, step).
    Offsets are drawn from 0 .. N - seq_len - 2, one fewer than nanoGPT's: the window ending at the
    last token is never drawn (docs/deviations.md, section 7; kept so published tables reproduce)."""
    offsets = np.random.default_rng([seed, step, 1]).integers(0, len(tokens) - seq_len - 1, size=batch)
    data = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])
    data_t = torch.from_numpy(data)
    return data_t[:, :-1], data_t[:, 1:]
