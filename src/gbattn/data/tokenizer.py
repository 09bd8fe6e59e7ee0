"""Tokenizers: the paper's BPE, GPT-2 byte-level, and characters. Trained once, cached by content
hash under ``$GBATTN_CACHE`` (default ``~/.cache/gbattn``).

* ``bpe`` (the paper's, docs/paper.md): HF ``tokenizers`` BPE, Whitespace pre-tokenizer, specials
  ``<pad>`` ``<unk>``, trained on the first 100k non-empty training lines. Unlike the authors'
  tokenizer it keeps an ``<unk>`` token for characters unseen in training (docs/deviations.md); decoded text
  shows it as ``<unk>``, WikiText v1's spelling of its rare words.
* ``gpt2``: GPT-2's byte-level BPE (50,257 tokens) from the Hugging Face hub, or any
  ``tokenizer.json`` file given by path (``gpt2=PATH``).
* ``hf``: any Hugging Face ``tokenizer.json`` (``hf=PATH``), e.g. a converted checkpoint's (``gbattn upcycle``).
* ``char``: one token per character of the corpus (nanoGPT's shakespeare_char).

A tokenizer file (``tokenizer.json`` in a run directory) is validated when read.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import operator
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

from gbattn.config import MAX_VOCAB_SIZE, TOKENIZER_CHOICES, TOKENIZER_FILE_KINDS, TOKENIZER_KINDS, unknown_tokenizer
from gbattn.errors import CheckpointError, DataError, UserError, locale_misread, shown
from gbattn.files import (
    atomic_write,
    check_writable_dir,
    dangling_link,
    did_you_mean_path,
    error_detail,
    read_json_bytes,
    refuse_not_regular,
    remove_abandoned,
)

BPE_TRAIN_LINES = 100_000
TRAIN_PIECE_CHARS = 1 << 20  # a longer training line is fed in pieces cut before spaces (cut_before_spaces)
SPECIALS = ["<pad>", "<unk>"]
KINDS, FILE_KINDS = TOKENIZER_KINDS, TOKENIZER_FILE_KINDS  # (FILE_KINDS: HF tokenizer JSON, also KIND=PATH)


def cache_dir() -> Path:
    """``$GBATTN_CACHE`` (default ``~/.cache/gbattn``), created and checked writable."""
    value = os.environ.get("GBATTN_CACHE")
    if value is not None and not value.strip():  # Path("") would be the working directory
        raise DataError("GBATTN_CACHE is set but empty: set it to a directory, or unset it for ~/.cache/gbattn")
    # os.path.expanduser leaves a "~" it cannot expand (no HOME, a user with no home directory: a container's
    # `--user 54321`), where Path.home() and Path.expanduser() raised a RuntimeError traceback
    path = os.path.expanduser(value if value is not None else os.path.join("~", ".cache", "gbattn"))
    if path.startswith("~"):
        raise DataError(f"cannot tell the home directory for the cache directory {path}: set GBATTN_CACHE to a "
                        f"directory (or HOME)")
    try:
        return check_writable_dir(Path(path), "the cache directory")
    except UserError as e:  # (the hint read inside the sentence: "the cache directory (set ...) /x is a file")
        raise type(e)(f"{e}; set GBATTN_CACHE to another directory") from None


@contextlib.contextmanager
def hf_failures_as_data_errors(what: str):
    """An error of the Hugging Face ``tokenizers`` library in the block (a plain ``Exception``, or a Rust panic,
    raised as a BaseException, which no ``except Exception`` catches) as a one-line :class:`DataError`: a
    hostile ``tokenizer.json`` whose pre-tokenizer's regex backtracks past Oniguruma's limit panics on the text
    it meets; one whose BPE merges make a token it lacks panics when read, one whose unknown token is not in its
    vocabulary fails on text it cannot encode."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":  # pyo3's class, exported nowhere
            raise
        raise DataError(f"{error_detail(e)} (the tokenizer failed while {what}: its tokenizer.json is damaged or "
                        f"cannot handle this text)") from None  # the library's words first: callers may cut the line


class Tokenizer:
    """A trained tokenizer: ``encode(text) -> ids``, ``decode(ids) -> text``, JSON-serialisable."""

    def __init__(self, kind: str, payload: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"tokenizer kind {kind!r}; expected one of {', '.join(KINDS)}")
        self.kind = kind
        self.payload = payload  # HF tokenizer JSON, or {"chars": [...]} for char
        if kind == "char":
            chars = json.loads(payload)["chars"]
            # A lone surrogate ("\ud800" in JSON) is no character of any UTF-8 text: decoding it to print or export
            # was a UnicodeEncodeError traceback.
            if not (isinstance(chars, list) and chars and all(isinstance(c, str) and len(c) == 1
                                                              and not "\ud800" <= c <= "\udfff" for c in chars)
                    and len(set(chars)) == len(chars)):
                raise ValueError("a char tokenizer's payload must list distinct single characters (of UTF-8 text)")
            self.chars = chars
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            self._hf = None
        else:
            from tokenizers import Tokenizer as HFTokenizer

            with hf_failures_as_data_errors("reading its file"):
                self._hf = HFTokenizer.from_str(payload)
            if self._hf.truncation is not None or self._hf.padding is not None:
                # a tokenizer.json saved with truncation or padding on would cut every line of a corpus to its
                # max_length and pad it to a fixed length; gbattn windows token streams itself (transformers'
                # form turns both off too). The payload without them: a new fingerprint, so no cached ids.
                self._hf.no_truncation()
                self._hf.no_padding()
                self.payload = self._hf.to_str()
            if getattr(self._hf.model, "dropout", None):
                # BPE-dropout (a regulariser for training a tokenizer's user) skips merges at random: the same text
                # encoded to other ids on every call, so token caches, perplexities and prompts were random. Off,
                # as transformers leaves it only for training; a new payload and fingerprint, as above.
                self._hf.model.dropout = None
                self.payload = self._hf.to_str()
            vocab = self._hf.get_vocab(with_added_tokens=True)
            ids = set(vocab.values())
            if len(ids) < len(vocab):  # (encoded silently: "thing" came back as "anding"; export, a traceback)
                spelled: dict[int, str] = {}
                for token, i in sorted(vocab.items(), key=lambda item: (item[1], item[0])):
                    if i in spelled:
                        raise ValueError(f"its tokens {spelled[i]!r} and {token!r} have one id, {i:,}: each id must "
                                         f"name one token")
                    spelled[i] = token
            pieces = [p[0] for p in (json.loads(payload).get("model") or {}).get("vocab") or []
                      if isinstance(p, list) and p] if type(self._hf.model).__name__ == "Unigram" else []
            if len(set(pieces)) < len(pieces):  # (one id then named nothing, and its export was refused, misnamed)
                listed: set = set()  # (the first piece listed twice: a scan of the pieces before each took 60 s)
                twice = next(piece for piece in pieces if piece in listed or listed.add(piece))
                raise ValueError(f"its Unigram piece {twice!r} is listed twice: each piece must be listed once")
            self._size, self._named = max(ids, default=-1) + 1, len(ids)
            self._largest_id = self._size - 1  # above vocab_size - 1 only in a run from before sizes counted to it
            if self._size > MAX_VOCAB_SIZE:  # the model config would refuse it as a vocab_size the user never set
                raise ValueError(f"its largest token id is {self._size - 1:,}; a model takes ids below "
                                 f"{MAX_VOCAB_SIZE:,}")
            # The ids its post-processor puts around a prompt (a Llama tokenizer's <s>) are tokens of its vocabulary:
            # one that is not passed the size check and reached the model (a traceback at `gbattn generate`)
            unnamed = sorted(set(self._hf.encode("").ids) - ids)
            if unnamed:
                raise ValueError(f"its post-processor adds token id {unnamed[0]:,}, which its vocabulary does not hold")
            if kind == "bpe":
                self._check_trained_bpe()

    def _check_trained_bpe(self) -> None:
        """A ``bpe`` tokenizer is one gbattn trained (:func:`_train_bpe`): a BPE model whose ids 0 .. n-1 name one
        token each, ``<pad>`` 0 and ``<unk>`` 1. A file edited otherwise (two tokens given one id, an id left
        unused, ``<unk>`` gone) is refused: its tokens would not be what the run's were."""
        vocab = self._hf.get_vocab(with_added_tokens=True)
        if (type(self._hf.model).__name__ != "BPE" or sorted(vocab.values()) != list(range(len(vocab)))
                or [vocab.get(token) for token in SPECIALS] != [0, 1]):
            raise ValueError("not a bpe tokenizer as gbattn trains it (a BPE model whose ids 0 .. n-1 name one token "
                             "each, <pad> 0 and <unk> 1)")

    @property
    def vocab_size(self) -> int:
        """The ids it can produce: 0 .. vocab_size - 1 (one past the largest id, so a vocabulary with
        unused ids still fits the embedding table)."""
        return len(self.chars) if self.kind == "char" else self._size

    @property
    def unused_ids(self) -> int:
        """Ids below :attr:`vocab_size` that name no token (a tokenizer.json whose ids leave gaps): each
        still has a row in the model's embedding table."""
        return 0 if self.kind == "char" else self._size - self._named

    @functools.cached_property
    def unknown_id(self) -> int | None:
        """The id of the unknown token (``<unk>``, BERT's ``[UNK]``: the one its model names), which text the
        tokenizer never saw encodes to (None where there is none: a char tokenizer refuses such text, a byte-level
        one has no unknown text)."""
        if self.kind == "char":
            return None
        model = json.loads(self.payload).get("model") or {}
        if type(model.get("unk_id")) is int:  # a Unigram model names it by id
            return model["unk_id"]
        # a BPE model without unk_token drops what it cannot encode, even with an "<unk>" among its special tokens
        return self._hf.token_to_id(model["unk_token"]) if isinstance(model.get("unk_token"), str) else None

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.kind, self.payload)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, a prompt: with the special tokens the tokenizer's post-processor puts before it (a
        Llama's start token), not those it puts after it (a BERT template's ``[SEP]``, after which generation went
        on). ``text`` is a string (other types are a TypeError: an HF tokenizer's refusal of bytes or a list
        read as a damaged tokenizer.json, and a char tokenizer took bytes for characters numbered 97, 98, ...)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a string, not a {type(text).__name__}" +
                            (" (decode bytes to text first)" if isinstance(text, (bytes, bytearray)) else ""))
        refuse_non_utf8(text)
        if self.kind == "char":
            self._refuse_unknown_characters([text])
            return [self.stoi[c] for c in text]
        with self._encoding([text]):
            encoding = self._prompt_encoder.encode(text)
        self._refuse_dropped([text], [encoding])
        return self._within_vocabulary([encoding.ids])[0]

    @functools.cached_property
    def prompt_payload(self) -> str:
        """The tokenizer.json of a prompt (an HF tokenizer's): its post-processor adding only the special tokens it
        puts before a text (:func:`leading_specials_only`), as :meth:`encode` and transformers' form of it
        (:func:`gbattn.hf.tokenization.backend_tokenizer`) encode one; the stored payload where it has none."""
        stored = json.loads(self.payload)
        if not isinstance(stored.get("post_processor"), dict):
            return self.payload
        stored["post_processor"] = leading_specials_only(stored["post_processor"])
        return json.dumps(stored)

    @functools.cached_property
    def _prompt_encoder(self):
        """The HF tokenizer of :attr:`prompt_payload`: the tokens after the text's last one were cut off before,
        which kept a BERT template's [SEP] where a prompt had no token of its own (whitespace alone)."""
        from tokenizers import Tokenizer as HFTokenizer

        if self.prompt_payload == self.payload:
            return self._hf
        with hf_failures_as_data_errors("reading its file"):
            return HFTokenizer.from_str(self.prompt_payload)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Lines of a corpus: their tokens only. Unlike :meth:`encode` (a prompt), no special token
        the tokenizer's post-processor would add (a Llama tokenizer's start token before every line)."""
        for text in texts:
            refuse_non_utf8(text)
        if self.kind == "char":
            self._refuse_unknown_characters(texts)  # all the batch's, not the first line's only
            return [[self.stoi[c] for c in t] for t in texts]
        with self._encoding(texts):
            encodings = self._hf.encode_batch(texts, add_special_tokens=False)
        self._refuse_dropped(texts, encodings)
        return self._within_vocabulary([e.ids for e in encodings])

    @contextlib.contextmanager
    def _encoding(self, texts: list[str]):
        """:func:`hf_failures_as_data_errors` while encoding ``texts``, where a text piece without a token in a
        vocabulary with no unknown token (a WordLevel model, such as an exported character-level tokenizer, whose
        unknown token is not among its tokens) is named: the library says only "Missing [UNK] token from the
        vocabulary", which read as a damaged tokenizer.json."""
        try:
            with hf_failures_as_data_errors("encoding"):
                yield
        except DataError as e:
            lacking = self._pieces_lacking_a_token(texts) if "Missing [UNK] token" in str(e) else []
            if not lacking:
                raise
            named = ", ".join(shown(piece, 40) for piece in lacking)  # (a 300 KB unknown word was printed whole)
            raise DataError(f"{named} {'is' if len(lacking) == 1 else 'are'} not in the tokenizer's vocabulary, which "
                            f"has no unknown token (a character-level tokenizer knows only the characters of the "
                            f"corpus it was built from; the tokenizers library: Missing [UNK] token from the "
                            f"vocabulary)") from None

    def _pieces_lacking_a_token(self, texts: list[str], most: int = 5) -> list[str]:
        """The first ``most`` distinct pieces of ``texts``, as the tokenizer's normalizer and pre-tokenizer cut
        them, that are no token of its vocabulary (added tokens included); [] where the tokenizer itself fails (the
        library's error is then the one reported)."""
        lacking: list[str] = []
        try:
            with hf_failures_as_data_errors("naming the text it lacks"):  # (its errors and Rust panics alike)
                vocab = self._hf.get_vocab(with_added_tokens=True)
                normalizer, pre_tokenizer = self._hf.normalizer, self._hf.pre_tokenizer
                for text in texts:
                    text = normalizer.normalize_str(text) if normalizer is not None else text
                    pieces = [p for p, _ in pre_tokenizer.pre_tokenize_str(text)] if pre_tokenizer else [text]
                    for piece in pieces:
                        if piece not in vocab and piece not in lacking:
                            lacking.append(piece)
                            if len(lacking) == most:
                                return lacking
        except DataError:
            return []
        return lacking

    def _within_vocabulary(self, ids: list[list[int]]) -> list[list[int]]:
        """``ids``, checked to be below :attr:`vocab_size` where the tokenizer has ids that are not (a run from before
        sizes counted up to the largest id, whose model has a row per entry): a DataError naming the first one, not
        an index past the model's embedding table."""
        if self._largest_id >= self.vocab_size:
            past = next((i for row in ids for i in row if i >= self.vocab_size), None)
            if past is not None:
                raise DataError(f"the tokenizer encodes this text to id {past:,}, past the model's {self.vocab_size:,} "
                                f"ids: its ids go up to {self._largest_id:,} with some unused (a run from before "
                                f"vocabulary sizes counted up to the largest id), and the model has no row for it")
        return ids

    def _refuse_unknown_characters(self, texts: list[str]) -> None:
        """A char tokenizer's DataError naming the characters of ``texts`` it has no token for (up to ten)."""
        unknown = set().union(*texts) - self.stoi.keys()
        if unknown:
            raise DataError(f"characters not in the tokenizer's vocabulary: {sorted(unknown)[:10]}")

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether its pre-tokenizer is byte-level (GPT-2's), alone or in a Sequence: text split into bytes."""
        return '"ByteLevel"' in json.dumps(json.loads(self.payload).get("pre_tokenizer"))

    @functools.cached_property
    def _may_drop_text(self) -> bool:
        """Whether text can encode to fewer characters' tokens than it has: no unknown token, and neither byte-level
        nor byte fallback with a token for every byte (GPT-2's), which encode any text (their text is not scanned; one
        lacking some bytes' tokens, a byte-level BPE trained without the whole byte alphabet, dropped text silently)."""
        if self.unknown_id is not None:
            return False
        from tokenizers.pre_tokenizers import ByteLevel

        byte_fallback = (json.loads(self.payload).get("model") or {}).get("byte_fallback")
        return not (self._byte_level and self._token_strings >= set(ByteLevel.alphabet())
                    or byte_fallback and self._token_strings >= {f"<0x{byte:02X}>" for byte in range(256)})

    @functools.cached_property
    def _token_strings(self) -> frozenset[str]:
        """Every token of the vocabulary as its string (added tokens too), read once (the scan of each batch of lines
        built the vocabulary's dict again)."""
        return frozenset(self._hf.get_vocab(with_added_tokens=True))

    @functools.cached_property
    def _normalized_away(self) -> dict[str, bool]:
        """Characters :meth:`_left_out` has found uncovered: whether the tokenizer's normalizer removes each."""
        return {}

    @functools.cached_property
    def _bytes_lacking(self) -> dict[str, bool]:
        """Characters :meth:`_refuse_dropped` has met in a byte-level tokenizer's text: whether one of their bytes has
        no token (it is left out, the others kept: their tokens' offsets still cover the character)."""
        return {}

    def _left_out(self, text: str, encoding) -> set[str]:
        """The characters of ``text`` that no token of its ``encoding`` covers (offsets count the text's own
        characters), but whitespace and those the tokenizer's normalizer removes (a combining accent, where it strips
        accents). Where a BPE model drops a character, the tokens after it in its word are placed as if it was not
        there: the characters left uncovered end the word, and need not be the one dropped."""
        uncovered, end = set(), 0  # end: where the tokens so far end (a sequence's come in the order of its text)
        for start, stop in encoding.offsets:
            if start > end and not is_space(text[end:start]):
                uncovered.update(text[end:start])
            if stop > end:
                end = stop
        if not is_space(text[end:]):
            uncovered.update(text[end:])
        normalizer = self._hf.normalizer
        for c in uncovered - self._normalized_away.keys():
            # (removed, or made whitespace as the library counts it: str.strip() took U+001C .. U+001F for it)
            self._normalized_away[c] = normalizer is not None and is_space(normalizer.normalize_str(c) or " ")
        return {c for c in uncovered if not is_space(c) and not self._normalized_away[c]}

    def _refuse_dropped(self, texts: list[str], encodings) -> None:
        """A DataError naming the characters of ``texts`` that an HF tokenizer without an unknown token encoded to
        nothing (a ``models.BPE()`` lacking them): the library drops them silently, and a run would train and score
        a text with them cut out. Text is judged by what its tokens cover (:meth:`_left_out`), not a character at a
        time: a special token written in it (``<|endoftext|>``) is one token, and a decomposed accent that a
        normalizer composes into a character without a token is dropped; a byte-level tokenizer's character is kept
        where each of its bytes has a token. Named: the characters left out alone, else those left uncovered."""
        if not self._may_drop_text:
            return
        missing = set()
        with hf_failures_as_data_errors("encoding"):
            if self._byte_level:
                from tokenizers.pre_tokenizers import ByteLevel

                chars = set().union(*texts)
                to_bytes = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str
                for c in chars - self._bytes_lacking.keys():
                    self._bytes_lacking[c] = not all(byte in self._token_strings for byte in to_bytes(c)[0][0])
                missing.update(c for c in chars if self._bytes_lacking[c])
            added = self._hf.get_added_tokens_decoder().keys()
            for text, encoding in zip(texts, encodings):
                uncovered = self._left_out(text, encoding)
                if uncovered:  # the text outside the special tokens written in it, each of which is a token
                    outside, end = [], 0
                    for token, (start, stop) in zip(encoding.ids, encoding.offsets):
                        if token in added and stop > start >= end:  # (not one a post-processor adds, at 0, 0)
                            outside.append(text[end:start])
                            end = stop
                    alone = {c for c in set("".join(outside) + text[end:])
                             if self._left_out(c, self._hf.encode(c, add_special_tokens=False))}
                    missing.update(alone or uncovered)
        if missing:
            raise DataError(f"characters the tokenizer has no token for (and no unknown token): {sorted(missing)[:10]}"
                            f"; it would leave them out silently: use a tokenizer.json with an unknown token or byte "
                            f"fallback, or take them out of the text")

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens (``<pad>``, an end-of-text token) are left out unless ``skip_special``
        is False. The unknown token is always shown, as it is spelled (``<unk>``, WikiText v1's own spelling of its
        rare words; ``[UNK]``): left out, a generated one would read as a word silently missing. An id outside
        0 .. vocab_size - 1 is a ValueError (a char tokenizer read -1 as its last character, an HF one dropped an id
        past its vocabulary silently). One sequence of integer ids: a batch of them (the (1, T) tensor generate
        returns), a string or a float id is a TypeError (the batch was torch's "only one element tensors can be
        converted to Python scalars", a string of digits and a float were read as ids)."""
        if isinstance(ids, (str, bytes, bytearray)):
            raise TypeError(f"decode takes token ids, not a {type(ids).__name__} (encode takes text)")
        if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # a tensor or numpy array: Python numbers
            ids = ids.tolist()
        ids = [_token_id(i) for i in ids]
        outside = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if outside is not None:
            ignored = " (-100 marks a target left out of a loss, not a token)" if outside == -100 else ""
            raise ValueError(f"token id {outside} outside the vocabulary: ids are 0 .. {self.vocab_size - 1} "
                             f"(vocab_size={self.vocab_size}){ignored}")
        if self.kind == "char":
            return "".join(self.chars[i] for i in ids)
        if skip_special:
            skipped = self._skipped_special_ids
            ids = [i for i in ids if i not in skipped]
        with hf_failures_as_data_errors("decoding"):
            return self._hf.decode(ids, skip_special_tokens=False)

    @functools.cached_property
    def _skipped_special_ids(self) -> frozenset[int]:
        """The ids :meth:`decode` leaves out: the special tokens but the unknown one."""
        special = {i for i, token in self._hf.get_added_tokens_decoder().items() if token.special}
        return frozenset(special - {self.unknown_id})

    def to_json(self, cache_key: str | None = None) -> str:
        """The tokenizer file's text; a cache entry's (:func:`get_tokenizer`) with its ``fingerprint`` and the
        ``cache_key`` it is stored under too."""
        record = {"kind": self.kind, "payload": self.payload}
        if cache_key is not None:
            record.update(fingerprint=self.fingerprint, key=cache_key)
        return json.dumps(record)

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        d = json.loads(text)
        return cls(d["kind"], d["payload"])

    def save(self, path: str | Path) -> None:
        atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, expected_vocab: int | None = None, recorded: str | None = None) -> Tokenizer:
        """Read and validate a tokenizer file; ``expected_vocab``: the model's vocabulary size; ``recorded``: the
        fingerprint the run recorded of its tokenizer (another run's file of the same size, its ids naming other
        tokens, is refused: its scores and text would be silently wrong)."""
        path = Path(path)
        if not path.is_file():
            refuse_not_regular(path)
            raise CheckpointError(f"{path} not found: is {path.parent} a gbattn run directory?")
        content = read_json_bytes(path)  # a huge file is refused unread
        try:
            saved = json.loads(content.decode("utf-8"))
            tok = cls(saved["kind"], saved["payload"])
            as_saved = _fingerprint(saved["kind"], saved["payload"])  # before truncation was turned off on reading
        except Exception as e:  # JSON, key, type or HF tokenizers errors: all mean a bad file
            raise CheckpointError(f"{path} is not a valid gbattn tokenizer file "
                                  f"({error_detail(e, with_type=True)})") from None
        if expected_vocab is not None and tok.kind != "char" and tok.vocab_size != expected_vocab and (
                tok._hf.get_vocab_size() == expected_vocab):
            tok._size = expected_vocab  # a run from before sizes counted up to the largest id: the count it used
        if expected_vocab is not None and tok.vocab_size != expected_vocab:
            resized = (" (or the model's embeddings were resized past it, as transformers' resize_token_embeddings "
                       "does: gbattn reads a model whose vocabulary is its tokenizer's)"
                       if tok.vocab_size < expected_vocab else "")
            raise CheckpointError(f"{path} has {tok.vocab_size:,} tokens but the model's vocabulary is "
                                  f"{expected_vocab:,}: the tokenizer does not belong to this model{resized}")
        if recorded is not None and recorded not in (tok.fingerprint, as_saved):
            raise CheckpointError(f"{path} is not the tokenizer the run was trained with (fingerprint {tok.fingerprint}"
                                  f"; its config.json records {recorded}): a tokenizer file from another run? Put "
                                  f"back the run's own")
        return tok


def is_space(text: str) -> bool:
    """Whether ``text`` is whitespace as the tokenizers library counts it (Unicode's White_Space): Python's
    ``isspace`` counts the separators U+001C .. U+001F too, which a tokenizer without them drops (they were left
    out of a prompt without a word)."""
    return text.isspace() and not any("\x1c" <= c <= "\x1f" for c in text)


def leading_specials_only(processor: dict | None) -> dict | None:
    """A ``tokenizer.json`` post-processor (its JSON) that adds the special tokens it puts before a text and none
    after it (:meth:`Tokenizer.encode`, and transformers' form of the tokenizer): a template's items after its last
    sequence dropped, BERT's and RoBERTa's ``[CLS] $A [SEP]`` made the template ``[CLS] $A`` (a pair keeps its
    separators between its texts), a sequence of post-processors each so. Others (byte-level offsets) add no
    token."""
    if not isinstance(processor, dict):
        return processor
    kind = processor.get("type")
    if kind == "Sequence":
        return {**processor, "processors": [leading_specials_only(p) for p in processor.get("processors", [])]}
    if kind in ("BertProcessing", "RobertaProcessing"):  # [CLS] $A [SEP] ([SEP] [SEP] between a pair's for RoBERTa)
        (sep, sep_id), (cls, cls_id) = processor["sep"], processor["cls"]
        between = [_special(sep, 0)] * (2 if kind == "RobertaProcessing" else 1)
        processor = {"type": "TemplateProcessing", "single": [_special(cls, 0), _sequence("A", 0)],
                     "pair": [_special(cls, 0), _sequence("A", 0), *between, _sequence("B", 1)],
                     "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in ((cls, cls_id),
                                                                                             (sep, sep_id))}}
    if processor.get("type") != "TemplateProcessing":
        return processor
    trimmed = dict(processor)
    for key in ("single", "pair"):
        items = processor.get(key) or []
        last = max((i for i, item in enumerate(items) if "Sequence" in item), default=len(items) - 1)
        trimmed[key] = items[: last + 1]
    return trimmed


def _special(token: str, type_id: int) -> dict:
    """A template's special token, in its JSON form."""
    return {"SpecialToken": {"id": token, "type_id": type_id}}


def _sequence(name: str, type_id: int) -> dict:
    """A template's text (``A``, or a pair's ``B``), in its JSON form."""
    return {"Sequence": {"id": name, "type_id": type_id}}


def refuse_non_utf8(text: str) -> None:
    """A DataError naming the first character of ``text`` that is no UTF-8 text: a byte of a shell argument in another
    encoding, which Python keeps as a surrogate, or a lone surrogate (the tokenizers library's refusal blamed its
    tokenizer.json, and encoding a stop string was a UnicodeEncodeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = (f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}")
        # (UTF-8 bytes Python read in an ASCII locale were called "not UTF-8: byte 0xc3" of "café")
        why = locale_misread(text) or "text typed or read in another encoding than UTF-8?"
        raise DataError(f"the text is not UTF-8: {what} at character {e.start} ({why})") from None


def _fingerprint(kind: str, payload: str) -> str:
    """What identifies a tokenizer (:attr:`Tokenizer.fingerprint`): its kind and payload."""
    return hashlib.sha256((kind + payload).encode()).hexdigest()[:16]


def cut_before_spaces(line: str, size: int) -> Iterator[str]:
    """``line`` in pieces that start at a space or tab, each of at most ``size`` characters where the line has a
    space or tab in every ``size``: a BPE with a Whitespace pre-tokenizer (gbattn's ``bpe``) finds the same words in
    the pieces, so trains to the same merges and gives each piece the ids it has in the line (a 10 MB line with no
    breaks peaked at 1.9 GB trained on and encoded whole)."""
    start = 0
    while len(line) - start > size:
        cut = max(line.rfind(" ", start + 1, start + size + 1), line.rfind("\t", start + 1, start + size + 1))
        if cut < 0:  # no space within size: the next one, however far
            cut = min((at for at in (line.find(" ", start + size), line.find("\t", start + size)) if at >= 0),
                      default=-1)
            if cut < 0:
                break
        yield line[start:cut]
        start = cut
    yield line[start:]


def _train_bpe(lines: Iterable[str], vocab_size: int) -> str:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def _gpt2_payload(spec: str) -> str:
    kind, _, given = spec.partition("=")
    if "=" in spec:
        if not given.strip():  # Path("") is the working directory
            raise DataError(f"--tokenizer {spec} names no file: give {kind}=PATH, the path of a tokenizer.json")
        path = Path(os.path.expanduser(given))  # a quoted ~, as --data takes it
        if path.is_dir():
            raise DataError(f"--tokenizer {spec} is a directory; name its tokenizer file: --tokenizer "
                            f"{kind}={path / 'tokenizer.json'}")
        if not path.is_file():  # a FIFO would block the read
            why = ("not a regular file (a device or a pipe)" if path.exists() else
                   dangling_link(path) or
                   f"no such tokenizer.json file{did_you_mean_path(path)}")
            raise DataError(f"--tokenizer {spec}: {why}")
        content = read_json_bytes(path)  # a huge file is refused unread
        payload = None
        try:
            payload = content.decode("utf-8")
            Tokenizer("gpt2", payload)
        except Exception as e:
            record = _json_object(payload) if payload is not None else {}
            if set(record) >= {"kind", "payload"} and record["kind"] in KINDS:  # a run's own {"kind", "payload"}
                own = record["kind"]
                rebuild = (f"--tokenizer {own} on that run's data and vocab_size builds the same one"
                           if own in ("bpe", "char") else  # a file's, or the hub's GPT-2, which may be another
                           "gbattn export on that run writes it as a tokenizer.json")
                raise DataError(f"--tokenizer {spec} is a gbattn run's tokenizer file ({own}), not a Hugging Face "
                                f"tokenizer.json: {rebuild} (or --init-from that run starts from its model and "
                                f"tokenizer)") from None
            # transformers' tokenizer_config.json: no tokenizer model, a tokenizer's settings (the library's error
            # on it was a JSON parse error cut mid-line)
            if "model" not in record and {"tokenizer_class", "model_max_length", "added_tokens_decoder"} & set(record):
                raise DataError(f"--tokenizer {spec} is a transformers tokenizer_config.json (a tokenizer's "
                                f"settings), not the tokenizer: give the tokenizer.json beside it") from None
            detail = error_detail(e, with_type=True)
            raise DataError(f"--tokenizer {spec}: not a valid tokenizer.json ({detail})") from None
        return payload
    from gbattn.data.corpus import hub_access

    try:
        from tokenizers import Tokenizer as HFTokenizer

        with hub_access():
            return HFTokenizer.from_pretrained("gpt2").to_str()
    except Exception as e:
        raise DataError(f"could not fetch the GPT-2 tokenizer from the Hugging Face hub ({type(e).__name__}); "
                        f"pass a local file instead: --tokenizer gpt2=/path/to/tokenizer.json") from None


def _json_object(text: str) -> dict:
    """``text`` parsed as a JSON object, else an empty dict."""
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):  # a file nested too deeply was a RecursionError traceback
        return {}
    return record if isinstance(record, dict) else {}


def get_tokenizer(kind: str, corpus, vocab_size: int | None = None, verbose: bool = True) -> Tokenizer:
    """Train (or fetch from the cache) the tokenizer of ``kind`` for ``corpus``."""
    base = kind.split("=", 1)[0]
    hint = unknown_tokenizer(kind)
    if hint is not None or kind == "hf":  # (a bare hf names no file to read)
        raise DataError(f"--tokenizer {kind!r} is not allowed{hint or ''}; choose one of {TOKENIZER_CHOICES}")
    if base in FILE_KINDS:
        return Tokenizer(base, _gpt2_payload(kind))
    key = f"{base}|{vocab_size}|{BPE_TRAIN_LINES}|{corpus.fingerprint}"
    path = cache_dir() / "tokenizers" / f"{base}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if path.is_file():
        cached = _cache_entry(path, base, key)
        if cached is not None:
            return cached
        path.unlink(missing_ok=True)  # a damaged cache entry: train again
    unwritable = (f"the tokenizer cache entry {path} cannot be written ({{why}}): delete what is there, or set "
                  f"GBATTN_CACHE to another directory")
    # a folder or a dangling link where the file goes: checked before training (a file there now is another process's
    # entry written since the check above: it was called "something other than a file")
    if (path.exists() or path.is_symlink()) and not path.is_file():
        raise DataError(unwritable.format(why="something other than a file is there"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(unwritable.format(why=e.strerror or e)) from None
    remove_abandoned(path.parent)  # the temporary files of entries whose writing was killed
    if base == "char":  # every split's characters, as nanoGPT's character model (README, "Data")
        chars = sorted({c for split in ("train", "valid", "test") for line in corpus.lines(split) for c in line})
        if not chars:
            raise DataError(f"--data {corpus.name} holds no text")
        tok = Tokenizer("char", json.dumps({"chars": chars}))
    else:
        if verbose:
            print(f"training a BPE tokenizer of up to {vocab_size:,} tokens on the first {BPE_TRAIN_LINES:,} "
                  f"non-empty training lines")
        lines = islice((line for line in corpus.lines("train") if line.strip()), BPE_TRAIN_LINES)
        lines = (piece for line in lines for piece in cut_before_spaces(line, TRAIN_PIECE_CHARS))  # (the same words)
        tok = Tokenizer("bpe", _train_bpe(lines, vocab_size))
        if tok.vocab_size < 3:
            raise DataError(f"--data {corpus.name}: the training split holds no text to train a tokenizer on")
    try:
        atomic_write(path, tok.to_json(cache_key=key))
    except OSError as e:
        raise DataError(unwritable.format(why=e.strerror or e)) from None
    return tok


def _cache_entry(path: Path, kind: str, key: str) -> Tokenizer | None:
    """The tokenizer a cache entry holds, or None where it is damaged: unreadable, of another kind or another
    ``key`` (a file copied over it: another vocabulary size's BPE sized the model by its own), or its payload not
    the one whose fingerprint it records (edited by hand: a char tokenizer short of a character would blame the corpus
    for it, one with a character more would size the model by it). An entry from before keys were recorded is
    trained again."""
    try:
        saved = json.loads(read_json_bytes(path).decode("utf-8"))  # parsed once: the tokenizer and its fingerprint
        cached = Tokenizer(saved["kind"], saved["payload"])
    except MemoryError:
        raise
    except Exception as e:  # too large, unreadable, JSON, key, type or HF tokenizers errors (Tokenizer.load's): damaged
        refuse_unread_entry(e, f"the tokenizer cache entry {path}")  # (what ran out: the good entry was trained again)
        return None
    return cached if (cached.kind == kind and saved.get("fingerprint") == cached.fingerprint
                      and saved.get("key") == key) else None


# Errors of reading a cache entry that say something ran out or failed on the way, not that the entry is damaged
NOT_DAMAGE = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO)


def refuse_unread_entry(error: BaseException, entry: str) -> None:
    """A one-line DataError where reading a cache entry (``entry``, as the message names it) failed for want of
    something (:data:`NOT_DAMAGE`: ``error`` itself, or the OSError under read_json's error), not for damage: the
    entry is kept, where it was deleted and built again, then "cannot be read back". Nothing otherwise."""
    failed = error if isinstance(error, OSError) else error.__context__
    if isinstance(failed, OSError) and failed.errno in NOT_DAMAGE:
        raise DataError(f"{entry} could not be read ({failed.strerror}); it is kept: free what ran out (open files, "
                        f"memory) and run again") from None


def _token_id(value) -> int:
    """One token id for :meth:`Tokenizer.decode`: an integer (Python's or numpy's), else a TypeError naming what it
    is (a row of a batch, a float)."""
    try:
        return operator.index(value)
    except TypeError:
        if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) >= 1:
            raise TypeError("decode takes one sequence of token ids, not a batch of them: decode each row (ids[0])"
                            ) from None
        raise TypeError(f"decode takes integer token ids, not {type(value).__name__} ({value!r})") from None
