"""Text corpora, chosen with ``--data``.

* a Hugging Face datasets name: ``wikitext-103-raw-v1``, ``wikitext-2-raw-v1``, ``openwebtext``
  (through the ``datasets`` library when the hub is reachable or the data is cached);
* a local directory in WikiText layout (``wiki.{train,valid,test}.{raw,tokens}``, optionally
  ``.gz``), or with ``train/valid/test`` text files (``.txt`` optional; ``validation`` also
  accepted);
* a single text file, split by characters: the first 90% train, the next 5% valid, the last 5%
  test (``split=(0.9, 0.1, 0.0)`` gives nanoGPT's 90/10 rule; then test is the valid split).

A corpus yields lines per split; the fingerprint identifies its content for the token cache.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from gbattn.errors import DataError

SPLITS = ("train", "valid", "test")
HF_NAMES = {
    "wikitext-103-raw-v1": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
    "wikitext-2-raw-v1": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext-103-v1": ("Salesforce/wikitext", "wikitext-103-v1"),
    "wikitext-2-v1": ("Salesforce/wikitext", "wikitext-2-v1"),
    "openwebtext": ("Skylion007/openwebtext", None),
}
DEFAULT_SPLIT = (0.9, 0.05, 0.05)
# Corpora shipped inside the package (``--data NAME``), read as single text files.
BUNDLED = {"tiny-shakespeare": "tiny-shakespeare.txt.gz"}


def bundled_path(name: str) -> Path:
    """Path of a corpus shipped with gbattn (see ``data/corpora/SOURCE.md``)."""
    return Path(__file__).parent / "corpora" / BUNDLED[name]


@dataclass
class Corpus:
    """Lines of text per split, newlines kept. ``lines(split)`` can be called repeatedly."""

    name: str
    fingerprint: str  # changes whenever the content changes
    reader: Callable[[str], Iterator[str]]
    notes: list[str] = field(default_factory=list)

    def lines(self, split: str) -> Iterator[str]:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; choose one of {', '.join(SPLITS)}")
        return self.reader(split)


def open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _find(directory: Path, stems: list[str]) -> Path | None:
    for stem in stems:
        for suffix in ("", ".gz"):
            p = directory / (stem + suffix)
            if p.is_file():
                return p
    return None


def _local_directory(path: Path) -> Corpus:
    layouts = {
        "train": ["wiki.train.raw", "wiki.train.tokens", "train.txt", "train"],
        "valid": ["wiki.valid.raw", "wiki.valid.tokens", "valid.txt", "valid", "validation.txt", "validation"],
        "test": ["wiki.test.raw", "wiki.test.tokens", "test.txt", "test"],
    }
    files = {split: _find(path, stems) for split, stems in layouts.items()}
    missing = [s for s, f in files.items() if f is None]
    if missing:
        raise DataError(
            f"--data {path}: no {'/'.join(missing)} file found; expected WikiText layout "
            f"(wiki.train.raw or wiki.train.tokens, optionally .gz, likewise valid/test) or train.txt/valid.txt/test.txt"
        )
    kinds = {f.name.split(".")[-1] if f.suffix != ".gz" else f.name.split(".")[-2] for f in files.values()}
    notes = []
    if len(kinds) > 1:
        notes.append(f"mixed file kinds across splits: {sorted(kinds)}")
    fingerprint = hashlib.sha256("|".join(f"{s}:{file_digest(files[s])}" for s in SPLITS).encode()).hexdigest()

    def reader(split: str) -> Iterator[str]:
        with open_text(files[split]) as f:
            yield from f

    return Corpus(name=str(path), fingerprint=fingerprint, reader=reader, notes=notes)


def _single_file(path: Path, split: tuple[float, float, float], name: str | None = None) -> Corpus:
    if abs(sum(split) - 1.0) > 1e-9 or min(split) < 0 or split[0] <= 0 or split[1] <= 0:
        raise DataError(f"split={split}: expected train,valid,test fractions summing to 1 with train and valid > 0")
    with open_text(path) as f:
        text = f.read()
    n = len(text)
    a = int(n * split[0])
    b = a + int(n * split[1]) if split[2] > 0 else n
    parts = {"train": text[:a], "valid": text[a:b], "test": text[b:] if split[2] > 0 else text[a:b]}
    notes = [f"single file split by characters {split[0]:.2f}/{split[1]:.2f}/{split[2]:.2f}"]
    if split[2] == 0:
        notes.append("no separate test split: test = valid")
    fingerprint = hashlib.sha256(f"{file_digest(path)}|{split}".encode()).hexdigest()

    def reader(s: str) -> Iterator[str]:
        # keepends: the character tokenizer must see newlines; BPE strips them anyway
        yield from parts[s].splitlines(keepends=True)

    return Corpus(name=name or str(path), fingerprint=fingerprint, reader=reader, notes=notes)


def _hugging_face(name: str, split_rule: tuple[float, float, float]) -> Corpus:
    dataset, config = HF_NAMES[name]
    hint = (
        f"could not load {name!r} from the Hugging Face hub ({{why}}); download it once where the hub is "
        f"reachable, or point --data at a local copy: a directory with wiki.train.raw/wiki.valid.raw/wiki.test.raw "
        f"(or train.txt/valid.txt/test.txt), or a single text file"
    )
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(hint.format(why="the `datasets` package is not installed: pip install 'gbattn[hf]'")) from None
    import datasets

    try:
        if config is None:  # openwebtext: one train split, streamed; valid/test by document index
            ds = datasets.load_dataset(dataset, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(dataset, config)
    except Exception as e:  # network, cache or hub errors all mean the same to the user
        raise DataError(hint.format(why=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")) from None

    if config is None:
        # Deterministic rule: document i goes to valid if i % 200 == 0, to test if i % 200 == 1.
        def reader(split: str) -> Iterator[str]:
            want = {"valid": 0, "test": 1}.get(split)
            for i, row in enumerate(ds):
                bucket = i % 200
                if (want is None and bucket > 1) or bucket == want:
                    yield from row["text"].splitlines(keepends=True)

        return Corpus(name=name, fingerprint=f"hf:{dataset}:stream:v1", reader=reader,
                      notes=["openwebtext: documents i%200==0 -> valid, i%200==1 -> test"])

    names = {"train": "train", "valid": "validation", "test": "test"}
    fingerprint = "hf:" + ":".join(getattr(ds[names[s]], "_fingerprint", name) for s in SPLITS)

    def reader(split: str) -> Iterator[str]:
        for row in ds[names[split]]:
            yield row["text"]

    return Corpus(name=name, fingerprint=fingerprint, reader=reader)


def load_corpus(data: str, split: tuple[float, float, float] = DEFAULT_SPLIT) -> Corpus:
    """Resolve ``--data``: a Hugging Face name, a local directory or a single text file."""
    if data in BUNDLED:
        return _single_file(bundled_path(data), split, name=data)
    if data in HF_NAMES:
        return _hugging_face(data, split)
    path = Path(os.path.expanduser(data))
    if path.is_dir():
        return _local_directory(path)
    if path.is_file():
        return _single_file(path, split)
    raise DataError(
        f"--data {data!r}: no such file or directory, and not a known dataset name "
        f"({', '.join([*BUNDLED, *HF_NAMES])})"
    )
