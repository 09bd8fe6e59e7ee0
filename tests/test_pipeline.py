"""Language-modelling pipeline: data caches, trainer, resume, DDP, checkpoints, NaN stop, eval."""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import errno
import gzip
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gbattn import files
from gbattn import rundir as ckpt
from gbattn.cli import main as cli_main
from gbattn.data import corpus as corpus_mod
from gbattn.data import tokenizer as tokenizer_mod
from gbattn.data.corpus import NO_TEST_SPLIT, load_corpus
from gbattn.data.tokenizer import Tokenizer, get_tokenizer
from gbattn.data.tokens import tokenize_corpus
from gbattn.errors import CheckpointError, ConfigError, DataError, Interrupted, UserError
from gbattn.model.params import flops_per_token
from gbattn.runtime import device_name
from gbattn.train.trainer import Trainer, TrainingDiverged, train
from helpers import (
    TINY,
    bpe_with_unknown_words,
    fails_if_blocked,
    run_cli,
    run_record,
    signal_during_step,
    tiny_configs,
    train_killed_at,
    train_losses,
    write_corpus,
    write_text,
)


def final_weights(run_dir: Path) -> dict:
    return ckpt.load_checkpoint(run_dir / ckpt.CHECKPOINT)["model"]


# ---- data --------------------------------------------------------------------------------


def test_tokenizer_is_trained_once_and_cached(tmp_path, monkeypatch):
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    first = get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    monkeypatch.setattr(tokenizer_mod, "_train_bpe", lambda *a, **k: pytest.fail("retrained instead of cached"))
    second = get_tokenizer("bpe", load_corpus(str(tmp_path / "c")), vocab_size=120, verbose=False)
    assert second.fingerprint == first.fingerprint
    # A different corpus content is a different cache entry.
    write_corpus(tmp_path / "c2", seed=1)
    with pytest.raises(pytest.fail.Exception):
        get_tokenizer("bpe", load_corpus(str(tmp_path / "c2")), vocab_size=120, verbose=False)


def test_a_long_training_line_trains_the_bpe_in_pieces_cut_before_spaces(tmp_path, monkeypatch):
    """The BPE trained on a corpus of one long line took it whole (most of a 10 MB line's 1.9 GB peak): it is fed in
    pieces of TRAIN_PIECE_CHARS cut before spaces, which hold the same words, so the tokenizer is the one the whole
    line trains."""
    line = " ".join(["alpha", "beta", "gamma", "delta", "alphabet"] * 60)
    (tmp_path / "c").mkdir()
    write_text(tmp_path / "c" / "train.txt", line + "\n")
    write_text(tmp_path / "c" / "valid.txt", "beta gamma\n")
    write_text(tmp_path / "c" / "test.txt", "delta alpha\n")
    whole = tokenizer_mod._train_bpe([line + "\n"], 60)
    monkeypatch.setattr(tokenizer_mod, "TRAIN_PIECE_CHARS", 50)
    fed, real = [], tokenizer_mod._train_bpe
    monkeypatch.setattr(tokenizer_mod, "_train_bpe", lambda lines, size: real(fed.extend(lines) or fed, size))
    tok = get_tokenizer("bpe", load_corpus(str(tmp_path / "c")), vocab_size=60, verbose=False)
    assert max(map(len, fed)) <= 50 and "".join(fed) == line + "\n"
    assert tok.payload == whole


def test_corpus_lines_get_no_special_tokens_from_a_post_processor(tmp_path):
    """A Llama-style tokenizer (an upcycled model's) adds a start token to what it encodes: a prompt
    keeps it, but the corpus's lines do not get one each."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    text = "".join(f"to be or not {i % 7}\n" for i in range(200))
    (tmp_path / "t.txt").write_text(text)
    corpus = load_corpus(str(tmp_path / "t.txt"), (0.8, 0.1, 0.1))
    vocab = {"<s>": 0, **{c: i + 1 for i, c in enumerate(sorted(set(text)))}}
    backend = Backend(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = Tokenizer("hf", backend.to_str())
    assert tok.encode("to be") == [0, *(vocab[c] for c in "to be")]
    splits = tokenize_corpus(corpus, tok, progress=False)
    assert all(0 not in splits[s] for s in splits)
    characters = sum(len(line) for s in splits for line in corpus.lines(s) if line.strip())
    assert sum(len(splits[s]) for s in splits) == characters
    # A template that also ends the text (BERT's "[CLS] $A [SEP]"): a prompt keeps the start, not the end, after
    # which generation went on; an empty text too, as the exported tokenizer encodes it (it kept both)
    backend.add_special_tokens(["</s>"])
    end = backend.token_to_id("</s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 0), ("</s>", end)])
    tok = Tokenizer("hf", backend.to_str())
    assert tok.encode("to be") == [0, *(vocab[c] for c in "to be")]
    assert tok.encode("") == [0]


def test_token_memmap_round_trip_and_reuse(tmp_path, monkeypatch):
    text = "".join(f"line {i}: to be or not to be\n" for i in range(300))
    (tmp_path / "t.txt").write_text(text)
    corpus = load_corpus(str(tmp_path / "t.txt"), (0.8, 0.1, 0.1))
    tok = get_tokenizer("char", corpus)
    splits = tokenize_corpus(corpus, tok, progress=False)
    assert isinstance(splits["train"], np.memmap) and splits["train"].dtype == np.uint16
    assert tok.decode(splits["train"]) + tok.decode(splits["valid"]) + tok.decode(splits["test"]) == text
    from gbattn.data import tokens as tokens_mod

    monkeypatch.setattr(tokens_mod, "_encode_split", lambda *a, **k: pytest.fail("re-encoded instead of cached"))
    again = tokenize_corpus(corpus, tok, progress=False)
    for s in splits:
        np.testing.assert_array_equal(again[s], splits[s])


def _damage_meta(entry: Path) -> None:
    (entry / "meta.json").write_text("{ not json")


def _damage_meta_type(entry: Path) -> None:
    (entry / "meta.json").write_text("[1, 2]")


def _damage_count(entry: Path) -> None:  # a count larger than its file: the memmap would read past the end
    meta = json.loads((entry / "meta.json").read_text())
    meta["counts"]["train"] += 1000
    (entry / "meta.json").write_text(json.dumps(meta))


def _damage_size(entry: Path) -> None:  # a file cut short (a full disk, a kill while copying the cache)
    path = entry / "train.bin"
    path.write_bytes(path.read_bytes()[:-10])


def _damage_appended(entry: Path) -> None:  # bytes past the ids it records (two copies written into one file)
    path = entry / "train.bin"
    path.write_bytes(path.read_bytes() * 2)


def _damage_missing(entry: Path) -> None:
    (entry / "valid.bin").unlink()


def _damage_content(entry: Path) -> None:  # ids still in the vocabulary, of the right size, but not the corpus's
    path = entry / "train.bin"
    path.write_bytes(bytes(path.stat().st_size))


def _damage_one_id(entry: Path) -> None:  # one id changed to another of the vocabulary (a flipped bit)
    meta = json.loads((entry / "meta.json").read_text())
    path = entry / "train.bin"
    ids = np.fromfile(path, dtype=meta["dtype"])
    ids[0] = next(i for i in ids if i != ids[0])
    ids.tofile(path)


def _damage_no_digest(entry: Path) -> None:  # an entry from before digests were recorded: it cannot be checked
    meta = json.loads((entry / "meta.json").read_text())
    del meta["sha256"]
    (entry / "meta.json").write_text(json.dumps(meta))


def _damage_counts_type(entry: Path) -> None:  # counts a list, not a mapping of splits
    meta = json.loads((entry / "meta.json").read_text())
    meta["counts"] = list(meta["counts"].values())
    (entry / "meta.json").write_text(json.dumps(meta))


def _damage_out_of_vocabulary(entry: Path) -> None:  # one id just past the vocabulary, its digest recorded to match
    import hashlib

    meta = json.loads((entry / "meta.json").read_text())
    vocab = 1 + max(int(np.fromfile(entry / f"{s}.bin", dtype=meta["dtype"]).max()) for s in meta["counts"])
    path = entry / "train.bin"
    ids = np.fromfile(path, dtype=meta["dtype"])
    ids[0] = vocab  # (a char tokenizer's every id occurs in some split: the largest is vocab_size - 1)
    ids.tofile(path)
    meta["sha256"]["train"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (entry / "meta.json").write_text(json.dumps(meta))


def _damage_replaced_by_a_file(entry: Path) -> None:
    shutil.rmtree(entry)
    entry.write_text("not a cache entry")


def _damage_replaced_by_a_link_to_nothing(entry: Path) -> None:  # a cache folder moved away, its link left behind
    shutil.rmtree(entry)
    entry.symlink_to(entry.parent / "moved")


def _damage_replaced_by_a_pipe(entry: Path) -> None:  # removing it opened it first, and waited for a writer forever
    shutil.rmtree(entry)
    os.mkfifo(entry)


@pytest.mark.parametrize("damage", [_damage_meta, _damage_meta_type, _damage_count, _damage_size, _damage_appended,
                                    _damage_missing,
                                    _damage_content, _damage_one_id, _damage_no_digest, _damage_out_of_vocabulary,
                                    _damage_counts_type, _damage_replaced_by_a_file,
                                    _damage_replaced_by_a_link_to_nothing, _damage_replaced_by_a_pipe])
def test_a_damaged_token_cache_entry_is_rebuilt(tmp_path, damage):
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    splits = {s: np.array(ids) for s, ids in tokenize_corpus(corpus, tok, progress=False).items()}
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokens").iterdir()
    damage(entry)
    with fails_if_blocked("removing a pipe in the entry's place blocked", 60):  # (it hung the run forever)
        again = tokenize_corpus(corpus, tok, progress=False)
    for s in splits:
        np.testing.assert_array_equal(again[s], splits[s])
    meta = json.loads((entry / "meta.json").read_text())  # the entry built again, digests and all
    assert meta["counts"] == {s: len(v) for s, v in splits.items()} and set(meta["sha256"]) == set(splits)
    assert {s: (entry / f"{s}.bin").stat().st_size for s in splits} == {s: v.nbytes for s, v in splits.items()}


@pytest.mark.parametrize("where", ["meta", "split"])
@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENOMEM, errno.EIO])
def test_a_token_cache_entry_that_cannot_be_read_for_want_of_resources_is_kept(tmp_path, monkeypatch, where, err):
    """Too many open files (`ulimit -n`), no memory to map a split, an I/O error: the good entry was taken for damaged,
    deleted and built again, then "cannot be read back after writing it; delete it". It is one line saying what
    failed, and the entry stays as it was."""
    from gbattn.data import tokens as tokens_mod

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    tokenize_corpus(corpus, tok, progress=False)
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokens").iterdir()
    before = {p.name: p.read_bytes() for p in entry.iterdir()}

    def failing_split(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    def failing_meta(path):
        raise _wrapped(err, path)

    monkeypatch.setattr(tokens_mod, *(("read_json", failing_meta) if where == "meta" else ("_split_ids",
                                                                                            failing_split)))
    with pytest.raises(DataError, match=rf"^the token cache entry .* could not be read \({os.strerror(err)}\); it is "
                                        rf"kept: free what ran out \(open files, memory\) and run again$"):
        tokenize_corpus(corpus, tok, progress=False)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before


def test_a_tokenizer_cache_entry_that_cannot_be_read_for_want_of_resources_is_kept(tmp_path, monkeypatch):
    """The tokenizer cache's sibling of the token cache's: a good entry unread for want of files (`ulimit -n`) was taken
    for damaged, deleted and trained again; it is one line, and the entry stays."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokenizers").iterdir()
    before = entry.read_bytes()

    def failing(path):
        raise _wrapped(errno.EMFILE, path)

    monkeypatch.setattr(tokenizer_mod, "read_json_bytes", failing)
    with pytest.raises(DataError, match=r"^the tokenizer cache entry .* could not be read \(Too many open files\); "
                                        r"it is kept: free what ran out"):
        get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    monkeypatch.undo()
    assert entry.read_bytes() == before


def _wrapped(err: int, path) -> CheckpointError:
    """read_json's error for a file it could not read: a CheckpointError whose context is the OSError."""
    try:
        try:
            raise OSError(err, os.strerror(err))
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    except CheckpointError as wrapped:
        return wrapped


def test_a_cached_entry_checks_only_the_splits_asked_for(tmp_path, monkeypatch):
    """Scoring the test split (eval, analyze) hashed and range-checked every split of a cached entry, the training
    split too (54M ids to score 1.3M). Only the splits asked for are read: one of another split, damaged, serves a
    test score, and is found and built again once that split is asked for (training)."""
    from gbattn.data import tokens as tokens_mod

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    splits = {s: np.array(ids) for s, ids in tokenize_corpus(corpus, tok, progress=False).items()}
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokens").iterdir()
    _damage_one_id(entry)
    hashed, digest = [], tokens_mod._ids_digest
    monkeypatch.setattr(tokens_mod, "_ids_digest", lambda ids: hashed.append(len(ids)) or digest(ids))
    test = tokenize_corpus(corpus, tok, progress=False, needed=("test",))["test"]
    np.testing.assert_array_equal(test, splits["test"])
    assert hashed == [len(splits["test"])]  # the test split's ids alone
    again = tokenize_corpus(corpus, tok, progress=False)  # every split: the damaged one found and built again
    np.testing.assert_array_equal(again["train"], splits["train"])
    assert len(hashed) > 1


def test_a_token_cache_entry_finished_by_another_process_at_the_same_moment_is_taken(tmp_path, monkeypatch):
    """Two processes (every rank of a torchrun job) build the same entry; one renames its copy into
    place just after the other checked it was absent: the later one takes the entry, no error, no debris."""
    from gbattn.data import tokens as tokens_mod

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    expected = {s: np.array(ids) for s, ids in tokenize_corpus(corpus, tok, progress=False).items()}
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokens").iterdir()
    finished = tmp_path / "finished-by-the-other-process"
    entry.rename(finished)
    real_replace = os.replace

    def other_process_first(src, dst):
        if Path(dst) == entry and not entry.exists():  # the other process's rename lands between the check and ours
            real_replace(finished, dst)
        real_replace(src, dst)

    monkeypatch.setattr(tokens_mod.os, "replace", other_process_first)
    again = tokenize_corpus(corpus, tok, progress=False)
    for s in expected:
        np.testing.assert_array_equal(again[s], expected[s])
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    # A rename that fails with no entry in its place (no other process finished it) is raised, its build folder gone
    shutil.rmtree(entry)

    def refused(src, dst):  # the entry's rename only (meta.json is written by a rename too)
        if Path(dst) == entry:
            raise PermissionError(13, "Permission denied")
        real_replace(src, dst)

    monkeypatch.setattr(tokens_mod.os, "replace", refused)
    with pytest.raises(PermissionError):
        tokenize_corpus(corpus, tok, progress=False)
    assert list(entry.parent.iterdir()) == []


def test_an_absent_token_cache_entry_is_not_removed_under_a_process_renaming_it_into_place(tmp_path, monkeypatch):
    """Finding no entry, a process removed "it" anyway: another process's entry renamed into place between the check
    and the removal was deleted, and that process failed ("cannot be read back after writing it"). Now only an
    entry that is there and damaged is removed."""
    from gbattn.data import tokens as tokens_mod

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    tokenize_corpus(corpus, tok, progress=False)
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokens").iterdir()
    finished = tmp_path / "finished-by-the-other-process"
    entry.rename(finished)
    real_exists = Path.exists

    def lands_after_the_check(path, *args, **kwargs):  # the other process's rename lands just after the check
        there = real_exists(path, *args, **kwargs)
        if path == entry and not there and real_exists(finished):
            finished.rename(entry)
        return there

    monkeypatch.setattr(Path, "exists", lands_after_the_check)
    dtype = np.dtype(tokens_mod.tokens_dtype(tok.vocab_size))
    key = tokens_mod._entry_key(corpus, tok, dict.fromkeys(("train", "valid", "test")))
    assert tokens_mod._cached(entry, dtype, tok.vocab_size, key) is None  # absent when looked at ...
    monkeypatch.setattr(Path, "exists", real_exists)
    assert tokens_mod._cached(entry, dtype, tok.vocab_size, key) is not None  # ... and the other process's entry kept


def test_a_tokenizer_cache_entry_another_process_writes_meanwhile_is_not_called_something_else(tmp_path,
                                                                                               monkeypatch):
    """A tokenizer cache entry written by another process just after this one found none was "something other than a
    file is there" (a DataError, the run ended): it is a file, and this process trains and writes its own."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    expected = get_tokenizer("char", corpus)
    (entry,) = (Path(os.environ["GBATTN_CACHE"]) / "tokenizers").iterdir()
    written = entry.read_bytes()
    entry.unlink()
    real_is_file, calls = Path.is_file, []

    def written_just_after_the_first_check(path):
        there = real_is_file(path)
        if path == entry and not calls:
            calls.append(path)
            entry.write_bytes(written)  # the other process's atomic write lands now
        return there

    monkeypatch.setattr(Path, "is_file", written_just_after_the_first_check)
    assert get_tokenizer("char", corpus).fingerprint == expected.fingerprint and entry.read_bytes() == written


def test_a_token_cache_entry_that_cannot_be_read_back_is_one_data_error(tmp_path, monkeypatch):
    """An entry written but not readable after its rename (a file system losing writes) is one line saying so."""
    from gbattn.data import tokens as tokens_mod

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    monkeypatch.setattr(tokens_mod, "_read_cache", lambda *args: None)
    with pytest.raises(DataError, match="cannot be read back after writing it; delete it and try again$"):
        tokenize_corpus(corpus, tok, progress=False)


def test_the_token_ids_handed_out_are_read_only(tmp_path):
    """The splits tokenize_corpus hands out, built or read from the cache, cannot be written: a write through a
    writable memmap would change the cache entry every later run reads."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    for splits in (tokenize_corpus(corpus, tok, progress=False), tokenize_corpus(corpus, tok, progress=False)):
        assert all(len(ids) for ids in splits.values())
        for ids in splits.values():
            with pytest.raises(ValueError, match="read-only"):
                ids[0] = 0


def test_caps_take_the_first_tokens(tmp_path):
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    full = tokenize_corpus(corpus, tok, progress=False)
    capped = tokenize_corpus(corpus, tok, {"train": 1000, "valid": 100, "test": 100}, progress=False)
    assert len(capped["train"]) == 1000 and len(capped["valid"]) == 100
    np.testing.assert_array_equal(capped["train"], full["train"][:1000])


def test_a_cap_stops_reading_its_split_once_reached(tmp_path, monkeypatch):
    """The paper caps WikiText-103's training split (100M+ tokens) at 10M: tokenizing stops after the batch
    of lines that reaches the cap, not after reading (and dropping) the rest of the split."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c", lines_per_split=(9000, 60, 60))))
    tok = get_tokenizer("char", corpus)
    read, lines = [], corpus.lines

    def counted(split):
        for line in lines(split):
            read.append(split)
            yield line

    monkeypatch.setattr(corpus, "lines", counted)
    capped = tokenize_corpus(corpus, tok, {"train": 1000}, progress=False)
    assert len(capped["train"]) == 1000 and read.count("valid") == 60
    assert read.count("train") < 9000


def test_the_token_cache_is_keyed_by_the_tokenizer_and_the_corpus_content(tmp_path, monkeypatch):
    """An entry built with one tokenizer is not read for another; a corpus rewritten in place (same
    path, same characters, other text) is tokenized again: each equals a build in an empty cache."""
    def fresh(corpus, tok):
        monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / f"fresh{len(list(tmp_path.iterdir()))}"))
        out = {s: np.array(v) for s, v in tokenize_corpus(corpus, tok, progress=False).items()}
        monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "shared"))
        return out

    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "shared"))
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    char = get_tokenizer("char", corpus)
    bpe = get_tokenizer("bpe", corpus, vocab_size=60, verbose=False)
    tokenize_corpus(corpus, char, progress=False)
    again = load_corpus(str(write_corpus(tmp_path / "c", seed=1)))
    assert get_tokenizer("char", again).fingerprint == char.fingerprint
    for corp, tok in ((corpus, bpe), (again, char)):
        got, expected = tokenize_corpus(corp, tok, progress=False), fresh(corp, tok)
        for s in expected:
            np.testing.assert_array_equal(got[s], expected[s])


def test_rows_and_random_windows_are_the_tokens_they_name_and_pure_functions_of_the_seed():
    """Rows of seq_len + 1 tokens do not overlap (the tokens left over make no row); an epoch's order and
    a step's windows depend on the seed and on the epoch or step; a window never ends at the last token."""
    from gbattn.data.tokens import epoch_permutation, num_rows, random_windows, rows_batch

    tokens = np.arange(3 * 9 + 5, dtype=np.uint16)
    assert num_rows(tokens, 8) == 3
    x, y = rows_batch(tokens, 8, np.array([2, 0]))
    assert x.tolist() == [list(range(18, 26)), list(range(0, 8))] and y.tolist() == [list(range(19, 27)),
                                                                                      list(range(1, 9))]
    orders = {tuple(epoch_permutation(50, seed, epoch)) for seed in (0, 1) for epoch in (0, 1)}
    assert len(orders) == 4 and all(sorted(o) == list(range(50)) for o in orders)
    np.testing.assert_array_equal(epoch_permutation(50, 3, 2), epoch_permutation(50, 3, 2))
    long = np.arange(1000, dtype=np.uint16)
    draws = {(seed, step): random_windows(long, 8, 4, seed, step) for seed in (0, 1) for step in (0, 1)}
    assert len({tuple(x[:, 0].tolist()) for x, _ in draws.values()}) == 4
    assert torch.equal(random_windows(long, 8, 4, 1, 1)[0], draws[1, 1][0])
    x, y = draws[0, 0]
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    # the draws themselves, pinned: another random stream would train published runs on other batches
    assert x[:, 0].tolist() == [881, 445, 24, 387]
    assert epoch_permutation(10, 0, 0).tolist() == [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]
    short = np.arange(8 + 3, dtype=np.uint16)  # offsets 0 and 1; 2 would end at the last token
    starts = {int(s) for step in range(50) for s in random_windows(short, 8, 4, 0, step)[0][:, 0]}
    assert starts == {0, 1}


def test_resume_truncates_the_metrics_after_the_checkpoints_step(tmp_path):
    """Events up to and including the checkpoint's step stay; later ones, every stop and test event
    (a run killed writing its result tests again) and a line whose step is not an integer (a bool, a
    string) go."""
    path = tmp_path / ckpt.METRICS
    events = [{"event": "train", "step": 1}, {"event": "eval", "step": 3}, {"event": "stop", "step": 2},
              {"event": "test", "step": 3},
              {"event": "train", "step": 4}, {"event": "train", "step": True}, {"event": "train", "step": "2"},
              {"event": "resume"}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    ckpt.truncate_metrics(path, 3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [events[0], events[1], events[7]]


def test_eval_reads_only_the_split_it_scores(tmp_path, capsys):
    """eval --split valid read and checked the test split too: a character a char tokenizer lacks, anywhere in the
    split not asked for, refused the command, naming that split."""
    text = "".join(f"line {i % 17}: to be or not to be\n" for i in range(400))
    (tmp_path / "t.txt").write_text(text)
    assert cli_main(["train", "--preset", "cpu-char", "--data", str(tmp_path / "t.txt"), "--out", str(tmp_path / "run"),
                     "--threads", "1", "--quiet", "--set", "max_steps=2", "--set", "eval_every=2", "--set",
                     "d_model=32", "--set", "split=[0.8,0.1,0.1]"]) == 0
    (tmp_path / "other.txt").write_text(text[:-3] + "é" + text[-2:])  # in the test split only (the file's end)
    capsys.readouterr()
    argv = ["eval", str(tmp_path / "run"), "--data", str(tmp_path / "other.txt"), "--allow-other-data", "--threads",
            "1"]
    assert cli_main([*argv, "--split", "valid"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("valid perplexity ")
    assert cli_main([*argv, "--split", "test"]) == 2
    assert "(test split): characters not in the tokenizer's vocabulary: ['é']" in capsys.readouterr().err


def test_eval_tokenizes_the_held_out_splits_only_with_the_runs_own_tokenizer(tmp_path, monkeypatch, capsys):
    """gbattn eval (and analyze) score valid or test, but tokenized the training split too (most of a corpus) where
    no token cache entry of the run's data was at hand (a run evaluated on another machine). The training split is
    now not read, unless an entry of every split is cached (after training), which serves as it is; the tokenizer
    is the run's own, from its directory (none is trained or cached)."""
    from gbattn.data.corpus import Corpus

    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    argv = ["eval", str(tmp_path / "run"), "--data", str(data), "--device", "cpu"]
    read, lines = [], Corpus.lines
    monkeypatch.setattr(Corpus, "lines", lambda self, split: read.append(split) or lines(self, split))
    assert cli_main(argv) == 0 and read == []  # training's entry serves (the first eval builds no entry of its own)
    expected = capsys.readouterr().out
    assert cli_main(argv) == 0 and capsys.readouterr().out == expected and read == []
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "elsewhere"))  # another machine's cache: no entry
    assert cli_main(argv) == 0 and capsys.readouterr().out == expected
    assert cli_main([*argv, "--split", "valid"]) == 0 and capsys.readouterr().out.startswith("valid perplexity ")
    assert read == ["test", "valid"]  # each split once, as it is scored (the other split is not read)
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["tokens"]  # no tokenizer trained here


def test_a_killed_tokenizer_caching_leaves_no_temporary_file_behind_the_next_one(tmp_path):
    """Killed between writing a tokenizer cache entry's temporary file and renaming it, a process left
    NAME.json.tmp<pid> in the cache for good. The temporary name now holds the host (atomic_write), and the
    next tokenizer cached removes those of this host's dead processes; a live process's, another host's and
    files not named as ours stay."""
    import socket

    from gbattn.data.tokenizer import cache_dir
    from gbattn.files import building_suffix

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    killed = subprocess.Popen([sys.executable, "-c", f"""
import os
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import get_tokenizer
os.replace = lambda *names: os._exit(137)  # killed between writing the temporary file and renaming it
get_tokenizer("char", load_corpus({str(tmp_path / "c")!r}), verbose=False)
"""], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    killed.wait()
    folder = cache_dir() / "tokenizers"
    left = [p.name for p in folder.iterdir()]
    assert killed.returncode == 137 and len(left) == 1 and left[0].endswith(f".tmp{killed.pid}@{socket.gethostname()}")
    kept = [f"char-x.json{building_suffix()}", f"char-x.json.tmp{killed.pid}@elsewhere", "notes.tmpfile",
            f"char-x.json.tmp{killed.pid}"]  # a live process's; another host's; not ours; no host named: kept
    for name in kept:
        (folder / name).write_text("")
    assert get_tokenizer("char", corpus, verbose=False).kind == "char"
    assert sorted(p.name for p in folder.iterdir() if ".tmp" in p.name) == sorted(kept)


def test_only_cache_builds_of_dead_processes_on_this_host_are_removed(tmp_path, monkeypatch):
    """A build of a live process (this one) stays, and so does one of another host (its pid means
    nothing here) and a name whose pid is no number; a build whose process has exited is removed, and
    a link named as one goes without what it leads to."""
    import socket

    from gbattn.files import remove_abandoned

    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    host = socket.gethostname()
    live, dead, other = (tmp_path / f"k.tmp{os.getpid()}@{host}", tmp_path / f"k.tmp{exited.pid}@{host}",
                         tmp_path / f"k.tmp{exited.pid}@elsewhere")
    for entry in (live, dead, other):
        entry.mkdir()
    no_pid = tmp_path / f"notes.tmpfile@{host}"
    no_pid.write_text("")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "kept").write_text("")
    link = tmp_path / f"l.tmp{exited.pid}@{host}"
    link.symlink_to(outside)
    named_tmp = tmp_path / f"losses.tmp.txt.tmp{exited.pid}@{host}"  # a target whose own name holds ".tmp"
    named_tmp.write_text("")
    remove_abandoned(tmp_path)
    assert live.is_dir() and not dead.exists() and other.is_dir() and no_pid.is_file()
    assert not link.is_symlink() and (outside / "kept").is_file() and not named_tmp.exists()
    # the pid follows the last ".tmp" before the host, and a host name may hold ".tmp" itself
    from gbattn.files import building_owner

    assert building_owner("losses.tmp.txt.tmp41@vm") == ("41", "vm")
    assert building_owner("checkpoint.pt.tmp41@build.tmp-runner") == ("41", "build.tmp-runner")
    assert building_owner("checkpoint.pt.tmp41") == ("41", "")  # written before the host was named
    # A process of another user (os.kill: PermissionError), alive in a shared cache, keeps its build.
    shared = tmp_path / "shared"
    shared.mkdir()
    another_users = shared / f"k.tmp{exited.pid}@{host}"
    another_users.write_text("")  # an atomic_write temporary file

    def not_permitted(pid, signal):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_permitted)
    remove_abandoned(shared)
    assert another_users.is_file()


def test_a_write_removes_its_files_temporaries_left_by_a_killed_writer(tmp_path):
    """atomic_write removes the temporary files of the same file left by a process killed with -9 during a write:
    the folders of analyze, plot and bench take no lock and were never cleaned, so each kill left one more
    ``gates.png.tmp<pid>@<host>`` beside the figures. A live writer's, another host's and another file's stay."""
    import socket

    from gbattn.files import atomic_write

    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    host = socket.gethostname()
    dead, live, other_host, other_file = (tmp_path / f"gates.png.tmp{exited.pid}@{host}",
                                          tmp_path / f"gates.png.tmp{os.getppid()}@{host}",  # a live process
                                          tmp_path / f"gates.png.tmp{exited.pid}@elsewhere",
                                          tmp_path / f"summary.json.tmp{exited.pid}@{host}")
    for leftover in (dead, live, other_host, other_file):
        leftover.write_text("half a figure")
    atomic_write(tmp_path / "gates.png", b"figure")
    assert (tmp_path / "gates.png").read_bytes() == b"figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["gates.png", live.name, other_host.name,
                                                                 other_file.name])
    # One that cannot be removed (another user's, in a shared sticky folder) is left: the write goes on (it was a
    # PermissionError, the file unwritten)
    dead.write_text("half a figure")
    real_unlink = Path.unlink

    def not_permitted(path, missing_ok=False):
        if path == dead:
            raise PermissionError(1, "Operation not permitted", str(path))
        real_unlink(path, missing_ok=missing_ok)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "unlink", not_permitted)
        atomic_write(tmp_path / "gates.png", b"again")
    assert (tmp_path / "gates.png").read_bytes() == b"again" and dead.is_file()


def test_a_build_named_with_a_pid_beyond_any_process_is_kept_not_a_traceback(tmp_path):
    """``NAME.tmp<20 digits>@<this host>``: digits, but past any pid, so os.kill raises OverflowError rather than
    ProcessLookupError; kept, as a name whose pid is no number is. Let through, the OverflowError would end the
    command opening that cache folder (or an export's --out) in a traceback."""
    import socket

    from gbattn.files import remove_abandoned

    huge = tmp_path / f"k.tmp{10**20}@{socket.gethostname()}"
    huge.mkdir()
    remove_abandoned(tmp_path)
    assert huge.is_dir()


def test_hf_name_offline_is_one_clear_line(capsys, tmp_path):
    code = cli_main(["train", "--data", "wikitext-103-raw-v1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "wikitext-103-raw-v1" in err and "point --data at a local copy" in err


def test_bad_data_path_exits_2_with_one_line(capsys, tmp_path):
    code = cli_main(["train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no such file or directory" in err
    (tmp_path / "empty").mkdir()
    code = cli_main(["train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "files seen: none" in err
    # a folder holding one text file (tiny-shakespeare's input.txt) names the file to give instead
    (tmp_path / "one").mkdir()
    write_text(tmp_path / "one" / "input.txt", "to be or not to be\n" * 50)
    code = cli_main(["train", "--data", str(tmp_path / "one"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    single = tmp_path / "one" / "input.txt"
    assert err.endswith(f"a single text file is split by the split setting (default 90/5/5) when given itself: "
                        f"--data {single}"), err


def test_a_data_path_that_is_a_link_to_nothing_is_named_so_not_offered_as_its_own_typo(capsys, tmp_path):
    """A link whose target is gone was "no such file or directory ... (did you mean '<the same path>'?)":
    the link's own name was the near miss of itself."""
    link = tmp_path / "input.txt"
    link.symlink_to(tmp_path / "moved" / "input.txt")
    code, _, err = run_cli(capsys, ["train", "--data", link, "--out", tmp_path / "r"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"is a link to {tmp_path / 'moved' / 'input.txt'}, which does not exist" in err and "did you mean" not in err
    assert files.did_you_mean_path(link) == ""
    (tmp_path / "input.tx").write_text("a near miss is still offered")
    assert files.did_you_mean_path(link) == f" (did you mean {str(tmp_path / 'input.tx')!r}?)"
    assert files.did_you_mean_path(tmp_path / "input.tx") == ""  # a path that exists is no typo of its neighbour


def test_a_tokenizer_file_that_is_a_link_to_nothing_is_named_so(capsys, tmp_path):
    """`--tokenizer hf=PATH` where PATH is a link to nothing says so, as --data does (not "no such file")."""
    link = tmp_path / "tokenizer.json"
    link.symlink_to(tmp_path / "moved" / "tokenizer.json")
    code, _, err = run_cli(capsys, ["train", "--data", "tiny-shakespeare", "--tokenizer", f"hf={link}",
                                    "--out", tmp_path / "r"])
    assert code == 2 and err.strip().splitlines() == [
        f"gbattn: error: --tokenizer hf={link}: a link to {tmp_path / 'moved' / 'tokenizer.json'}, which does not "
        f"exist"], err


def test_a_split_file_in_a_data_folder_that_is_a_link_to_nothing_is_named_so(capsys, tmp_path):
    """A folder whose valid.txt is a link to nothing (a Hugging Face hub snapshot copied without its blobs: its files
    are links into ../../blobs) listed it as "valid.txt (not a regular file)", as if it were a device or a pipe."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.txt").write_text("abc\n" * 50)
    (data / "valid.txt").symlink_to(tmp_path / "blobs" / "0123")
    os.mkfifo(tmp_path / "fifo")
    (data / "pipe").symlink_to(tmp_path / "fifo")  # a link to something there, which is no file
    code, _, err = run_cli(capsys, ["train", "--data", data, "--out", tmp_path / "r"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"valid.txt (a link to {tmp_path / 'blobs' / '0123'}, which does not exist)" in err, err
    assert "pipe (not a regular file)" in err, err


def test_a_data_file_of_whitespace_only_is_refused_for_every_tokenizer(capsys, tmp_path):
    """Blank lines and spaces (a byte order mark before them, a split file of a folder, gzip-compressed) were
    trained on by the char tokenizer, which makes tokens of them, while bpe said its training split held no text."""
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b"\xef\xbb\xbf" + "\n \t\r\n\u3000".encode() * 500)  # a BOM, then Unicode whitespace too
    code, _, err = run_cli(capsys, ["train", "--data", blank, "--tokenizer", "char", "--out", tmp_path / "r"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--data file {blank} holds only whitespace" in err
    folder = write_corpus(tmp_path / "c")
    (folder / "wiki.valid.tokens").unlink()
    write_text(folder / "wiki.valid.tokens.gz", "\n\n   \n")
    with pytest.raises(DataError, match=r"wiki\.valid\.tokens\.gz holds only whitespace"):
        load_corpus(str(folder))
    write_text(folder / "wiki.valid.tokens.gz", "\n\n . \n")  # one character of text is text
    assert list(load_corpus(str(folder)).lines("valid")) == ["\n", "\n", " . \n"]


def test_a_split_setting_with_a_data_path_that_is_no_corpus_gets_the_paths_own_error(capsys, tmp_path):
    """--set split with a --data typo (or a pipe) was told "--data ... has its own train, valid and test splits:
    leave it out"; leaving it out then gave the real error. Only a directory or a hub name comes in splits."""
    (tmp_path / "input.txt").write_text("to be or not to be\n" * 50)
    os.mkfifo(tmp_path / "pipe")
    for data, message in ((tmp_path / "input.tx", "no such file or directory"),
                          (tmp_path / "pipe", "is neither a regular file nor a directory"),
                          (tmp_path, "is a folder, read as one file per split (train, valid and test)")):
        for command in (["train", "--preset", "cpu-char"], ["compare", "--recipe", "cpu-char"]):
            code, _, err = run_cli(capsys, [*command, "--data", data, "--out", tmp_path / "r", "--set",
                                            "split=[0.8,0.1,0.1]"])
            assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (command, err)


# ---- training ----------------------------------------------------------------------------


def test_train_writes_a_self_describing_run(tmp_path):
    data = write_corpus(tmp_path / "c")
    result = train(tmp_path / "run", *tiny_configs(data), quiet=True)
    for name in (ckpt.CONFIG, ckpt.TOKENIZER, ckpt.CHECKPOINT, ckpt.BEST, ckpt.METRICS, ckpt.RESULT):
        assert (tmp_path / "run" / name).is_file(), name
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [4, 8, 12]
    assert result["steps"] == 12 and result["test_ppl"] < 30  # learned something (char vocab ~30)
    assert [p["step"] for p in result["curve"]] == [4, 8, 12]
    per_step = result["train_tokens_seen"] // 12  # each point counts the tokens trained on by its step
    assert [p["tokens"] for p in result["curve"]] == [4 * per_step, 8 * per_step, 12 * per_step]
    assert [e["tokens"] for e in events if e["event"] == "train"] == [s * per_step for s in range(1, 13)]
    # config.json records the run's length and warmup for its readers (compare checks a run it reuses against them)
    config = json.loads((tmp_path / "run" / ckpt.CONFIG).read_text())
    assert (config["steps"], config["warmup_steps"]) == (12, 3)
    # ... and metrics.jsonl its test evaluation, once, with result.json's numbers
    tested = [(e["step"], e["test_loss"], e["test_ppl"], e["tokens"]) for e in events if e["event"] == "test"]
    assert tested == [(12, result["test_loss"], result["test_ppl"], result["test_tokens"])]
    # `gbattn eval` on the run gives the same test perplexity as the trainer's final record.
    from gbattn.data.prepare import prepare_data
    from gbattn.eval.perplexity import evaluate
    from gbattn.rundir import load_run

    run = load_run(tmp_path / "run")
    d = prepare_data(run.train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False)
    tested = evaluate(run.model, d.splits["test"], run.seq_len)
    assert tested.ppl == pytest.approx(result["test_ppl"], rel=1e-6) and tested.tokens == result["test_tokens"] > 0
    # run.perplexity(text) scores text as the trainer scored its test split; a text shorter than a row is one row
    test_text = run.tokenizer.decode(d.splits["test"].tolist())
    assert run.perplexity(test_text).ppl == pytest.approx(result["test_ppl"], rel=1e-6)
    ids = torch.tensor([run.tokenizer.encode("to be or")])
    by_hand = torch.nn.functional.cross_entropy(run.model(ids[:, :-1])[0], ids[0, 1:]).item()
    scored = run.perplexity("to be or")
    assert scored.tokens == ids.shape[1] - 1 and scored.loss == pytest.approx(by_hand, rel=1e-6)
    # with a KV cache the caller set up: scored as without it (each whole-row forward was refused for lacking
    # input_pos), and the cache is the caller's again afterwards, as generate() leaves it
    run.model.setup_cache(1)
    cache = run.model.kv_cache
    assert run.perplexity("to be or").loss == scored.loss and run.model.kv_cache is cache
    run.model.clear_cache()
    with pytest.raises(UserError, match="the text encodes to 1 token: a perplexity needs at least 2"):
        run.perplexity("t")
    # token ids given to the text API were the tokenizer's "'int' object is not iterable"
    for ids in ([3, 4], torch.tensor([[3, 4]])):
        with pytest.raises(UserError, match=rf"prompt of type {type(ids).__name__}: give a string "
                                            r"\(run\.model\.generate takes token ids\)"):
            run.generate(ids, max_new_tokens=2)
    with pytest.raises(UserError, match="the prompt encodes to no tokens"):  # not an error from inside the model
        run.generate("", max_new_tokens=2)
    assert run.generate("to be", max_new_tokens=2, temperature=0).startswith("to be")


@pytest.mark.parametrize("amp", ["bf16", "off"])
def test_eval_command_scores_under_the_precision_the_run_trained_and_tested_in(tmp_path, capsys, amp):
    """`gbattn eval` gives result.json's test loss: it evaluates under the run's own `amp` setting (it
    used the device's default, so a run with amp=bf16 on CPU, or amp=off on CUDA, was scored in
    another precision than its trainer scored it: 499.891 vs 499.886 in a tiny bf16 CPU run)."""
    data = write_corpus(tmp_path / "c")
    result = train(tmp_path / "run", *tiny_configs(data, amp=amp, threads=1), quiet=True)
    code, out, err = run_cli(capsys, ["eval", tmp_path / "run", "--batch-size", "16", "--threads", "1"])
    assert code == 0, err
    record = json.loads(out.splitlines()[-1])
    assert (record["loss"], record["tokens"]) == (pytest.approx(result["test_loss"], rel=1e-9, abs=0),
                                                  result["test_tokens"])
    precision = {"bf16": "bfloat16", "off": "float32"}[amp]
    assert record["precision"] == result["test_precision"] == precision and "note:" not in err


def test_eval_names_another_precision_than_the_runs_test_was_scored_in(tmp_path, capsys):
    """amp=auto is bfloat16 on a GPU and float32 on a CPU: a run trained and tested on a GPU, scored by `eval` on a
    CPU, gave another loss than its result.json's, unsaid. eval records its precision and notes the difference, from
    result.json's test_precision or, for a run from before it was recorded, the device of its last leg."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, threads=1), quiet=True)  # amp=auto on the CPU: float32
    path = tmp_path / "run" / ckpt.RESULT
    result = json.loads(path.read_text())
    note = (f"note: {tmp_path / 'run'} was tested in bfloat16 (amp=auto on the device it trained on), and is scored "
            f"here in float32 on cpu: its numbers differ from result.json's in the last digits\n")
    for recorded in ({"test_precision": "bfloat16"}, {"test_precision": None, "device": "cpu (2 threads); NVIDIA H200"},
                     {"test_precision": "float32"}, {"test_precision": None, "device": "cpu (1 thread, x86_64)"}):
        path.write_text(json.dumps({**result, **recorded}))
        code, out, err = run_cli(capsys, ["eval", tmp_path / "run", "--threads", "1"])
        assert code == 0 and json.loads(out.splitlines()[-1])["precision"] == "float32"
        expected = "H200" in str(recorded) or recorded["test_precision"] == "bfloat16"
        assert (note in err, err.count("note:")) == (expected, int(expected)), (recorded, err)


def test_a_test_perplexity_of_data_without_a_test_split_is_called_valid(tmp_path, capsys):
    """A single file split 90/10/0 has no test split (test = valid): train's last line and `eval`
    (--split test) say so beside the test perplexity, `analyze` in a note; a corpus with a test split, or
    --split valid, do not."""
    text = "".join(f"line {i % 17}: to be or not to be\n" for i in range(400))
    (tmp_path / "t.txt").write_text(text)
    data = write_corpus(tmp_path / "c")
    note = "(this data has no test split: test is valid)"
    sets = ["--set", "max_steps=2", "--set", "eval_every=2", "--set", "d_model=32"]
    for source, run, split, expected in ((tmp_path / "t.txt", "one", ["--set", "split=[0.9,0.1,0]"], True),
                                         (data, "three", [], False)):
        code, out, err = run_cli(capsys, ["train", "--preset", "cpu-char", "--data", source, "--out",
                                          tmp_path / run, "--threads", "1", *sets, *split])
        assert code == 0, err
        last = out.splitlines()[-2]
        assert last.startswith(f"{tmp_path / run}: best valid ppl") and last.endswith(note) == expected, last
        summary, result = json.loads(out.splitlines()[-1]), ckpt.read_result(tmp_path / run / ckpt.RESULT)
        assert summary["test_split"] == result["test_split"] == ("valid" if expected else "test")
        code, out, err = run_cli(capsys, ["eval", tmp_path / run, "--threads", "1"])
        assert code == 0 and out.splitlines()[0].startswith("test perplexity"), err
        assert out.splitlines()[0].endswith(note) == expected, out
        # its JSON line too, as result.json (scripts read "split": "test" alone, a validation figure unsaid)
        assert json.loads(out.splitlines()[-1])["test_split"] == ("valid" if expected else "test")
        code, out, err = run_cli(capsys, ["eval", tmp_path / run, "--split", "valid", "--threads", "1"])
        assert code == 0 and note not in out, err
        for analyze_split, said in (("test", expected), ("valid", False)):  # analyze said "test rows" alone
            code, out, err = run_cli(capsys, ["analyze", tmp_path / run, "--split", analyze_split, "--max-rows", "2",
                                              "--quiet", "--threads", "1", "--out", tmp_path / f"an-{run}"])
            assert code == 0 and ("  note: this data has no test split: test is valid" in out) == said, out


@pytest.mark.parametrize("sampling, amp", [("rows", "off"), ("random", "off"), ("rows", "bf16")])
def test_resume_after_crash_equals_uninterrupted(tmp_path, monkeypatch, sampling, amp):
    """Crash at step 7 (last checkpoint: step 4), resume: same final loss and weights, and the same
    training-loss records (log_every=3: the one at step 6 averages steps 4-6 in both); under bf16
    autocast too (the resumed run computes in the precision the run recorded)."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, sampling=sampling, log_every=3, amp=amp)
    ref = train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(7, tmp_path / "crashed", *configs, monkeypatch)
    assert ckpt.load_checkpoint(tmp_path / "crashed" / ckpt.CHECKPOINT)["step"] == 4
    resumed = train(tmp_path / "crashed", resume=True, quiet=True)

    assert resumed["test_loss"] == ref["test_loss"]
    assert resumed["valid_loss"] == ref["valid_loss"]
    a, b = final_weights(tmp_path / "ref"), final_weights(tmp_path / "crashed")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert train_losses(tmp_path / "ref") == train_losses(tmp_path / "crashed")  # no duplicated or lost events
    events = [json.loads(line) for line in (tmp_path / "crashed" / ckpt.METRICS).read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]  # the checkpoint's step
    # Everything else it records too (tokens seen, FLOPs, curve, events), timings apart.
    ref_result, ref_events = run_record(tmp_path / "ref")
    resumed_result, resumed_events = run_record(tmp_path / "crashed")
    assert resumed_result == {**ref_result, "run_dir": "crashed"}
    assert resumed_events == ref_events


def test_activation_checkpointing_trains_the_same_run_bit_for_bit_and_may_be_switched_on_resume(tmp_path, monkeypatch,
                                                                                                 capsys):
    """A run that recomputes its blocks in the backward pass (activation_checkpointing, dropout 0.1) ends with the
    weights, losses and training-loss records of one that keeps their activations, bit for bit, and so does a run
    killed without it and resumed with it (a result-neutral field, taken from the resuming call). The recomputing
    function is counted: the option reaches the model's blocks."""
    from gbattn.model.gpt import Block

    recomputed_blocks = []

    def counted(fn, *args):
        recomputed_blocks.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    monkeypatch.setattr(Block, "_gradient_checkpointing_func", counted)
    data = write_corpus(tmp_path / "c")
    model_cfg, train_cfg = tiny_configs(data, log_every=3)
    ref = train(tmp_path / "ref", model_cfg, train_cfg, quiet=True)
    assert not recomputed_blocks
    capsys.readouterr()
    recomputing = train(tmp_path / "ac", model_cfg, train_cfg.replace(activation_checkpointing=True))
    assert len(recomputed_blocks) == ref["steps"] * model_cfg.n_layers
    assert ", each block recomputed in the backward pass (activation_checkpointing)" in capsys.readouterr().out
    train_killed_at(7, tmp_path / "crashed", model_cfg, train_cfg, monkeypatch)
    recomputed_blocks.clear()
    resumed = train(tmp_path / "crashed", resume=True, quiet=True, overrides={"activation_checkpointing": True})
    assert len(recomputed_blocks) == (ref["steps"] - 4) * model_cfg.n_layers  # (from the checkpoint of step 4)
    reference_weights = final_weights(tmp_path / "ref")
    for run, result in (("ac", recomputing), ("crashed", resumed)):
        assert (result["valid_loss"], result["test_loss"]) == (ref["valid_loss"], ref["test_loss"]), run
        weights = final_weights(tmp_path / run)
        for k in reference_weights:
            torch.testing.assert_close(weights[k], reference_weights[k], rtol=0, atol=0, msg=f"{run}: {k}")
        assert train_losses(tmp_path / run) == train_losses(tmp_path / "ref"), run


def test_resume_from_python_checks_the_configs_given_against_the_recorded_ones(tmp_path, monkeypatch):
    """``train(run, model_cfg, train_cfg, resume=True)`` (the script that started a killed run, run again with
    resume=True): the run's own configs resume it exactly, a result-neutral field (threads) may differ, and configs
    that would change the run (more steps, another width) are a UserError naming the field: they were ignored for
    the recorded ones, silently."""
    data = write_corpus(tmp_path / "c")
    model_cfg, train_cfg = tiny_configs(data, sampling="random", max_steps=6, eval_every=3)
    ref = train(tmp_path / "ref", model_cfg, train_cfg, quiet=True)
    train_killed_at(5, tmp_path / "crashed", model_cfg, train_cfg, monkeypatch)
    with pytest.raises(UserError, match=r"max_steps: recorded 6, given 12"):
        train(tmp_path / "crashed", model_cfg, train_cfg.replace(max_steps=12), resume=True, quiet=True)
    with pytest.raises(UserError, match=r"d_model: recorded 32, given 64"):
        train(tmp_path / "crashed", model_cfg.replace(d_model=64), train_cfg, resume=True, quiet=True)
    # fit_warmup, by the warmup it gives over the run's steps (ignored, the recorded warmup was trained, silently;
    # compared as a flag, a run from before it existed, recorded off, was refused where the warmup was the same)
    fitted = train_cfg.replace(warmup_steps=12, fit_warmup=True)  # longer than the run: fitted to a tenth of it
    train(tmp_path / "fitted", model_cfg, fitted, quiet=True)
    with pytest.raises(UserError, match=r"the warmup over its 6 steps: recorded 1, given 12 \(fit_warmup=False\)"):
        train(tmp_path / "fitted", model_cfg, fitted.replace(fit_warmup=False), resume=True, quiet=True)
    # a run an earlier gbattn fitted by its rule (a default warmup over half the run, to a tenth): said why, as
    # compare says it
    old_rule = train_cfg.replace(warmup_steps=4, fit_warmup=True)
    train(tmp_path / "old-rule", model_cfg, old_rule, quiet=True)
    config = ckpt.read_config(tmp_path / "old-rule" / ckpt.CONFIG)
    config["warmup_steps"] = 1  # what gbattn before 2026-12-04 fitted 4 of 6 steps to, and recorded
    (tmp_path / "old-rule" / ckpt.CONFIG).write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"the warmup over its 6 steps: recorded 1, given 4 \(fit_warmup=True; gbattn "
                                        r"before 2026-12-04 shortened a default warmup .*docs/deviations.md entry 9\)"):
        train(tmp_path / "old-rule", model_cfg, old_rule, resume=True, quiet=True)
    with pytest.raises(UserError, match=r"data: recorded .*, given .*other"):  # another corpus
        train(tmp_path / "crashed", model_cfg, train_cfg.replace(data=str(write_corpus(tmp_path / "other", seed=1))),
              resume=True, quiet=True)
    with pytest.raises(UserError, match=r"preset: recorded None, given 'cpu-char'"):  # was ignored, silently
        train(tmp_path / "crashed", model_cfg, train_cfg, resume=True, quiet=True, preset="cpu-char")
    with pytest.raises(UserError, match=r'extra: recorded \{\}, given \{"note": "b"\}'):  # was ignored, silently
        train(tmp_path / "crashed", model_cfg, train_cfg, resume=True, quiet=True, extra={"note": "b"})
    # the same corpus moved to another path, as train --resume --data: read there (the recorded path is gone)
    moved = shutil.move(data, tmp_path / "moved")
    # (threads given where the run recorded none: the count it trained with, so the result stays exact; 1 was
    # another count than the default on a machine with a free core, and the test failed there)
    threads = torch.get_num_threads()
    # (and fit_warmup flipped: over 6 steps its warmup of 3 is not fitted either way)
    resumed = train(tmp_path / "crashed", model_cfg, train_cfg.replace(threads=threads, data=str(moved),
                                                                       fit_warmup=not train_cfg.fit_warmup),
                    resume=True, quiet=True)
    assert resumed["steps"] == 6 and resumed["test_loss"] == ref["test_loss"]
    recorded = ckpt.read_config(tmp_path / "crashed" / ckpt.CONFIG)["train"]
    assert (recorded["threads"], recorded["data"]) == (threads, str(moved))  # the neutral fields taken


def test_train_overrides_are_result_neutral_fields_of_a_resumed_run_only(tmp_path):
    """train(..., overrides={"lr": 1.0}) was ignored by a new run and applied to a resumed one, silently (changing a
    run `train --resume` keeps as it was started): overrides are the result-neutral fields of a resumed run (threads,
    device, ...; what compare passes), and anything else is a UserError naming it."""
    from gbattn.config import build_configs

    configs = build_configs("cpu-char", "standard", "tiny-shakespeare",
                            {"max_steps": 2, "eval_every": 2, "d_model": 16, "n_layers": 1, "threads": 1})
    with pytest.raises(UserError, match=r"^overrides are for a resumed run \(resume=True\)"):
        train(tmp_path / "new", *configs, overrides={"lr": 1.0})
    assert not (tmp_path / "new").exists()
    train(tmp_path / "run", *configs, quiet=True)
    with pytest.raises(UserError, match=r"^overrides \['lr'\] would change the resumed run"):
        train(tmp_path / "run", resume=True, overrides={"lr": 1.0, "threads": 1})
    assert train(tmp_path / "run", resume=True, quiet=True, overrides={"threads": 1})["steps"] == 2


def test_a_run_killed_writing_its_result_logs_its_test_once_when_resumed(tmp_path, monkeypatch):
    """Killed after its test evaluation was logged but before result.json was in place (the checkpoint
    is at the last step): the resumed run tests again, and metrics.jsonl holds one test event, as an
    uninterrupted run's does (the killed attempt's was kept beside the new one)."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, sampling="random", max_steps=6, eval_every=3)
    train(tmp_path / "ref", *configs, quiet=True)

    def killed(directory, result):
        raise RuntimeError("simulated kill")

    with monkeypatch.context() as patched:
        patched.setattr(ckpt, "write_result", killed)
        with pytest.raises(RuntimeError, match="simulated kill"):
            train(tmp_path / "crashed", *configs, quiet=True)
    assert not (tmp_path / "crashed" / ckpt.RESULT).exists()
    train(tmp_path / "crashed", resume=True, quiet=True)
    ref_result, ref_events = run_record(tmp_path / "ref")
    resumed_result, resumed_events = run_record(tmp_path / "crashed")
    assert resumed_events == ref_events
    assert resumed_result == {**ref_result, "run_dir": "crashed"}


def test_resume_keeps_the_best_validation_so_far(tmp_path, monkeypatch):
    """The best validation loss and its step survive a resume: with validation losses that rise
    after step 4, best.pt and best_step stay at step 4, whether the last checkpoint is the best one's
    (killed at step 7) or a later one's (killed at step 9: checkpoint at step 8, best step 4)."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data)
    original = Trainer._evaluate

    def rising_valid(self, split):
        res = original(self, split)
        return dataclasses.replace(res, loss=float(self.step)) if split == "valid" else res

    monkeypatch.setattr(Trainer, "_evaluate", rising_valid)
    ref = train(tmp_path / "ref", *configs, quiet=True)
    for killed_at in (7, 9):
        crashed = tmp_path / f"crashed-at-{killed_at}"
        train_killed_at(killed_at, crashed, *configs, monkeypatch)
        resumed = train(crashed, resume=True, quiet=True)
        assert ref["best_step"] == resumed["best_step"] == 4, killed_at
        # the result's validation numbers are the best evaluation's (loss 4.0), not the last one's (12.0)
        assert ref["valid_loss"] == resumed["valid_loss"] == 4.0, killed_at
        assert ref["valid_ppl"] == resumed["valid_ppl"] == pytest.approx(math.exp(4.0), rel=1e-12)
        assert ckpt.load_checkpoint(crashed / ckpt.BEST)["step"] == 4
        assert run_record(crashed)[1] == run_record(tmp_path / "ref")[1]  # the events' "best" flags


def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    """grad_accum=2 (two micro-batches of 4 rows) trains the same weights as one batch of 8."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "one", *tiny_configs(data, dropout=0.0, max_steps=6), quiet=True)
    train(tmp_path / "two", *tiny_configs(data, dropout=0.0, max_steps=6, grad_accum=2), quiet=True)
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)  # the mean


def older_checkpoint_format(state: dict) -> dict:
    """A checkpoint as gbattn wrote it before FSDP2 support: one RNG state ("rng"), the optimizer
    keyed by parameter index, and the scalar gate's logit and its AdamW moments 0-dim."""
    optim = state["optimizer"]
    names = [name for group in optim["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}

    def zero_dim(name: str, value):
        return value.reshape(()) if name.endswith("gate.logit") else value

    return {
        **{k: v for k, v in state.items() if k != "rng_per_rank"},
        "rng": state["rng_per_rank"][0],
        "model": {name: zero_dim(name, v) for name, v in state["model"].items()},
        "optimizer": {
            "state": {index[name]: {k: zero_dim(name, v) if k != "step" else v for k, v in s.items()}
                      for name, s in optim["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]],
        },
    }


def test_a_run_resumed_on_other_arithmetic_says_it_is_not_exact_and_how_to_resume_as_it_ran(tmp_path, monkeypatch,
                                                                                              capsys):
    """A checkpoint trained on 1 CPU thread and resumed on 2 ended 1.6e-6 away from the uninterrupted run's weights,
    yet the resume said "redone, exactly" and nothing warned (nor did one trained compiled and resumed eager, which
    a run without dropout may do). The checkpoint now records its device, threads and compilation; a resume that
    differs warns, on stderr, and says how to resume as it ran. One that does not still says "exactly"."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, threads=1)
    for run, threads in (("same", 1), ("more", 2)):
        train_killed_at(5, tmp_path / run, *configs, monkeypatch)
        capsys.readouterr()
        train(tmp_path / run, resume=True, overrides={"threads": threads})
        printed = capsys.readouterr()
        exactly = ", exactly" if threads == 1 else ""
        assert f"resuming at step 4 of 12, the last checkpoint (work after it is redone{exactly})\n" in printed.out
        result = ckpt.read_result(tmp_path / run / ckpt.RESULT)
        if threads == 1:
            assert "warning" not in printed.err
            assert result["device"] == device_name(torch.device("cpu"), 1)
        else:
            saved, now = device_name(torch.device("cpu"), 1), device_name(torch.device("cpu"), 2)
            assert (f"warning: the checkpoint of {tmp_path / run} was trained on {saved} and this run "
                                   f"is on {now} (resume with --threads 1): it goes on, but not exactly as the "
                                   f"uninterrupted run would (the same sums add up in another order)\n") in printed.err
            # every leg's device: it said only the last one's (2 threads) of steps trained on 1 thread too
            assert result["device"] == f"{saved}; {now}"
    train_killed_at(5, tmp_path / "compiled", *configs, monkeypatch)
    path = tmp_path / "compiled" / ckpt.CHECKPOINT
    state = ckpt.load_checkpoint(path)
    assert state["trained_on"] == {"device": device_name(torch.device("cpu"), 1), "threads": 1, "compiled": False}
    state["trained_on"]["threads"] = "1"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="its record of the hardware it trained on is malformed"):
        train(tmp_path / "compiled", resume=True, quiet=True)
    state["trained_on"]["threads"] = 1
    state["trained_on"]["device"] = "cpu\x1b]0;TITLE\x07"  # an escape sequence it would print in its warning
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="its record of the hardware it trained on is malformed"):
        train(tmp_path / "compiled", resume=True, quiet=True)
    state["trained_on"]["device"] = device_name(torch.device("cpu"), 1)
    for devices in ("cpu", [1], ["cpu"] * 65, ["cpu\x1b[2J"]):
        torch.save({**state, "devices": devices}, path)
        with pytest.raises(CheckpointError, match="its record of the devices it ran on is malformed"):
            train(tmp_path / "compiled", resume=True, quiet=True)
    two = {**state, "rng_per_rank": [state["rng_per_rank"][0]] * 2}  # (two processes' streams)
    for most in ("2", 0, 1.0, 1):  # fewer than its own streams' processes, or not a count
        torch.save({**two, "most_processes": most}, path)
        with pytest.raises(CheckpointError, match="its record of the processes it ran in is malformed"):
            train(tmp_path / "compiled", resume=True, quiet=True)
    state["trained_on"].update(threads=1, compiled=True)  # as a run without dropout may switch
    torch.save(state, path)
    capsys.readouterr()
    train(tmp_path / "compiled", resume=True, quiet=True)
    assert capsys.readouterr().err.startswith(
        f"warning: the checkpoint of {tmp_path / 'compiled'} was trained compiled and this run trains eager (resume "
        f"with --compile): it goes on")
    # a run that has run on as many devices as a checkpoint may record, resumed on one more: the 65th was written,
    # and every later resume refused the checkpoint as malformed. The first ones and the last are kept.
    train_killed_at(5, tmp_path / "many", *configs, monkeypatch)
    path = tmp_path / "many" / ckpt.CHECKPOINT
    torch.save({**ckpt.load_checkpoint(path), "devices": [f"device {i}" for i in range(64)]}, path)
    result = train(tmp_path / "many", resume=True, quiet=True)
    now = device_name(torch.device("cpu"), 1)
    kept = [*(f"device {i}" for i in range(62)), "...", now]
    assert ckpt.load_checkpoint(path)["devices"] == kept and result["device"] == "; ".join(kept)


def test_a_checkpoint_in_the_older_format_resumes_exactly(tmp_path, monkeypatch, capsys):
    """A run killed with a checkpoint in the format written before FSDP2 support (see
    :func:`older_checkpoint_format`) still resumes to the uninterrupted run's weights (dropout on)."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, **{"attn.gate": "scalar"})
    train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(7, tmp_path / "crashed", *configs, monkeypatch)
    path = tmp_path / "crashed" / ckpt.CHECKPOINT
    older = older_checkpoint_format(ckpt.load_checkpoint(path))
    assert [v.dim() for k, v in older["model"].items() if k.endswith("gate.logit")] == [0, 0]  # 2 layers
    del older["trained_on"]  # (nor did it record the hardware it trained on: not called exact)
    torch.save(older, path)
    capsys.readouterr()
    train(tmp_path / "crashed", resume=True)
    assert re.search(r"resuming at step \d+ of 12, the last checkpoint \(work after it is redone; exactly where it "
                     r"resumes on the device, threads and gbattn it trained with, which its checkpoint, from an "
                     r"earlier gbattn, does not record\)\n", capsys.readouterr().out)
    a, b = final_weights(tmp_path / "ref"), final_weights(tmp_path / "crashed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_without_its_training_loss_window_resumes_with_an_empty_one(tmp_path, monkeypatch):
    """Checkpoints written before the training-loss window was kept lack "train_window": resumed, the window starts
    empty (as it is at the checkpoint of a run that logs every step), so the training records are the uninterrupted
    run's; a window of one phantom step would halve the next record's loss."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data)  # log_every=1
    train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(7, tmp_path / "crashed", *configs, monkeypatch)
    path = tmp_path / "crashed" / ckpt.CHECKPOINT
    state = ckpt.load_checkpoint(path)
    assert state.pop("train_window") == [0.0, 0]
    torch.save(state, path)
    train(tmp_path / "crashed", resume=True, quiet=True)
    assert train_losses(tmp_path / "crashed") == train_losses(tmp_path / "ref")


def test_a_resumed_run_keeps_the_extra_it_recorded(tmp_path):
    """A run resumed without its extra (compare's labels; a script's notes) keeps the one config.json recorded, in
    config.json and result.json alike: rewriting it from the resuming call's (none) dropped a comparison's labels."""
    data = write_corpus(tmp_path / "c")
    extra = {"label": "gba-m2", "recipe": "cpu-char", "note": "kept"}
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True, extra=extra)
    (tmp_path / "run" / ckpt.RESULT).unlink()  # killed writing its result: resumed at its last step
    assert train(tmp_path / "run", resume=True, quiet=True)["extra"] == extra
    assert ckpt.read_config(tmp_path / "run" / ckpt.CONFIG)["extra"] == extra


def test_a_run_trains_in_a_thread_other_than_the_main_one(tmp_path):
    """Python allows signal handlers in the main thread only: a run trained in another thread (a script's worker)
    trains without the Ctrl-C handlers instead of failing with signal's ValueError."""
    import threading

    data = write_corpus(tmp_path / "c")
    outcome = []

    def work():
        try:
            outcome.append(train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True))
        except Exception as e:  # reported below
            outcome.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert isinstance(outcome[0], dict) and outcome[0]["steps"] == 2, outcome


def test_continuation_killed_before_its_first_checkpoint_resumes_from_its_start(tmp_path, monkeypatch):
    """A run started from another run's weights (``init_from``) that has no checkpoint yet, because it
    was killed before its first evaluation or planned by ``compare --jobs N`` (which trains every run
    with ``train --resume``), starts from those weights on resume: it ends as the uninterrupted run."""
    data = write_corpus(tmp_path / "c")
    base_model, base_train = tiny_configs(data, attn="standard", max_steps=4)
    train(tmp_path / "base", base_model, base_train, quiet=True)
    recorded = ckpt.load_run(tmp_path / "base").model_cfg  # as compare does: the start's model config
    configs = (recorded, dataclasses.replace(base_train, init_from=str(tmp_path / "base"), seed=7))
    ref = train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(2, tmp_path / "crashed", *configs, monkeypatch)
    assert not (tmp_path / "crashed" / ckpt.CHECKPOINT).exists()
    resumed = train(tmp_path / "crashed", resume=True, quiet=True)
    assert resumed["test_loss"] == ref["test_loss"]

    # compare --jobs N: config.json written first, then `train --resume`.
    (tmp_path / "planned").mkdir()
    files.write_json({"preset": None, "model": configs[0].to_dict(), "train": configs[1].to_dict(), "planned": True},
                     tmp_path / "planned" / ckpt.CONFIG)
    assert train(tmp_path / "planned", resume=True, quiet=True)["test_loss"] == ref["test_loss"]
    events = [json.loads(line)["event"] for line in (tmp_path / "planned" / ckpt.METRICS).read_text().splitlines()]
    assert "resume" not in events  # it started, nothing was resumed


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once_when_resumed(tmp_path, monkeypatch, capsys):
    """Resumed without a checkpoint, a run starts at step 0, and says so: the records its killed attempt
    logged go, so metrics.jsonl is the uninterrupted run's (no step logged twice)."""
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, attn="standard", log_every=1)
    train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(3, tmp_path / "crashed", *configs, monkeypatch)
    assert not (tmp_path / "crashed" / ckpt.CHECKPOINT).exists() and len(train_losses(tmp_path / "crashed")) == 3
    capsys.readouterr()
    train(tmp_path / "crashed", resume=True)
    assert "has no checkpoint.pt yet: training starts at step 0" in capsys.readouterr().out
    assert run_record(tmp_path / "crashed")[1] == run_record(tmp_path / "ref")[1]


@pytest.mark.parametrize("stop", ["sigint", "sigterm"])
def test_a_stop_during_the_final_test_evaluation_says_how_to_continue(tmp_path, monkeypatch, stop):
    """Ctrl-C or SIGTERM after the training loop, while the best weights are tested: the run said only 'gbattn:
    interrupted' (or 'terminated'), not that its last step's checkpoint is saved nor how to continue. It now says
    both, with the signal's status; resumed, it evaluates again and ends as the uninterrupted run."""
    from gbattn.errors import Terminated

    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, attn="standard", max_steps=4, eval_every=2)
    ref = train(tmp_path / "ref", *configs, quiet=True)
    run = tmp_path / "run"
    original = Trainer._evaluate

    def stopped(self, split):
        if split == "test":  # as cli's SIGTERM handler raises, or Python on Ctrl-C
            raise Terminated if stop == "sigterm" else KeyboardInterrupt
        return original(self, split)

    monkeypatch.setattr(Trainer, "_evaluate", stopped)
    with pytest.raises(BaseException) as stopped_run:  # (a KeyboardInterrupt let through would end the session)
        train(run, *configs, quiet=True)
    how = "terminated" if stop == "sigterm" else "interrupted"
    assert isinstance(stopped_run.value, Interrupted), repr(stopped_run.value)
    assert str(stopped_run.value) == (f"{how} during the test evaluation after the last step; its checkpoint is saved "
                                      f"in {run}: continue with `gbattn train --resume --out "
                                      f"{files.shell_path(run)}` (it tests again)")
    assert stopped_run.value.exit_code == (143 if stop == "sigterm" else 130)
    monkeypatch.setattr(Trainer, "_evaluate", original)
    assert train(run, resume=True, quiet=True)["test_loss"] == ref["test_loss"]


def test_a_second_ctrl_c_in_the_training_loop_stops_at_once_and_a_repeated_sigterm_does_not():
    """The first SIGINT or SIGTERM asks the loop to stop at a step boundary; a second Ctrl-C stops at once
    (KeyboardInterrupt, status 130). A repeated SIGTERM asks again: the kernel sends a parent-death SIGTERM once
    per thread of the dying parent (torchrun, a comparison), and taken as "stop now" it ended a worker mid-step,
    without its checkpoint or its line. A SIGTERM after a Ctrl-C makes the stop SIGTERM's, as among processes."""
    import signal

    from gbattn.train.trainer import _StopFlag

    def send(signals):
        for signum in signals:
            signal.getsignal(signum)(signum, None)

    for signals, stop in (((signal.SIGTERM,) * 3, signal.SIGTERM), ((signal.SIGINT, signal.SIGTERM), signal.SIGTERM)):
        with _StopFlag() as flag:
            try:
                send(signals)
            except KeyboardInterrupt as e:  # (it would end the test session)
                pytest.fail(f"{signals} stopped at once: {e!r}")
        assert flag.requested and flag.signum == stop, signals
    for signals in ((signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)):
        with pytest.raises(KeyboardInterrupt) as stopped, _StopFlag():
            send(signals)
        assert type(stopped.value) is KeyboardInterrupt, signals  # not cli's Terminated: status 130


LEAVING_AFTER_ITS_STOP = """
import os, signal, sys, time
from gbattn.parent_death import stop_with_parent
from gbattn.train.trainer import _StopFlag
if sys.argv[1] == "stops with its parent":
    stop_with_parent()
with _StopFlag() as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # the first parent-death SIGTERM: the loop stops
    while not stop.requested:
        time.sleep(0.01)
os.kill(os.getpid(), signal.SIGTERM)  # the dying parent's next thread's, while the process leaves
time.sleep(0.2)
print("its line")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_parent_death_sigterm_after_the_loop_stopped_leaves_the_process_its_line():
    """A torchrun worker's loop stopped on torchrun's death, and the next of the kernel's parent-death SIGTERMs
    (one per thread of torchrun; seconds apart on a busy machine) ended it with SIGTERM's default before its
    line (CI: test_a_killed_torchrun_leaves_no_process_training). After a stop, a process its parent's death
    stops absorbs them; any other process gets SIGTERM's own handler back (here the default: it ends)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for kind, status, out in (("stops with its parent", 0, "its line\n"), ("alone", -signal.SIGTERM, "")):
        done = subprocess.run([sys.executable, "-c", LEAVING_AFTER_ITS_STOP, kind], capture_output=True, text=True,
                              env=env, timeout=300)
        assert (done.returncode, done.stdout) == (status, out), (kind, done.stderr[-2000:])


def test_sigterm_sent_twice_stops_the_run_at_a_step_boundary_with_its_checkpoint(tmp_path, monkeypatch):
    """Two SIGTERMs during a step (a killed torchrun's workers receive one per thread of it): the run still stops
    after that step, checkpointed, with its "terminated" line, where it stopped mid-step without either."""
    import signal

    data = write_corpus(tmp_path / "c")
    signal_during_step(2, monkeypatch, signal.SIGTERM, signal.SIGTERM)
    with pytest.raises(Interrupted, match="^terminated at step 3; checkpoint saved") as stopped:
        try:
            train(tmp_path / "run", *tiny_configs(data, max_steps=6, eval_every=5), quiet=True)
        except KeyboardInterrupt as e:  # a bare one: stopped mid-step (it would end the test session)
            if isinstance(e, Interrupted):
                raise
            pytest.fail(f"stopped mid-step: {e!r}")
    assert stopped.value.exit_code == 143
    assert ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)["step"] == 3
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert events[-1] == {"event": "interrupted", "step": 3}


@pytest.mark.parametrize("name", ["SIGHUP", "SIGUSR1", "SIGUSR2"])
def test_a_hangup_or_a_schedulers_user_signal_stops_the_run_with_its_checkpoint(tmp_path, monkeypatch, name):
    """SIGHUP (a terminal closed without nohup) and SIGUSR1/SIGUSR2 (SLURM's --signal, scancel --signal) ended a
    training at once, silently, with no checkpoint (resume started at step 0). In the loop they stop it as SIGTERM
    does, with the status a shell reports for the signal; ignored (nohup), SIGHUP stays ignored; a caller's own
    handler of one stays its own (taken over, the run stopped and the handler was never called)."""
    import signal

    signum = getattr(signal, name)
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, max_steps=6, eval_every=5)
    previous = signal.signal(signum, signal.SIG_DFL)  # (as in a process of its own)
    try:
        signal_during_step(2, monkeypatch, signum)
        with pytest.raises(Interrupted, match=f"^stopped by {name} at step 3; checkpoint saved") as stopped:
            train(tmp_path / "run", *configs, quiet=True)
        assert stopped.value.exit_code == 128 + signum and signal.getsignal(signum) is signal.SIG_DFL
        assert ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)["step"] == 3
        if name == "SIGHUP":
            signal.signal(signum, signal.SIG_IGN)
            assert train(tmp_path / "nohup", *configs, quiet=True)["steps"] == 6
        received = []

        def own(sig, frame):
            received.append(sig)

        signal.signal(signum, own)
        try:
            result = train(tmp_path / "own", *configs, quiet=True)
        except Interrupted as e:  # (a KeyboardInterrupt: it would end the test session)
            pytest.fail(f"the caller's own {name} handler was taken over: {e}")
        assert result["steps"] == 6 and received == [signum] and signal.getsignal(signum) is own
    finally:
        signal.signal(signum, previous)


@pytest.mark.parametrize("terminal", [False, True], ids=["file", "terminal"])
def test_a_log_that_cannot_be_written_does_not_end_the_training(tmp_path, monkeypatch, terminal):
    """stderr that refuses writes (`2>/dev/full`, a terminal gone after a hangup): the progress and evaluation lines
    are dropped and the run trains on to its end. The evaluation's line came before its checkpoint, and failing
    there it ended the run with status 1, that evaluation's checkpoint lost; a note before the first step (a warmup
    longer than the run) ended it there. On a terminal (tqdm's bar) alike: its failing line was untested."""
    import errno

    code = errno.EIO if terminal else errno.ENOSPC  # (what a terminal gone, and /dev/full, answer)

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(code, os.strerror(code))

        def isatty(self):
            return terminal

    data = write_corpus(tmp_path / "c")
    monkeypatch.setattr(sys, "stderr", Full())
    # (a warmup longer than the run: its note, on stderr before the first step, ended the run there with status 1)
    configs = tiny_configs(data, max_steps=6, eval_every=3, log_every=1, warmup_steps=100)
    result = train(tmp_path / "run", *configs, quiet=False)
    assert result["steps"] == 6 and ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)["step"] == 6


def test_ctrl_c_stops_a_python_sweep_that_catches_exception(tmp_path, monkeypatch):
    """A sweep in Python that goes on to its next run when one fails (``except Exception``) went on after Ctrl-C too:
    the stop was a UserError. It is a KeyboardInterrupt now, which ``except Exception`` lets through, with its line
    and status (the checkpoint is saved; the sweep's next run never starts)."""
    data = write_corpus(tmp_path / "c")
    signal_during_step(2, monkeypatch)  # Ctrl-C
    started = []
    with pytest.raises(Interrupted, match="^interrupted at step 3; checkpoint saved") as stopped:
        for name in ("first", "second"):
            started.append(name)
            try:
                train(tmp_path / name, *tiny_configs(data, max_steps=6, eval_every=5), quiet=True)
            except Exception:  # a failed run: on to the next
                continue
    assert started == ["first"] and isinstance(stopped.value, KeyboardInterrupt) and stopped.value.exit_code == 130


def test_a_run_started_with_sigint_ignored_trains_on_through_one(tmp_path, monkeypatch):
    """A shell starts a background job (`gbattn train ... &` in a script) with SIGINT ignored, so that
    Ctrl-C on the script leaves it running: data preparation ignored it, but the training loop's
    handler took it as a stop. It stays ignored; SIGTERM still stops the run."""
    import signal

    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, max_steps=6, eval_every=3)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        signal_during_step(2, monkeypatch, signal.SIGINT)
        assert train(tmp_path / "background", *configs, quiet=True)["steps"] == 6
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal_during_step(2, monkeypatch, signal.SIGTERM)
        with pytest.raises(Interrupted, match="terminated at step 3"):
            train(tmp_path / "terminated", *configs, quiet=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_resume_command_of_a_stopped_run_quotes_its_directory_for_the_shell(tmp_path, monkeypatch):
    """The command a stopped run suggests is one a shell reads back: a run directory named with a space is quoted
    (unquoted, `gbattn train --resume --out my run` would be two arguments)."""
    import shlex

    data = write_corpus(tmp_path / "c")
    monkeypatch.setattr(Trainer, "_should_stop", lambda self, requested: self.step == 2)
    with pytest.raises(Interrupted) as stopped:
        train(tmp_path / "my run", *tiny_configs(data, max_steps=4, eval_every=2), quiet=True)
    command = str(stopped.value).split("continue with `", 1)[1].rstrip("`")
    assert shlex.split(command) == ["gbattn", "train", "--resume", "--out", str(tmp_path / "my run")]


def test_interrupt_checkpoints_and_resumes(tmp_path, monkeypatch, capsys):
    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data)
    ref = train(tmp_path / "ref", *configs, quiet=True)
    monkeypatch.setattr(Trainer, "_should_stop", lambda self, requested: self.step == 6)
    with pytest.raises(Interrupted) as stopped:
        train(tmp_path / "int", *configs, quiet=True)
    # A run of its own is continued by train --resume only (no `gbattn compare` command ran it).
    assert str(stopped.value) == (f"interrupted at step 6; checkpoint saved in {tmp_path / 'int'}: continue with "
                                  f"`gbattn train --resume --out {files.shell_path(tmp_path / 'int')}`")
    with pytest.raises(Interrupted, match=r"interrupted at step 6; .*`gbattn train --resume --out .*compared'?` \(or "
                                        r"rerun the same `gbattn compare` command\)$"):
        train(tmp_path / "compared", *configs, quiet=True, extra={"label": "gba-m2", "recipe": "cpu-char"})
    monkeypatch.setattr(Trainer, "_should_stop", lambda self, requested: False)
    capsys.readouterr()
    assert train(tmp_path / "int", resume=True)["test_loss"] == ref["test_loss"]
    printed = capsys.readouterr()
    assert "resuming at step 6 of 12, the last checkpoint" in printed.out
    assert "train int: 12/12 steps" in printed.err  # the progress count starts at the checkpoint's step
    # Resumed again once finished: its result, and a line saying there was nothing left to train.
    assert train(tmp_path / "int", resume=True)["test_loss"] == ref["test_loss"]
    assert capsys.readouterr().out == (f"{tmp_path / 'int'} finished at step 12 (its result.json): nothing to resume; "
                                       f"--restart trains it again\n")
    train(tmp_path / "int", resume=True, quiet=True)
    assert capsys.readouterr().out == ""


def test_quiet_hides_progress_and_summary_lines_but_not_warnings(tmp_path, capsys):
    """--quiet is "no progress display": a warmup that never ends and parallel=fsdp2 outside torchrun
    (one process after all) still say so on stderr, where they were hidden with the progress before; without
    --quiet the plan and each evaluation's line are shown."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2, warmup_steps=5, parallel="fsdp2"),
          quiet=True)
    captured = capsys.readouterr()
    assert "warmup_steps=5 >= the run's 2 steps" in captured.err
    assert "parallel=fsdp2 applies under torchrun only" in captured.err
    assert "tokenizer:" not in captured.out and "step 2: valid" not in captured.out + captured.err
    train(tmp_path / "shown", *tiny_configs(data, max_steps=2, eval_every=2))  # what --quiet leaves out
    captured = capsys.readouterr()
    assert "tokenizer:" in captured.out and "step 2: valid loss " in captured.err and "(best)" in captured.err


def test_existing_run_needs_resume(tmp_path, capsys):
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    code = cli_main(["train", "--data", str(data), "--out", str(tmp_path / "run")])
    assert code == 2 and "pass --resume" in capsys.readouterr().err


def test_train_from_python_releases_the_runs_lock_when_it_returns_or_fails(tmp_path, monkeypatch):
    """train() holds the run directory's lock while it trains and lets go when it returns or raises, as the end of
    `gbattn train` does: held on, the directory would stay "in use by another gbattn process" for every other process
    (a `gbattn train --resume`, another script) until the Python session that trained it ended."""
    import fcntl

    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    train_killed_at(3, tmp_path / "killed", *tiny_configs(data, max_steps=4, eval_every=2), monkeypatch)
    for run in (tmp_path / "run", tmp_path / "killed"):
        fd = os.open(run / ckpt.LOCK, os.O_RDWR)
        try:  # another open file takes the lock as another process would: refused while it is still held
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_resume_of_a_run_killed_before_its_config_says_to_start_it_again(tmp_path, capsys):
    """kill -9 during data preparation (the token cache being built, under torchrun too) leaves the run directory
    with its lock alone; `train --resume` then asked 'config.json not found: is RUN a gbattn run directory?'. It now
    says that the run had not trained yet and how to start it; started so, it trains."""
    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    run.mkdir()
    (run / ckpt.LOCK).write_text("12345\n")  # what the killed process left
    code = cli_main(["train", "--resume", "--out", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"gbattn: error: {run} holds no run to resume (no config.json: a run stopped before "
                                 f"writing it had not trained yet): start it with the command that started it, without "
                                 f"--resume\n")
    train(run, *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    assert (run / ckpt.RESULT).is_file()


def test_corrupted_checkpoint_is_a_clear_error(tmp_path, capsys):
    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train(run, *tiny_configs(data, max_steps=4, eval_every=2), quiet=True)
    (run / ckpt.RESULT).unlink()  # pretend it did not finish
    blob = (run / ckpt.CHECKPOINT).read_bytes()
    (run / ckpt.CHECKPOINT).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        train(run, resume=True, quiet=True)
    code = cli_main(["train", "--resume", "--out", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "truncated or corrupted" in err


class _Interrupted(io.FileIO):
    """A file whose first write lands half its bytes, then the process is interrupted (Ctrl-C)."""

    def write(self, data) -> int:
        super().write(memoryview(data)[: len(data) // 2])
        raise KeyboardInterrupt


def test_atomic_save_keeps_previous_file_on_crash(tmp_path, monkeypatch):
    path = tmp_path / "x.pt"
    ckpt.save_checkpoint({"model": {"w": torch.ones(2)}}, path)
    monkeypatch.setattr(files, "open", lambda name, mode: _Interrupted(name, "w"), raising=False)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint({"model": {"w": torch.zeros(2)}}, path)
    monkeypatch.undo()
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no half-written temporary file


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    data = write_corpus(tmp_path / "c")
    original = Trainer._train_step

    def poison_at_6(self, step):
        if step == 6:
            with torch.no_grad():
                self.model.wte.weight[0, 0] = float("nan")
                self.model.wte.weight[1:, 0] = float("nan")
        return original(self, step)

    monkeypatch.setattr(Trainer, "_train_step", poison_at_6)
    with pytest.raises(TrainingDiverged, match="loss became nan in step 7"):
        train(tmp_path / "run", *tiny_configs(data), quiet=True)
    state = ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)
    assert state["step"] == 4
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "non-finite loss" and events[-1]["step"] == 6
    # A run of a comparison says how to start the comparison again (its directory refuses other settings).
    with pytest.raises(TrainingDiverged, match=r"start again with other settings: gbattn compare \.\.\. with another"):
        train(tmp_path / "compared", *tiny_configs(data), quiet=True, extra={"label": "gba-m2"})


def test_an_infinite_loss_stops_as_a_nan_does(tmp_path, monkeypatch):
    """A loss of +inf (no NaN: without clipping the gradient norm does not join it) stops the run at its step."""
    data = write_corpus(tmp_path / "c")
    original = Trainer._train_step

    def infinite_at_6(self, step):
        value = original(self, step)
        return float("inf") if step == 6 else value

    monkeypatch.setattr(Trainer, "_train_step", infinite_at_6)
    with pytest.raises(TrainingDiverged, match="loss became inf in step 7"):
        train(tmp_path / "run", *tiny_configs(data, grad_clip=0.0), quiet=True)
    assert ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)["step"] == 4


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_an_infinite_gradient_with_a_finite_loss_also_stops(tmp_path, monkeypatch, grad_clip):
    """A gradient that overflows while the loss stays finite stops the run before the optimizer steps
    on it (the gradient norm joins the checked value), also without clipping (grad_clip=0 checked the loss alone:
    AdamW stepped onto NaN weights, and the run kept them as its 'last good checkpoint', which --resume refused)."""
    data = write_corpus(tmp_path / "c")
    original, seen = Trainer._train_step, []

    def overflow_at_6(self, step):
        if step != 6:
            return original(self, step)
        hook = self.model.wte.weight.register_hook(lambda g: g * float("inf"))
        before = self.model.wte.weight.detach().clone()
        try:
            value = original(self, step)
        finally:
            hook.remove()
        seen.append(torch.equal(before, self.model.wte.weight.detach()))  # not stepped
        return value

    monkeypatch.setattr(Trainer, "_train_step", overflow_at_6)
    # named as the gradient's, with the step's finite loss (it said "loss became nan", the norm folded into the loss)
    with pytest.raises(TrainingDiverged, match=r"^the gradient norm became (inf|nan) \(loss \d\.\d+\) in step 7: "
                                               r"stopped; the last good checkpoint \(step 4\)"):
        train(tmp_path / "run", *tiny_configs(data, grad_clip=grad_clip), quiet=True)
    assert seen == [True]
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "non-finite gradient"


def test_a_non_finite_validation_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, monkeypatch):
    """Weights that are finite can give NaN outputs (an update too large): the validation loss was NaN, never below
    the best, so the point was logged and checkpointed as the run's last good state, and a run whose last update did
    it ended with exit 0 and every figure null. It stops the run as a non-finite training loss does."""
    from gbattn.eval.perplexity import EvalResult

    data = write_corpus(tmp_path / "c")
    original, calls = Trainer._evaluate, []

    def nan_at_the_second(self, split):
        calls.append(split)
        result = original(self, split)
        return EvalResult(float("nan"), result.tokens, None) if len(calls) == 2 else result

    monkeypatch.setattr(Trainer, "_evaluate", nan_at_the_second)
    with pytest.raises(TrainingDiverged, match=r"^the validation loss became nan after step 4: stopped; the last good "
                                               r"checkpoint \(step 2\) is kept"):
        train(tmp_path / "run", *tiny_configs(data, max_steps=6, eval_every=2), quiet=True)
    assert ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)["step"] == 2
    assert ckpt.load_checkpoint(tmp_path / "run" / ckpt.BEST)["step"] == 2
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert events[-1] == {"event": "stop", "reason": "non-finite validation loss", "step": 4, "valid_loss": "nan"}
    assert not (tmp_path / "run" / ckpt.RESULT).exists()


def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    """2 processes x 4 rows == 1 process x 8 rows (same global batch), dropout off."""
    data = write_corpus(tmp_path / "c")
    common = ["--preset", "paper-small", "--attn", "boosted", "--data", str(data), "--tokenizer", "char", "--quiet",
              "--set", "dropout=0.0", "--set", "batch_size=8", "--set", "max_steps=6", "--set", "eval_every=3",
              "--set", "warmup_steps=2", "--set", "lr=3e-3", "--set", "train_tokens=null", "--set", "eval_tokens=null"]
    for k, v in TINY.items():
        common += ["--set", f"{k}={v}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([sys.executable, "-m", "gbattn.cli", "train", "--out", str(tmp_path / "one"), *common],
                            capture_output=True, text=True, env=env)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",
            "-m",
            "gbattn.cli",
            "train",
            "--out",
            str(tmp_path / "two"),
            *common,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = json.loads((tmp_path / "one" / ckpt.RESULT).read_text())
    two = json.loads((tmp_path / "two" / ckpt.RESULT).read_text())
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["device"] == f"{one['device']} x 2 processes" and "processes" not in one["device"]
    # Stated tolerance: float32 gradient all-reduce sums in a different order.
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-4)
    # the logged training loss is the global batch's mean, not the sum over processes
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-4)
    # each process draws dropout masks from a stream of its own (seeded apart), kept per process
    states = ckpt.load_checkpoint(tmp_path / "two" / ckpt.CHECKPOINT)["rng_per_rank"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


def test_a_single_file_splits_at_exact_character_fractions(tmp_path):
    text = "".join(f"{i:03d}\n" for i in range(250))  # 1,000 characters
    path = tmp_path / "t.txt"
    path.write_text(text)
    corpus = load_corpus(str(path), (0.9, 0.05, 0.05))
    parts = {s: "".join(corpus.lines(s)) for s in ("train", "valid", "test")}
    assert (parts["train"], parts["valid"], parts["test"]) == (text[:900], text[900:950], text[950:])
    nano = load_corpus(str(path), (0.9, 0.1, 0.0))  # nanoGPT's 90/10: test is the valid split
    assert corpus.notes == ["single file split by characters 0.90/0.05/0.05"]
    assert nano.notes == ["single file split by characters 0.90/0.10/0.00", NO_TEST_SPLIT]
    # fractions that two decimals would misstate are written as given (0.004 read 0.00: a test split of none)
    odd = load_corpus(str(path), (0.99, 0.006, 0.004))
    assert odd.notes == ["single file split by characters 0.99/0.006/0.004"]
    # (imported as corpus_mod's: a test_* or tested_* name imported into a test file is collected as a test)
    assert (corpus_mod.tested_split(corpus.notes), corpus_mod.tested_split(nano.notes)) == ("test", "valid")
    assert corpus_mod.test_split_note(corpus.notes) == ""
    assert corpus_mod.test_split_note(nano.notes) == " (this data has no test split: test is valid)"
    assert "".join(nano.lines("valid")) == "".join(nano.lines("test")) == text[900:]
    assert "".join(nano.lines("train")) == text[:900]
    # Valid takes the second fraction, test the third (unequal here); the same file split another
    # way is other data for the caches (another fingerprint).
    corpus = load_corpus(str(path), (0.8, 0.15, 0.05))
    parts = {s: "".join(corpus.lines(s)) for s in ("train", "valid", "test")}
    assert (parts["train"], parts["valid"], parts["test"]) == (text[:800], text[800:950], text[950:])
    assert corpus.fingerprint != load_corpus(str(path), (0.9, 0.05, 0.05)).fingerprint
    assert corpus.fingerprint == load_corpus(str(path), (0.8, 0.15, 0.05)).fingerprint
    # Fractions between two characters: train ends at the floor, and without a test split valid runs to
    # the end of the file (int(0.9 n) + int(0.1 n) falls one short here: no character is dropped).
    odd = text + "abc"  # 1,003 characters
    path.write_text(odd)
    nano = load_corpus(str(path), (0.9, 0.1, 0.0))
    assert ("".join(nano.lines("train")), "".join(nano.lines("valid"))) == (odd[:902], odd[902:])


def test_a_single_file_is_cut_into_lines_at_newlines_only_as_a_folder_is(tmp_path):
    """str.splitlines also broke a single file's text at form feeds, U+2028, U+0085 and the like (a folder's files and
    run.perplexity break at newlines only): a byte-level tokenizer then saw other lines, and a line holding only such
    a character was dropped. The file's lines are the folder's; a file without such characters keeps its
    fingerprint, one with them gets another (its tokens were cut otherwise before)."""
    line = "First Citizen:\x0cBefore we\u2028\u2028proceed.\x85All:\x1cSpeak, speak.\n"
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.txt").write_text(line * 3)
    for split in ("valid", "test"):
        (tmp_path / "folder" / f"{split}.txt").write_text("x\n")
    (tmp_path / "one.txt").write_text(line * 3 + "x\n" * 20)  # (90% of it holds the three lines)
    single = list(load_corpus(str(tmp_path / "one.txt"), (0.9, 0.05, 0.05)).lines("train"))
    assert single[:3] == list(load_corpus(str(tmp_path / "folder")).lines("train")) == [line] * 3
    plain = tmp_path / "plain.txt"
    plain.write_text("to be or not to be\n" * 20)
    for path, kept in ((plain, True), (tmp_path / "one.txt", False)):
        before = hashlib.sha256(f"{corpus_mod.checked_digest(path)}|{corpus_mod.DEFAULT_SPLIT}".encode()).hexdigest()
        assert (load_corpus(str(path)).fingerprint == before) == kept


def test_text_lines_read_in_place_are_the_lines_a_file_reader_gives():
    """text_lines reads a split of a single file's text in place (io.StringIO's copy, and the three parts' copies,
    held a 201 MB corpus in 1.2 GB): its lines, of any part, are those Python's newline-only reader gives."""
    import io

    for text in ("", "\n", "a", "a\n", "\n\na\n\nb", "x\ry\n\x0cz\u2028w\n\x85", "line one\nline two\nlast"):
        assert list(corpus_mod.text_lines(text)) == list(io.StringIO(text, newline="\n")), repr(text)
        for start in range(len(text) + 1):
            for end in range(start, len(text) + 1):
                assert list(corpus_mod.text_lines(text, start, end)) == list(io.StringIO(text[start:end],
                                                                                        newline="\n"))


@pytest.mark.parametrize("names, chosen", [
    # both WikiText flavours present: the raw files (listed first) are the ones read
    (["wiki.train.raw", "wiki.train.tokens", "wiki.valid.raw", "wiki.valid.tokens", "wiki.test.raw",
      "wiki.test.tokens"], ["wiki.train.raw", "wiki.valid.raw", "wiki.test.raw"]),
    # gzip-compressed files with split words in their names
    (["ptb.train.txt.gz", "ptb.valid.txt.gz", "ptb.test.txt.gz"], ["ptb.train.txt.gz", "ptb.valid.txt.gz",
                                                                   "ptb.test.txt.gz"]),
    # "val" only as a word of its own: interval.txt is no validation split
    (["a.train.txt", "a.val.txt", "a.test.txt", "interval.txt"], ["a.train.txt", "a.val.txt", "a.test.txt"]),
    # "dev" as a word too: devices.txt beside dev.txt is no split (it was "several files could be the valid split",
    # and alone it was taken as the valid split)
    (["train.txt", "dev.txt", "test.txt", "devices.txt"], ["train.txt", "dev.txt", "test.txt"]),
    # raw valid and test beside a tokens-only train (no wiki.train.raw): the flavour with all three splits,
    # not <unk>-tokenized train with raw valid and test
    (["wiki.train.tokens.gz", "wiki.valid.raw", "wiki.valid.tokens", "wiki.test.raw", "wiki.test.tokens"],
     ["wiki.train.tokens.gz", "wiki.valid.tokens", "wiki.test.tokens"]),
    # both WikiText flavours gzipped: still the raw ones, not "several files"
    ([f"wiki.{s}.{k}.gz" for s in ("train", "valid", "test") for k in ("raw", "tokens")],
     ["wiki.train.raw.gz", "wiki.valid.raw.gz", "wiki.test.raw.gz"]),
    # macOS's hidden ._ copies and files of other kinds that name a split are not splits
    (["ptb.train.txt", "._ptb.train.txt", "ptb.valid.txt", "ptb.test.txt", "train_log.json", "test_scores.csv"],
     ["ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"]),
    # names in capitals, as Windows tools may write them; a gzip file named .GZ is still gzip
    (["TRAIN.TXT", "VALID.TXT", "TEST.TXT.GZ"], ["TRAIN.TXT", "VALID.TXT", "TEST.TXT.GZ"]),
    # the split word as the suffix (corpus.train, as some toolkits name splits) is a text file: the README reads any
    # name holding the split word, and these were "no train/valid/test file found" while the error listed them
    (["corpus.train", "corpus.dev", "corpus.test"], ["corpus.train", "corpus.dev", "corpus.test"]),
    (["a.train.gz", "a.valid", "a.test"], ["a.train.gz", "a.valid", "a.test"]),
    # a suffix that is no file type (a version, a year) is still a text file
    (["news.train.2024", "news.valid.2024", "news.test.2024"], ["news.train.2024", "news.valid.2024",
                                                               "news.test.2024"]),
])
def test_split_files_are_found_by_name(tmp_path, names, chosen):
    for name in names:
        write_text(tmp_path / name, f"{name}\n")
    corpus = load_corpus(str(tmp_path))
    assert ["".join(corpus.lines(s)) for s in ("train", "valid", "test")] == [f"{n}\n" for n in chosen]
    assert corpus.notes == [f"{s}: {n}" for s, n in zip(("train", "valid", "test"), chosen)]  # the summaries' words


@pytest.mark.parametrize("names", [["wiki.train.raw", "wiki.train.raw.gz", "wiki.valid.raw", "wiki.test.raw"],
                                   ["train.txt", "train.txt.gz", "valid.txt", "test.txt"],
                                   ["ptb.train.txt", "ptb.train.txt.gz", "ptb.valid.txt", "ptb.test.txt"]])
def test_a_split_file_beside_its_gzip_copy_is_refused_for_every_naming(tmp_path, names):
    """wiki.train.raw beside wiki.train.raw.gz (`gzip -k`, then an edit to one) read the plain file without a word,
    while ptb.train.txt beside ptb.train.txt.gz was refused as two candidates: one rule for both namings now."""
    for name in names:
        write_text(tmp_path / name, f"{name}\n")
    plain = names[0]
    with pytest.raises(DataError, match=rf"several files could be the train split \({plain}, {plain}\.gz\)"):
        load_corpus(str(tmp_path))


def test_two_exact_names_for_one_split_are_refused(tmp_path):
    """valid.txt beside validation.txt: the first of the two names was read without a word."""
    for name in ("train.txt", "valid.txt", "validation.txt", "test.txt"):
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=r"several files could be the valid split \(valid.txt, validation.txt\)"):
        load_corpus(str(tmp_path))

def test_an_editors_backup_beside_a_split_is_no_split(tmp_path):
    """train.txt~ (an editor's backup) and #train.txt# (its autosave) beside train.txt: no second train split."""
    for name in ("train.txt", "train.txt~", "#train.txt#", "valid.txt", "test.txt"):
        write_text(tmp_path / name, f"{name}\n")
    assert "".join(load_corpus(str(tmp_path)).lines("train")) == "train.txt\n"


@pytest.mark.parametrize("names, split, listed", [
    (["train.txt", "ptb.train.txt", "valid.txt", "test.txt"], "train", "train.txt, ptb.train.txt"),
    (["train.txt", "val.txt", "validation.txt", "test.txt"], "valid", "validation.txt, val.txt"),
    (["wiki.train.raw", "wiki.valid.raw", "wiki.test.raw", "old.test.txt"], "test", "wiki.test.raw, old.test.txt"),
])
def test_a_file_named_for_a_split_beside_its_exact_name_is_refused(tmp_path, names, split, listed):
    """train.txt beside ptb.train.txt, validation.txt beside val.txt (with other text): the exact name was read and
    the other file ignored without a word, where two files of either kind alone were refused."""
    for name in names:
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=rf"several files could be the {split} split \({re.escape(listed)}\); keep one"):
        load_corpus(str(tmp_path))


def test_a_train_txt_beside_a_complete_wikitext_folder_is_refused_as_a_second_train_split(tmp_path):
    """Choosing the WikiText flavour with all three splits sets the other flavour's files aside, not a train.txt
    beside them: which of the two train files is meant is not said."""
    for name in ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw", "train.txt"):
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=r"several files could be the train split \(wiki.train.raw, train.txt\)"):
        load_corpus(str(tmp_path))


@pytest.mark.parametrize("names, shared", [(["train_val.txt", "test.txt"], "train or the valid"),
                                           (["ptb.train.txt", "dev_test.txt"], "valid or the test")])
def test_one_file_that_names_two_splits_is_refused(tmp_path, names, shared):
    """train_val.txt was read as both train and valid: validation scored on the training text."""
    for name in names:
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=f"could be the {shared} split; give each split its own file"):
        load_corpus(str(tmp_path))


def test_a_corpus_given_from_the_home_directory_is_named_as_given(tmp_path, monkeypatch):
    """--data ~/c was recorded (config.json's corpus, eval's other-data note) as this machine's home path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_corpus(tmp_path / "c")
    write_text(tmp_path / "one.txt", "some text\n" * 50)
    assert load_corpus("~/c").name == "~/c" and load_corpus("~/one.txt").name == "~/one.txt"


@pytest.mark.parametrize("name, copy", [
    ("valid.txt", b"line one\r\nline two\r\n" * 20), ("valid.txt", b"\xef\xbb\xbf" + b"line one\nline two\n" * 20),
    ("valid.txt", b"line one\rline two\r" * 20), ("valid.txt", b"line one\nline two\n" * 20 + b"\n"),
    ("valid.txt", (b"line one\nline two\n" * 20)[:-1]),
    ("valid.txt.gz", gzip.compress(b"line one\r\nline two\r\n" * 20, mtime=0)),
])
def test_a_split_reading_as_the_training_text_with_other_line_ends_or_a_bom_is_refused(tmp_path, name, copy):
    """valid.txt as train.txt with Windows line ends (or a byte order mark, old Mac line ends, a blank line more,
    no last newline, or gzip-compressed): its bytes differ, so it passed as held-out text, and validation scored
    the training text (the lines read are the same). A held-out file of about the same size is read and kept."""
    (tmp_path / "train.txt").write_bytes(b"line one\nline two\n" * 20)
    (tmp_path / name).write_bytes(copy)
    (tmp_path / "test.txt").write_bytes(b"other text\n")
    with pytest.raises(DataError, match=rf": the valid file {name} holds the same text as the train file train.txt"):
        load_corpus(str(tmp_path))
    # a split much smaller than train is not read to tell (a one-line train of 200 MB was read whole)
    from gbattn.data import corpus as corpus_mod

    (tmp_path / "small.txt").write_bytes(b"line one\n" * 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_mod, "open_text", lambda path: pytest.fail(f"{path} read"))
        assert not corpus_mod.same_text_read(tmp_path / "small.txt", tmp_path / "train.txt")
    (tmp_path / "small.txt").unlink()
    held_out = gzip.decompress(copy) if name.endswith(".gz") else copy
    (tmp_path / name).write_bytes(gzip.compress(held_out.replace(b"two", b"2")) if name.endswith(".gz")
                                  else held_out.replace(b"two", b"2"))
    assert "".join(load_corpus(str(tmp_path)).lines("valid")).count("line 2") == 20


def test_a_split_holding_the_training_text_or_a_split_word_inside_a_word_is_no_split(tmp_path):
    """valid.txt as a link to train.txt (or a copy of it) trained and validated on one text without a word; latest.txt
    was taken as the test split (test inside the word), as invalid.txt would be the valid one."""
    folder = tmp_path / "linked"
    folder.mkdir()
    write_text(folder / "train.txt", "some training text\n" * 20)
    write_text(folder / "test.txt", "other text\n")
    os.symlink("train.txt", folder / "valid.txt")
    with pytest.raises(DataError, match=r": the valid file valid.txt holds the same text as the train file train.txt, "
                                        r"so valid figures would be of the training text"):
        load_corpus(str(folder))
    (folder / "valid.txt").unlink()
    write_text(folder / "valid.txt", "held-out text\n")
    load_corpus(str(folder))  # (a test file like none of them: fine)
    words = tmp_path / "words"
    words.mkdir()
    for name in ("train.txt", "valid.txt", "latest.txt"):
        write_text(words / name, f"{name}\n")
    with pytest.raises(DataError, match=r"no test file found \(files seen: latest.txt, train.txt, valid.txt\)"):
        load_corpus(str(words))
    (words / "valid.txt").rename(words / "invalid.txt")
    with pytest.raises(DataError, match=r"no valid/test file found"):
        load_corpus(str(words))


def test_a_folder_without_split_files_lists_what_it_holds_and_points_a_lone_text_file_out(tmp_path):
    """The error lists the folder's first 12 entries (a directory marked as one) and counts the rest; only a folder
    holding a single text file (macOS's hidden ._ copy aside) and no split file at all (tiny-shakespeare's
    input.txt), or a train file alone, and no save_to_disk folder, is told to give that file itself."""
    expected = "expected one text file per split, e.g. wiki.train.raw, train.txt or ptb.train.txt (optionally .gz)"
    many = tmp_path / "many"
    (many / "a-folder").mkdir(parents=True)
    for i in range(12):
        (many / f"f{i:02d}.json").write_text("{}")
    seen = ", ".join(["a-folder (a directory)", *(f"f{i:02d}.json" for i in range(11))]) + " and 1 more"
    with pytest.raises(DataError, match=re.escape(f"no train/valid/test file found (files seen: {seen}); {expected}")
                       + "$"):
        load_corpus(str(many))
    single = "; a single text file is split by the split setting (default 90/5/5) when given itself: --data "
    for names, hint in ((["input.txt"], True), (["input.txt", "._input.txt"], True), (["input.txt", "more.txt"], False),
                        (["train.txt"], True), (["train.txt", "test.txt"], False), (["valid.txt"], False),
                        (["input.txt", "dataset_dict.json"], False),
                        (["input.txt", "notes.json"], True)):  # a file not read as text is no second text file
        folder = tmp_path / "-".join(names)
        folder.mkdir()
        for name in names:
            write_text(folder / name, "some text\n")
        with pytest.raises(DataError) as caught:
            load_corpus(str(folder))
        message = str(caught.value)
        assert message.endswith(single + str(folder / names[0])) if hint else single not in message, message


@pytest.mark.parametrize("name", ["data.jsonl", "rows.CSV", "d.json.gz", "t.tsv", "x.parquet", "r.ndjson"])
def test_a_file_of_records_is_refused_as_a_new_runs_data(tmp_path, capsys, name):
    """A .jsonl or .csv file given as --data was trained on as text, its syntax and field names with it (a decoded
    row read '{" text ": " sample ..."}'), without a word: a new run or comparison refuses it, before any folder."""
    path = tmp_path / name
    write_text(path, '{"text": "some text"}\n' * 50)
    said = f"--data {path}: a {Path(name.lower().removesuffix('.gz')).suffix} file holds records, not plain text"
    for argv in (["train", "--data", path, "--out", tmp_path / "run"],
                 ["compare", "--recipe", "cpu-char", "--data", path, "--out", tmp_path / "cmp"]):
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and err == f"gbattn: error: {said}, and gbattn reads a file as text: write the records' " \
                                    f"text to a .txt file, one document after another (README, 'Data')\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    # a file of that suffix that is not there is not said to hold records: the data's own "not found" answers
    code, _, err = run_cli(capsys, ["train", "--data", tmp_path / f"missing-{name}", "--out", tmp_path / "run"])
    assert code == 2 and "holds records" not in err and "missing-" in err, err


def test_a_run_trained_on_a_file_of_records_before_its_refusal_is_read_and_resumed_as_it_was(tmp_path, capsys,
                                                                                             monkeypatch):
    """The refusal is a new run's: a run trained on a .csv file by an earlier gbattn (or from Python) is evaluated,
    resumed and started from (--init-from) on it as before (it was refused everywhere, as if the file were gone)."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "lines.csv", "".join(f"line {i},the cat sat on the mat\n" for i in range(400)))
    model_cfg, train_cfg = tiny_configs("lines.csv", max_steps=2, eval_every=2)
    train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    code, _, err = run_cli(capsys, ["eval", "run"])
    assert code == 0, err
    (tmp_path / "run" / ckpt.RESULT).unlink()  # unfinished, as if killed during its test evaluation
    code, _, err = run_cli(capsys, ["train", "--resume", "--out", "run"])
    assert code == 0 and (tmp_path / "run" / ckpt.RESULT).is_file(), err
    code, _, err = run_cli(capsys, ["train", "--init-from", "run", "--out", "next", "--set", "max_steps=1"])
    assert code == 0, err
    # ... but a continuation given another file of records as its own --data is a new run's choice: refused
    write_text(tmp_path / "other.jsonl", '{"text": "the cat sat on the mat"}\n' * 400)
    code, _, err = run_cli(capsys, ["train", "--init-from", "run", "--data", "other.jsonl", "--out", "next2",
                                    "--set", "max_steps=1"])
    assert code == 2 and "--data other.jsonl: a .jsonl file holds records, not plain text" in err, err


@pytest.mark.parametrize("names, unread", [(["train.en", "valid.en", "test.en"], "test.en, train.en, valid.en"),
                                           (["train.txt", "valid.txt", "data_test.jsonl"], "data_test.jsonl")])
def test_a_split_file_of_another_suffix_is_named_as_not_read(tmp_path, names, unread):
    """fairseq's train.en, or a JSON-lines test file: the error said no such split file was found while listing
    the files that name the splits, without saying why they were passed over (their suffix)."""
    for name in names:
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=re.escape(f"; not read as text for their suffix: {unread} (gbattn reads "
                                                  f".txt, .raw, .tokens, a split word or no suffix, optionally .gz)")):
        load_corpus(str(tmp_path))


def test_a_hugging_face_save_to_disk_folder_is_named_as_such(tmp_path):
    """Its train/validation/test subfolders were listed as if text files were missing beside them."""
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train", "validation", "test"]}')
    for split in ("train", "validation", "test"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "state.json").write_text("{}")
    for folder in (tmp_path, tmp_path / "train"):  # a DatasetDict, or one Dataset
        with pytest.raises(DataError, match="this is a Hugging Face save_to_disk folder, which gbattn does not read"):
            load_corpus(str(folder))


def test_a_folder_mixing_raw_and_tokenized_wikitext_splits_is_refused(tmp_path):
    for name in ("wiki.train.raw", "wiki.valid.tokens", "wiki.test.tokens", "wiki.test.raw"):
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=r"mixes raw and <unk>-tokenized WikiText files \(train: wiki.train.raw, "
                                        r"valid: wiki.valid.tokens, test: wiki.test.raw\)"):
        load_corpus(str(tmp_path))


def test_a_txt_suffixed_raw_wikitext_split_beside_tokenized_ones_is_refused(tmp_path):
    """Some copies name the files wiki.test.raw.txt: found by the split word, such a raw test split beside
    <unk>-tokenized train and valid splits passed the flavour check, which knew only the exact names."""
    for name in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.raw.txt"):
        write_text(tmp_path / name, f"{name}\n")
    with pytest.raises(DataError, match=r"mixes raw and <unk>-tokenized WikiText files \(train: wiki.train.tokens, "
                                        r"valid: wiki.valid.tokens, test: wiki.test.raw.txt\)"):
        load_corpus(str(tmp_path))
    (tmp_path / "wiki.test.raw.txt").rename(tmp_path / "wiki.test.tokens.txt")  # one flavour: read
    assert "".join(load_corpus(str(tmp_path)).lines("test")) == "wiki.test.raw.txt\n"


def test_a_character_across_a_read_chunk_is_text_and_offsets_count_every_chunk(tmp_path):
    """Files are checked 1 MiB at a time: a two-byte character that straddles the boundary is valid
    UTF-8, a later chunk that starts like compressed data is text (only a file's start says it is compressed),
    and a NUL or a bad byte after the first MiB is reported at its offset in the file."""
    straddle = tmp_path / "straddle.txt"
    straddle.write_bytes(b"a" * (2**20 - 1) + "\u00e9\n".encode())
    assert "".join(load_corpus(str(straddle), (0.5, 0.25, 0.25)).lines("test")).endswith("a\u00e9\n")
    later = tmp_path / "later.txt"
    later.write_bytes(b"a" * (2**20 - 1) + b"\nBZh91AY&SY is text here\n")  # bzip2's magic opens the second MiB
    assert "".join(load_corpus(str(later), (0.5, 0.25, 0.25)).lines("test")).endswith("\nBZh91AY&SY is text here\n")
    for name, bad, why in (("nul.txt", b"\x00", "NUL byte"), ("latin1.txt", b"\xe9\n", "invalid byte")):
        (tmp_path / name).write_bytes(b"a" * (2**20 + 5) + bad)
        with pytest.raises(DataError, match=f"{why} at byte offset {2**20 + 5}"):
            load_corpus(str(tmp_path / name))
    # a NUL that is the first byte of a read chunk (of the file, or of its second MiB) is found too
    for start in (0, 2**20):
        (tmp_path / "nul-first.txt").write_bytes(b"a" * start + b"\x00text\n")
        with pytest.raises(DataError, match=f"looks binary \\(NUL byte at byte offset {start}\\)"):
            load_corpus(str(tmp_path / "nul-first.txt"))
    # likewise a UTF-16 byte order mark only at the file's start says it is UTF-16: at the second MiB it is a bad byte
    (tmp_path / "bom-later.txt").write_bytes(b"a" * 2**20 + codecs.BOM_UTF16_LE + b"text\n")
    with pytest.raises(DataError, match=f"is not UTF-8 text \\(invalid byte at byte offset {2**20}\\)$"):
        load_corpus(str(tmp_path / "bom-later.txt"))
    # a character cut by the read's 1 MiB boundary, then a bad byte: its offset counted the held bytes twice (+1)
    (tmp_path / "straddle.txt").write_bytes(b"a" * (2**20 - 1) + "\u00e9".encode() + b"b" * 9 + b"\xff")
    with pytest.raises(DataError, match=f"is not UTF-8 text \\(invalid byte at byte offset {2**20 + 10}\\)$"):
        load_corpus(str(tmp_path / "straddle.txt"))


def test_text_in_the_first_mebibyte_and_blank_lines_after_it_is_not_whitespace_only(tmp_path):
    """Files are checked 1 MiB at a time: a file whose words are all in its first chunk and whose later chunks hold
    only blank lines (plain or gzipped) has text; only text in no chunk at all is "holds only whitespace"."""
    content = "to be or not to be\n" + "\n" * 2**20
    for name in ("padded.txt", "padded.txt.gz"):
        write_text(tmp_path / name, content)
        assert "".join(load_corpus(str(tmp_path / name)).lines("train")).startswith("to be or not to be\n")


class _FakeDatasets:
    """The ``datasets`` module as corpus.py uses it: WikiText as three named splits, OpenWebText as
    one streamed train split of documents."""

    @staticmethod
    def load_dataset(dataset, config=None, split=None, streaming=False):
        if config is None:
            assert (split, streaming) == ("train", True)
            return [{"text": f"doc {i}\n" if i != 2 else "doc 2\n\nits second paragraph\n"} for i in range(402)]
        return {s: [{"text": f"{s} {i}\n"} for i in range(2)] for s in ("train", "validation", "test")}


def test_hugging_face_corpora_map_their_splits(monkeypatch):
    """WikiText's ``validation`` split is gbattn's valid; OpenWebText's documents i % 200 == 0 are
    valid, i % 200 == 1 test, the rest train. Each corpus is named by the name given (as results files name it)."""
    monkeypatch.setitem(sys.modules, "datasets", _FakeDatasets)
    wiki = load_corpus("wikitext-2-raw-v1")
    assert (wiki.name, load_corpus("openwebtext").name) == ("wikitext-2-raw-v1", "openwebtext")
    assert [list(wiki.lines(s)) for s in ("train", "valid", "test")] == [
        ["train 0\n", "train 1\n"], ["validation 0\n", "validation 1\n"], ["test 0\n", "test 1\n"]]
    owt = load_corpus("openwebtext")
    assert list(owt.lines("valid")) == ["doc 0\n", "doc 200\n", "doc 400\n"]
    assert list(owt.lines("test")) == ["doc 1\n", "doc 201\n", "doc 401\n"]
    train = list(owt.lines("train"))  # a document of several lines gives each line (its blank one too) apart
    assert len(train) == 398 and train[:4] == ["doc 2\n", "\n", "its second paragraph\n", "doc 3\n"]
    assert "doc 200\n" not in train


def test_a_split_is_named_train_valid_or_test(monkeypatch):
    """Every corpus takes gbattn's split names only: OpenWebText's reader, asked for the hub's own name of its
    validation split, would have given the training documents (the split it gives any name but valid and test)."""
    monkeypatch.setitem(sys.modules, "datasets", _FakeDatasets)
    for name in ("openwebtext", "wikitext-2-raw-v1"):
        with pytest.raises(ValueError, match="^split='validation'; choose one of train, valid, test$"):
            load_corpus(name).lines("validation")


class _OfflineDatasets:
    @staticmethod
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")


def test_a_hugging_face_name_that_is_also_a_local_folder_names_the_folder_when_the_hub_fails(tmp_path, monkeypatch):
    """A bare name such as wikitext-2-v1 is the hub's dataset even where a folder of that name is in
    the working directory: without the hub the error says how to use the folder (./NAME). The local copy it
    names has the files of that flavour (.tokens for the <unk>-tokenized -v1 names, .raw for -raw-v1)."""
    monkeypatch.setitem(sys.modules, "datasets", _OfflineDatasets)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as plain:
        load_corpus("wikitext-2-v1")
    assert "./wikitext-2-v1" not in str(plain.value)
    assert "a directory with wiki.train.tokens/wiki.valid.tokens/wiki.test.tokens" in str(plain.value)
    with pytest.raises(DataError, match="a directory with wiki.train.raw/wiki.valid.raw/wiki.test.raw"):
        load_corpus("wikitext-103-raw-v1")
    # (openwebtext was told to make a folder of WikiText's file names)
    with pytest.raises(DataError, match="a local copy: a directory with train.txt/valid.txt/test.txt, or a single"):
        load_corpus("openwebtext")
    write_corpus(tmp_path / "wikitext-2-v1")
    with pytest.raises(DataError, match=r"; \./wikitext-2-v1 is here, but a bare name is the hub's dataset: pass "
                                        r"--data \./wikitext-2-v1 to use the local one$"):
        load_corpus("wikitext-2-v1")
    # named as a path: the bare name recorded (a run's corpus, a comparison's data) was the hub's dataset again
    assert load_corpus("./wikitext-2-v1").name == "./wikitext-2-v1"


def test_a_split_setting_is_refused_for_a_hub_corpus():
    """A hub corpus comes in its own splits: --set split (which cuts a single text) would be ignored, so it is
    refused, as for a local directory."""
    from gbattn.data.corpus import check_split_setting

    with pytest.raises(DataError, match=r"--set split cuts a single text file by characters; --data "
                                        r"wikitext-2-raw-v1 names a corpus in splits \(train, valid and test\): "
                                        r"leave split out, or give one text file"):
        check_split_setting("wikitext-2-raw-v1", {"split": [0.8, 0.1, 0.1]})
    check_split_setting("wikitext-2-raw-v1", {})


def test_a_split_setting_is_refused_for_a_folder_given_with_a_tilde_and_kept_for_the_bundled_corpus(tmp_path,
                                                                                                  monkeypatch):
    """``--data ~/corpus`` names a folder in the home directory (the split setting is refused there as for any
    folder), while ``tiny-shakespeare`` is the shipped text even where a folder of that name is here."""
    from gbattn.data.corpus import check_split_setting

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in ("corpus", "tiny-shakespeare"):
        (tmp_path / name).mkdir()
    with pytest.raises(DataError, match="^--set split cuts a single text file by characters; --data ~/corpus is a "
                                        "folder"):
        check_split_setting("~/corpus", {"split": [0.8, 0.1, 0.1]})
    check_split_setting("tiny-shakespeare", {"split": [0.8, 0.1, 0.1]})


class _DatasetsOfAnotherError:
    @staticmethod
    def load_dataset(*args, **kwargs):
        raise ValueError("BuilderConfig 'wikitext-2-raw-v1' not found")


def test_an_optional_package_installed_but_failing_to_import_is_one_line_that_says_so(tmp_path, monkeypatch):
    """datasets 2.14.0 (allowed then) with pyarrow 26 failed to import: a 49-line traceback for a corpus by its hub
    name; matplotlib 3.7 with numpy 2 was "figures need matplotlib: pip install 'gbattn[plot]'", a line that changed
    nothing, as it was installed. A package that fails to import, its own error or a dependency it lacks, is now one
    line that says so and names the error; one not installed is still told as not installed."""
    from gbattn.errors import optional_module

    for name, code in (("datasets", "raise AttributeError(\"module 'pyarrow' has no attribute 'PyExtensionType'\")"),
                       ("lacking", "import not_a_package_here"), ("halfway", "raise ImportError('numpy.core.multiarray "
                                                                             "failed\\n\\n  to import')")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(code + "\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DataError, match=r"could not load 'wikitext-2-raw-v1' from the Hugging Face hub \(a corpus by "
                                        r"its Hugging Face name needs datasets, which is installed but fails to import "
                                        r"\(AttributeError: module 'pyarrow' has no attribute 'PyExtensionType'\): "
                                        r"install versions that work together: pip install -U 'gbattn\[hf\]'\); "):
        load_corpus("wikitext-2-raw-v1")
    for name, error in (("lacking", "ModuleNotFoundError: No module named 'not_a_package_here'"),
                        ("halfway", "ImportError: numpy.core.multiarray failed to import")):  # one line
        with pytest.raises(UserError) as told:
            optional_module(name, "plot", "figures need")
        assert str(told.value) == (f"figures need {name}, which is installed but fails to import ({error}): install "
                                   f"versions that work together: pip install -U 'gbattn[plot]'")
    with pytest.raises(UserError) as told:
        optional_module("absent_package.sub", "plot", "figures need")
    assert str(told.value) == "figures need absent_package, which is not installed: pip install 'gbattn[plot]'"
    # a Hugging Face checkpoint's weights (upcycle's source) without safetensors: named as the file they are, not as
    # "an exported directory"
    from gbattn.rundir import read_safetensors

    class NotInstalled:  # finds no safetensors, as Python without it
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "safetensors":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    for name in [m for m in sys.modules if m.split(".")[0] == "safetensors"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled(), *sys.meta_path])
    with pytest.raises(UserError) as told:
        read_safetensors(tmp_path / "model.safetensors", "cpu")
    assert str(told.value) == ("reading model.safetensors needs safetensors, which is not installed: pip install "
                               "'gbattn[transformers]'")


def test_a_hub_corpus_that_cannot_load_is_one_data_error_whatever_went_wrong(monkeypatch):
    """Without the `datasets` package, or with any error of the hub or its cache (not only a connection error), the
    hub name is one DataError saying what went wrong and how to give a local copy; a hub address whose host name
    is malformed (HF_ENDPOINT mistyped) is a host without an address, not a crash, and huggingface_hub missing
    leaves the hub's error as it is."""
    from gbattn.data.corpus import _host_resolves

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DataError, match=r"a corpus by its Hugging Face name needs datasets, which is not installed: "
                                        r"pip install 'gbattn\[hf\]'\); download it once"):
        load_corpus("wikitext-2-raw-v1")
    monkeypatch.setitem(sys.modules, "datasets", _DatasetsOfAnotherError)
    with pytest.raises(DataError, match=r"from the Hugging Face hub \(ValueError: BuilderConfig 'wikitext-2-raw-v1' "
                                        r"not found\); download it once"):
        load_corpus("wikitext-2-raw-v1")
    assert _host_resolves("https://" + "a" * 64 + ".example") is False
    # without huggingface_hub (nothing to put offline) the error is still the hub's own, not one of gbattn's
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setitem(sys.modules, "datasets", _OfflineDatasets)
    with pytest.raises(DataError, match=r"from the Hugging Face hub \(ConnectionError: Couldn't reach"):
        load_corpus("wikitext-2-raw-v1")


@pytest.mark.parametrize("resolves, proxy, no_proxy", [(False, "", ""), (True, "", ""),
                                                       (False, "http://proxy.example:3128", ""),
                                                       (False, "", "localhost,127.0.0.1")])
def test_the_hub_is_asked_offline_where_its_host_has_no_address(tmp_path, monkeypatch, resolves, proxy, no_proxy):
    """Without the network, huggingface_hub retried each request for about half a minute before the one-line
    error (a hub name for --data, --tokenizer gpt2): where the hub's host has no address, its offline mode is
    on while gbattn asks it (a cached copy still loads), and off again after; where it has one, it stays off.
    Behind a proxy the host need not resolve here (the proxy resolves it): it stays off too. NO_PROXY alone (hosts to
    reach without a proxy, common in CI) is no proxy: it was taken for one, and the error took 27 s, not 3."""
    import socket

    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    if proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy)
    if no_proxy:
        monkeypatch.setenv("NO_PROXY", no_proxy)
    offline_expected = not resolves and not proxy

    from huggingface_hub import constants as hub
    from tokenizers import Tokenizer as Backend

    def getaddrinfo(host, *args, **kwargs):
        if not resolves:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 443))]

    offline_while_asked = []

    class Datasets:
        @staticmethod
        def load_dataset(*args, **kwargs):
            offline_while_asked.append(hub.is_offline_mode())
            raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")

    def from_pretrained(*args, **kwargs):
        offline_while_asked.append(hub.is_offline_mode())
        raise OSError("offline")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setitem(sys.modules, "datasets", Datasets)
    monkeypatch.setattr(Backend, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match="could not load 'wikitext-2-raw-v1' from the Hugging Face hub"):
        load_corpus("wikitext-2-raw-v1")
    with pytest.raises(DataError, match="could not fetch the GPT-2 tokenizer"):
        get_tokenizer("gpt2", load_corpus(str(write_corpus(tmp_path / "c"))))
    assert offline_while_asked == [offline_expected] * 2 and hub.HF_HUB_OFFLINE is False


def test_bpe_trains_on_the_first_non_empty_training_lines(tmp_path, monkeypatch):
    """The paper's BPE sees the first BPE_TRAIN_LINES non-empty lines of the train split only (the
    paper's 100k; 3 here)."""
    assert tokenizer_mod.BPE_TRAIN_LINES == 100_000
    data = tmp_path / "c"
    data.mkdir()
    (data / "train.txt").write_text("one two\n\nthree four\n   \nfive six\nseven eight\n")
    (data / "valid.txt").write_text("valid words\n")
    (data / "test.txt").write_text("test words\n")
    seen = []
    real_train = tokenizer_mod._train_bpe
    monkeypatch.setattr(tokenizer_mod, "BPE_TRAIN_LINES", 3)
    monkeypatch.setattr(tokenizer_mod, "_train_bpe",
                        lambda lines, vocab_size: real_train(seen.extend(lines) or seen, vocab_size))
    get_tokenizer("bpe", load_corpus(str(data)), vocab_size=40, verbose=False)
    assert seen == ["one two\n", "three four\n", "five six\n"]


def test_prepared_data_follows_the_configs_caps_and_split(tmp_path):
    """train_tokens caps train, eval_tokens caps valid and test; a single file is split by the
    config's fractions; the splits asked for are the ones returned (eval's valid and test, not train), and those
    prepared first on a fresh cache leave the train split to a later training run."""
    from gbattn.config import TrainConfig
    from gbattn.data.prepare import prepare_data

    data = write_corpus(tmp_path / "c")
    cfg = TrainConfig(data=str(data), tokenizer="char", train_tokens=500, eval_tokens=70)
    splits = prepare_data(cfg, vocab_size=64, progress=False).splits
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [500, 70, 70]
    (tmp_path / "t.txt").write_text("".join(f"{i:03d}\n" for i in range(250)))  # 1,000 characters
    cfg = TrainConfig(data=str(tmp_path / "t.txt"), tokenizer="char", split=[0.5, 0.3, 0.2], train_tokens=None,
                      eval_tokens=None)
    splits = prepare_data(cfg, vocab_size=64, progress=False).splits
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [500, 300, 200]
    held_out = prepare_data(cfg, vocab_size=64, progress=False, needed=("valid", "test")).splits  # eval's splits
    assert sorted(held_out) == ["test", "valid"] and [len(held_out[s]) for s in ("valid", "test")] == [300, 200]
    # eval first on a fresh cache (another machine's run): its held-out-only entry is no training run's entry
    cfg = TrainConfig(data=str(data), tokenizer="char", train_tokens=400, eval_tokens=60)  # caps not cached yet
    held_out = prepare_data(cfg, vocab_size=64, progress=False, needed=("valid", "test")).splits
    assert [len(held_out[s]) for s in ("valid", "test")] == [60, 60]
    splits = prepare_data(cfg, vocab_size=64, progress=False).splits
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [400, 60, 60]  # (train was 0: the entry's)


def test_prepared_data_without_progress_prints_nothing(tmp_path, capsys):
    """eval and analyze prepare their data with progress=False: neither the BPE training line nor a tokenizing
    count is printed (with progress on, both are)."""
    from gbattn.config import TrainConfig
    from gbattn.data.prepare import prepare_data

    cfg = TrainConfig(data=str(write_corpus(tmp_path / "c")), tokenizer="bpe", train_tokens=500, eval_tokens=70)
    prepare_data(cfg, vocab_size=60, progress=True)
    out, err = capsys.readouterr()
    assert "training a BPE tokenizer" in out and "tokenizing train: 500/500 tokens" in err
    prepare_data(cfg, vocab_size=61, progress=False)  # another tokenizer: trained and tokenized again, quietly
    assert capsys.readouterr() == ("", "")


def test_the_held_out_splits_of_a_run_are_prepared_quietly(tmp_path, capsys):
    """eval and analyze print their figures only: tokenizing a run's valid and test splits (no token cache entry
    at hand) prints no progress count, and the splits are the run's held-out ones only."""
    from types import SimpleNamespace

    from gbattn.config import TrainConfig
    from gbattn.data.prepare import prepare_run_data

    data = write_corpus(tmp_path / "c")
    tokenizer = get_tokenizer("char", load_corpus(str(data)), verbose=False)
    run = SimpleNamespace(train_cfg=TrainConfig(data=str(data), tokenizer="char", eval_tokens=70), run_dir=tmp_path,
                          model_cfg=SimpleNamespace(vocab_size=tokenizer.vocab_size), tokenizer=tokenizer,
                          data_fingerprint=load_corpus(str(data)).fingerprint, checkpoint="best")
    capsys.readouterr()
    for split in ("valid", "test"):  # the split asked for alone
        prepared = prepare_run_data(run, None, allow_other_data=False, split=split)
        assert list(prepared.splits) == [split] and len(prepared.splits[split]) == 70
    assert capsys.readouterr() == ("", "")


def test_the_other_data_note_names_data_other_than_the_runs_only():
    """eval's note beside its figures: nothing for the run's own data or for a run that recorded no corpus (an
    upcycled checkpoint), else both fingerprints."""
    from types import SimpleNamespace

    from gbattn.data.prepare import Data, other_data_note

    data = Data(tokenizer=None, splits={}, corpus_name="c", corpus_fingerprint="f" * 64, notes=[])
    assert other_data_note(SimpleNamespace(data_fingerprint=None), data) == ""
    assert other_data_note(SimpleNamespace(data_fingerprint="f" * 64), data) == ""
    assert other_data_note(SimpleNamespace(data_fingerprint="e" * 64), data) == (
        f"evaluated on c, not the data the run was trained on (fingerprint {'e' * 16} recorded, {'f' * 16} here)")


def test_char_vocabulary_covers_every_split(tmp_path):
    """A character seen only in valid or test is in the char vocabulary: every split encodes."""
    data = tmp_path / "c"
    data.mkdir()
    for split, text in (("train", "abc\n"), ("valid", "abz\n"), ("test", "a!c\n")):
        (data / f"{split}.txt").write_text(text)
    corpus = load_corpus(str(data))
    tok = get_tokenizer("char", corpus)
    assert tok.chars == sorted("\nabcz!")
    assert [tok.decode(tok.encode("".join(corpus.lines(s)))) for s in ("valid", "test")] == ["abz\n", "a!c\n"]


def test_a_byte_order_mark_is_no_text_and_windows_line_endings_are_newlines(tmp_path):
    """A file saved by Windows tools (a UTF-8 byte order mark, CRLF line ends), plain or gzipped, one
    file or one per split, reads as the same text written without them: the mark is in no split and
    no vocabulary, and a line ends in a newline only."""
    data = tmp_path / "c"
    data.mkdir()
    for split, text in (("train", "abc\r\nab\r\n"), ("valid", "ba\r\n"), ("test", "cab\r\n")):
        name = f"{split}.txt.gz" if split == "test" else f"{split}.txt"
        write_text(data / name, "\ufeff" + text)
    whole = tmp_path / "whole.txt"
    whole.write_bytes(b"\xef\xbb\xbf" + b"abc\r\n" * 20)
    for corpus, texts in ((load_corpus(str(data)), ["abc\nab\n", "ba\n", "cab\n"]),
                          (load_corpus(str(whole), (0.5, 0.25, 0.25)), ["abc\n" * 10, "abc\n" * 5, "abc\n" * 5])):
        assert ["".join(corpus.lines(s)) for s in ("train", "valid", "test")] == texts
        assert get_tokenizer("char", corpus).chars == sorted("\nabc")


def test_byte_level_tokens_decode_to_the_text_less_its_blank_lines(tmp_path):
    """README, Data: a byte-level tokenizer's ids decode to the corpus text exactly, except that blank
    lines (paragraph breaks) are left out for every tokenizer but char; char keeps them."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = "First line.\n\nSecond line.\n\n\nThird.\n" * 40
    path = tmp_path / "t.txt"
    path.write_text(text)
    corpus = load_corpus(str(path), (0.5, 0.25, 0.25))
    byte_level = Backend(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus.lines("train"), trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    (tmp_path / "tokenizer.json").write_text(byte_level.to_str())
    for kind in (f"hf={tmp_path / 'tokenizer.json'}", "char"):
        tok = get_tokenizer(kind, corpus)
        train = "".join(corpus.lines("train"))
        expected = train if kind == "char" else "".join(line for line in train.splitlines(True) if line.strip())
        assert tok.decode(tokenize_corpus(corpus, tok, progress=False)["train"]) == expected


def test_run_perplexity_of_a_split_text_scores_what_eval_scores_with_a_byte_level_tokenizer(tmp_path):
    """README, "Using gbattn from Python": ``run.perplexity(text)`` scores the text as `gbattn eval` scores a split.
    A split leaves blank lines out for every tokenizer but char, and a byte-level tokenizer's ids keep newlines: the
    whole text encoded at once scored the blank lines' newlines as tokens of their own (valid.txt scored more tokens
    than `gbattn eval --split valid`, at another loss). Its lines are split as a file is read: Windows's line ends
    too."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from gbattn.data.prepare import prepare_data
    from gbattn.eval.perplexity import evaluate

    data = tmp_path / "c"
    data.mkdir()
    for split, n, newline in (("train", 60, "\n"), ("valid", 12, "\r\n"), ("test", 12, "\n")):  # valid: Windows's
        text = f"the quick brown fox .{newline}{newline}jumps over it .{newline}"
        (data / f"{split}.txt").write_bytes(text.encode() * n)
    byte_level = Backend(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(["the quick brown fox .\n", "jumps over it .\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    (tmp_path / "tokenizer.json").write_text(byte_level.to_str())
    model_cfg, train_cfg = tiny_configs(data, tokenizer=f"hf={tmp_path / 'tokenizer.json'}", vocab_size=300,
                                        max_steps=1, eval_every=1, warmup_steps=0)
    train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    run = ckpt.load_run(tmp_path / "run")
    valid_ids = prepare_data(run.train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False).splits["valid"]
    expected = evaluate(run.model, valid_ids, run.seq_len)
    scored = run.perplexity((data / "valid.txt").read_bytes().decode())  # its line ends as they are, read as a file is
    assert scored.tokens == expected.tokens and scored.loss == pytest.approx(expected.loss, rel=1e-6)


def test_tokenizer_kinds_are_checked(tmp_path):
    """``hf`` needs a file (``hf=PATH``; a bare ``hf`` must not quietly fetch GPT-2's), only file
    kinds take one, and a char tokenizer's payload lists each character once."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    for kind in ("hf", "char=x", "bpe=x", "words"):
        with pytest.raises(DataError, match=f"--tokenizer {kind!r} is not allowed"):
            get_tokenizer(kind, corpus)
    for chars in (["a", "b", "a"], ["a", "bc"], [], ["a", 1]):
        with pytest.raises(ValueError, match="distinct single characters"):
            Tokenizer("char", json.dumps({"chars": chars}))
    # a tokenizer file's kind is one of gbattn's: another, with a valid Hugging Face payload, is not read as one
    bpe_json = get_tokenizer("bpe", corpus, vocab_size=60, verbose=False).payload
    with pytest.raises(ValueError, match="^tokenizer kind 'wordpiece'; expected one of bpe, gpt2, char, hf$"):
        Tokenizer("wordpiece", bpe_json)


def test_ctrl_c_inside_the_tokenizer_library_is_no_tokenizer_failure():
    """Errors of the tokenizers library (its panics too) are one DataError; a KeyboardInterrupt or SystemExit
    there is passed on as it is, never told as a damaged tokenizer.json."""
    for stop in (KeyboardInterrupt, SystemExit):
        with pytest.raises(stop), tokenizer_mod.hf_failures_as_data_errors("encoding"):
            raise stop()
    damaged = r"^boom \(the tokenizer failed while encoding: its tokenizer.json is damaged"
    with pytest.raises(DataError, match=damaged), tokenizer_mod.hf_failures_as_data_errors("encoding"):
        raise RuntimeError("boom")


def test_a_tokenizer_of_another_vocabulary_size_is_not_taken_from_the_cache(tmp_path):
    """Nor when its cache entry is copied over the other's (a valid entry, of another key): a 40-token BPE sized the
    model asked for 60 by its own 40 (the message blamed the config), and a char entry with a character more sized
    the model by it. The entry records what it holds; another one in its place is trained again."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    small = get_tokenizer("bpe", corpus, vocab_size=40, verbose=False)
    large = get_tokenizer("bpe", corpus, vocab_size=60, verbose=False)
    assert (small.vocab_size, large.vocab_size) == (40, 60)
    assert get_tokenizer("bpe", corpus, vocab_size=40, verbose=False).fingerprint == small.fingerprint
    entries = {}
    for path in (Path(os.environ["GBATTN_CACHE"]) / "tokenizers").iterdir():
        entries[json.loads(path.read_text())["key"].split("|")[1]] = path
    shutil.copy(entries["40"], entries["60"])
    assert get_tokenizer("bpe", corpus, vocab_size=60, verbose=False).fingerprint == large.fingerprint
    assert json.loads(entries["60"].read_text())["key"].split("|")[1] == "60"  # trained again in its place


def test_a_token_cache_entry_in_another_ones_place_is_built_again(tmp_path):
    """Entries copied, swapped or linked into one another's place (each valid: its own ids and digests) were read
    as the other's tokens, silently: a run trained on a training split of another cap, and eval scored another
    tokenizer's ids. An entry records what it holds (corpus, tokenizer, caps) and is built again where it is not
    what its place asks for."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    tok = get_tokenizer("char", corpus)
    cache = Path(os.environ["GBATTN_CACHE"]) / "tokens"
    small = {s: np.array(ids) for s, ids in tokenize_corpus(corpus, tok, {"train": 100}, progress=False).items()}
    large = {s: np.array(ids) for s, ids in tokenize_corpus(corpus, tok, {"train": 200}, progress=False).items()}
    assert len(small["train"]) == 100 and len(large["train"]) == 200
    by_cap = {json.loads((e / "meta.json").read_text())["caps"]["train"]: e for e in cache.iterdir()}
    for place in ("copy", "link"):
        shutil.rmtree(by_cap[200])
        if place == "copy":
            shutil.copytree(by_cap[100], by_cap[200])
        else:
            by_cap[200].symlink_to(by_cap[100])
        again = tokenize_corpus(corpus, tok, {"train": 200}, progress=False)
        for s in large:
            np.testing.assert_array_equal(again[s], large[s])
        assert not by_cap[200].is_symlink() and len(np.array(tokenize_corpus(corpus, tok, {"train": 100},
                                                                             progress=False)["train"])) == 100


def test_a_single_file_without_a_split_is_90_5_5_and_a_bundled_corpus_takes_the_split_given(tmp_path):
    """load_corpus's default rule is the module's 90/5/5; the bundled corpus is split by the
    fractions given (nanoGPT's 90/10: test is valid), under its own name."""
    text = "".join(f"{i:03d}\n" for i in range(250))  # 1,000 characters
    (tmp_path / "t.txt").write_text(text)
    corpus = load_corpus(str(tmp_path / "t.txt"))
    assert ["".join(corpus.lines(s)) for s in ("train", "valid", "test")] == [text[:900], text[900:950], text[950:]]
    nano = load_corpus("tiny-shakespeare", (0.9, 0.1, 0.0))
    assert nano.name == "tiny-shakespeare" and list(nano.lines("test")) == list(nano.lines("valid"))
    assert nano.fingerprint != load_corpus("tiny-shakespeare").fingerprint


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-be"])
def test_a_utf16_or_utf32_file_is_named_as_such_not_as_binary(tmp_path, encoding):
    """Windows PowerShell's ``>`` writes UTF-16 with a byte order mark: its NUL bytes read as 'looks binary'."""
    path = tmp_path / "notes.txt"
    path.write_bytes(("\ufeff" if encoding.endswith("-be") else "").encode(encoding) + "hello\n".encode(encoding))
    with pytest.raises(DataError, match="is UTF-16 or UTF-32 text .*; save it as UTF-8"):
        load_corpus(str(path))


def test_a_file_cut_inside_a_character_or_bad_past_two_chunks_is_named_at_its_offset(tmp_path):
    """A file whose last character is cut off is not UTF-8 text (not an error later, while reading);
    offsets count every chunk read before, not just the last one."""
    (tmp_path / "cut.txt").write_bytes(b"caf" + "\u00e9".encode()[:1])
    with pytest.raises(DataError, match="ends inside a character that starts at byte offset 3"):
        load_corpus(str(tmp_path / "cut.txt"))
    # (the offset was the file's length: 11 here, for a character starting at byte 9 with one of its bytes missing)
    (tmp_path / "cut3.txt").write_bytes(b"hello\nabc\xe2\x82")
    with pytest.raises(DataError, match="ends inside a character that starts at byte offset 9\\)"):
        load_corpus(str(tmp_path / "cut3.txt"))
    (tmp_path / "far.txt").write_bytes(b"a" * (2**21 + 7) + b"\x00")
    with pytest.raises(DataError, match=f"NUL byte at byte offset {2**21 + 7}"):
        load_corpus(str(tmp_path / "far.txt"))
    # in a gzip file (named so in capitals, as Windows may), the offset is in the decompressed data
    # (a NUL byte and a cut character were given at offsets in the decompressed data as if in the file)
    for content, why in ((b"a\xff", "invalid byte at byte offset 1"), (b"ab\x00", "NUL byte at byte offset 2"),
                         (b"caf" + "\u00e9".encode()[:1], "it ends inside a character that starts at byte offset 3")):
        (tmp_path / "zipped.TXT.GZ").write_bytes(gzip.compress(content))
        with pytest.raises(DataError, match=rf"\({why} of the decompressed data\)"):
            load_corpus(str(tmp_path / "zipped.TXT.GZ"))


def test_the_offset_of_a_bad_byte_counts_the_byte_order_mark_before_it(tmp_path):
    """A file saved by a Windows tool starts with a UTF-8 byte order mark: the offset of a bad byte after it counts
    the mark's three bytes, as a hex editor shows the file (plain, or in the decompressed data of a gzip file)."""
    content = codecs.BOM_UTF8 + b"ab\xff\n"
    (tmp_path / "bom.txt").write_bytes(content)
    (tmp_path / "bom.txt.gz").write_bytes(gzip.compress(content))
    for name, where in (("bom.txt", ""), ("bom.txt.gz", " of the decompressed data")):
        with pytest.raises(DataError, match=rf"is not UTF-8 text \(invalid byte at byte offset 5{where}\)$"):
            load_corpus(str(tmp_path / name))


def test_a_gzip_file_cut_short_is_one_data_error_naming_it(tmp_path):
    """A .gz file whose download stopped early (gzip's end-of-stream marker missing) is "named .gz but is not complete
    gzip data", one line naming the file, not an EOFError traceback; likewise a .gz file that holds no gzip data."""
    complete = gzip.compress(b"to be or not to be\n" * 50)
    for name, content in (("cut.txt.gz", complete[: len(complete) // 2]), ("no-trailer.txt.gz", complete[:-4]),
                          ("plain.txt.gz", b"to be or not to be\n")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=f"^--data file {re.escape(str(tmp_path / name))} is named .gz but is not "
                                            f"complete gzip data"):
            load_corpus(str(tmp_path / name))


def test_an_empty_data_file_is_called_empty(tmp_path):
    """A file of no bytes (plain, or gzip of nothing) is "is empty", not "holds only whitespace" (it holds nothing)."""
    from gbattn.data.corpus import checked_digest

    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.txt.gz").write_bytes(gzip.compress(b""))
    for name in ("empty.txt", "empty.txt.gz"):
        with pytest.raises(DataError, match=f"^--data file {re.escape(str(tmp_path / name))} is empty$"):
            checked_digest(tmp_path / name)


def test_a_data_file_that_cannot_be_read_is_one_data_error(tmp_path):
    """A split file gone between listing its folder and reading it (or a directory in its place) is one line
    naming the file and why, not an OSError traceback."""
    from gbattn.data.corpus import checked_digest

    for path, why in ((tmp_path / "gone.txt", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(DataError, match=f"^--data file {path} cannot be read \\({why}\\)$"):
            checked_digest(path)


def test_a_data_folder_that_cannot_be_listed_is_one_data_error(tmp_path, monkeypatch):
    """A folder without read permission (its listing refused) is one line naming it, not a PermissionError traceback
    (as root, the permission is not enforced: the refusal is made here)."""
    folder = write_corpus(tmp_path / "c")

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refused)
    with pytest.raises(DataError, match=f"^--data {folder} cannot be read \\(Permission denied\\)$"):
        load_corpus(str(folder))


def test_compressed_data_is_named_by_its_format_not_called_binary(tmp_path):
    """A gzip file without .gz in its name, an xz, bzip2, zip, zstd or 7z file, or gzip data gzipped again, was
    "looks binary (NUL byte at byte offset 3); give a UTF-8 text file": not a word of what it is or that naming it
    .gz would do."""
    import bz2
    import lzma
    import zipfile

    text = b"to be or not to be\n" * 50
    with zipfile.ZipFile(tmp_path / "corpus.zip", "w") as archive:
        archive.writestr("corpus.txt", text)
    cases = {"corpus.txt": (gzip.compress(text), "holds gzip-compressed data; name it .gz to have it read"),
             "corpus.txt.xz": (lzma.compress(text), "holds xz-compressed data; decompress it"),
             "corpus.txt.bz2": (bz2.compress(text), "holds bzip2-compressed data; decompress it"),
             "twice.txt.gz": (gzip.compress(gzip.compress(text)),
                              "holds gzip-compressed data \\(compressed twice\\); decompress it"),
             "corpus.zip": (None, "holds zip-compressed data; decompress it"),
             "corpus.txt.zst": (b"\x28\xb5\x2f\xfd" + bytes(range(64)), "holds zstd-compressed data; decompress it"),
             "corpus.7z": (b"7z\xbc\xaf\x27\x1c" + bytes(range(64)), "holds 7z-compressed data; decompress it")}
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=f"^--data file {tmp_path / name} {message}"):
            load_corpus(str(tmp_path / name))
    for start in ("BZh is", "BZh9 is"):  # bzip2's magic with its block size, but not its block mark: text
        (tmp_path / "BZh.txt").write_text(f"{start} a text's first word here\n" * 20)
        assert "".join(load_corpus(str(tmp_path / "BZh.txt")).lines("train")).startswith(start)


def test_data_paths_expand_the_home_directory_and_an_empty_name_is_refused(tmp_path, monkeypatch):
    """``--data ~/corpus`` is the home directory's; an empty --data is an error, never the working
    directory (even when that holds a corpus)."""
    write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_corpus("~/corpus").fingerprint == load_corpus(str(tmp_path / "corpus")).fingerprint
    monkeypatch.chdir(tmp_path / "corpus")
    with pytest.raises(DataError, match="--data is empty"):
        load_corpus("")


class _FingerprintedDatasets:
    """WikiText whose splits carry the ``datasets`` library's content fingerprints; records what was asked for."""

    asked: list = []
    fingerprints = {"train": "a", "validation": "b", "test": "c"}

    @classmethod
    def load_dataset(cls, dataset, config=None, **kwargs):
        cls.asked.append((dataset, config, logging.getLogger("datasets").level))
        splits = {}
        for s, fp in cls.fingerprints.items():
            rows = type("Split", (list,), {})([{"text": f"{s}\n"}])
            rows._fingerprint = fp
            splits[s] = rows
        return splits


def test_hugging_face_names_are_their_configs_fingerprinted_by_content_and_logging_put_back(monkeypatch):
    """Each WikiText name loads the config of that name; the fingerprint follows every split's
    content fingerprint; the libraries' loggers are quiet while loading and put back after, as is logging
    itself (disabled below CRITICAL while loading)."""
    logger = logging.getLogger("datasets")
    level, disabled = logger.level, logging.root.manager.disable
    monkeypatch.setattr(_FingerprintedDatasets, "asked", [])
    monkeypatch.setitem(sys.modules, "datasets", _FingerprintedDatasets)
    logger.setLevel(logging.INFO)
    try:
        names = ["wikitext-103-raw-v1", "wikitext-2-raw-v1", "wikitext-103-v1", "wikitext-2-v1"]
        prints = {name: load_corpus(name).fingerprint for name in names}
        assert [(d, c) for d, c, _ in _FingerprintedDatasets.asked] == [("Salesforce/wikitext", n) for n in names]
        assert {level for *_, level in _FingerprintedDatasets.asked} == {logging.CRITICAL}
        assert logger.level == logging.INFO and logging.root.manager.disable == disabled
        before = dict(_FingerprintedDatasets.fingerprints)
        for split in before:  # the content of any split changed: another corpus for the caches
            monkeypatch.setattr(_FingerprintedDatasets, "fingerprints", {**before, split: "changed"})
            assert load_corpus("wikitext-2-raw-v1").fingerprint != prints["wikitext-2-raw-v1"], split
    finally:
        logger.setLevel(level)


def test_the_gpt2_tokenizer_fetch_is_quiet_and_a_failure_one_line(tmp_path, monkeypatch, caplog):
    """--tokenizer gpt2 without the hub: nothing is logged while fetching (the hub's connection
    retries printed ten warning lines before the one-line error: its first import set its loggers'
    level back to WARNING, so quieting them beforehand was not enough); logging is put back after."""
    from tokenizers import Tokenizer as Backend

    def offline(name, *args, **kwargs):
        logging.getLogger("huggingface_hub").setLevel(logging.WARNING)  # what huggingface_hub's import does
        logging.getLogger("huggingface_hub.utils._http").warning("thrown while requesting HEAD")
        raise OSError("Name or service not known")

    monkeypatch.setattr(Backend, "from_pretrained", staticmethod(offline))
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    try:
        corpus = load_corpus(str(write_corpus(tmp_path / "c")))
        with caplog.at_level(logging.INFO), pytest.raises(DataError, match=r"^could not fetch the GPT-2 tokenizer"):
            get_tokenizer("gpt2", corpus)
        assert not [r for r in caplog.records if "thrown while requesting" in r.getMessage()]
        assert logging.root.manager.disable == logging.NOTSET
    finally:
        logger.setLevel(level)


def test_the_papers_bpe_splits_punctuation_and_numbers_its_specials_first(tmp_path):
    """Whitespace pre-tokenizer: punctuation is never merged into a word; ``<pad>`` is id 0 and
    ``<unk>`` id 1 (the order the paper lists them), and an unseen character encodes as ``<unk>``."""
    data = tmp_path / "c"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_text("cat.dog,cat.dog cat.dog\n" * (50 if split == "train" else 20))
    tok = get_tokenizer("bpe", load_corpus(str(data)), vocab_size=60, verbose=False)
    assert [tok.decode([i]) for i in tok.encode("cat.dog,cat")] == ["cat", ".", "dog", ",", "cat"]
    assert (tok.encode("<pad>"), tok.encode("<unk>"), tok.encode("\u00e9")) == ([0], [1], [1])


def test_decoding_shows_the_unknown_token_and_leaves_padding_out(tmp_path):
    """Decoded text left every special token out, ``<unk>`` too: WikiText v1's rare words (2.7% of WikiText-2's
    training words) and a generated unknown token read as nothing. ``<unk>`` is now shown as ``<unk>``, as the
    corpus writes it; ``<pad>`` is still left out unless asked for; the ids are unchanged."""
    tok = bpe_with_unknown_words(tmp_path / "c")
    ids = tok.encode("the <unk> mat \u00e9")
    assert ids[1] == ids[3] == tok.unknown_id == 1
    assert tok.decode([0, *ids, 0]) == "the <unk> mat <unk>" and tok.decode([1]) == "<unk>"
    assert tok.decode([0, *ids], skip_special=False) == "<pad> the <unk> mat <unk>"



def test_decoding_leaves_out_special_added_tokens_only():
    """An added token that is not special (a tokenizer's own word, a separator) is text: decoded as any token;
    only special ones (an end-of-text token) are left out."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.add_tokens(["<sep>"])
    backend.add_special_tokens(["<eos>"])
    tok = Tokenizer("hf", backend.to_str())
    sep, eos = backend.token_to_id("<sep>"), backend.token_to_id("<eos>")
    assert tok.decode([0, sep, 1, eos]) == "a <sep> b"
    assert tok.decode([0, sep, 1, eos], skip_special=False) == "a <sep> b <eos>"


@pytest.mark.parametrize("model", ["WordLevel", "WordPiece", "BPE", "Unigram"])
def test_an_unknown_token_spelled_otherwise_is_shown_too(model):
    """A tokenizer.json whose unknown token is a special token spelled otherwise (BERT's ``[UNK]``) had no
    unknown id (only ``<unk>`` was looked up), so decoding left it out as a special token: ``a zz b`` read back
    as ``a b``, a word silently missing. The unknown token is the one its model names."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}
    built = {"WordLevel": lambda: models.WordLevel(vocab, unk_token="[UNK]"),
             "WordPiece": lambda: models.WordPiece(vocab, unk_token="[UNK]"),
             "BPE": lambda: models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True),
             "Unigram": lambda: models.Unigram([(t, -1.0) for t in vocab], unk_id=1)}[model]()
    hf = HFTokenizer(built)
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["[PAD]", "[UNK]"])
    tok = Tokenizer("hf", hf.to_str())
    ids = tok.encode("a zz b")
    assert ids == [2, 1, 3] and tok.unknown_id == 1
    assert tok.decode([0, *ids]) == "a [UNK] b"
    from gbattn.hf.tokenization import hf_tokenizer  # an export names the same unknown token

    assert hf_tokenizer(tok, 64).unk_token == "[UNK]"


def test_a_unigram_tokenizers_unknown_token_at_id_0_is_shown():
    """sentencepiece numbers its unknown token 0: a Unigram model's ``unk_id`` of 0 is an unknown id (a test of
    truth, not of the type, would read it as none, and decoding would leave the unknown word out silently)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.Unigram([(t, -1.0) for t in ("<unk>", "<pad>", "a", "b")], unk_id=0))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<unk>", "<pad>"])
    tok = Tokenizer("hf", hf.to_str())
    ids = tok.encode("a zz b")
    assert ids == [2, 0, 3] and tok.unknown_id == 0 and tok.decode(ids) == "a <unk> b"


def test_a_tokenizers_added_tokens_count_in_its_size():
    """A tokenizer.json whose end-of-text token was added after its vocabulary (id 3 of a 3-word
    model): the size counts it, so the model has a row for it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>"])
    tok = Tokenizer("hf", backend.to_str())
    assert tok.vocab_size == 4 and tok.encode("a <|endoftext|>") == [0, 3]


def test_a_training_split_of_blank_lines_trains_no_bpe(tmp_path):
    """Only the two special tokens would be learnt: a one-line error, not a tokenizer of no words (a split file
    of blank lines is refused when read)."""
    data = tmp_path / "c"
    data.mkdir()
    (data / "train.txt").write_text("\n   \n\n")
    (data / "valid.txt").write_text("valid words\n")
    (data / "test.txt").write_text("test words\n")
    with pytest.raises(DataError, match="train.txt holds only whitespace"):
        load_corpus(str(data))
    (data / "text.txt").write_text(" \n" * 1000 + "words only in the valid and test splits\n")
    with pytest.raises(DataError, match="the training split holds no text"):
        get_tokenizer("bpe", load_corpus(str(data / "text.txt")), vocab_size=40, verbose=False)
    # A corpus no file check reads (a hub dataset whose rows are empty) holds no character to list: one line too
    empty = corpus_mod.Corpus(name="empty-rows", fingerprint="hf:empty", reader=lambda split: iter(["", ""]))
    with pytest.raises(DataError, match="^--data empty-rows holds no text$"):
        get_tokenizer("char", empty)


def test_a_tokenizer_file_is_read_from_a_path_holding_an_equals_sign_and_checked(tmp_path):
    """``--tokenizer hf=PATH`` splits at the first ``=`` only: a directory named ``vocab=3`` is part of
    the path; the directory itself is refused naming its tokenizer file; a JSON file that is no
    tokenizer is refused when named."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "vocab=3" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(backend.to_str())
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    for kind in ("hf", "gpt2"):
        tok = get_tokenizer(f"{kind}={path}", corpus)
        assert (tok.kind, tok.vocab_size, tok.encode("b a")) == (kind, 3, [1, 0])
    with pytest.raises(DataError, match=r"^--tokenizer hf=.*vocab=3 is a directory; name its tokenizer file: "
                                        r"--tokenizer hf=.*vocab=3/tokenizer.json$"):  # was "no such ... file"
        get_tokenizer(f"hf={path.parent}", corpus)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # JSON, but not a tokenizer
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        get_tokenizer(f"gpt2={tmp_path / 'config.json'}", corpus)
    # A run's own tokenizer.json (gbattn's record around the payload) is named as such, not as broken JSON.
    for own in (get_tokenizer("char", corpus), get_tokenizer("bpe", corpus, vocab_size=40, verbose=False)):
        own.save(tmp_path / f"{own.kind}-run.json")
        with pytest.raises(DataError, match=rf"^--tokenizer hf=.*{own.kind}-run.json is a gbattn run's tokenizer "
                                            rf"file \({own.kind}\), not a Hugging Face tokenizer.json: --tokenizer "
                                            rf"{own.kind} on that run's data and vocab_size builds the same one"):
            get_tokenizer(f"hf={tmp_path / f'{own.kind}-run.json'}", corpus)
    for kind in ("hf", "gpt2"):  # a file's tokenizer (or the hub's GPT-2): `--tokenizer hf` would be refused
        get_tokenizer(f"{kind}={path}", corpus).save(tmp_path / f"{kind}-run.json")
        with pytest.raises(DataError, match=rf"^--tokenizer hf=.*{kind}-run.json is a gbattn run's tokenizer file "
                                            rf"\({kind}\), not a Hugging Face tokenizer.json: gbattn export on that "
                                            rf"run writes it as a tokenizer.json \(or --init-from"):
            get_tokenizer(f"hf={tmp_path / f'{kind}-run.json'}", corpus)
    # transformers' tokenizer_config.json beside a tokenizer.json (the settings, not the tokenizer): the library's
    # parse error was cut mid-line ("expected `,` or `}` at line 1 column 17 (the tokenizer failed while reading its…")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                                "model_max_length": 2048}))
    with pytest.raises(DataError, match=r"^--tokenizer hf=.*tokenizer_config.json is a transformers "
                                        r"tokenizer_config.json \(a tokenizer's settings\), not the tokenizer: give "
                                        r"the tokenizer.json beside it$"):
        get_tokenizer(f"hf={tmp_path / 'tokenizer_config.json'}", corpus)
    # JSON with a kind but no payload, or a kind gbattn has not, is no run's file: only "not a valid tokenizer.json"
    # (nor is a JSON array, or one nested past Python's recursion limit: a RecursionError traceback once)
    for record in ({"kind": "bpe"}, {"kind": "sentencepiece", "payload": "{}"}, ["kind", "payload"],
                   "[" * 100_000 + "]" * 100_000):
        (tmp_path / "other.json").write_text(record if isinstance(record, str) else json.dumps(record))
        with pytest.raises(DataError, match=r"^--tokenizer hf=.*other.json: not a valid tokenizer.json"):
            get_tokenizer(f"hf={tmp_path / 'other.json'}", corpus)


def test_a_tokenizer_with_an_id_beyond_any_models_vocabulary_is_refused_as_its_file(tmp_path):
    """A tokenizer.json holding an id of a billion was "vocab_size=1000000001 must be an integer in [1, 16777216]",
    a setting the user never gave; a tokenizer cache entry edited so was that error too, not trained again."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from gbattn.config import MAX_VOCAB_SIZE

    path = tmp_path / "tokenizer.json"
    largest = Backend(models.WordLevel({"a": 0, "<unk>": MAX_VOCAB_SIZE - 1}, unk_token="<unk>")).to_str()
    assert Tokenizer("hf", largest).vocab_size == MAX_VOCAB_SIZE  # the largest vocabulary a model takes
    path.write_text(Backend(models.WordLevel({"a": 0, "<unk>": MAX_VOCAB_SIZE}, unk_token="<unk>")).to_str())
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    with pytest.raises(DataError, match=rf"^--tokenizer hf={path}: not a valid tokenizer.json \(ValueError: its "
                                        rf"largest token id is 16,777,216; a model takes ids below 16,777,216\)$"):
        get_tokenizer(f"hf={path}", corpus)
    bpe = get_tokenizer("bpe", corpus, vocab_size=40, verbose=False)
    [entry] = (tmp_path / "gbattn-cache" / "tokenizers").glob("bpe-*.json")
    hf = json.loads(bpe.payload)
    hf["model"]["vocab"]["huge"] = 10**9
    entry.write_text(json.dumps({"kind": "bpe", "payload": json.dumps(hf)}))
    assert get_tokenizer("bpe", corpus, vocab_size=40, verbose=False).fingerprint == bpe.fingerprint


def test_a_tokenizer_whose_post_processor_adds_an_id_it_does_not_hold_is_refused_as_its_file(tmp_path):
    """A post-processor's special token (a Llama tokenizer's <s>, put before every prompt) of an id the vocabulary does
    not hold escaped the size check, which counts the vocabulary: `gbattn upcycle` took such a tokenizer.json, and
    `gbattn generate` on the result ended in a traceback ("token id 99999 outside the vocabulary")."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, processors

    backend = Backend(models.WordLevel({"a": 0, "<s>": 1, "<unk>": 2}, unk_token="<unk>"))
    for start_id, refused in ((1, False), (99_999, True)):
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", start_id)])
        path = tmp_path / "tokenizer.json"
        path.write_text(backend.to_str())
        corpus = load_corpus(str(write_corpus(tmp_path / "c")))
        if not refused:  # a start token of the vocabulary: put before a prompt, not before a corpus's lines
            tok = get_tokenizer(f"hf={path}", corpus)
            assert (tok.encode("a"), tok.encode_batch(["a"])) == ([1, 0], [[0]])
            continue
        with pytest.raises(DataError, match=rf"^--tokenizer hf={path}: not a valid tokenizer.json \(ValueError: its "
                                            rf"post-processor adds token id 99,999, which its vocabulary does not "
                                            rf"hold\)$"):
            get_tokenizer(f"hf={path}", corpus)


@pytest.mark.parametrize("edit", ["two tokens share an id", "an unused id", "no <unk>", "<unk> given another id",
                                  "another model"])
def test_a_bpe_tokenizer_edited_by_hand_is_trained_again_in_the_cache_and_refused_in_a_run(tmp_path, edit):
    """A bpe cache entry (or a run's tokenizer.json) whose ids were edited parsed and was used as it was: the run
    trained on tokens that were not the corpus's (two words one id), or on a vocabulary of unused rows."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    bpe = get_tokenizer("bpe", corpus, vocab_size=40, verbose=False)
    hf = json.loads(bpe.payload)
    vocab = hf["model"]["vocab"]
    first, second = [token for token, i in vocab.items() if i in (5, 6)]
    if edit == "two tokens share an id":
        vocab[first] = vocab[second]
    elif edit == "an unused id":
        vocab["far"] = len(vocab) + 100
    elif edit == "no <unk>":
        del vocab["<unk>"]
        hf["added_tokens"] = hf["added_tokens"][:1]
        hf["model"]["unk_token"] = None
    elif edit == "<unk> given another id":  # ids 0 .. n-1 each naming one token still, <unk> 5 and the 6th token 1
        vocab["<unk>"], vocab[first] = vocab[first], vocab["<unk>"]
        next(t for t in hf["added_tokens"] if t["content"] == "<unk>")["id"] = vocab["<unk>"]
    else:
        hf["model"] = {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    edited = json.dumps({"kind": "bpe", "payload": json.dumps(hf)})
    [entry] = (tmp_path / "gbattn-cache" / "tokenizers").glob("bpe-*.json")
    entry.write_text(edited)
    assert get_tokenizer("bpe", corpus, vocab_size=40, verbose=False).payload == bpe.payload
    (tmp_path / "tokenizer.json").write_text(edited)
    with pytest.raises(CheckpointError, match=r"tokenizer.json is not a valid gbattn tokenizer file \(ValueError: "
                                              r"(not a bpe tokenizer as gbattn trains it|its tokens .* have one id)"):
        Tokenizer.load(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("edit", ["a character fewer", "a character more", "no fingerprint"])
def test_a_char_tokenizer_cache_entry_edited_by_hand_is_built_again(tmp_path, edit):
    """A cached char tokenizer short of a character made every later run on that corpus fail with "characters
    not in the tokenizer's vocabulary", blaming the data, until the cache was found and cleared; one with a
    character more sized the model by it. An entry records its fingerprint: one that differs is built again."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    char = get_tokenizer("char", corpus)
    [entry] = (tmp_path / "gbattn-cache" / "tokenizers").glob("char-*.json")
    record = json.loads(entry.read_text())
    assert record["fingerprint"] == char.fingerprint
    chars = char.chars[:-1] if edit == "a character fewer" else [*char.chars, "\u00e9"] if edit == "a character more" \
        else char.chars
    record["payload"] = json.dumps({"chars": chars})
    if edit == "no fingerprint":
        del record["fingerprint"]
    entry.write_text(json.dumps(record))
    again = get_tokenizer("char", corpus)
    assert (again.chars, again.fingerprint) == (char.chars, char.fingerprint)
    assert tokenize_corpus(corpus, again, progress=False)["train"].size > 0
    assert json.loads(entry.read_text())["fingerprint"] == char.fingerprint


def test_a_tokenizer_path_that_names_no_file_says_what_it_names(tmp_path, monkeypatch):
    """hf= (nothing after the =) was "is a directory; name its tokenizer file: --tokenizer hf=tokenizer.json"
    (the working directory); a FIFO was "no such tokenizer.json file"; a quoted ~ was not the home directory,
    as it is for --data; a near miss of a file's name got no hint, as it does for --data."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    home = tmp_path / "home"
    home.mkdir()
    (home / "tokenizer.json").write_text(get_tokenizer("bpe", corpus, vocab_size=40, verbose=False).payload)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "gone.json").symlink_to(tmp_path / "moved.json")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert get_tokenizer("hf=~/tokenizer.json", corpus).kind == "hf"
    for spec, message in (("hf=", "--tokenizer hf= names no file: give hf=PATH, the path of a tokenizer.json"),
                          ("gpt2= ", "--tokenizer gpt2=  names no file: give gpt2=PATH, the path of a tokenizer.json"),
                          ("hf=fifo.json", "--tokenizer hf=fifo.json: not a regular file (a device or a pipe)"),
                          ("hf=gone.json", f"--tokenizer hf=gone.json: a link to {tmp_path / 'moved.json'}, which "
                                           f"does not exist"),
                          ("hf=~/tokenizer.jsn", f"--tokenizer hf=~/tokenizer.jsn: no such tokenizer.json file (did "
                                                 f"you mean {str(home / 'tokenizer.json')!r}?)")):
        with pytest.raises(DataError) as caught:
            get_tokenizer(spec, corpus)
        assert str(caught.value) == message


def test_a_damaged_tokenizer_cache_entry_is_trained_again_and_every_kind_round_trips(tmp_path):
    """A cached tokenizer file that does not parse, or holds another kind, is replaced, not an error; a
    saved tokenizer reads back as the same kind with the same fingerprint (the token caches' key)."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    char = get_tokenizer("char", corpus)
    [cached] = (tmp_path / "gbattn-cache" / "tokenizers").iterdir()
    cached.write_text("{not json")
    assert get_tokenizer("char", corpus).fingerprint == char.fingerprint
    assert Tokenizer.load(cached).fingerprint == char.fingerprint
    bpe = get_tokenizer("bpe", corpus, vocab_size=60, verbose=False)
    # A valid tokenizer of another kind in an entry's place (the char one was returned for bpe): trained again, even
    # where it is a whole cache entry, its own fingerprint recorded and matching (another entry copied over it).
    [bpe_entry] = (tmp_path / "gbattn-cache" / "tokenizers").glob("bpe-*.json")
    bpe_entry.write_text(char.to_json(cache_key=json.loads(bpe_entry.read_text())["key"]))  # (its key, its place's)
    again = get_tokenizer("bpe", corpus, vocab_size=60, verbose=False)
    assert (again.kind, again.fingerprint) == ("bpe", bpe.fingerprint)
    for tok in (char, bpe, Tokenizer("hf", bpe.payload), Tokenizer("gpt2", bpe.payload)):
        tok.save(tmp_path / "tokenizer.json")
        back = Tokenizer.load(tmp_path / "tokenizer.json", expected_vocab=tok.vocab_size)
        assert (back.kind, back.payload, back.fingerprint) == (tok.kind, tok.payload, tok.fingerprint)


def test_a_char_tokenizer_file_of_another_size_than_the_model_is_refused_in_one_line(tmp_path):
    """A char tokenizer has no Hugging Face vocabulary to fall back on (the count older runs used): one of another
    size than the model's vocabulary is refused as not the model's, not an AttributeError."""
    Tokenizer("char", json.dumps({"chars": list("abc")})).save(tmp_path / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "tokenizer.json", expected_vocab=3).vocab_size == 3
    # smaller than the model's vocabulary: the model's embeddings may have been resized past it (transformers)
    with pytest.raises(CheckpointError, match=r"has 3 tokens but the model's vocabulary is 4: the tokenizer does not "
                                              r"belong to this model \(or the model's embeddings were resized past it, "
                                              r"as transformers' resize_token_embeddings does: .*\)$"):
        Tokenizer.load(tmp_path / "tokenizer.json", expected_vocab=4)
    with pytest.raises(CheckpointError, match="has 3 tokens but the model's vocabulary is 2: the tokenizer does not "
                                              "belong to this model$"):  # larger: no resizing makes that
        Tokenizer.load(tmp_path / "tokenizer.json", expected_vocab=2)


def test_a_tokenizer_file_other_than_the_one_the_run_recorded_is_refused(tmp_path):
    """A run's tokenizer.json replaced by another of the same size (another run's char tokenizer, its characters in
    another order) was taken: eval scored and generate decoded through the wrong tokens, silently. The fingerprint
    the run recorded is checked; a file written before truncation was turned off on reading (recorded as written)
    still loads."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    path = tmp_path / "tokenizer.json"
    char = Tokenizer("char", json.dumps({"chars": list("abc")}))
    char.save(path)
    assert Tokenizer.load(path, expected_vocab=3, recorded=char.fingerprint).payload == char.payload
    reordered = Tokenizer("char", json.dumps({"chars": list("cba")}))
    reordered.save(path)
    with pytest.raises(CheckpointError, match=f"is not the tokenizer the run was trained with \\(fingerprint "
                                              f"{reordered.fingerprint}; its config.json records {char.fingerprint}"):
        Tokenizer.load(path, expected_vocab=3, recorded=char.fingerprint)
    assert Tokenizer.load(path, expected_vocab=3).payload == reordered.payload  # nothing recorded: nothing to check
    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    hf.enable_truncation(max_length=2)
    written = {"kind": "hf", "payload": hf.to_str()}  # as a run saved it before truncation was turned off on reading
    path.write_text(json.dumps(written))
    loaded = Tokenizer.load(path, recorded=hashlib.sha256("".join(written.values()).encode()).hexdigest()[:16])
    assert loaded.payload != written["payload"] and json.loads(loaded.payload)["truncation"] is None


@pytest.mark.parametrize("in_the_way", ["tokenizers", "tokenizer entry", "tokenizer entry link", "tokens"])
def test_a_cache_path_taken_by_something_else_is_one_line(tmp_path, in_the_way):
    """A file where the cache's tokenizers or tokens folder goes, or a folder (or a dangling link) where a
    tokenizer entry goes, was an IsADirectoryError or FileExistsError traceback (after training the tokenizer)."""
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    cache = tmp_path / "gbattn-cache"
    if in_the_way.startswith("tokenizer entry"):
        get_tokenizer("char", corpus)
        [entry] = (cache / "tokenizers").iterdir()
        entry.unlink()
        if in_the_way == "tokenizer entry":
            entry.mkdir()
        else:
            entry.symlink_to(tmp_path / "gone.json")
    else:
        cache.mkdir()
        (cache / in_the_way).write_text("")
    with pytest.raises(DataError, match="cannot be written|could not write the token cache") as caught:
        tokenize_corpus(corpus, get_tokenizer("char", corpus), progress=False)
    assert "\n" not in str(caught.value) and "GBATTN_CACHE" in str(caught.value)


def test_a_blank_cache_directory_is_refused_and_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """GBATTN_CACHE of spaces only is unset by mistake, like an empty one: not a directory named by spaces."""
    monkeypatch.chdir(tmp_path)
    for blank in ("", "  "):
        monkeypatch.setenv("GBATTN_CACHE", blank)
        with pytest.raises(DataError, match="GBATTN_CACHE is set but empty"):
            tokenizer_mod.cache_dir()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a quoted ~ (an env file): the home directory, as --data
    monkeypatch.setenv("GBATTN_CACHE", "~/gbattn-cache")
    assert tokenizer_mod.cache_dir() == tmp_path / "home" / "gbattn-cache" and not (tmp_path / "~").exists()
    # a home directory nobody can tell (HOME unset for a user with none: a container's `--user 54321`) was
    # Path.home()'s RuntimeError traceback: one line naming what to set
    monkeypatch.setenv("GBATTN_CACHE", "~no-such-user-here/gbattn")
    with pytest.raises(DataError, match=r"^cannot tell the home directory for the cache directory "
                                        r"~no-such-user-here/gbattn: set GBATTN_CACHE to a directory \(or HOME\)$"):
        tokenizer_mod.cache_dir()
    monkeypatch.delenv("GBATTN_CACHE")
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # (what it gives where no home is known)
    with pytest.raises(DataError, match=r"^cannot tell the home directory for the cache directory ~/.cache/gbattn"):
        tokenizer_mod.cache_dir()


def test_atomic_write_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    """The temporary file is synced holding all of its content (flushed from Python's buffer first), then
    renamed into place, then its directory synced."""
    events, sizes = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        sizes.append(os.fstat(fd).st_size)
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    target = tmp_path / "config.json"
    files.atomic_write(target, '{"a": 1}')
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"], events
    assert events[0][1] == events[1][1] == target.stat().st_ino  # the file synced is the one renamed into place
    assert sizes[0] == len('{"a": 1}')  # synced with its content: not an empty file, the bytes still buffered
    assert events[2][1] == tmp_path.stat().st_ino  # then its directory, so the rename survives a crash
    assert target.read_text() == '{"a": 1}' and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_char_tokens_keep_blank_lines(tmp_path):
    """BPE tokenizers skip blank lines (they would encode to nothing); a char tokenizer keeps every
    character, blank and whitespace-only lines included."""
    text = "".join(f"line {i}\n" + ("\n" if i % 3 else " \n") for i in range(300))
    (tmp_path / "t.txt").write_text(text)
    corpus = load_corpus(str(tmp_path / "t.txt"), (0.8, 0.1, 0.1))
    tok = get_tokenizer("char", corpus)
    splits = tokenize_corpus(corpus, tok, progress=False)
    assert "".join(tok.decode(splits[s]) for s in ("train", "valid", "test")) == text


def test_evaluate_scores_every_non_overlapping_row_once():
    """7 rows of 9 tokens (5 left over, too few for a row), in batches of 3: 56 tokens scored, each
    loss the model's own for its row, the mean their mean."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT, lm_loss

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=7 * 9 + 5).astype(np.uint16)
    res = evaluate(model, tokens, seq_len=8, batch_size=3, per_token=True)
    rows = torch.from_numpy(tokens[: 7 * 9].astype(np.int64)).view(7, 9)
    with torch.no_grad():
        want = lm_loss(model(rows[:, :-1]), rows[:, 1:], reduction="none").flatten()
    assert res.tokens == 7 * 8 and res.per_token.shape == (7 * 8,)
    np.testing.assert_allclose(res.per_token, want.numpy(), rtol=1e-5, atol=1e-6)
    assert res.loss == pytest.approx(float(want.mean()), rel=1e-5)
    # a float64 model's losses are kept in float64 (the buffer takes the losses' dtype), exactly its own
    model.double()
    with torch.no_grad():
        want = lm_loss(model(rows[:, :-1]), rows[:, 1:], reduction="none").flatten()
    res = evaluate(model, tokens, seq_len=8, batch_size=3, per_token=True)
    assert res.per_token.dtype == np.float64 and np.array_equal(res.per_token, want.numpy())


def test_evaluate_names_a_batch_size_or_seq_len_below_one():
    """evaluate(..., batch_size=0) was a ZeroDivisionError, seq_len=0 the model's "token ids of shape (32, 0)"."""
    from gbattn.config import ModelConfig
    from gbattn.errors import ConfigError
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=3 * 9).astype(np.uint16)
    with pytest.raises(ConfigError, match=r"batch_size=0 must be an integer >= 1 \(rows per batch\)"):
        evaluate(model, tokens, seq_len=8, batch_size=0)
    with pytest.raises(ConfigError, match=r"seq_len=0 must be an integer >= 1 \(input tokens per row\)"):
        evaluate(model, tokens, seq_len=0)
    # ids that are no row of integers: float ids were cut (1.9 read as 1), a (1, N) array counted as one token
    for bad, described in ((tokens + 0.9, "shape (27,) and dtype float64"), (tokens[None], "shape (1, 27) and dtype "
                                                                                          "uint16")):
        with pytest.raises(ValueError, match=re.escape(f"tokens of {described}: give one row of integer token ids")):
            evaluate(model, bad, seq_len=8)
    with pytest.raises(ValueError, match=r"^per_token='no' must be True or False$"):  # ('no' was true)
        evaluate(model, tokens, seq_len=8, per_token="no")
    with pytest.raises(ValueError, match=r"^progress of type int: give a function, or None$"):
        evaluate(model, tokens, seq_len=8, progress=5)
    for dtype in (torch.int64, torch.uint16, torch.int8):  # a tensor of ids of any integer type, as an array
        assert evaluate(model, torch.from_numpy(tokens.astype(np.int64)).to(dtype), seq_len=8).loss == evaluate(
            model, tokens, seq_len=8).loss, dtype
    with pytest.raises(ValueError, match="dtype torch.bool: give one row of integer token ids"):
        evaluate(model, torch.ones(27, dtype=torch.bool), seq_len=8)


def test_evaluate_that_raises_leaves_the_model_in_training_mode():
    """A forward that raised inside evaluate (here a progress callback that stops it) left the model in eval
    mode, so a caller that caught the error went on training without dropout."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2)).train()
    tokens = np.random.default_rng(0).integers(0, 11, size=3 * 9).astype(np.uint16)

    def stop(_rows):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate(model, tokens, seq_len=8, batch_size=1, progress=stop)
    assert model.training


def test_evaluate_refuses_fewer_tokens_than_one_row():
    """8 tokens hold no row of 9: the result was a loss of 0 over 0 tokens, perplexity 1.0 (a perfect
    model); now a ValueError. 9 tokens are one row."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0))
    tokens = np.random.default_rng(0).integers(0, 11, size=9).astype(np.uint16)
    with pytest.raises(ValueError, match="8 tokens: fewer than one row of seq_len \\+ 1 = 9"):
        evaluate(model, tokens[:8], seq_len=8)
    assert evaluate(model, tokens, seq_len=8).tokens == 8


def test_evaluate_of_one_row_of_one_prediction_is_that_predictions_loss():
    """seq_len 1 over 2 tokens: one row, one predicted token, and the loss is its loss (not halved)."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT, lm_loss

    model = GPT(ModelConfig(vocab_size=11, block_size=1, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.array([3, 7], dtype=np.uint16)
    res = evaluate(model, tokens, seq_len=1)
    with torch.no_grad():
        want = lm_loss(model(torch.tensor([[3]])), torch.tensor([[7]]))
    assert res.tokens == 1 and res.loss == pytest.approx(float(want), rel=1e-6)


def test_evaluate_under_ddp_counts_no_tokens_of_a_repeated_row():
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    class SecondOfTwo:  # rank 1 of 2; all_sum as in a world where the other rank contributed nothing
        enabled, world, rank = True, 2, 1

        def all_sum(self, values):
            return values

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=3 * 9).astype(np.uint16)  # 3 rows: rank 1 gets row 1
    res = evaluate(model, tokens, seq_len=8, batch_size=1, dist_env=SecondOfTwo())
    alone = evaluate(model, tokens[9:18], seq_len=8)  # row 1 by itself
    assert res.tokens == 8  # 2 forward passes (as rank 0), the second a repeated row of weight 0
    assert res.loss == pytest.approx(alone.loss, rel=1e-6)


def test_evaluate_under_ddp_every_rank_runs_as_many_passes_and_scores_its_own_rows():
    """3 rows over 2 ranks in batches of 1: both ranks run 2 forward passes; rank 0 scores rows 0 and 2,
    rank 1 row 1 (its second pass repeats a row of weight 0: no per-token losses, no progress)."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    class Rank:  # all_sum as in a world where the other rank contributed nothing
        enabled, world = True, 2

        def __init__(self, rank):
            self.rank = rank

        def all_sum(self, values):
            return values

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=3 * 9).astype(np.uint16)
    passes = []
    model.register_forward_hook(lambda *_: passes.append(1))
    for rank, rows in ((0, [0, 2]), (1, [1])):
        passes.clear()
        ticks = []
        res = evaluate(model, tokens, seq_len=8, batch_size=1, dist_env=Rank(rank), per_token=True,
                       progress=ticks.append)
        own = np.concatenate([tokens[r * 9 : (r + 1) * 9] for r in rows])
        alone = evaluate(model, own, seq_len=8, per_token=True)
        assert len(passes) == 2 + 1 and sum(ticks) == len(rows), rank  # (+1: the pass scoring `own` alone)
        assert res.tokens == 8 * len(rows) and res.per_token.shape == (8 * len(rows),), rank
        np.testing.assert_allclose(res.per_token, alone.per_token, rtol=1e-6)


def test_evaluate_under_ddp_is_the_mean_over_every_ranks_tokens():
    """Rank 0 of 2 (3 rows in batches of 1), its all_sum adding rank 1's loss sum and token count (row 1 scored
    alone): the loss and token count of all 3 rows scored by one process. The tests above sum with a rank that
    scored nothing, where dividing the world's loss sum by the rank's own count looked the same."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=3 * 9).astype(np.uint16)
    whole, second = evaluate(model, tokens, seq_len=8), evaluate(model, tokens[9:18], seq_len=8)

    class FirstOfTwo:
        enabled, world, rank = True, 2, 0

        def all_sum(self, values):
            return [values[0] + second.loss * second.tokens, values[1] + second.tokens]

    res = evaluate(model, tokens, seq_len=8, batch_size=1, dist_env=FirstOfTwo())
    assert res.tokens == whole.tokens == 3 * 8
    assert res.loss == pytest.approx(whole.loss, rel=1e-6)


def test_evaluate_under_ddp_a_rank_without_rows_of_its_own_still_runs_its_pass():
    """1 row over 2 ranks: rank 1 has no row of its own, yet runs its one forward pass (FSDP2 gathers parameters
    in each) on a stand-in row of weight 0; its all_sum brings rank 0's sums, so it reports the row's loss."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=9).astype(np.uint16)
    whole = evaluate(model, tokens, seq_len=8)

    class SecondOfTwo:  # all_sum adds what rank 0 scored: the only row
        enabled, world, rank = True, 2, 1

        def all_sum(self, values):
            return [values[0] + whole.loss * whole.tokens, values[1] + whole.tokens]

    passes, ticks = [], []
    model.register_forward_hook(lambda *_: passes.append(1))
    res = evaluate(model, tokens, seq_len=8, batch_size=4, dist_env=SecondOfTwo(), per_token=True,
                   progress=ticks.append)
    assert len(passes) == 1 and ticks == [0] and res.per_token is None
    assert res.tokens == whole.tokens == 8 and res.loss == pytest.approx(whole.loss, rel=1e-6)


def test_evaluate_runs_the_model_under_the_autocast_it_is_given():
    """The forward passes run inside ``autocast`` (a run's own precision, as its trainer scored it): under bf16
    autocast on CPU the loss is that of the model's bf16 logits, not the float32 one. `gbattn eval` and the
    trainer both call evaluate, so comparing the two could not tell whether autocast was used at all."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT, lm_loss

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=3 * 9).astype(np.uint16)

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    rows = torch.from_numpy(tokens.astype(np.int64)).view(3, 9)
    with torch.no_grad(), bf16():
        want = lm_loss(model(rows[:, :-1]), rows[:, 1:]).item()
    res = evaluate(model, tokens, seq_len=8, autocast=bf16)
    assert res.loss == pytest.approx(want, rel=1e-6)
    assert res.loss != pytest.approx(evaluate(model, tokens, seq_len=8).loss, rel=1e-6)


def test_evaluate_reports_progress_per_row_and_restores_training_mode():
    """7 rows in batches of 3: progress adds up to 7 rows (3 + 3 + 1); a model in training mode with
    dropout is scored without dropout and is back in training mode afterwards; a KV cache the caller set up is
    the model's again afterwards."""
    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.5)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=7 * 9 + 5).astype(np.uint16)
    ticks = []
    expected = evaluate(model, tokens, seq_len=8, batch_size=3, progress=ticks.append)
    assert ticks == [3, 3, 1] and not model.training
    model.train()
    assert evaluate(model, tokens, seq_len=8, batch_size=3).loss == expected.loss
    assert model.training
    model.blocks[0].eval()  # each module's own mode, as generate() keeps it
    modes = {name: module.training for name, module in model.named_modules()}
    evaluate(model, tokens, seq_len=8, batch_size=3)
    assert {name: module.training for name, module in model.named_modules()} == modes
    # and the KV cache a caller set up and filled: the caller's next decode step is the full forward's
    model.eval()
    idx_BT = torch.randint(0, 11, (1, 8))
    full_BTV = model(idx_BT)
    model.setup_cache(batch=1, max_len=8)
    callers_cache = model.kv_cache
    model(idx_BT[:, :7], input_pos=torch.arange(7))
    evaluate(model, tokens, seq_len=8, batch_size=3)
    assert model.kv_cache is callers_cache
    torch.testing.assert_close(model(idx_BT[:, 7:], input_pos=torch.tensor([7]))[:, -1], full_BTV[:, -1])


def test_perplexity_of_a_loss_of_50_or_more_is_infinite():
    import math

    from gbattn.eval.perplexity import EvalResult

    assert EvalResult(loss=49.0, tokens=1).ppl == pytest.approx(math.exp(49.0))
    assert EvalResult(loss=50.0, tokens=1).ppl == float("inf")
    assert EvalResult(loss=1e4, tokens=1).ppl == float("inf")  # math.exp would raise OverflowError


def test_random_windows_never_draw_the_window_ending_at_the_last_token():
    from gbattn.data.tokens import random_windows

    tokens = np.arange(12, dtype=np.uint16)  # windows of 9 tokens: offsets 0..3; offset 3 ends at the last token
    starts = set()
    for step in range(100):
        x, y = random_windows(tokens, 8, 4, seed=0, step=step)
        assert x.shape == y.shape == (4, 8) and torch.equal(y - x, torch.ones_like(x))
        starts |= set(x[:, 0].tolist())
    assert starts == {0, 1, 2}
    again, _ = random_windows(tokens, 8, 4, seed=0, step=7)
    assert torch.equal(again, random_windows(tokens, 8, 4, seed=0, step=7)[0])  # a pure function of (seed, step)


def test_random_windows_need_a_row_and_one_token_more_and_the_error_says_so(tmp_path):
    """Random windows never end at the last token, so a training split of exactly one row (33 tokens
    here) is refused with the count it needs (34), not called "fewer than one row"; 34 tokens train."""
    for n_train, fits in ((33, False), (34, True)):
        path = tmp_path / f"t{n_train}.txt"
        path.write_text("abcdefghij" * 10)
        configs = tiny_configs(path, sampling="random", split=[n_train / 100, 1 - n_train / 100, 0.0])
        trainer = Trainer(tmp_path / f"run{n_train}", *configs, quiet=True)
        if fits:
            trainer._setup()
            assert len(trainer.data.splits["train"]) == 34
        else:
            with pytest.raises(DataError) as error:
                trainer._setup()
            assert "has 33 tokens" in str(error.value) and "at least 34" in str(error.value)
            assert "fewer than one row" not in str(error.value)
        trainer.lock.release()


@pytest.mark.parametrize("sampling, capped", [("random", "train_tokens"), ("rows", "train_tokens"),
                                               ("random", "eval_tokens")])
def test_a_split_cut_short_by_its_cap_names_the_cap_not_the_file(tmp_path, sampling, capped):
    """A split too short for one row because train_tokens or eval_tokens cut it was told "use a longer file" (or,
    with rows, nothing): the file was long enough; the cap is what to raise."""
    path = tmp_path / "text.txt"
    path.write_text("abcdefghij" * 200)
    trainer = Trainer(tmp_path / "run", *tiny_configs(path, sampling=sampling, **{capped: 20}), quiet=True)
    with pytest.raises(DataError, match=rf"[:;] {capped}=20 cut it there: raise it, or use a smaller seq_len$"):
        trainer._setup()
    trainer.lock.release()
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 2)
    trainer = Trainer(tmp_path / "run2", *tiny_configs(short, sampling=sampling), quiet=True)
    with pytest.raises(DataError, match=r"[:;] use a longer file or a smaller seq_len$"):
        trainer._setup()
    trainer.lock.release()


def test_a_split_of_blank_lines_only_is_told_so_not_to_use_a_longer_file(tmp_path):
    """A single file ending in blank lines (a paragraph of empty lines past its last text) gave a bpe run a valid
    split of 0 tokens, refused with "use a longer file or a smaller seq_len": neither helps, as every tokenizer but
    char leaves blank lines out. The line says the split holds no text."""
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox\n" * 200 + "\n" * 1000)
    trainer = Trainer(tmp_path / "run", *tiny_configs(path, tokenizer="bpe", vocab_size=40), quiet=True)
    with pytest.raises(DataError, match=r"valid split .* has 0 tokens: fewer than one row of 33; none of its lines "
                                        r"holds text \(blank lines are left out by every tokenizer but char\)"):
        trainer._setup()
    trainer.lock.release()
    # char keeps blank lines: its split of 0 tokens is one of no characters, which a longer file does fill
    trainer = Trainer(tmp_path / "run2", *tiny_configs(path, split=[0.9999, 0.00005, 0.00005]), quiet=True)
    with pytest.raises(DataError, match=r"valid split .* has 0 tokens: .*; use a longer file or a smaller seq_len$"):
        trainer._setup()
    trainer.lock.release()


def test_a_valid_or_test_split_shorter_than_one_row_is_refused_before_training(tmp_path, monkeypatch):
    """A validation or test split of fewer tokens than one row (here 10 characters, rows of 33) is a one-line
    DataError before the first step, not an evaluation error after the steps before the first evaluation; the line
    names the data, which it did not."""
    original, steps = Trainer._train_step, []

    def counted(self, step):
        steps.append(step)
        return original(self, step)

    monkeypatch.setattr(Trainer, "_train_step", counted)
    for split in ("valid", "test"):
        data = write_corpus(tmp_path / f"short-{split}")
        (data / f"wiki.{split}.tokens").write_text("the cat .\n")
        with pytest.raises(DataError) as error:
            train(tmp_path / f"run-{split}", *tiny_configs(data), quiet=True)
        assert str(error.value).startswith(f"the {split} split of --data {data} has 10 tokens: fewer than one row "
                                           f"of 33;"), error.value
        assert steps == []


def test_swapping_two_split_files_changes_the_corpus_fingerprint(tmp_path):
    data = write_corpus(tmp_path / "c")
    before = load_corpus(str(data)).fingerprint
    valid, test = (data / "wiki.valid.tokens").read_text(), (data / "wiki.test.tokens").read_text()
    (data / "wiki.valid.tokens").write_text(test)
    (data / "wiki.test.tokens").write_text(valid)
    assert load_corpus(str(data)).fingerprint != before
    (data / "wiki.valid.tokens").write_text(valid)
    (data / "wiki.test.tokens").write_text(test)
    assert load_corpus(str(data)).fingerprint == before


def test_any_changed_byte_changes_the_corpus_fingerprint(tmp_path):
    """The fingerprint keys the caches and the data a run recorded: a byte changed anywhere in a file (its
    first, its last, either side of the 1 MiB chunks it is read in) gives another one, folder or single file."""
    data = write_corpus(tmp_path / "c")
    (data / "wiki.train.tokens").write_text("x" * (2**20 - 1) + (data / "wiki.train.tokens").read_text())
    content = (data / "wiki.train.tokens").read_bytes()
    prints = {load_corpus(str(data)).fingerprint, load_corpus(str(data / "wiki.train.tokens")).fingerprint}
    for at in (0, 2**20 - 1, 2**20, len(content) - 2):
        (data / "wiki.train.tokens").write_bytes(content[:at] + b"y" + content[at + 1:])
        prints |= {load_corpus(str(data)).fingerprint, load_corpus(str(data / "wiki.train.tokens")).fingerprint}
    assert len(prints) == 10


def test_whitespace_added_at_the_start_or_end_of_a_file_changes_the_corpus_fingerprint(tmp_path):
    """The char tokenizer trains on newlines and spaces too: a blank line added at the end of a split file, or spaces
    before its first word, is other data for the caches (another fingerprint), folder or single file."""
    data = write_corpus(tmp_path / "c")
    valid = data / "wiki.valid.tokens"
    content = valid.read_text()
    prints = set()
    for edited in (content, content + "\n", "  " + content):
        valid.write_text(edited)
        prints |= {load_corpus(str(data)).fingerprint, load_corpus(str(valid)).fingerprint}
    assert len(prints) == 6


def clip_thresholds(monkeypatch) -> list:
    """The max_norm of every clip_grad_norm_ call from now on (each call still clips)."""
    original, seen = torch.nn.utils.clip_grad_norm_, []

    def spy(parameters, max_norm, *args, **kwargs):
        seen.append(max_norm)
        return original(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    return seen


def test_clipping_uses_grad_clip_on_the_accumulated_gradient(tmp_path, monkeypatch):
    """grad_clip is the threshold, applied once per step to the whole batch's gradient: with clipping
    active (0.05), grad_accum=2 still trains the weights of one batch of 8."""
    data = write_corpus(tmp_path / "c")
    seen = clip_thresholds(monkeypatch)
    train(tmp_path / "one", *tiny_configs(data, dropout=0.0, max_steps=4, grad_clip=0.05), quiet=True)
    assert seen == [0.05] * 4
    train(tmp_path / "two", *tiny_configs(data, dropout=0.0, max_steps=4, grad_clip=0.05, grad_accum=2), quiet=True)
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_a_grad_clip_of_zero_trains_without_clipping(tmp_path, monkeypatch):
    """grad_clip=0 means no clipping (config: "0 = no clipping"): the run's threshold is infinite (the gradient norm
    is still taken, to stop on a non-finite one), and its weights are those of a run whose threshold is never reached;
    clipping at a norm of 0 would zero every gradient (no learning at all)."""
    data = write_corpus(tmp_path / "c")
    seen = clip_thresholds(monkeypatch)
    train(tmp_path / "off", *tiny_configs(data, dropout=0.0, max_steps=3, eval_every=3, grad_clip=0.0), quiet=True)
    assert seen == [math.inf] * 3
    seen.clear()
    train(tmp_path / "far", *tiny_configs(data, dropout=0.0, max_steps=3, eval_every=3, grad_clip=1e9), quiet=True)
    assert seen == [1e9] * 3
    a, b = final_weights(tmp_path / "off"), final_weights(tmp_path / "far")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_each_training_step_is_one_adamw_step_on_the_clipped_gradient_of_its_batch(tmp_path):
    """Two steps of a run (grad_accum=2, clipping active, decay on matrices only) against the same steps written
    out with torch's AdamW: the config's lr, betas and weight decay, AdamW's own eps, one update per step on the
    clipped gradient of the mean loss of the step's batch; the step returns that mean loss."""
    import copy

    data = write_corpus(tmp_path / "c")
    trainer = Trainer(tmp_path / "run", *tiny_configs(data, dropout=0.0, grad_accum=2, grad_clip=0.05,
                                                      weight_decay=0.1, decay_matrices_only=True, beta2=0.95),
                      quiet=True)
    trainer._setup()
    cfg, reference = trainer.train_cfg, copy.deepcopy(trainer.model)
    params = list(reference.parameters())
    adamw = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=1.0, betas=(0.9, 0.95))
    for step, lr in enumerate([2e-3, 3e-3]):
        for group in trainer.optimizer.param_groups + adamw.param_groups:
            group["lr"] = lr
        loss = trainer._train_step(step)
        x, y = trainer._global_batch(step)
        total = 0.0
        for half in (slice(0, 4), slice(4, 8)):
            with trainer.autocast():
                part = reference(x[half], y[half]) / 2
            part.backward()
            total += part.item()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        assert loss == pytest.approx(total, rel=1e-6)
        for name, weight in reference.state_dict().items():
            torch.testing.assert_close(trainer.model.state_dict()[name], weight, rtol=1e-6, atol=1e-8,
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("preset", ["cpu-char", "paper-small"])
def test_weight_decay_groups_and_betas_follow_the_preset(preset):
    """decay_matrices_only (nanoGPT, cpu-char): weight decay on every >= 2-dim weight (embeddings
    included), none on biases, norm gains or scalar gates; otherwise (the authors', paper-small) decay on
    every parameter. betas are the preset's."""
    from gbattn.config import build_configs
    from gbattn.model import GPT
    from gbattn.train.trainer import make_optimizer

    sets = dict(TINY, vocab_size=16_384, **{"attn.gate": "scalar"})  # the paper's vocabulary: a large embedding
    model_cfg, train_cfg = build_configs(preset, "boosted", "data", sets)
    model = GPT(model_cfg)
    opt = make_optimizer(model, train_cfg, torch.device("cpu"))
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert len(decay) == sum(1 for _ in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    small = [n for n, p in model.named_parameters() if p.dim() < 2]  # biases, norm gains, the gate's logit
    assert any(n.endswith("bias") for n in small) and any("gate" in n for n in small), small
    for p in model.parameters():
        expected = train_cfg.weight_decay if p.dim() >= 2 or not train_cfg.decay_matrices_only else 0.0
        assert decay[id(p)] == expected, (names[id(p)], decay[id(p)])
    assert train_cfg.decay_matrices_only == (preset == "cpu-char") and train_cfg.weight_decay > 0
    assert all(g["betas"] == (train_cfg.beta1, train_cfg.beta2) for g in opt.param_groups)
    assert (train_cfg.beta1, train_cfg.beta2) == ((0.9, 0.99) if preset == "cpu-char" else (0.9, 0.999))


def test_the_pinned_draws_take_the_seed_and_the_epoch_or_step_in_their_order():
    """The pinned row order and windows at a seed and an epoch (or step) that differ: seed 0, epoch 0 alone could
    not tell ``default_rng([seed, epoch])`` from ``default_rng([epoch, seed])``, and either swap trains a published
    run on other batches."""
    from gbattn.data.tokens import epoch_permutation, random_windows

    assert epoch_permutation(10, 1, 0).tolist() == [8, 4, 7, 0, 1, 2, 5, 9, 6, 3]
    assert epoch_permutation(10, 0, 1).tolist() == [9, 1, 3, 8, 7, 6, 0, 4, 2, 5]
    tokens = np.arange(1000, dtype=np.uint16)
    assert random_windows(tokens, 8, 4, seed=1, step=0)[0][:, 0].tolist() == [967, 686, 763, 221]
    assert random_windows(tokens, 8, 4, seed=0, step=1)[0][:, 0].tolist() == [668, 841, 810, 251]


def test_each_epoch_reads_every_row_once_in_its_own_order(tmp_path):
    """Sampling by rows, batches of 10 rows (the split's rows are not a multiple of 10): an epoch is
    whole batches of distinct rows (the rows left over are not read as a short batch), and the next
    epoch reads them in another order; seed s, epoch e + 1 is not seed s + 1, epoch e."""
    from gbattn.data.tokens import epoch_permutation

    data = write_corpus(tmp_path / "c")
    trainer = Trainer(tmp_path / "run", *tiny_configs(data, batch_size=10), quiet=True)
    trainer._setup()
    per_epoch = trainer.steps_per_epoch
    assert trainer.n_rows % 10 and per_epoch == trainer.n_rows // 10 > 1
    epochs = [torch.cat([trainer._global_batch(e * per_epoch + i)[0] for i in range(per_epoch)]) for e in range(2)]
    for x in epochs:
        assert x.shape[0] == per_epoch * 10 and len({tuple(row.tolist()) for row in x}) == x.shape[0]
    assert not torch.equal(epochs[0], epochs[1])
    assert not np.array_equal(epoch_permutation(50, 1, 0), epoch_permutation(50, 0, 1))
    # An epoch's order is drawn once, not at every step (312 ms and 67 MiB a step for OpenWebText's 8.8M rows), and
    # a step of another epoch, the first again as a resumed run would ask, still gets its own epoch's rows.
    from gbattn.train import trainer as trainer_module

    drawn = []
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(trainer_module, "epoch_permutation",
                        lambda *args: drawn.append(args) or epoch_permutation(*args))
        again = [torch.cat([trainer._global_batch(e * per_epoch + i)[0] for i in range(per_epoch)]) for e in (0, 1)]
        assert torch.equal(trainer._global_batch(0)[0], epochs[0][:10])
    assert [a[2] for a in drawn] == [0, 1, 0] and all(torch.equal(a, b) for a, b in zip(again, epochs))
    trainer.lock.release()


@pytest.mark.parametrize("sampling", ["rows", "random"])
def test_the_runs_seed_alone_decides_its_initial_weights_and_batches(tmp_path, sampling):
    """A run's initial weights and its batches (rows in each epoch's order, or random windows) are those of its seed,
    whatever the caller's random stream held; another seed draws other weights and other batches."""
    data = write_corpus(tmp_path / "c")

    def set_up(seed, callers_seed):
        torch.manual_seed(callers_seed)
        trainer = Trainer(tmp_path / f"seed{seed}-caller{callers_seed}",
                          *tiny_configs(data, sampling=sampling, seed=seed), quiet=True)
        trainer._setup()
        trainer.lock.release()
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        batches = [trainer._global_batch(step)[0] for step in (0, trainer.steps_per_epoch or 1)]
        return weights, batches

    (weights, batches), (same_weights, same_batches), (other_weights, other_batches) = (
        set_up(1, callers_seed=0), set_up(1, callers_seed=5), set_up(2, callers_seed=0))
    for k in weights:
        torch.testing.assert_close(same_weights[k], weights[k], rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(same_batches, batches))
    assert not torch.equal(other_weights["wte.weight"], weights["wte.weight"])
    assert not any(torch.equal(a, b) for a, b in zip(other_batches, batches))


def test_token_ids_fit_their_dtype_and_a_cap_spans_several_batches(tmp_path):
    """uint16 holds ids of a vocabulary up to 65,536 tokens, one more needs uint32; a cap larger than one
    batch of encoded lines (4,096) keeps exactly the first ``cap`` tokens."""
    from gbattn.data.tokens import _encode_split, tokens_dtype

    assert tokens_dtype(65_536) == np.uint16 and tokens_dtype(65_537) == np.uint32

    class Lines:
        def lines(self, split):
            return (f"{i % 10}\n" for i in range(10_000))

    tok = Tokenizer("char", json.dumps({"chars": sorted("0123456789\n")}))
    cap = 4_096 * 2 + 100  # more than the first batch's tokens (2 per line), less than all
    count = _encode_split(Lines(), "train", tok, cap, tmp_path / "train.bin", progress=False)
    ids = np.fromfile(tmp_path / "train.bin", dtype=tokens_dtype(tok.vocab_size))
    assert count == len(ids) == cap
    assert tok.decode(ids.tolist()) == "".join(f"{i % 10}\n" for i in range(10_000))[:cap]


def test_a_long_line_is_encoded_in_pieces_and_the_cap_stops_the_encoding(tmp_path, monkeypatch):
    """A corpus of one long line (text8: 100M characters on one line) was encoded whole before the cap cut its ids
    (a 50 MB line peaked at 1.09 GB with char): a char tokenizer's line is encoded in pieces of FLUSH_CHARS (the
    same ids), batches hold about FLUSH_CHARS characters, and encoding stops at the cap."""
    from gbattn.data import tokens as tokens_mod

    monkeypatch.setattr(tokens_mod, "FLUSH_CHARS", 10)
    line = "".join(str(i % 10) for i in range(95)) + "\n"

    class OneLine:
        def lines(self, split):
            return iter([line, "12\n", "3\n"])

    tok = Tokenizer("char", json.dumps({"chars": sorted("0123456789\n")}))
    sizes = []
    real = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda texts: sizes.append(sum(map(len, texts))) or real(texts))
    count = tokens_mod._encode_split(OneLine(), "train", tok, None, tmp_path / "all.bin", progress=False)
    ids = np.fromfile(tmp_path / "all.bin", dtype=tokens_mod.tokens_dtype(tok.vocab_size))
    assert count == len(ids) == 101 and tok.decode(ids.tolist()) == line + "12\n3\n"
    assert max(sizes) <= 10 + 3  # (a batch ends once it holds 10 characters or more: one short line past them)
    sizes.clear()
    assert tokens_mod._encode_split(OneLine(), "train", tok, 25, tmp_path / "cap.bin", progress=False) == 25
    assert sum(sizes) == 30  # three pieces of 10, not the 96 characters of the line
    # Only a char tokenizer's line is cut: a BPE one's token at the cut would be two tokens
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "<unk>": 3}, [("a", "b")], unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    words = Tokenizer("hf", hf.to_str())
    line = "ab " * 40 + "\n"  # a cut every 10 characters falls inside "ab" four times
    count = tokens_mod._encode_split(OneLine(), "train", words, None, tmp_path / "bpe.bin", progress=False)
    ids = np.fromfile(tmp_path / "bpe.bin", dtype=tokens_mod.tokens_dtype(words.vocab_size))
    whole = [i for text in (line, "12\n", "3\n") for i in words.encode(text)]
    assert count == len(ids) == len(whole) and ids.tolist() == whole and whole[:40] == [2] * 40


def test_gbattns_bpe_encodes_a_long_line_in_pieces_cut_before_spaces_to_the_same_ids(tmp_path, monkeypatch):
    """A corpus of one long line with gbattn's BPE was encoded whole (a 20 MB line peaked at 2.86 GB): it is cut
    before a space or tab into pieces of about FLUSH_CHARS, and its ids are those of the whole line."""
    from gbattn.data import tokens as tokens_mod
    from gbattn.data.tokenizer import _train_bpe

    words = ["the", "cat", "sat", "on", "a", "mat,", "and", "then", "...", "ran"]
    line = "\t".join(" ".join(words[(i * 7 + j) % 10] for j in range(i % 5 + 1)) for i in range(300)) + " !!\n"
    tok = Tokenizer("bpe", _train_bpe([line] * 3, 60))
    pieces = list(tokens_mod.cut_before_spaces(line, 40))
    assert "".join(pieces) == line and len(pieces) > 20 and max(map(len, pieces)) <= 40
    assert all(p[0] in " \t" for p in pieces[1:])
    assert list(tokens_mod.cut_before_spaces("x" * 50 + " y" * 3, 10)) == ["x" * 50, " y y y"]  # (no space sooner)
    assert list(tokens_mod.cut_before_spaces("x" * 5 + " y" * 3, 3)) == ["x" * 5, " y", " y", " y"]
    monkeypatch.setattr(tokens_mod, "FLUSH_CHARS", 40)
    assert _train_bpe(tokens_mod.cut_before_spaces(line, 40), 60) == _train_bpe([line], 60)  # the same merges

    class OneLine:
        def lines(self, split):
            return iter([line, "cat sat\n"])

    sizes = []
    real = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda texts: sizes.append(max(map(len, texts))) or real(texts))
    count = tokens_mod._encode_split(OneLine(), "train", tok, None, tmp_path / "bpe.bin", progress=False)
    ids = np.fromfile(tmp_path / "bpe.bin", dtype=tokens_mod.tokens_dtype(tok.vocab_size))
    whole = [i for text in (line, "cat sat\n") for i in tok.encode(text)]
    assert count == len(ids) == len(whole) and ids.tolist() == whole
    assert max(sizes) <= 40


def test_test_perplexity_is_the_best_checkpoints_and_tokens_seen_count_inputs(tmp_path, monkeypatch, capsys):
    """A 10-step run evaluating every 4 steps evaluates at steps 4, 8 and at its end (10); with
    validation losses that rise after step 4, the final test loss is that of best.pt (step 4), not
    of the last weights, scored on rows of the run's seq_len (16, shorter than the block); and its 10
    steps of 8 rows have read 10 * 8 * seq_len input tokens."""
    from gbattn.data.prepare import prepare_data
    from gbattn.eval.perplexity import evaluate
    from gbattn.rundir import load_run

    data = write_corpus(tmp_path / "c")
    original = Trainer._evaluate

    def rising_valid(self, split):
        res = original(self, split)
        return dataclasses.replace(res, loss=float(self.step)) if split == "valid" else res

    monkeypatch.setattr(Trainer, "_evaluate", rising_valid)
    seq_len = 16
    assert seq_len < TINY["block_size"] - 1  # the default rows would fill the block
    result = train(tmp_path / "run", *tiny_configs(data, max_steps=10, seq_len=seq_len))
    assert [p["step"] for p in result["curve"]] == [4, 8, 10]
    # the summary names the best step (the test is of its weights), and a resume of the finished run its last step
    printed = capsys.readouterr().out
    assert f"{tmp_path / 'run'}: best valid ppl {math.exp(4.0):.2f} (step 4), test ppl" in printed
    assert train(tmp_path / "run", resume=True) == result
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'run'} finished at step 10 (its result.json)")
    assert result["best_step"] == 4 and result["valid_loss"] == 4.0
    assert result["train_tokens_seen"] == 10 * 8 * seq_len
    assert result["train_flops"] == result["flops_per_token_train"] * 10 * 8 * seq_len  # FLOPs of the tokens seen
    # a training step's FLOPs (forward and backward) at the run's seq_len, not the block's
    model_cfg = ckpt.read_configs(json.loads((tmp_path / "run" / ckpt.CONFIG).read_text()), tmp_path / "run")[0]
    assert result["flops_per_token_train"] == flops_per_token(model_cfg, seq_len=seq_len, backward=True)
    assert flops_per_token(model_cfg, seq_len=seq_len, backward=True) not in (
        flops_per_token(model_cfg, seq_len=seq_len), flops_per_token(model_cfg, backward=True))
    losses = {}
    for which in ("best", "last"):
        run = load_run(tmp_path / "run", which)
        test = prepare_data(run.train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False).splits["test"]
        assert run.seq_len == seq_len
        losses[which] = evaluate(run.model, test, run.seq_len).loss
    assert result["test_loss"] == pytest.approx(losses["best"], rel=1e-6) != losses["last"]


def test_result_json_names_the_runs_attention_options_seed_and_tokens_per_parameter(tmp_path, monkeypatch):
    """result.json is what compare, report and the figures read a run by: its attention with its options, its seed,
    its hardware and tokens seen per parameter are the run's own (a seed or options of another run would mislabel
    its row)."""
    from gbattn.runtime import device_name

    data = write_corpus(tmp_path / "c")
    model_cfg, train_cfg = tiny_configs(data, max_steps=2, eval_every=2, seed=7, threads=torch.get_num_threads(),
                                        **{"attn.gate": "scalar"})
    result = train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    assert (result["attn"], result["attn_options"], result["seed"]) == ("boosted", {"gate": "scalar"}, 7)
    assert result["device"] == device_name(torch.device("cpu"))  # the CPU's model and the threads it trained with
    assert result["tokens_per_parameter"] == result["train_tokens_seen"] / result["parameters"]
    assert ckpt.read_result(tmp_path / "run" / ckpt.RESULT) == result
    assert result["run_dir"] == "run"
    # --out . names the folder by its own name ("" before; --out .. gave "..")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert train(Path("."), model_cfg, train_cfg, quiet=True)["run_dir"] == "here"
    # ... and a link by its own name, as given (not its target's)
    (tmp_path / "real-2024").mkdir()
    os.symlink(tmp_path / "real-2024", tmp_path / "latest")
    assert train(tmp_path / "latest", model_cfg, train_cfg, quiet=True)["run_dir"] == "latest"


def test_a_training_record_averages_the_steps_since_the_last_one(tmp_path, monkeypatch):
    """log_every=3 in a 5-step run: the record at step 3 averages steps 0-2 and the one at the end
    (step 5) the two steps since, not their sum over three."""
    data = write_corpus(tmp_path / "c")
    original = Trainer._train_step

    def known_loss(self, step):
        original(self, step)
        return float(step)

    monkeypatch.setattr(Trainer, "_train_step", known_loss)
    train(tmp_path / "run", *tiny_configs(data, max_steps=5, log_every=3, eval_every=5), quiet=True)
    assert train_losses(tmp_path / "run") == [1.0, 3.5]


def test_the_progress_bar_counts_each_step_once(tmp_path, monkeypatch):
    """log_every=2 in a 5-step run: the bar, moved at each training record, ends at 5 of 5 steps."""
    from gbattn.progress import Progress
    from gbattn.train import trainer as trainer_mod

    bars = []

    class Kept(Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(trainer_mod, "Progress", Kept)
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=5, log_every=2, eval_every=5), quiet=True)
    assert [(bar.n, bar.total) for bar in bars] == [(5, 5)]


def test_tokens_per_second_count_training_time_only(tmp_path, monkeypatch):
    """On a clock where a step takes 1 s and an evaluation or a checkpoint 100 s, every record's tok_s is
    one step's tokens a second: also the record after an evaluation between two records (it counted the
    steps before the evaluation over the time after it: twice the speed) and after a timed checkpoint."""
    from gbattn.train import trainer as trainer_mod

    data = write_corpus(tmp_path / "c")
    clock = [0.0]
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock[0])

    def taking(seconds, original):
        def timed(self, *args):
            clock[0] += seconds
            return original(self, *args)
        return timed

    for name, seconds in (("_train_step", 1.0), ("_evaluate", 100.0), ("_save", 100.0)):
        monkeypatch.setattr(Trainer, name, taking(seconds, getattr(Trainer, name)))
    monkeypatch.setattr(trainer_mod.time, "monotonic", lambda: clock[0])  # a timed checkpoint after every step
    model_cfg, train_cfg = tiny_configs(data, max_steps=8, log_every=2, eval_every=3, checkpoint_minutes=0.001)
    result = train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    speeds = [r["tok_s"] for r in records if r["event"] == "train"]
    tokens_per_step = result["train_tokens_seen"] // result["steps"]
    assert len(speeds) == 4 and speeds == [tokens_per_step] * 4
    assert result["train_tokens_per_s"] == tokens_per_step


def test_a_validation_loss_equal_to_the_best_is_not_a_new_best(tmp_path, monkeypatch):
    """With the same validation loss at every evaluation (steps 4, 8, 12) the first stays the best:
    best_step 4, best.pt from step 4, and only the first eval event flagged best. The loss is 50, where
    perplexity is infinite (evaluate's rule): the result's valid_ppl follows the same rule."""
    from gbattn.eval.perplexity import EvalResult

    data = write_corpus(tmp_path / "c")
    original = Trainer._evaluate

    def flat_valid(self, split):
        res = original(self, split)
        return dataclasses.replace(res, loss=50.0) if split == "valid" else res

    monkeypatch.setattr(Trainer, "_evaluate", flat_valid)
    result = train(tmp_path / "run", *tiny_configs(data), quiet=True)
    assert result["valid_loss"] == 50.0 and result["valid_ppl"] == EvalResult(loss=50.0, tokens=1).ppl == math.inf
    assert result["best_step"] == 4 and ckpt.load_checkpoint(tmp_path / "run" / ckpt.BEST)["step"] == 4
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert [(e["step"], e["best"]) for e in events if e["event"] == "eval"] == [(4, True), (8, False), (12, False)]


def test_evaluations_follow_eval_every_or_the_epochs_and_the_curve_counts_epochs_in_fractions(tmp_path):
    """Batches of 64 rows: without eval_every, an evaluation after every epoch and at the end of a
    1.3-epoch run (ceil(1.3 * steps_per_epoch) steps); with eval_every=5, after every 5th step and at
    the end only, not at the end of an epoch; the curve's epoch is step / steps_per_epoch."""
    data = write_corpus(tmp_path / "c")
    trainer = Trainer(tmp_path / "epochs", *tiny_configs(data, batch_size=64, epochs=1.3, max_steps=None,
                                                         eval_every=None), quiet=True)
    trainer._setup()
    trainer.lock.release()
    per_epoch = trainer.steps_per_epoch
    total = math.ceil(1.3 * per_epoch)
    assert per_epoch > 4 and total != int(1.3 * per_epoch)  # 1.3 epochs: not a whole number of steps
    assert trainer.total_steps == total
    assert [s for s in range(1, total + 1) if trainer._is_eval_step(s)] == [per_epoch, total]
    assert per_epoch % 5 and (per_epoch + 2) % 5  # the epoch's end and the run's are no multiples of 5
    result = train(tmp_path / "every", *tiny_configs(data, batch_size=64, max_steps=per_epoch + 2, eval_every=5),
                   quiet=True)
    steps = [*range(5, per_epoch + 2, 5), per_epoch + 2]
    assert [p["step"] for p in result["curve"]] == steps
    assert [p["epoch"] for p in result["curve"]] == [s / per_epoch for s in steps]


def test_a_stop_asked_for_at_the_last_step_finishes_the_run(tmp_path, monkeypatch):
    """A signal that arrives during the last step ends the run as usual (result.json, test perplexity):
    nothing is left to resume."""
    data = write_corpus(tmp_path / "c")
    monkeypatch.setattr(Trainer, "_should_stop", lambda self, requested: self.step == 12)
    result = train(tmp_path / "run", *tiny_configs(data), quiet=True)
    assert result["steps"] == 12 and (tmp_path / "run" / ckpt.RESULT).is_file()
    events = [json.loads(line)["event"] for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert "interrupted" not in events and events[-1] == "test"


@pytest.mark.parametrize("name, how, status", [("SIGINT", "interrupted", 130), ("SIGTERM", "terminated", 143)])
def test_ctrl_c_during_the_last_step_finishes_the_run_and_is_not_lost(tmp_path, monkeypatch, name, how, status):
    """Ctrl-C (a real SIGINT) during the last step: the run finishes (result.json), then says it was
    interrupted with status 130. It ended with status 0 as if no Ctrl-C had come, and `compare` went on to
    train its next runs: the stop was lost. SIGTERM the same, in its own words and status (143)."""
    import signal

    data = write_corpus(tmp_path / "c")
    original = Trainer._train_step

    def ctrl_c_in_the_last_step(self, step):
        if step == self.total_steps - 1:
            os.kill(os.getpid(), getattr(signal, name))
        return original(self, step)

    monkeypatch.setattr(Trainer, "_train_step", ctrl_c_in_the_last_step)
    with pytest.raises(Interrupted, match=rf"{how} during the last step: .*run finished all the same .*nothing is "
                                        r"left to resume$") as stopped:
        train(tmp_path / "run", *tiny_configs(data), quiet=True)
    assert stopped.value.exit_code == status and ckpt.read_result(tmp_path / "run" / ckpt.RESULT)["steps"] == 12
    with pytest.raises(Interrupted, match=r"; rerun the same `gbattn compare` command for the rest of the comparison$"):
        train(tmp_path / "compared", *tiny_configs(data), quiet=True, extra={"label": "gba-m2", "recipe": "cpu-char"})


def test_a_stop_after_result_json_is_written_says_the_run_finished(tmp_path, monkeypatch):
    """SIGTERM in the moment after result.json was written (its summary printing, the folder's sync) said the run
    was stopped during its test evaluation and was to be continued with `train --resume`, which then answered that
    it had finished: it says it finished, with status 143 all the same."""
    import signal

    data = write_corpus(tmp_path / "c")
    written = ckpt.write_result

    def terminated_once_written(directory, result):
        written(directory, result)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ckpt, "write_result", terminated_once_written)
    with pytest.raises(Interrupted, match=r"^terminated after the test evaluation: .*run finished all the same \(its "
                                        r"result.json is written\); nothing is left to resume$") as stopped:
        train(tmp_path / "run", *tiny_configs(data), quiet=True)
    assert stopped.value.exit_code == 143 and ckpt.read_result(tmp_path / "run" / ckpt.RESULT)["steps"] == 12


def test_a_checkpoint_is_also_saved_every_checkpoint_minutes(tmp_path, monkeypatch):
    """Between evaluations a checkpoint is saved once more than checkpoint_minutes have passed since
    the last one: with a clock the test moves one minute per step and checkpoint_minutes=2.5, at steps
    3, 6 and 9, and at the evaluation of step 12."""
    import types

    from gbattn.train import trainer as trainer_mod

    data = write_corpus(tmp_path / "c")
    now, saved = [0.0], []
    monkeypatch.setattr(trainer_mod, "time", types.SimpleNamespace(perf_counter=trainer_mod.time.perf_counter,
                                                                    monotonic=lambda: now[0]))
    original_step, original_save = Trainer._train_step, Trainer._save

    def minute_per_step(self, step):
        value = original_step(self, step)
        now[0] = 60.0 * (step + 1)
        return value

    def spy_save(self):
        saved.append(self.step)
        original_save(self)

    monkeypatch.setattr(Trainer, "_train_step", minute_per_step)
    monkeypatch.setattr(Trainer, "_save", spy_save)
    train(tmp_path / "run", *tiny_configs(data, eval_every=100, checkpoint_minutes=2.5), quiet=True)
    assert saved == [3, 6, 9, 12]
    # An evaluation's checkpoint restarts the clock: evaluations at 4, 8 and 12, timed saves 3 minutes after each
    # checkpoint (at 3, 7, 11), not 3 minutes after the last timed one (at 3, 6, 9: a save just after an evaluation's).
    saved.clear()
    now[0] = 0.0
    train(tmp_path / "evaluated", *tiny_configs(data, eval_every=4, checkpoint_minutes=2.5), quiet=True)
    assert saved == [3, 4, 7, 8, 11, 12]


def test_training_runs_under_the_configs_autocast_and_puts_the_thread_count_back(tmp_path, monkeypatch):
    """amp=bf16 trains a CPU run's forward passes under bf16 autocast and amp=off without; a run with
    threads=1 leaves torch's thread count as it found it."""
    from gbattn.model.gpt import GPT

    data = write_corpus(tmp_path / "c")
    original, original_step, seen, stepping = GPT.forward, Trainer._train_step, [], [False]

    def spy(self, *args, **kwargs):
        if stepping[0]:
            seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return original(self, *args, **kwargs)

    def step(self, s):
        stepping[0] = True
        try:
            return original_step(self, s)
        finally:
            stepping[0] = False

    monkeypatch.setattr(GPT, "forward", spy)
    monkeypatch.setattr(Trainer, "_train_step", step)
    torch.set_num_threads(2)
    for amp in ("bf16", "off"):
        seen.clear()
        train(tmp_path / amp, *tiny_configs(data, max_steps=2, eval_every=2, amp=amp, threads=1), quiet=True)
        assert seen == [amp == "bf16"] * 2, amp
        assert torch.get_num_threads() == 2


def test_training_leaves_the_callers_random_stream_where_it_was(tmp_path):
    """train() seeds torch for its weights and dropout; from Python it left the global stream at its own seed's, so a
    caller's torch.manual_seed no longer decided what came next (loading a run leaves it alone, rundir.model_holding).
    A finished run and one stopped by a mistake put the caller's stream back."""
    data = write_corpus(tmp_path / "c")
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2, threads=1), quiet=True)
    assert torch.equal(torch.rand(4), expected)
    (tmp_path / "run" / ckpt.RESULT).unlink()  # resumed from a checkpoint past the run's end: refused after the seeds
    state = ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)
    torch.save({**state, "step": 10**6}, tmp_path / "run" / ckpt.CHECKPOINT)
    torch.manual_seed(7)
    with pytest.raises(CheckpointError):
        train(tmp_path / "run", resume=True, quiet=True)
    assert torch.equal(torch.rand(4), expected)


def test_a_run_trains_in_float32_with_gradients_whatever_the_caller_set(tmp_path):
    """A run's arithmetic is its own: under a caller's torch.set_default_dtype(torch.float64) (a notebook's) it built
    its model in float64, another run that nothing recorded (its resume went on in float32); under torch.no_grad() or
    anomaly detection (set when chasing a NaN) it failed with a RuntimeError. Each trains the same weights as a run
    with torch's defaults, and the caller's settings are as they were afterwards."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "plain", *tiny_configs(data, max_steps=3, eval_every=3, threads=1), quiet=True)
    expected = ckpt.load_checkpoint(tmp_path / "plain" / ckpt.CHECKPOINT)["model"]
    settings = {"float64": lambda: _default_dtype(torch.float64), "no_grad": torch.no_grad,
                "anomaly": lambda: torch.autograd.set_detect_anomaly(True), "inference": torch.inference_mode}
    for name, setting in settings.items():
        with setting():
            train(tmp_path / name, *tiny_configs(data, max_steps=3, eval_every=3, threads=1), quiet=True)
            assert torch.get_default_dtype() == (torch.float64 if name == "float64" else torch.float32)
            assert torch.is_grad_enabled() == (name not in ("no_grad", "inference"))
            assert torch.is_inference_mode_enabled() == (name == "inference")
            assert torch.is_anomaly_enabled() == (name == "anomaly")
        weights = ckpt.load_checkpoint(tmp_path / name / ckpt.CHECKPOINT)["model"]
        assert weights.keys() == expected.keys()
        for key, value in weights.items():
            assert value.dtype == expected[key].dtype and torch.equal(value, expected[key]), (name, key)


def test_train_takes_true_or_false_for_resume_quiet_and_restart(tmp_path):
    """restart="no" was true (a string), and replaced the run already in run_dir, its weights deleted; resume="no"
    looked for a run to resume. Each is a ConfigError naming it, and the run is left as it was."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2, threads=1), quiet=True)
    before = (tmp_path / "run" / ckpt.CHECKPOINT).read_bytes()
    for name in ("restart", "resume", "quiet"):
        with pytest.raises(ConfigError, match=f"^{name}='no' must be True or False$"):
            train(tmp_path / "run", *tiny_configs(data, max_steps=4, eval_every=2, threads=1), **{name: "no"})
    assert (tmp_path / "run" / ckpt.CHECKPOINT).read_bytes() == before


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def test_the_perplexity_of_a_nan_loss_is_nan():
    """A model whose outputs are NaN has no perplexity: `eval` printed "test perplexity inf (loss nan nats)"."""
    from gbattn.eval.perplexity import perplexity

    assert math.isnan(perplexity(float("nan")))
    assert perplexity(50.0) == perplexity(float("inf")) == float("inf") and perplexity(1.0) == math.e


def test_evaluation_does_not_depend_on_its_batch_size():
    """Each batch's token losses were summed in float32, whose rounding depends on how the rows are grouped:
    `gbattn eval --batch-size 5` and `7` gave losses 1e-8 apart, and a resume with another eval_batch_size recorded
    other valid and test losses (the best step could change on a near tie). Summed in float64 they agree."""
    from gbattn.eval.perplexity import evaluate
    from test_model import tiny_model

    torch.manual_seed(0)
    model = tiny_model(("boosted", {})).float()  # (a run's model: float32 token losses)
    tokens = np.random.default_rng(0).integers(0, 37, 200 * 24 + 1)
    losses = {b: evaluate(model, tokens, 24, batch_size=b).loss for b in (1, 3, 5, 7, 64, 200)}
    assert max(losses.values()) - min(losses.values()) <= 1e-13 * losses[1], losses


def test_training_puts_the_callers_signal_handlers_back(tmp_path):
    """The loop's SIGINT/SIGTERM handlers (a stop at the next step boundary) are the run's alone: left installed
    after train() returned, a Ctrl-C in the caller's later work would only set the finished run's flag, and be lost."""
    data = write_corpus(tmp_path / "c")
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2, threads=1), quiet=True)
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_training_puts_the_callers_matmul_precision_back(tmp_path, monkeypatch):
    """On CUDA a run trains with TF32 matmuls (runtime.use_tf32); from Python they stayed on after train() returned,
    changing the precision of the caller's later float32 work. Here use_tf32 acts as on CUDA."""
    from gbattn.train import trainer

    def as_on_cuda(device):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    monkeypatch.setattr(trainer, "use_tf32", as_on_cuda)
    data = write_corpus(tmp_path / "c")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        train(tmp_path / "run", *tiny_configs(data, max_steps=1, eval_every=1, threads=1), quiet=True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_checkpoint_whose_adam_moments_do_not_fit_their_weights_is_refused(tmp_path):
    """Either moment (exp_avg or exp_avg_sq) of another shape than its weight, or an exp_avg_sq below 0
    (AdamW's square root of it is NaN: the run diverged at its next step), or moments of integers: a one-line
    CheckpointError naming it, before anything is trained."""
    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train(run, *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    (run / ckpt.RESULT).unlink()  # pretend it did not finish
    path = run / ckpt.CHECKPOINT
    good = path.read_bytes()
    for key in ("exp_avg", "exp_avg_sq"):
        path.write_bytes(good)
        state = ckpt.load_checkpoint(path)
        state["optimizer"]["state"]["wte.weight"][key] = torch.zeros(3)
        torch.save(state, path)
        with pytest.raises(CheckpointError, match=f"optimizer's {key} of wte.weight has shape \\(3,\\)"):
            train(run, resume=True, quiet=True)
        assert ckpt.load_checkpoint(path)["step"] == 2  # left as it was
    path.write_bytes(good)
    state = ckpt.load_checkpoint(path)
    state["optimizer"]["state"]["wte.weight"]["exp_avg_sq"][0, 0] = -1.0
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="optimizer's exp_avg_sq of wte.weight holds torch.float32 values that "
                                              "are not finite floating-point numbers >= 0"):
        train(run, resume=True, quiet=True)
    assert ckpt.load_checkpoint(path)["step"] == 2
    for value in (True, 2.5, None, "x"):  # (an AttributeError traceback at the first step, after files were touched)
        path.write_bytes(good)
        state = ckpt.load_checkpoint(path)
        state["optimizer"]["state"]["wte.weight"]["exp_avg"] = value
        torch.save(state, path)
        with pytest.raises(CheckpointError, match=f"optimizer's exp_avg of wte.weight is {value!r}, not a tensor"):
            train(run, resume=True, quiet=True)
    # Moments of integers (finite, >= 0, the weight's shape) are refused too: AdamW would train on with them
    path.write_bytes(good)
    state = ckpt.load_checkpoint(path)
    state["optimizer"]["state"]["wte.weight"]["exp_avg"] = torch.zeros_like(state["model"]["wte.weight"],
                                                                         dtype=torch.long)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="optimizer's exp_avg of wte.weight holds torch.int64 values that are "
                                              "not finite floating-point numbers"):
        train(run, resume=True, quiet=True)
    assert ckpt.load_checkpoint(path)["step"] == 2


def test_an_index_keyed_or_incomplete_optimizer_state_is_refused_before_the_run_is_touched(tmp_path):
    """Moment shapes were checked for a state keyed by parameter name only: one keyed by index (checkpoints from before
    FSDP2 support, still read) with two parameters' moments swapped was a RuntimeError traceback at AdamW's first
    step, after config.json was rewritten and metrics.jsonl cut back; and a parameter's state without exp_avg,
    exp_avg_sq or its step count resumed with that one started again from zero, "exactly". Now each index's moments
    are checked against the optimizer's own parameter there, each state must hold all three, and an index the
    optimizer has not is refused: the one-line malformed-checkpoint error, before any file of the run changes. An
    intact index-keyed state still resumes."""
    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train(run, *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    (run / ckpt.RESULT).unlink()  # pretend it did not finish
    path, good = run / ckpt.CHECKPOINT, tmp_path / "good.pt"
    shutil.copy(path, good)
    state = ckpt.load_checkpoint(good)
    names = [name for group in state["optimizer"]["param_groups"] for name in group["params"]]
    wte_VD, wpe_TD = state["model"]["wte.weight"], state["model"]["wpe.weight"]
    assert names[:2] == ["wte.weight", "wpe.weight"] and wte_VD.shape != wpe_TD.shape

    def by_index(state: dict) -> dict:  # the pre-FSDP2 layout of the same state
        optimizer = state["optimizer"]
        optimizer["state"] = {names.index(name): entry for name, entry in optimizer["state"].items()}
        for group in optimizer["param_groups"]:
            group["params"] = [names.index(name) for name in group["params"]]
        return state

    def refused(state: dict, detail: str) -> None:
        torch.save(state, path)
        before = {name: (run / name).read_bytes() for name in (ckpt.CHECKPOINT, ckpt.CONFIG, ckpt.METRICS)}
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} is malformed or does not match this "
                                                            f"run ({detail})")):
            train(run, resume=True, quiet=True)
        assert {name: (run / name).read_bytes() for name in before} == before

    swapped = by_index(ckpt.load_checkpoint(good))
    moments = swapped["optimizer"]["state"]
    moments[0], moments[1] = moments[1], moments[0]
    refused(swapped, f"the optimizer's exp_avg of parameter 0 has shape {tuple(wpe_TD.shape)}, the weight "
                     f"{tuple(wte_VD.shape)}")
    beyond = by_index(ckpt.load_checkpoint(good))
    beyond["optimizer"]["state"][len(names)] = beyond["optimizer"]["state"].pop(0)
    refused(beyond, f"its optimizer's state names parameter {len(names)}, which this model's optimizer has not (it "
                    f"has {len(names)}, numbered from 0)")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        named, indexed = ckpt.load_checkpoint(good), by_index(ckpt.load_checkpoint(good))
        del named["optimizer"]["state"]["wte.weight"][key], indexed["optimizer"]["state"][0][key]
        refused(named, f"the optimizer's state of wte.weight has no {key}")
        refused(indexed, f"the optimizer's state of parameter 0 has no {key}")
    # parameter groups split in two, short of a parameter, or none: the groups are the model's or refused
    for regroup in (lambda groups: [{**groups[0], "params": groups[0]["params"][:3]},
                                    {**groups[0], "params": groups[0]["params"][3:]}] + groups[1:],
                    lambda groups: [{**groups[0], "params": groups[0]["params"][1:]}] + groups[1:],
                    lambda groups: []):
        damaged = ckpt.load_checkpoint(good)
        damaged["optimizer"]["param_groups"] = regroup(damaged["optimizer"]["param_groups"])
        refused(damaged, "its optimizer's parameter groups are not this model's")
    torch.save(by_index(ckpt.load_checkpoint(good)), path)
    assert train(run, resume=True, quiet=True)["steps"] == 2


def test_a_resumed_run_whose_best_checkpoint_is_lost_is_refused_not_tested_on_the_last_weights(tmp_path):
    """A run resumed without its best.pt (lost, or a copy without it) tested its last weights and reported their
    perplexity as the best step's. Now, where the best validation was not at the last step, a best.pt that is
    missing, or holds another step's weights, is a one-line CheckpointError naming it and no result.json is written;
    a best validation at the last step needs no best.pt (the last weights are the best)."""
    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train(run, *tiny_configs(data, max_steps=4, eval_every=2), quiet=True)
    (run / ckpt.RESULT).unlink()  # killed during its test: --resume tests again
    resume, best = ckpt.load_checkpoint(run / ckpt.CHECKPOINT), ckpt.load_checkpoint(run / ckpt.BEST)

    def best_at(step: int) -> dict:
        """The checkpoint with its curve's other loss raised, so its best validation is at ``step``."""
        loss = {p["step"]: p["valid_loss"] for p in resume["curve"]}[step]
        curve = [{**p, "valid_loss": loss if p["step"] == step else loss + 1.0} for p in resume["curve"]]
        return {**resume, "curve": curve, "best_step": step, "best_valid": loss}

    torch.save(best_at(2), run / ckpt.CHECKPOINT)  # its best validation at step 2 of 4
    torch.save({**best, "step": 4}, run / ckpt.BEST)
    with pytest.raises(CheckpointError, match=re.escape(f"{run / ckpt.BEST} holds the weights of step 4, not those of "
                                                        f"the run's best validation (step 2): restore a copy of it, or "
                                                        f"train again (--restart)")):
        train(run, resume=True, quiet=True)
    (run / ckpt.BEST).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{run / ckpt.BEST} is missing: the run's best validation was "
                                                        f"at step 2, whose weights it held, so its test perplexity "
                                                        f"cannot be measured; restore a copy of it, or train again "
                                                        f"(--restart)")):
        train(run, resume=True, quiet=True)
    assert not (run / ckpt.RESULT).exists()
    torch.save(best_at(4), run / ckpt.CHECKPOINT)
    assert train(run, resume=True, quiet=True)["best_step"] == 4


def test_the_warmup_warning_and_fitting_follow_where_the_learning_rate_reaches_its_peak():
    """fitted_warmup warned "warmup_steps=4 >= the run's 4 steps: the learning rate never reaches lr" where
    lr * (step + 1) / W reaches it at the run's last step; and fitted a default warmup to 1 step in a one-step run
    warming up from zero (lr * step / W), whose only update then had lr 0. Now the warning comes where the peak is
    not reached (W past the run's steps; from zero, W from them on), and a fitted warmup always reaches it."""
    from gbattn.config import build_configs
    from gbattn.train.trainer import fitted_warmup, learning_rate

    _, plus_one = build_configs("cpu-proxy", "standard", "data", {"warmup_steps": 4})
    assert (plus_one.warmup_from_zero, plus_one.fit_warmup) == (False, False)
    assert fitted_warmup(plus_one, 4) == (4, None) and learning_rate(3, plus_one, 4, 4) == plus_one.lr
    assert fitted_warmup(plus_one, 3) == (4, f"warning: warmup_steps=4 >= the run's 3 steps: the learning rate never "
                                             f"reaches lr={plus_one.lr:g}")
    from_zero = plus_one.replace(warmup_from_zero=True)
    assert fitted_warmup(from_zero, 4) == (4, f"warning: warmup_steps=4 >= the run's 4 steps: the learning rate never "
                                              f"reaches lr={plus_one.lr:g}")
    assert max(learning_rate(s, from_zero, 4, 4) for s in range(4)) < from_zero.lr
    assert fitted_warmup(from_zero, 5) == (4, None) and learning_rate(4, from_zero, 5, 4) == from_zero.lr
    for preset in ("paper-small", "cpu-proxy"):  # a default warmup (1,500 from zero; 100), fitted to short runs
        _, default = build_configs(preset, "standard", "data", {})
        for total in (1, 2, 3, 4, 10, 135):
            warmup = fitted_warmup(default, total)[0]
            assert max(learning_rate(s, default, total, warmup) for s in range(total)) == default.lr, (preset, total)
        assert fitted_warmup(default, 1)[0] == (0 if default.warmup_from_zero else 1)


def test_the_seconds_a_run_records_add_up_across_a_resume(tmp_path, monkeypatch):
    """With a clock that moves one second per reading, 12 steps and 3 evaluations take 12 + 3 seconds,
    12 of them training (tokens/s = tokens / 12): for a run resumed after a crash at step 7 (last
    checkpoint: step 4) as for an uninterrupted one."""
    import itertools
    import types

    from gbattn.train import trainer as trainer_mod

    data = write_corpus(tmp_path / "c")
    ticks = itertools.count()
    monkeypatch.setattr(trainer_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks)),
                                                                    monotonic=trainer_mod.time.monotonic))
    configs = tiny_configs(data)
    train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(7, tmp_path / "crashed", *configs, monkeypatch)
    state = ckpt.load_checkpoint(tmp_path / "crashed" / ckpt.CHECKPOINT)
    assert (state["step"], state["elapsed"], state["train_seconds"]) == (4, 5.0, 4.0)
    train(tmp_path / "crashed", resume=True, quiet=True)
    for run in ("ref", "crashed"):
        result = json.loads((tmp_path / run / ckpt.RESULT).read_text())
        assert result["wall_clock_s"] == 15.0, run
        assert result["train_tokens_per_s"] == result["train_tokens_seen"] / 12, run


def test_rows_that_fill_the_block_train(tmp_path):
    """seq_len = block_size (inputs fill every position) is a valid run; one more is refused."""
    data = write_corpus(tmp_path / "c")
    result = train(tmp_path / "run", *tiny_configs(data, seq_len=TINY["block_size"], max_steps=2, eval_every=2),
                   quiet=True)
    assert result["steps"] == 2 and result["train_tokens_seen"] == 2 * 8 * TINY["block_size"]
    over = TINY["block_size"] + 1  # (the position table has block_size rows)
    with pytest.raises(UserError, match=f"^seq_len={over} exceeds block_size={TINY['block_size']}$"):
        train(tmp_path / "over", *tiny_configs(data, seq_len=over, max_steps=2, eval_every=2), quiet=True)


def test_weights_with_a_name_missing_or_unknown_are_refused_and_the_model_left_alone():
    """load_full_state compares the names both ways: a checkpoint lacking a weight, or holding one the
    model does not have, is refused naming it, before any weight is loaded."""
    from gbattn.config import ModelConfig
    from gbattn.model import GPT
    from gbattn.train.distributed import load_full_state

    model = GPT(ModelConfig(vocab_size=20, block_size=8, d_model=16, n_layers=1, n_heads=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in before.items()}
    with pytest.raises(ValueError, match=r"\(unexpected: blocks\.9\.extra\)"):
        load_full_state(model, {**state, "blocks.9.extra": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"\(missing: ln_f\.weight\)"):
        load_full_state(model, {k: v for k, v in state.items() if k != "ln_f.weight"})
    first = ", ".join(sorted(state)[:3])  # of many: the first three by name, then "..."
    with pytest.raises(ValueError) as refused:
        load_full_state(model, {})
    assert str(refused.value) == f"its model weights do not match the model (missing: {first}, ...)"
    for n, more in ((3, ""), (4, ", ...")):  # exactly three named whole; a fourth is "..." (not left unsaid)
        names = sorted(state)[:n]
        with pytest.raises(ValueError) as refused:
            load_full_state(model, {k: v for k, v in state.items() if k not in names})
        assert str(refused.value).endswith(f"(missing: {', '.join(names[:3])}{more})")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", ["char", "hf"])
def test_decoding_an_id_outside_the_vocabulary_is_refused_naming_it(kind):
    """A char tokenizer decoded -1 as its last character and an HF one dropped an id past its vocabulary, silently
    (decoding a row of targets holding -100 read as text); each is one ValueError naming the id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer("char", json.dumps({"chars": list("abc")})) if kind == "char" else \
        Tokenizer("hf", HFTokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="c")).to_str())
    assert tok.decode([0, 1]).replace(" ", "") == "ab"
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=f"token id {bad} outside the vocabulary: ids are 0 .. 2 "):
            tok.decode([0, bad])
    with pytest.raises(ValueError, match="-100 marks a target left out of a loss"):
        tok.decode([-100])


@pytest.mark.parametrize("kind", ["char", "hf"])
def test_decode_takes_one_sequence_of_integer_ids(kind):
    """``run.tokenizer.decode(run.model.generate(...))`` passed the (1, T) batch: torch's "only one element tensors
    can be converted to Python scalars", naming no row; a string of digits decoded as ids 1, 2 and a float id was
    truncated to an integer, silently. A row, a list, a numpy array or a 1-D integer tensor decode as before."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer("char", json.dumps({"chars": list("abc")})) if kind == "char" else \
        Tokenizer("hf", HFTokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="c")).to_str())
    row = tok.decode([0, 1])
    for ids in (torch.tensor([0, 1]), np.array([0, 1]), (np.int64(0), 1), torch.tensor([[0, 1]])[0]):
        assert tok.decode(ids) == row
    for batch in (torch.tensor([[0, 1]]), np.array([[0, 1]]), [[0, 1]]):
        with pytest.raises(TypeError, match=r"^decode takes one sequence of token ids, not a batch of them: decode "
                                            r"each row \(ids\[0\]\)"):
            tok.decode(batch)
    with pytest.raises(TypeError, match=r"^decode takes token ids, not a str \(encode takes text\)"):
        tok.decode("12")
    for floats in ([0.5], torch.tensor([0.0, 1.0])):
        with pytest.raises(TypeError, match=r"^decode takes integer token ids, not float \(0\.[05]\)"):
            tok.decode(floats)


def test_train_from_python_restarts_a_run_as_train_restart_does(tmp_path):
    """A script run again into its run directory is told the run is there ("--restart to replace it"); train() takes
    restart=True as `gbattn train --restart` does (it had no such argument: the old run had to be deleted by hand)."""
    from gbattn.config import build_configs

    sets = {"max_steps": 2, "eval_every": 2, "d_model": 16, "n_layers": 1, "threads": 1}
    train(tmp_path / "run", *build_configs("cpu-char", "standard", "tiny-shakespeare", sets), quiet=True)
    wider = build_configs("cpu-char", "standard", "tiny-shakespeare", {**sets, "d_model": 32})
    with pytest.raises(UserError, match=r"already holds a run; pass --resume \(from Python: resume=True\) to "
                                        r"continue it, --restart \(restart=True\) to replace it"):
        train(tmp_path / "run", *wider, quiet=True)
    assert train(tmp_path / "run", *wider, quiet=True, restart=True)["d_model"] == 32
    assert ckpt.load_run(tmp_path / "run").model_cfg.d_model == 32
    events = [json.loads(line) for line in (tmp_path / "run" / ckpt.METRICS).read_text().splitlines()]
    assert [e["event"] for e in events].count("test") == 1  # the replaced run's records went with it
    with pytest.raises(UserError, match="resume=True continues the run in run_dir and restart=True replaces it"):
        train(tmp_path / "run", resume=True, restart=True)


def test_train_names_a_config_argument_of_another_type(tmp_path):
    """train() from Python with a config as a dict, or the two configs swapped, was "'dict' object has no attribute
    'data'" from inside the trainer; it is one ConfigError naming the argument, before anything is written."""
    from gbattn.config import build_configs
    from gbattn.errors import ConfigError

    model_cfg, train_cfg = build_configs("cpu-char", "standard", "tiny-shakespeare", {"max_steps": 1})
    for args, named in (((model_cfg.to_dict(), train_cfg), "model_cfg of type dict: give a ModelConfig"),
                        ((model_cfg, train_cfg.to_dict()), "train_cfg of type dict: give a TrainConfig"),
                        ((train_cfg, model_cfg), "model_cfg of type TrainConfig: give a ModelConfig")):
        with pytest.raises(ConfigError, match=named):
            train(tmp_path / "run", *args)
    # (was "no --data given", a flag the Python caller never saw)
    with pytest.raises(UserError, match=r"^no data given \(train_cfg\.data: a corpus name"):
        train(tmp_path / "run", *build_configs("cpu-char", "standard", "", {}))
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_preset_or_extra_that_no_reader_of_the_run_would_take(tmp_path):
    """train() records ``preset`` and ``extra`` in config.json, whose readers take a preset name and a JSON object:
    preset=5 or extra=[1] trained the whole run, then load_run and every command refused it ("preset=5 must be a
    string"), and an extra of a Path was a json TypeError from deep inside the first write. Each is one ConfigError
    naming the argument, before anything is written."""
    from gbattn.config import build_configs
    from gbattn.errors import ConfigError

    configs = build_configs("cpu-char", "standard", "tiny-shakespeare", {"max_steps": 1})
    for kwargs, named in (({"preset": 5}, r"^preset=5 is not allowed; choose one of paper-small"),
                          ({"preset": "cpu-chr"}, r"^preset='cpu-chr' is not allowed \(did you mean 'cpu-char'\?\)"),
                          ({"extra": [1]}, r"^extra of type list: give a dict"),
                          ({"extra": {"source": Path("x")}}, r"^extra holds a value JSON cannot record \(Object of "
                                                             r"type PosixPath is not JSON serializable\)")):
        with pytest.raises(ConfigError, match=named):
            train(tmp_path / "run", *configs, quiet=True, **kwargs)
    assert not (tmp_path / "run").exists()


def test_train_checks_a_config_field_set_after_the_config_was_built(tmp_path):
    """A config's fields are checked when it is built, not when one is set afterwards (``train_cfg.max_steps = 0``,
    a script's way to change a run): max_steps=0 or eval_every=-1 trained and wrote a run that load_run and every
    command refused, lr='x' was a TypeError from inside AdamW. train() checks its own copy of each config, as GPT
    does: one ConfigError naming the field, before anything is written."""
    from gbattn.config import build_configs
    from gbattn.errors import ConfigError

    model_cfg, train_cfg = build_configs("cpu-char", "standard", "tiny-shakespeare", {"max_steps": 1})
    for field, value, named in (("max_steps", 0, r"^max_steps=0 must be an integer >= 1"),
                                ("eval_every", -1, r"^eval_every=-1 must be an integer >= 1"),
                                ("lr", "x", r"^lr='x' must be a number")):
        changed = train_cfg.replace()
        setattr(changed, field, value)
        with pytest.raises(ConfigError, match=named):
            train(tmp_path / "run", model_cfg, changed, quiet=True)
    changed = model_cfg.replace()
    changed.dropout = 1.5
    with pytest.raises(ConfigError, match=r"^dropout=1\.5 must be in \[0, 1\)"):
        train(tmp_path / "run", changed, train_cfg, quiet=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("given", [None, 3, b"run", ["run"]])
def test_load_run_and_train_name_a_directory_of_another_type(tmp_path, given):
    """load_run(None) or train(3, ...) was pathlib's "expected str, bytes or os.PathLike object, not NoneType" (bytes:
    "argument should be a str object ..."), naming neither the argument nor what it takes: a TypeError naming both."""
    from gbattn.config import build_configs

    kind = type(given).__name__
    with pytest.raises(TypeError, match=rf"^path of type {kind}: give a run directory \(a str or pathlib\.Path\)"):
        ckpt.load_run(given)
    configs = build_configs("cpu-char", "standard", "tiny-shakespeare", {"max_steps": 1})
    with pytest.raises(TypeError, match=rf"^run_dir of type {kind}: give a run directory \(a str or pathlib\.Path\)"):
        train(given, *configs, quiet=True)


@pytest.mark.parametrize("kind", ["char", "hf"])
def test_encoding_anything_but_a_string_is_a_type_error_not_a_damaged_tokenizer(kind):
    """An HF tokenizer's refusal of bytes (or a list, or None) read "its tokenizer.json is damaged", and a char
    tokenizer took bytes for the characters numbered 97, 98, ...: each is a TypeError naming the type."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer("char", json.dumps({"chars": list("abc")})) if kind == "char" else \
        Tokenizer("hf", HFTokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="c")).to_str())
    assert tok.encode("a") == [0]
    with pytest.raises(TypeError, match=r"encode takes a string, not a bytes \(decode bytes to text first\)"):
        tok.encode(b"ab")
    for given in (["a", "b"], None):
        with pytest.raises(TypeError, match=f"encode takes a string, not a {type(given).__name__}$"):
            tok.encode(given)
    # text that is not UTF-8: a shell argument's byte 0xe9 (Latin-1 é) kept as a surrogate, or a lone surrogate; the
    # HF tokenizer said "TextInputSequence must be str ... its tokenizer.json is damaged", and encode_batch (a corpus's
    # lines, run.perplexity's text) still did
    for text, what in ((b"ab\xe9".decode("utf-8", "surrogateescape"), "byte 0xe9 at character 2"),
                       ("a\ud800", "a lone surrogate U\\+D800 at character 1"),
                       ("a\udc41", "a lone surrogate U\\+DC41 at character 1")):  # (no escaped byte: those are 0x80+)
        for encode in (tok.encode, lambda text: tok.encode_batch(["ab", text])):
            with pytest.raises(DataError, match=f"^the text is not UTF-8: {what} \\(text typed or read in another "
                                                f"encoding than UTF-8\\?\\)$"):
                encode(text)


def test_utf8_text_read_in_an_ascii_locale_is_said_to_be_the_locales_doing():
    """`LC_ALL=C PYTHONUTF8=0 gbattn generate RUN --prompt café`: Python read the argument's UTF-8 bytes as ASCII, and
    the refusal said the text was not UTF-8 ("byte 0xc3"); it says the bytes are UTF-8 and how to read them so."""
    code = ("from gbattn.data.tokenizer import refuse_non_utf8\n"
            "import sys\n"
            "try:\n"
            "    refuse_non_utf8(sys.argv[1])\n"
            "except Exception as e:\n"
            "    print(e)\n")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, "café".encode()], capture_output=True, env=env, text=True)
    assert out.stdout == ("the text is not UTF-8: byte 0xc3 at character 3 (the bytes are UTF-8, but Python read them "
                          "in this locale's ascii: set a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1)\n"), out.stderr
    # a path or --set value so read: the same advice (it said "rename the file or folder", a valid UTF-8 name)
    out = subprocess.run([sys.executable, "-m", "gbattn", "eval", "/nonexistent/café".encode()], capture_output=True,
                         env=env, text=True)
    assert out.returncode == 2 and out.stderr.endswith(
        "gbattn writes paths and settings into its results as UTF-8 text; the bytes are UTF-8, but Python read them in "
        "this locale's ascii: set a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1\n"), out.stderr


def test_text_a_tokenizer_without_an_unknown_token_cannot_encode_is_refused_not_dropped(tmp_path):
    """A tokenizer.json whose BPE model has no unknown token (``models.BPE()``, the library's default) encodes a
    character missing from its vocabulary to nothing: the run trained and scored a text with those characters
    silently cut out. Such text is refused in one line naming the characters, as the char tokenizer refuses it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox\n" * 30 + "the quick brown föx 狐\n" * 10)
    corpus = load_corpus(str(path), (0.5, 0.25, 0.25))
    # also with an "<unk>" among its special tokens that its BPE model does not name (it was taken for the unknown
    # token, so nothing was scanned and the text lost "föx 狐" silently)
    for specials in ([], ["<unk>", "<pad>"]):
        no_unknown = Backend(models.BPE())
        no_unknown.pre_tokenizer = pre_tokenizers.Whitespace()
        no_unknown.train_from_iterator(["the quick brown fox\n"] * 20, trainers.BpeTrainer(
            vocab_size=40, special_tokens=specials, show_progress=False))
        (tmp_path / "tokenizer.json").write_text(no_unknown.to_str())
        tok = get_tokenizer(f"hf={tmp_path / 'tokenizer.json'}", corpus)
        assert tok.unknown_id is None
        assert tok.decode(tok.encode("the fox")) == "the fox"  # text it has tokens for: unchanged
        with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['\\x07', '\\u200d'\]; "):
            tok.encode("the\u200dfox\x07")  # control and format characters too: no normalizer removes them
        with pytest.raises(DataError, match=r"^.*t\.txt \(test split\): characters the tokenizer has no token for "
                                            r"\(and no unknown token\): \['ö', '狐'\]; "):
            tokenize_corpus(corpus, tok, progress=False)
        with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['ö'\]"):
            tok.encode("föx")  # a prompt too
        # the information separators U+001C .. U+001F: whitespace to Python's isspace, not to the tokenizers
        # library, which dropped them (a prompt's "KING\x1dHENRY" lost its separator without a word)
        with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['\\x1d'\]"):
            tok.encode("the\x1dfox")
        assert tok.encode("the\tfox \u2028") == tok.encode("the fox")  # whitespace to both: no token, nothing lost
        # ... with a normalizer too, which keeps them (str.strip() took them for whitespace it left)
        from tokenizers import normalizers

        normalized = Backend.from_str(no_unknown.to_str())
        normalized.normalizer = normalizers.NFC()
        (tmp_path / "normalized.json").write_text(normalized.to_str())
        with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['\\x1d'\]"):
            get_tokenizer(f"hf={tmp_path / 'normalized.json'}", corpus).encode("the\x1dfox")
    # A byte-level tokenizer (GPT-2's) has no unknown token either, but encodes any text: it is not scanned
    from tokenizers import decoders

    byte_level = Backend(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(["the quick brown fox\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    (tmp_path / "tokenizer.json").write_text(byte_level.to_str())
    tok = get_tokenizer(f"hf={tmp_path / 'tokenizer.json'}", corpus)
    assert (tok.unknown_id, tok._may_drop_text) == (None, False)
    assert tok.decode(tok.encode("the quick brown föx 狐")) == "the quick brown föx 狐"


def test_a_tokenizer_file_giving_two_tokens_one_id_or_listing_a_piece_twice_is_refused():
    """A gpt2=/hf= tokenizer.json whose vocabulary gives two tokens one id was used: typed "thing" came back as
    "anding", and `gbattn export` ended in a traceback. A Unigram piece listed twice left an id naming nothing, and its
    export was refused as if a special token were missing. Each is refused, naming the tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"<unk>": 0, "a": 1, "th": 2, "and": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    payload = json.loads(backend.to_str())
    payload["model"]["vocab"]["th"] = 3
    with pytest.raises(ValueError, match=r"^its tokens 'and' and 'th' have one id, 3: each id must name one token$"):
        Tokenizer("hf", json.dumps(payload))
    unigram = Backend(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0), ("a", -3.0)], 0))
    with pytest.raises(ValueError, match=r"^its Unigram piece 'a' is listed twice: each piece must be listed once$"):
        Tokenizer("hf", unigram.to_str())
    Tokenizer("hf", Backend(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], 0)).to_str())  # once each


def test_a_prompt_gets_the_special_tokens_a_template_puts_before_it_only_whitespace_alone_too():
    """A BERT template ([CLS] $A [SEP]): a prompt of whitespace alone kept its [SEP] (a prompt with text of its own did
    not), and generation went on after it, where transformers' form of the tokenizer gives [CLS] alone."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    backend = Backend(models.WordLevel({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "x": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["[CLS]", "[SEP]"])
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1),
                                                                                                   ("[SEP]", 2)])
    tok = Tokenizer("hf", backend.to_str())
    assert tok.encode("x x") == [1, 3, 3]
    for blank in ("", "   ", "\t", "\n"):
        assert tok.encode(blank) == [1], repr(blank)
    assert tok.encode_batch(["x"]) == [[3]]  # corpus lines: no special token at all


def test_a_bpe_dropout_tokenizer_encodes_the_same_text_to_the_same_ids_every_time():
    """A tokenizer.json whose BPE model has dropout (a regulariser that skips merges at random) encoded the same text
    to other ids on every call: token caches, perplexities and prompts were random. It is read with dropout off, as
    truncation and padding are, under a new fingerprint."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    from gbattn.data.tokenizer import Tokenizer

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(["hello world lower lowest newer wider\n"] * 20,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    plain = Tokenizer("hf", backend.to_str())
    backend.model.dropout = 0.5
    tok = Tokenizer("hf", backend.to_str())
    text = "hello world lower lowest newer wider " * 8
    assert {tuple(tok.encode(text)) for _ in range(4)} == {tuple(plain.encode(text))}
    assert tok.encode_batch([text] * 4) == [plain.encode(text)] * 4
    assert json.loads(tok.payload)["model"]["dropout"] is None and tok.payload == plain.payload


def test_a_character_the_tokenizers_own_normalizer_removes_is_not_refused_as_lacking_a_token(tmp_path):
    """A tokenizer.json without an unknown token whose normalizer strips accents (NFD, then StripAccents) removes a
    combining accent by design, as BERT's uncased one does: text holding one was refused as holding a character the
    tokenizer "has no token for". What its normalizer keeps and its vocabulary lacks is still refused."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    stripping = Backend(models.BPE())
    stripping.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    stripping.pre_tokenizer = pre_tokenizers.Whitespace()
    stripping.train_from_iterator(["the quick brown fox cafe\n"] * 20, trainers.BpeTrainer(vocab_size=40,
                                                                                            show_progress=False))
    (tmp_path / "tokenizer.json").write_text(stripping.to_str())
    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox cafe\u0301 café\n" * 40)
    corpus = load_corpus(str(path), (0.5, 0.25, 0.25))
    tok = get_tokenizer(f"hf={tmp_path / 'tokenizer.json'}", corpus)
    assert tok.encode("cafe\u0301 café") == tok.encode("cafe cafe")
    assert len(tokenize_corpus(corpus, tok, progress=False)["train"]) > 0
    with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['狐'\]"):
        tok.encode("cafe\u0301 狐")


def test_a_character_no_token_covers_is_refused_whatever_its_category_and_a_special_token_in_the_text_is_not():
    """Text a tokenizer without an unknown token drops was judged a character at a time, control, format, private-use
    and unassigned characters (Unicode's C categories) exempted: "the cat \\uf8ff sat" trained as "the cat sat"
    without a word, where no normalizer removes them; a decomposed "e\\u0301" that an NFC normalizer composes into an
    "é" without a token was dropped, as each character alone has a token; and a special token written in the text
    ("<|endoftext|>" between documents) was refused as characters ['<', '>', 'x', '|'] that it encodes whole. Each
    character of the text must now be covered by one of its tokens (whitespace, and what a normalizer removes, pass)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    def trained(texts, normalizer=None, **options):
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=60, show_progress=False, **options))
        return Tokenizer("hf", backend.to_str())

    tok = trained(["the cat sat on the mat", "a dog ran far"], special_tokens=["<|endoftext|>"])
    for c, named in (("\uf8ff", r"\\uf8ff"), ("\x07", r"\\x07"), ("\u0378", r"\\u0378"), ("Q", "Q")):
        for encode in (tok.encode, lambda text: tok.encode_batch(["a dog", text])):
            with pytest.raises(DataError, match=rf"^characters the tokenizer has no token for \(and no unknown "
                                                rf"token\): \['{named}'\]; it would leave them out silently"):
                encode(f"the cat {c} sat")
    # inside a word, the tokens after the character dropped are placed as if it was not there: it is still the one named
    for text in ("the catQsat<|endoftext|>", "<|endoftext|>the catQsat"):  # the special token last or first
        with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['Q'\]; "):
            tok.encode(text)
    end_of_text = tok._hf.token_to_id("<|endoftext|>")
    assert tok.encode("the cat<|endoftext|>a dog") == tok.encode("the cat") + [end_of_text] + tok.encode("a dog")
    assert tok.encode_batch(["the cat<|endoftext|>a dog"]) == [tok.encode("the cat<|endoftext|>a dog")]
    # composed by the normalizer into a character without a token: both characters are named
    composing = trained(["the cafe sat", "a \u0301 mark"], normalizer=normalizers.NFC())
    assert composing.decode(composing.encode("the cafe sat")) == "the cafe sat"
    with pytest.raises(DataError, match="no token for \\(and no unknown token\\): \\['e', '\u0301'\\]; "):
        composing.encode("the cafe\u0301 sat")
    # a control character a normalizer removes (BERT's cleans text of them) still passes
    cleaning = trained(["the cat sat"], normalizer=normalizers.BertNormalizer(lowercase=False))
    assert cleaning.encode("the cat\x07 sat") == cleaning.encode("the cat sat")


def test_a_byte_level_or_byte_fallback_tokenizer_lacking_some_bytes_tokens_is_scanned_for_text_it_drops():
    """A byte-level tokenizer or one with byte fallback was never scanned for text it drops, as if it had a token for
    every byte: a byte-level BPE trained without the whole byte alphabet (only its training text's bytes) encoded
    "the CAT sat" to "the  sat", and one with byte_fallback but no <0xNN> tokens to "the sat", silently. Only one
    with all 256 bytes' tokens is now left unscanned; a character some of whose bytes lack a token is named."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    texts = ["the cat sat on the mat föx", "a dog ran far"]
    byte_level = Backend(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=60, show_progress=False))
    tok = Tokenizer("hf", byte_level.to_str())
    assert (tok.unknown_id, tok._may_drop_text) == (None, True)
    assert tok.encode("the föx") == byte_level.encode("the föx").ids
    # "é" shares its first byte with "ö": one of its bytes has a token, the other none
    for text, named in (("the CAT sat", "'A', 'C', 'T'"), ("the fé", "'é'")):
        with pytest.raises(DataError, match=rf"no token for \(and no unknown token\): \[{named}\]; "):
            tok.encode(text)
    for bytes_named in ([], [f"<0x{byte:02X}>" for byte in range(256)]):
        fallback = Backend(models.BPE(byte_fallback=True))
        fallback.pre_tokenizer = pre_tokenizers.Whitespace()
        fallback.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=bytes_named,
                                                                show_progress=False))
        tok = Tokenizer("hf", fallback.to_str())
        assert tok._may_drop_text == (not bytes_named)
        if bytes_named:  # every byte has a token: "CAT" is three of them
            assert tok.encode("the CAT") == [tok._hf.token_to_id(token) for token in ("the", "<0x43>", "<0x41>",
                                                                                       "<0x54>")]
        else:
            with pytest.raises(DataError, match=r"no token for \(and no unknown token\): \['A', 'C', 'T'\]; "):
                tok.encode("the CAT")


def test_a_char_tokenizer_names_every_unknown_character_of_a_batch_not_the_first_lines_only(tmp_path):
    """Text a char tokenizer lacks characters for is refused naming them all (up to ten), wherever they are in the
    lines encoded together: naming the first line's only, a user who took those out met the next line's next run."""
    path = tmp_path / "t.txt"
    path.write_text("abc\n" * 40)
    tok = get_tokenizer("char", load_corpus(str(path), (0.5, 0.25, 0.25)))
    with pytest.raises(DataError, match=r"^characters not in the tokenizer's vocabulary: \['ö', '狐'\]$"):
        tok.encode_batch(["abc\n", "aöc\n", "ab\n", "狐\n"])


def test_a_one_character_corpus_is_counted_in_the_singular(tmp_path, capsys, monkeypatch):
    """A corpus of one character: "char tokenizer: 1 tokens" (and "has 1 tokens" of a split of one token)."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    write_text(tmp_path / "a.txt", "a" * 4000)
    train(tmp_path / "run", *tiny_configs(tmp_path / "a.txt", max_steps=1, eval_every=1), quiet=False)
    out = capsys.readouterr().out
    assert "char tokenizer: 1 token" in out and "1 tokens" not in out, out
