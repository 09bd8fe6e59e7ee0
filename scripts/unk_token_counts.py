"""How many token ids gbattn's `<unk>` adds over the authors' tokenizer (docs/deviations.md, entry 1).

The authors' BPE has no unknown token, so it drops a character it never saw in training; gbattn's emits
``<unk>``. Both are trained here as gbattn trains its BPE (same lines, same merges: only the unknown token
differs) on the training split of ``--train`` and then encode the valid and test splits of ``--text``
as gbattn does (its non-blank lines). Run from the repository root, with local copies of WikiText-2 and of
its raw valid and test files (README, "Data"):

    python scripts/unk_token_counts.py --train wikitext-2 --text wikitext-2-raw \
        --out results/unk-token-counts/counts.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from itertools import islice
from pathlib import Path

from gbattn.arguments import at_least
from gbattn.cli import run_script
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import BPE_TRAIN_LINES, Tokenizer, _train_bpe
from gbattn.data.tokens import encoded_lines
from gbattn.errors import UserError
from gbattn.files import atomic_write


def without_unknown_token(tok: Tokenizer):
    """The same BPE (vocabulary and merges) with no unknown token: characters it lacks are dropped."""
    from tokenizers import Tokenizer as HFTokenizer

    payload = json.loads(tok.payload)
    payload["model"]["unk_token"] = None
    return HFTokenizer.from_str(json.dumps(payload))


def text_lines(directory: Path, split: str) -> list[str]:
    """A WikiText folder's split as gbattn reads it, whether or not the folder has a training file."""
    with tempfile.TemporaryDirectory() as tmp:  # load_corpus wants a train file: lend it one (not the split's own
        for name in directory.iterdir():  # text, which it refuses as a split holding the training text)
            (Path(tmp) / name.name).symlink_to(name.resolve())
        files = [name.name for name in directory.iterdir()]
        if not any("train" in name for name in files):
            own = next(name for name in files if split in name)
            (Path(tmp) / own.replace(split, "train")).write_text("a stand-in training file\n", encoding="utf-8")
        return list(load_corpus(tmp).lines(split))


def check_arguments(text: Path, out: Path) -> None:
    """Before the BPE trains: --text is a folder holding a valid and a test file, --out is no folder (each was a
    traceback: FileNotFoundError, StopIteration, IsADirectoryError)."""
    if not text.is_dir():
        raise UserError(f"--text {text}: {'is not a folder' if text.exists() else 'does not exist'}")
    files = [name.name for name in text.iterdir()]
    for split in ("valid", "test"):
        if not any(split in name for name in files):
            raise UserError(f"--text {text}: no file with {split!r} in its name (a WikiText folder holds *.valid.* "
                            f"and *.test.* files)")
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; name the JSON file to write")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--train", required=True, help="a corpus folder whose training split trains the BPE")
    parser.add_argument("--text", required=True, help="a WikiText folder whose valid and test splits are encoded")
    parser.add_argument("--vocab-size", type=at_least(1), default=16_384)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    check_arguments(Path(args.text), Path(args.out))
    training = list(islice((s for s in load_corpus(args.train).lines("train") if s.strip()), BPE_TRAIN_LINES))
    ours = Tokenizer("bpe", _train_bpe(training, args.vocab_size))
    authors = without_unknown_token(ours)
    seen = {c for line in training for c in line}  # the characters the BPE was trained on
    record = {"train": Path(args.train).name, "text": Path(args.text).name, "vocab_size": ours.vocab_size,
              "train_lines": len(training), "splits": {}}  # (the lines trained on: at most BPE_TRAIN_LINES)
    for split in ("valid", "test"):
        lines = list(encoded_lines(text_lines(Path(args.text), split), ours))
        with_unk = ours.encode_batch(lines)
        dropped = [enc.ids for enc in authors.encode_batch(lines)]
        unseen = [c for line in lines for c in line if c not in seen and not c.isspace()]
        record["splits"][split] = {
            "tokens_gbattn": sum(map(len, with_unk)),
            "tokens_authors": sum(map(len, dropped)),
            "unk_tokens_gbattn": sum(ids.count(ours.unknown_id) for ids in with_unk),
            "unseen_characters": len(unseen),
            "distinct_unseen_characters": len(set(unseen)),
            "lines_that_differ": sum(a != b for a, b in zip(with_unk, dropped, strict=True)),
        }
        print(split, record["splits"][split])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(args.out), json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    run_script(main)
