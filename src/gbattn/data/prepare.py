"""From ``--data`` to token ids: corpus -> tokenizer (trained once, cached) -> token memmaps (cached)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gbattn.config import TrainConfig
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import Tokenizer, get_tokenizer
from gbattn.data.tokens import tokenize_corpus


@dataclass
class Data:
    tokenizer: Tokenizer
    splits: dict[str, np.ndarray]  # split -> token ids
    corpus_name: str
    corpus_fingerprint: str
    notes: list[str]


def prepare_data(cfg: TrainConfig, vocab_size: int, tokenizer: Tokenizer | None = None, progress: bool = True) -> Data:
    """The training config's corpus as token ids, with ``tokenizer`` (default: trained for it)."""
    corpus = load_corpus(cfg.data, tuple(cfg.split))
    tok = tokenizer or get_tokenizer(cfg.tokenizer, corpus, vocab_size=vocab_size, verbose=progress)
    caps = {"train": cfg.train_tokens, "valid": cfg.eval_tokens, "test": cfg.eval_tokens}
    splits = tokenize_corpus(corpus, tok, caps, progress=progress)
    return Data(tok, splits, corpus.name, corpus.fingerprint, corpus.notes)
