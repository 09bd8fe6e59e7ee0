"""Text corpora, chosen with ``--data``.

* a corpus shipped with gbattn: ``tiny-shakespeare`` (data/corpora/SOURCE.md);
* a Hugging Face datasets name: ``wikitext-103-raw-v1``, ``wikitext-2-raw-v1``, ``wikitext-103-v1``,
  ``wikitext-2-v1`` (``<unk>``-tokenized), ``openwebtext``
  (through the ``datasets`` library when the hub is reachable or the data is cached);
* a local directory with one text file per split, optionally ``.gz``: WikiText's
  ``wiki.{train,valid,test}.{raw,tokens}``, ``train.txt``/``valid.txt``/``test.txt``, or any names
  containing ``train``, ``valid`` (or ``val``, ``dev``) and ``test``, as in Mikolov's ``ptb.train.txt``;
* a single text file, split by characters: the first 90% train, the next 5% valid, the last 5%
  test (``split=[0.9, 0.1, 0]`` gives nanoGPT's 90/10 rule; then test is the valid split).

Every local file is checked before use: UTF-8 text (a leading byte order mark is dropped; the error
names the file and the byte offset of the first bad byte, or of a NUL byte in a binary file, and says
so of UTF-16 or UTF-32 text with its byte order mark), real gzip data behind a ``.gz`` name, not
empty nor only whitespace, not a Git LFS pointer. A corpus yields lines per split; its fingerprint identifies
the content for the caches.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import hashlib
import itertools
import logging
import os
import re
import socket
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gbattn.checks import did_you_mean
from gbattn.errors import DataError, DataNotFound, UserError, optional_module
from gbattn.files import dangling_link, did_you_mean_path, error_detail, refuse_lfs_pointer

SPLITS = ("train", "valid", "test")
NO_TEST_SPLIT = "no separate test split: test = valid"  # a corpus note; the summaries say so beside test figures
HF_NAMES = {
    "wikitext-103-raw-v1": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
    "wikitext-2-raw-v1": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext-103-v1": ("Salesforce/wikitext", "wikitext-103-v1"),
    "wikitext-2-v1": ("Salesforce/wikitext", "wikitext-2-v1"),
    "openwebtext": ("Skylion007/openwebtext", None),
}
DEFAULT_SPLIT = (0.9, 0.05, 0.05)
BUNDLED = {"tiny-shakespeare": "tiny-shakespeare.txt.gz"}  # shipped inside the package

# Line breaks str.splitlines takes beside the newline (a form feed, U+2028, ...).
OTHER_LINE_BREAKS = re.compile("[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def text_lines(text: str, start: int = 0, end: int | None = None) -> Iterator[str]:
    """The lines of ``text[start:end]`` (newlines already translated), each ending at a newline, kept (the character
    tokenizer must see it): as a folder's files and ``run.perplexity`` read text. ``str.splitlines`` also broke at
    form feeds, U+2028 and the like, which changed a byte-level tokenizer's tokens and dropped a line holding only
    one. Read in place: a copy of the text (``io.StringIO``'s, four bytes a character) took 589 MB for a 201 MB
    single-file corpus."""
    end = len(text) if end is None else end
    while start < end:
        stop = text.find("\n", start, end)
        stop = end if stop < 0 else stop + 1
        yield text[start:stop]
        start = stop


def bundled_path(name: str) -> Path:
    """Path of a corpus shipped with gbattn (see ``data/corpora/SOURCE.md``)."""
    return Path(__file__).parent / "corpora" / BUNDLED[name]


@dataclass
class Corpus:
    """Lines of text per split, newlines kept. ``lines(split)`` can be called repeatedly."""

    name: str  # how results files name it: a bundled or HF name, or the path as given
    fingerprint: str  # changes whenever the content changes
    reader: Callable[[str], Iterator[str]]
    notes: list[str] = field(default_factory=list)

    def lines(self, split: str) -> Iterator[str]:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; choose one of {', '.join(SPLITS)}")
        return self.reader(split)


def _is_gzip_name(path: Path) -> bool:
    """Whether a file is read as gzip: named .gz in any case (``TRAIN.TXT.GZ`` from Windows too)."""
    return path.suffix.lower() == ".gz"


def open_text(path: Path):
    """The text of a checked file: a UTF-8 byte order mark (Windows tools write one) is no text."""
    if _is_gzip_name(path):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


COMPRESSED = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip",
              b"7z\xbc\xaf\x27\x1c": "7z"}  # how their files start: never UTF-8 text


def _compression(head: bytes) -> str | None:
    """The compression format whose data starts with ``head``, else None (bzip2's "BZh" with its block magic)."""
    if re.match(rb"BZh[1-9]1AY&SY", head):
        return "bzip2"
    return next((kind for magic, kind in COMPRESSED.items() if head.startswith(magic)), None)


def checked_digest(path: Path) -> str:
    """SHA-256 of the (decompressed) content, after checking it is UTF-8 text holding more than whitespace (the
    char tokenizer would train on blank lines) and not a Git LFS pointer (read as text, its three lines would be
    trained on)."""
    refuse_lfs_pointer(path, error=DataError, what="--data file ")  # the file's own bytes: a .gz one is not gzip
    h = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    has_text = False
    of_data = " of the decompressed data" if _is_gzip_name(path) else ""  # where an offset counts in a .gz file
    try:
        with (gzip.open if _is_gzip_name(path) else open)(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                packed = _compression(chunk) if offset == 0 else None
                if packed:  # read as text, it is "binary": say what it is and how to give it
                    raise DataError(f"--data file {path} holds {packed}-compressed data"
                                    + (" (compressed twice)" if of_data else "")
                                    + ("; name it .gz to have it read" if packed == "gzip" and not of_data else
                                       "; decompress it (gbattn reads UTF-8 text, or gzip named .gz)"))
                if offset == 0 and chunk.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_BE)):
                    # Windows PowerShell's ">" writes UTF-16: its NUL bytes would read as a binary file
                    raise DataError(f"--data file {path} is UTF-16 or UTF-32 text (it starts with their byte order "
                                    f"mark); save it as UTF-8")
                nul = chunk.find(b"\x00")
                if nul >= 0:
                    raise DataError(f"--data file {path} looks binary (NUL byte at byte offset {offset + nul}"
                                    f"{of_data}); give a UTF-8 text file")
                held = len(decoder.getstate()[0])  # the start of a character the last chunk cut, decoded with this one
                try:
                    text = decoder.decode(chunk)
                except UnicodeDecodeError as e:  # (e.start counts from the held bytes)
                    raise DataError(f"--data file {path} is not UTF-8 text (invalid byte at byte offset "
                                    f"{offset - held + e.start}{of_data})") from None
                has_text = has_text or bool(text.replace("\ufeff", "").strip())  # a byte order mark is no text
                h.update(chunk)
                offset += len(chunk)
            cut = offset - len(decoder.getstate()[0])  # where the unfinished character starts (offset: the file's end)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(
            f"--data file {path} is not UTF-8 text (it ends inside a character that starts at byte offset "
            f"{cut}{of_data})"
        ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"--data file {path} is named .gz but is not complete gzip data ({e})") from None
    except OSError as e:
        raise DataError(f"--data file {path} cannot be read ({e.strerror or e})") from None
    if offset == 0:
        raise DataError(f"--data file {path} is empty")
    if not has_text:
        raise DataError(f"--data file {path} holds only whitespace (blank lines, spaces): no text to train or "
                        f"evaluate on")
    return h.hexdigest()


def _text_size(path: Path) -> int:
    """About how many bytes of text a file holds: its size, or a gzip file's record of its data's (modulo 2**32)."""
    if not _is_gzip_name(path):
        return path.stat().st_size
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little")


def same_text_read(path: Path, other: Path) -> bool:
    """Whether two files (already checked) hold the same text as gbattn's tokenizers read it: the same non-blank
    lines, whatever their line ends (Windows', old Mac's), a byte order mark, blank lines or a last line's newline,
    and whether either is gzip. A copy of train so changed scored the training text as held-out text. Read up to
    the first line that differs, and only for files of about the same size (within 2.5x: a valid file much smaller
    than train is no copy of it, and a one-line train of 200 MB was read whole to tell so)."""
    sizes = sorted((_text_size(path), _text_size(other)))
    if sizes[1] > 2.5 * sizes[0] + 4:  # (+4: tiny files, whose line ends may double them)
        return False

    def text_lines(f):
        return (line.rstrip("\r\n") for line in f if line.strip())

    with open_text(path) as a, open_text(other) as b:
        return all(x == y for x, y in itertools.zip_longest(text_lines(a), text_lines(b)))


# --------------------------------------------------------------------------------------
# Local directories
# --------------------------------------------------------------------------------------

EXACT_NAMES = {
    "train": ["wiki.train.raw", "wiki.train.tokens", "train.txt", "train"],
    "valid": ["wiki.valid.raw", "wiki.valid.tokens", "valid.txt", "valid", "validation.txt", "validation"],
    "test": ["wiki.test.raw", "wiki.test.tokens", "test.txt", "test"],
}
# a split word that starts a word of the name (latest.txt, contest.txt, invalid.txt and restrain.txt are no splits)
NAME_PATTERNS = {"train": r"(?<![a-z])train", "valid": r"(?<![a-z])valid|(?<![a-z])(val|dev)(?![a-z])",
                 "test": r"(?<![a-z])test"}
TEXT_SUFFIXES = ("", ".txt", ".raw", ".tokens")
RECORD_SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".arrow")  # a --data file is read as text
SPLIT_SUFFIXES = (".train", ".valid", ".validation", ".val", ".dev", ".test")  # corpus.train: the split word as suffix


def _is_text_name(name: str) -> bool:
    name = name.lower()  # TRAIN.TXT
    if name.endswith("~") or name.startswith("#"):  # an editor's backup (train.txt~) or autosave (#train.txt#)
        return False
    stem = name[:-3] if name.endswith(".gz") else name
    return Path(stem).suffix in TEXT_SUFFIXES + SPLIT_SUFFIXES or not Path(stem).suffix.strip(".").isalpha()


def _wikitext_flavour(name: str) -> str | None:
    """The WikiText flavour of a file name: ``raw`` or ``tokens`` (``wiki.train.tokens.gz``, also with ``.txt``
    as some copies have it: ``wiki.test.raw.txt``), else None."""
    match = re.fullmatch(r"wiki\.(?:train|valid|test)\.(raw|tokens)(?:\.txt)?(?:\.gz)?", name.lower())
    return match.group(1) if match else None


def _visible_files(path: Path) -> list[str]:
    """The names of the regular files in the folder ``path`` that are not hidden, sorted."""
    return sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


def _find_split_files(path: Path) -> dict[str, Path | None]:
    names = _visible_files(path)
    exact = {s: [n + gz for n in EXACT_NAMES[s] for gz in ("", ".gz") if n + gz in names] for s in SPLITS}
    # Both WikiText flavours in one folder: the first one that has all three splits (raw, else tokens), so
    # that a folder lacking wiki.train.raw is not read as <unk>-tokenized train with raw valid and test.
    complete = [f for f in ("raw", "tokens") if all(any(_wikitext_flavour(n) == f for n in exact[s]) for s in SPLITS)]
    if complete:
        exact = {s: [n for n in exact[s] if _wikitext_flavour(n) in (complete[0], None)] for s in SPLITS}
    found: dict[str, Path | None] = {}
    for split in SPLITS:
        matches = [n for n in names if _is_text_name(n) and re.search(NAME_PATTERNS[split], n.lower())]
        if exact[split]:
            # ptb.train.txt beside train.txt, val.txt beside validation.txt: the exact name was read, the other
            # ignored without a word (WikiText files of either flavour are the flavour checks')
            others = [n for n in matches if n not in exact[split] and _wikitext_flavour(n) is None]
            if others:
                raise DataError(f"--data {path}: several files could be the {split} split "
                                f"({', '.join([exact[split][0], *others])}); keep one")
            # `gzip -k`, or valid.txt beside validation.txt: which one is meant (they may differ) is not said (one
            # file of each WikiText flavour is left to the flavour check below, which names what each split holds)
            flavours = sorted(str(_wikitext_flavour(n)) for n in exact[split])
            if len(exact[split]) > 1 and flavours != ["raw", "tokens"]:
                raise DataError(f"--data {path}: several files could be the {split} split "
                                f"({', '.join(exact[split])}); keep one")
            found[split] = path / exact[split][0]
            continue
        if len(matches) > 1:
            raise DataError(f"--data {path}: several files could be the {split} split ({', '.join(matches)}); "
                            f"keep one, or name it {split}.txt")
        found[split] = path / matches[0] if matches else None
    for name in {f.name for f in found.values() if f is not None}:
        shared = [s for s, f in found.items() if f is not None and f.name == name]
        if len(shared) > 1:  # train_val.txt: validating on the training text
            raise DataError(f"--data {path}: {name} could be the {' or the '.join(shared)} split; give each split its "
                            f"own file (train.txt, valid.txt, test.txt)")
    flavours = {_wikitext_flavour(f.name) for f in found.values() if f is not None} - {None}
    if len(flavours) > 1:
        chosen = ", ".join(f"{s}: {f.name}" for s, f in found.items() if f is not None)
        raise DataError(f"--data {path} mixes raw and <unk>-tokenized WikiText files ({chosen}); give a folder "
                        f"holding one flavour for all three splits")
    return found


def _listed(entry: Path) -> str:
    """A folder's entry as an error lists it: its name, and what it is where it is no file (a link to nothing: a
    Hugging Face hub snapshot copied without the blobs its files link to)."""
    if entry.is_file():
        return entry.name
    if entry.is_dir():
        return f"{entry.name} (a directory)"
    if link := dangling_link(entry):
        return f"{entry.name} ({link})"
    return f"{entry.name} (not a regular file)"


def _local_directory(path: Path, name: str | None = None) -> Corpus:
    files = _find_split_files(path)
    missing = [s for s, f in files.items() if f is None]
    if missing:
        seen = sorted(map(_listed, path.iterdir()))
        shown = ", ".join(seen[:12]) + (f" and {len(seen) - 12} more" if len(seen) > 12 else "") if seen else "none"
        saved = any((path / n).is_file() for n in ("dataset_dict.json", "state.json"))  # datasets' save_to_disk
        names = _visible_files(path)
        texts = [n for n in names if _is_text_name(n)]
        # tiny-shakespeare's input.txt alone, or a train.txt alone: the one text file, split when given itself
        single = len(texts) == 1 and not saved and (len(missing) == len(SPLITS) or files["train"] is not None)
        unread = [n for n in names if not _is_text_name(n)
                  and any(re.search(NAME_PATTERNS[s], n.lower()) for s in missing)]  # fairseq's train.en
        raise DataError(f"--data {path}: no {'/'.join(missing)} file found (files seen: {shown}); expected one text "
                        f"file per split, e.g. wiki.train.raw, train.txt or ptb.train.txt (optionally .gz)"
                        + (f"; not read as text for their suffix: {', '.join(unread[:6])} (gbattn reads .txt, .raw, "
                           f".tokens, a split word or no suffix, optionally .gz)" if unread else "")
                        + ("; this is a Hugging Face save_to_disk folder, which gbattn does not read: write each "
                           "split's text to a file (README, 'Data')" if saved else "")
                        + (f"; a single text file is split by the split setting (default 90/5/5) when given itself: "
                           f"--data {path / texts[0]}" if single else ""))
    digests = {s: checked_digest(files[s]) for s in SPLITS}
    for split in ("valid", "test"):  # (a link to train.txt, or a copy: its figures were of the training text)
        if digests[split] == digests["train"] or same_text_read(files[split], files["train"]):
            raise DataError(f"--data {path}: the {split} file {files[split].name} holds the same text as the train "
                            f"file {files['train'].name}, so {split} figures would be of the training text; give each "
                            f"split its own text")
    fingerprint = hashlib.sha256("|".join(f"{s}:{digests[s]}" for s in SPLITS).encode()).hexdigest()

    def reader(split: str) -> Iterator[str]:
        with open_text(files[split]) as f:
            yield from f

    notes = [f"{s}: {files[s].name}" for s in SPLITS]
    return Corpus(name=name or str(path), fingerprint=fingerprint, reader=reader, notes=notes)


def _single_file(path: Path, split: tuple[float, float, float], name: str | None = None) -> Corpus:
    digest = checked_digest(path)
    with open_text(path) as f:
        text = f.read()
    n = len(text)
    a = int(n * split[0])
    b = a + int(n * split[1]) if split[2] > 0 else n
    # each split's bounds in the text, read in place (copies of the three parts held the text twice)
    parts = {"train": (0, a), "valid": (a, b), "test": (b, n) if split[2] > 0 else (a, b)}
    # each fraction as given (two decimals where they say it all: 0.006 was written 0.01, and 0.004 0.00, a test split
    # of none while there was one)
    notes = ["single file split by characters " + "/".join(f"{x:.2f}" if round(x, 2) == x else f"{x:g}" for x in split)]
    if split[2] == 0:
        notes.append(NO_TEST_SPLIT)
    # (a text with a line break other than a newline was cut into other lines before: its token cache is not reused)
    lines_rule = "|newline-lines" if OTHER_LINE_BREAKS.search(text) else ""
    fingerprint = hashlib.sha256(f"{digest}|{tuple(split)}{lines_rule}".encode()).hexdigest()

    def reader(s: str) -> Iterator[str]:
        yield from text_lines(text, *parts[s])

    return Corpus(name=name or str(path), fingerprint=fingerprint, reader=reader, notes=notes)


# --------------------------------------------------------------------------------------
# Hugging Face datasets
# --------------------------------------------------------------------------------------


def _host_resolves(url: str) -> bool:
    """Whether the host of ``url`` has an address here (no network, or no name server: it has none)."""
    try:
        socket.getaddrinfo(urllib.parse.urlparse(url).hostname, 443)
    except (OSError, UnicodeError):  # socket.gaierror; a malformed host name
        return False
    return True


@contextlib.contextmanager
def hub_access(other_logs: bool = False):
    """A download from the Hugging Face hub, quiet and quick to fail without the network.

    Quiet: its loggers are silenced (without the network its connection retries print a dozen warnings before our
    one-line error). Logging is disabled below CRITICAL as well, because huggingface_hub sets its loggers' level
    again when its modules are first imported (as the tokenizers library's download does, inside this block);
    ``other_logs``: not disabled, for a block whose other logging is its output (lm-eval's, where huggingface_hub
    is imported already).

    Quick: where the hub's host has no address, huggingface_hub is put in its offline mode for the block, so that
    its requests fail at once (a copy in its cache still loads) instead of being retried for about half a minute.
    Not behind a proxy (an ``*_PROXY`` variable set): there the proxy resolves the host, which need not resolve here."""
    quiet = [logging.getLogger(n) for n in ("huggingface_hub", "datasets", "fsspec", "urllib3")]
    levels = [logger.level for logger in quiet]
    disabled = logging.root.manager.disable
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    if not other_logs:
        logging.disable(logging.ERROR)
    try:
        from huggingface_hub import constants as hub
    except ImportError:  # the library that would fetch is missing too: its caller says so
        hub = None
    offline = getattr(hub, "HF_HUB_OFFLINE", None)
    try:
        # (NO_PROXY alone, common in CI, names hosts to reach without a proxy: no proxy, and the fast failure)
        proxies = [scheme for scheme in urllib.request.getproxies() if scheme != "no"]
        if offline is False and not proxies and not _host_resolves(hub.ENDPOINT):
            hub.HF_HUB_OFFLINE = True
        yield
    finally:
        if offline is not None:
            hub.HF_HUB_OFFLINE = offline
        logging.disable(disabled)
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _hugging_face(name: str) -> Corpus:
    dataset, config = HF_NAMES[name]
    suffix = "tokens" if "raw" not in name else "raw"  # -v1: <unk>-tokenized
    files = (f"wiki.train.{suffix}/wiki.valid.{suffix}/wiki.test.{suffix} (or train.txt/valid.txt/test.txt)"
             if name.startswith("wikitext") else "train.txt/valid.txt/test.txt")  # (openwebtext was told WikiText's)
    hint = (f"could not load {name!r} from the Hugging Face hub ({{why}}); download it once where the hub is "
            f"reachable, or point --data at a local copy: a directory with {files}, or a single text file (README, "
            f"'Data')")
    if Path(name).exists():  # a bare name is the hub's dataset, even where a folder of that name is here
        hint += f"; ./{name} is here, but a bare name is the hub's dataset: pass --data ./{name} to use the local one"
    try:
        datasets = optional_module("datasets", "hf", "a corpus by its Hugging Face name needs")
    except UserError as e:
        raise DataError(hint.format(why=str(e))) from None
    try:
        with hub_access():
            if config is None:  # openwebtext: one train split, streamed; valid/test by document index
                ds = datasets.load_dataset(dataset, split="train", streaming=True)
            else:
                ds = datasets.load_dataset(dataset, config)
    except Exception as e:  # network, cache or hub errors all mean the same to the user
        raise DataError(hint.format(why=error_detail(e, 120, with_type=True))) from None

    if config is None:
        # Deterministic rule: document i goes to valid if i % 200 == 0, to test if i % 200 == 1.
        def reader(split: str) -> Iterator[str]:
            want = {"valid": 0, "test": 1}.get(split)
            for i, row in enumerate(ds):
                bucket = i % 200
                if (want is None and bucket > 1) or bucket == want:
                    yield from text_lines(row["text"])

        return Corpus(name=name, fingerprint=f"hf:{dataset}:stream:v2", reader=reader,  # v2: text_lines
                      notes=["openwebtext: documents i%200==0 -> valid, i%200==1 -> test"])

    names = {"train": "train", "valid": "validation", "test": "test"}
    fingerprint = "hf:" + ":".join(getattr(ds[names[s]], "_fingerprint", name) for s in SPLITS)

    def reader(split: str) -> Iterator[str]:
        for row in ds[names[split]]:
            yield row["text"]

    return Corpus(name=name, fingerprint=fingerprint, reader=reader)


def check_split_setting(data: str, sets: dict) -> None:
    """``--set split`` cuts one text (the shipped corpus or a file) into three; a corpus that comes in
    splits (a hub name, a directory) would ignore it, so it is refused (``train`` and ``compare``). A path that
    is neither is left to :func:`load_corpus`, which says what it is (missing, a typo, a pipe)."""
    in_splits = data in HF_NAMES or (data not in BUNDLED and Path(os.path.expanduser(data)).is_dir())
    if "split" in sets and in_splits:
        kind = "names a corpus in splits" if data in HF_NAMES else "is a folder, read as one file per split"
        raise DataError(f"--set split cuts a single text file by characters; --data {data} {kind} (train, valid "
                        f"and test): leave split out, or give one text file")


def tested_split(notes: list[str]) -> str:
    """The split a corpus with these notes is tested on: "test", or "valid" when it has no test split."""
    return "valid" if NO_TEST_SPLIT in notes else "test"


def test_split_note(notes: list[str]) -> str:
    """What follows a test figure of a corpus with these notes: nothing, or that test is valid."""
    return " (this data has no test split: test is valid)" if tested_split(notes) == "valid" else ""


def refuse_record_file(data: str) -> None:
    """A new run's ``--data`` file of records (``.jsonl``, ``.csv``, ...) is refused: read as text, its syntax and field
    names were trained on (tokens of ``{"``, ``":``, ``text``), without a word. Runs trained on one before are read as
    they were (eval, analyze, resume, --init-from)."""
    path = Path(os.path.expanduser(data))
    stem = path.name.lower().removesuffix(".gz")
    if Path(stem).suffix in RECORD_SUFFIXES and path.is_file():  # (no corpus name gbattn knows ends so)
        raise DataError(f"--data {data}: a {Path(stem).suffix} file holds records, not plain text, and gbattn reads a "
                        f"file as text: write the records' text to a .txt file, one document after another "
                        f"(README, 'Data')")


def load_corpus(data: str, split: tuple[float, float, float] = DEFAULT_SPLIT) -> Corpus:
    """Resolve ``--data``: a bundled corpus, a Hugging Face name, a local directory or a text file."""
    if not data:
        raise DataError("--data is empty: give a corpus name (tiny-shakespeare, wikitext-103-raw-v1, ...), "
                        "a directory or a text file")
    if data in BUNDLED:
        return _single_file(bundled_path(data), tuple(split), name=data)
    if data in HF_NAMES:
        return _hugging_face(data)
    path = Path(os.path.expanduser(data))
    given = str(Path(data))  # named as given ("~/data/x" recorded this machine's home directory), ./x as x
    if given in BUNDLED or given in HF_NAMES:  # a folder or file of a corpus's name is not that corpus
        given = f"./{given}"
    if path.is_dir():
        try:
            return _local_directory(path, name=given)
        except PermissionError as e:
            raise DataError(f"--data {path} cannot be read ({e.strerror})") from None
    if path.is_file():
        return _single_file(path, tuple(split), name=given)
    if path.exists():
        raise DataError(f"--data {data!r} is neither a regular file nor a directory (a device or a pipe)")
    if link := dangling_link(path):
        raise DataNotFound(f"--data {data!r} is {link}")
    names = [*BUNDLED, *HF_NAMES]
    # A path (`./wikitext-2-v1`, the README's name for a local folder of a hub corpus's name) is no typo of a
    # corpus name: following "did you mean 'wikitext-2-v1'?" would fetch the hub's copy instead.
    named = did_you_mean(data, names) if "/" not in data and os.sep not in data else ""
    raise DataNotFound(f"--data {data!r}: no such file or directory, and not a known corpus name "
                       f"({', '.join(names)}){named or did_you_mean_path(path)}")
