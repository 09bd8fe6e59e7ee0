"""Tokenizers: the paper's BPE, GPT-2 byte-level, and characters. Trained once, cached by
content hash under ``$GBATTN_CACHE`` (default ``~/.cache/gbattn``).

* ``bpe`` (paper, SPEC.md section 1): HF ``tokenizers`` BPE, Whitespace pre-tokenizer,
  specials ``<pad>`` ``<unk>``, trained on the first 100k non-empty training lines.
* ``gpt2``: GPT-2's byte-level BPE (50,257 tokens) from the Hugging Face hub, or any
  ``tokenizer.json`` file given by path.
* ``char``: one token per character of the corpus (nanoGPT's shakespeare_char).
"""

from __future__ import annotations

import hashlib
import json
import os
from itertools import islice
from pathlib import Path
from typing import Iterable

from gbattn.errors import DataError

BPE_TRAIN_LINES = 100_000
SPECIALS = ["<pad>", "<unk>"]


def cache_dir() -> Path:
    path = Path(os.environ.get("GBATTN_CACHE", Path.home() / ".cache" / "gbattn"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Tokenizer:
    """A trained tokenizer: ``encode(text) -> ids``, ``decode(ids) -> text``, JSON-serialisable."""

    def __init__(self, kind: str, payload: str) -> None:
        self.kind = kind
        self.payload = payload  # HF tokenizer JSON, or {"chars": [...]} for char
        if kind == "char":
            self.chars = json.loads(payload)["chars"]
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            self._hf = None
        else:
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_str(payload)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) if self.kind == "char" else self._hf.get_vocab_size()

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256((self.kind + self.payload).encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        if self.kind == "char":
            unknown = set(text) - self.stoi.keys()
            if unknown:
                raise DataError(f"characters not in the tokenizer's vocabulary: {sorted(unknown)[:10]}")
            return [self.stoi[c] for c in text]
        return self._hf.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "char":
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._hf.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "char":
            return "".join(self.chars[i] for i in ids)
        return self._hf.decode(ids)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "payload": self.payload})

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        d = json.loads(text)
        return cls(d["kind"], d["payload"])

    def save(self, path: Path) -> None:
        atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: Path) -> "Tokenizer":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def _train_bpe(lines: Iterable[str], vocab_size: int) -> str:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def _gpt2_payload(spec: str) -> str:
    path = Path(spec.split("=", 1)[1]) if "=" in spec else None
    if path is not None:
        if not path.is_file():
            raise DataError(f"--tokenizer {spec}: no such tokenizer.json file")
        return path.read_text(encoding="utf-8")
    try:
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_pretrained("gpt2").to_str()
    except Exception as e:
        raise DataError(
            f"could not fetch the GPT-2 tokenizer from the Hugging Face hub ({type(e).__name__}); "
            f"pass a local file instead: --tokenizer gpt2=/path/to/tokenizer.json"
        ) from None


TOKENIZER_KINDS = ("bpe", "gpt2", "char")


def get_tokenizer(kind: str, corpus, vocab_size: int | None = None, verbose: bool = True) -> Tokenizer:
    """Train (or fetch from the cache) the tokenizer of ``kind`` for ``corpus``."""
    base = kind.split("=", 1)[0]
    if base not in TOKENIZER_KINDS:
        raise DataError(f"--tokenizer {kind!r} is not allowed; choose one of {', '.join(TOKENIZER_KINDS)} (or gpt2=PATH)")
    if base == "gpt2":
        return Tokenizer("gpt2", _gpt2_payload(kind))
    key = hashlib.sha256(f"{base}|{vocab_size}|{BPE_TRAIN_LINES}|{corpus.fingerprint}".encode()).hexdigest()[:20]
    path = cache_dir() / "tokenizers" / f"{base}-{key}.json"
    if path.is_file():
        return Tokenizer.load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if base == "char":
        chars = sorted({c for split in ("train", "valid", "test") for line in corpus.lines(split) for c in line})
        tok = Tokenizer("char", json.dumps({"chars": chars}))
    else:
        if verbose:
            print(f"training BPE tokenizer (vocabulary {vocab_size}) on the first {BPE_TRAIN_LINES:,} non-empty lines")
        lines = islice((line for line in corpus.lines("train") if line.strip()), BPE_TRAIN_LINES)
        tok = Tokenizer("bpe", _train_bpe(lines, vocab_size))
    tok.save(path)
    return tok
