"""From ``--data`` to token ids: corpus -> tokenizer (trained once, cached) -> token memmaps (cached)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gbattn.config import TrainConfig
from gbattn.data.corpus import SPLITS, Corpus, load_corpus
from gbattn.data.tokenizer import Tokenizer, get_tokenizer
from gbattn.data.tokens import tokenize_corpus
from gbattn.errors import DataError, UserError


@dataclass
class Data:
    tokenizer: Tokenizer
    splits: dict[str, np.ndarray]  # split -> token ids
    corpus_name: str
    corpus_fingerprint: str
    notes: list[str]

    def split_of(self, split: str) -> str:
        """How an error names one of its splits: ``the valid split of --data NAME``."""
        return f"the {split} split of --data {self.corpus_name}"


def prepare_data(cfg: TrainConfig, vocab_size: int, tokenizer: Tokenizer | None = None, progress: bool = True,
                 trained_on: str | None = None, mismatch: str = "", needed: tuple[str, ...] = SPLITS,
                 named: str | None = None, corpus: Corpus | None = None) -> Data:
    """The training config's corpus as token ids, with ``tokenizer`` (default: trained for it).

    ``trained_on``: the fingerprint a run recorded; other data is refused before it is tokenized (a
    new character would otherwise fail first), with ``mismatch`` (what to do) ending the line.
    ``needed``: the splits tokenized and returned (tokenize_corpus). ``named``: how that refusal names the data
    (``--data NAME`` by default: as typed). ``corpus``: ``cfg.data`` already loaded (:func:`load_corpus`)."""
    corpus = corpus or load_corpus(cfg.data, tuple(cfg.split))
    if trained_on and corpus.fingerprint != trained_on:
        # the hub's copy and a local one (the README's folder of it) never match, even holding the same text
        sources = ("; the hub's datasets are fingerprinted by `datasets`, local files by their content, so a hub "
                   "dataset and a local copy of it never match" if trained_on.startswith("hf:")
                   != corpus.fingerprint.startswith("hf:") else "")
        raise UserError(f"{named or f'--data {cfg.data}'} is not the data the run was trained on (fingerprint "
                        f"{trained_on[:16]} recorded, {corpus.fingerprint[:16]} now{sources}){mismatch}")
    tok = tokenizer or get_tokenizer(cfg.tokenizer, corpus, vocab_size=vocab_size, verbose=progress)
    caps = {"train": cfg.train_tokens, "valid": cfg.eval_tokens, "test": cfg.eval_tokens}
    splits = tokenize_corpus(corpus, tok, caps, progress=progress, needed=needed)
    return Data(tok, {s: splits[s] for s in needed}, corpus.name, corpus.fingerprint, corpus.notes)


def prepare_run_data(run, data: str | None, allow_other_data: bool, split: str):
    """A trained run's (:class:`gbattn.rundir.LoadedRun`) held-out ``split`` (valid or test) as token ids, by its own
    tokenizer (``eval``, ``analyze``): at ``data`` if given, else where the run recorded it; data other than the run's
    (its fingerprint) is refused unless allowed. The other splits are not read (the training split can be most of the
    corpus, and a character of the other held-out split that a char tokenizer lacks refused the one asked for)."""
    if not data and not run.train_cfg.data:  # e.g. upcycled from a Hugging Face checkpoint: trained on nothing here
        raise UserError(f"{run.run_dir} records no corpus: pass --data (a corpus name, a directory or a text file)")
    train_cfg = run.train_cfg.replace(data=data) if data else run.train_cfg
    recorded = None if allow_other_data else run.data_fingerprint
    # Data not typed now is where the run recorded it: an export's path cut to its last part can name another corpus
    # (a folder named tiny-shakespeare: the bundled one) or the hub's; said so, not "--data NAME" as if typed.
    advice = "" if data else f"; {recorded_path_advice(run.run_dir, exported=data_path_cut(run))}"
    try:
        corpus = load_corpus(train_cfg.data, tuple(train_cfg.split))
    except DataError as e:  # not found, or a hub name not loadable here (not a token cache's error, which it was said
        if data:  # to be: "could not write the token cache ...: pass --data PATH where the corpus is now")
            raise
        raise type(e)(f"{e}{advice}") from None
    return prepare_data(train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False, trained_on=recorded,
                        mismatch=f"{advice}; pass --allow-other-data to evaluate on it anyway",
                        needed=(split,), corpus=corpus,
                        named=None if data else f"the data {run.run_dir} recorded ({train_cfg.data})")


def data_path_cut(run) -> bool:
    """Whether the corpus path a loaded run records was cut to its last part: an export's, or that of a run
    upcycled from an export (its ``extra`` names the source's weights as ``exported``)."""
    config = getattr(run, "config", None)
    extra = config.get("extra") if isinstance(config, dict) else None
    from gbattn.rundir import CHANGED, EXPORTED

    exported = (EXPORTED, CHANGED)
    return run.checkpoint in exported or (isinstance(extra, dict) and extra.get("source_checkpoint") in exported)


def recorded_path_advice(run_dir, exported: bool = False) -> str:
    """What follows a corpus not found at the path ``run_dir`` recorded (``eval``, ``analyze``, ``train --resume``):
    the path was not typed now, and ``--data`` names where the corpus is."""
    kept = ("an export keeps only its last part" if exported
            else "a relative path is relative to where the run was trained")
    return f"that is the path {run_dir} recorded ({kept}): pass --data PATH where the corpus is now"


def other_data_note(run, data: Data) -> str:
    """What ``eval`` and ``analyze`` say beside their figures when ``--allow-other-data`` let in a corpus
    other than the one the run recorded (its fingerprint); empty for the run's own data or a run that
    recorded none."""
    recorded = run.data_fingerprint
    if not recorded or data.corpus_fingerprint == recorded:
        return ""
    return (f"evaluated on {data.corpus_name}, not the data the run was trained on (fingerprint {recorded[:16]} "
            f"recorded, {data.corpus_fingerprint[:16]} here)")
