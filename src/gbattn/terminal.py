"""Text bound for the user's terminal: a control character in it (an escape sequence in a hostile file's
weight name or tokenizer) is shown escaped, ``\\x1b``, never sent to the terminal. One escaping, two uses:
generated text keeps its lines (:func:`terminal_text`), an error message is one line (:func:`terminal_line`).
Imports nothing of gbattn, so the CLI's error path stays fast."""

from __future__ import annotations

import contextlib
import sys
import unicodedata


def escaped(char: str) -> str:
    """One character as Python spells it in ASCII: ``\\x1b``, ``\\u202e``."""
    return ascii(char)[1:-1]


def terminal_text(text: str) -> str:
    """Generated text for a terminal: every control character but newline and tab (an escape sequence that a
    hostile tokenizer's token decodes to, a carriage return over the line) escaped; every other character,
    non-ASCII spaces included, as it is."""
    return "".join(escaped(c) if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def terminal_line(text: str) -> str:
    """``text`` as one line of printable characters: whitespace runs become one space, and any other
    character that is not printable (an escape sequence in a weight name or a key of a file being read, a
    right-to-left override) escaped."""
    return printable_text(" ".join(text.split()))


def printable_text(text: str) -> str:
    """``text`` read from a file, for a report or a terminal: each character that is not printable (an escape
    sequence in a received result.json's device, a newline) escaped; the spaces kept as they are."""
    return "".join(c if c.isprintable() else escaped(c) for c in text)


def in_millions(value: float) -> str:
    """``value`` in millions for a table or a line: two decimals, or three significant digits below one million (a
    tiny model's 0.0426 M and 0.0520 M both printed 0.04 or 0.05, beside a FLOP ratio its figures could not give;
    a figure under 5,000 printed 0.00)."""
    millions = value / 1e6
    return f"{millions:,.2f}" if millions >= 0.9995 else f"{millions:.3g}"  # (999,999: 1.00, not 1)


def note(text: str) -> None:
    """``text`` on stderr (a warning or note beside the output), dropped where stderr cannot be written (`2>/dev/full`,
    a terminal gone after a hangup): a note must not end the work it notes on (a training ended at its warmup note
    with status 1, before its first step)."""
    with contextlib.suppress(OSError):  # one write: torchrun's processes write unbuffered to one stderr, at once
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class ForgivingStream:
    """stderr for the gbattn program (cli.run): a write or flush that fails with an OSError (a full disk under
    `2>file`, a terminal gone after a hangup) is dropped, so that no note, progress bar or warning, gbattn's or a
    library's (lm-eval's harness drew its bar there and wrote no results), ends the work it reports on. Everything
    else is the stream's own."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
