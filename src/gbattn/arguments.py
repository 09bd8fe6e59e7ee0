"""Command-line arguments shared by several commands, defined once. Imports nothing but argparse,
:mod:`gbattn.checks` and :mod:`gbattn.terminal` (no torch), so ``gbattn --help`` stays fast."""

from __future__ import annotations

import argparse
import textwrap

from gbattn.checks import MAX_INT, did_you_mean
from gbattn.terminal import terminal_line


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a line never breaks inside a word: in a narrow terminal `paper-wt103` and `--no-compile` were
    split at their hyphens, and a word longer than the line (`wikitext-103-raw-v1`) anywhere; such a word now runs
    past the line's end."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False,
                             break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and status 2, and help lines keep hyphenated names whole."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str, help_of: str | None = None):
        """``help_of``: the command whose --help to point at (this parser's by default). The message quotes what
        was typed (an unrecognized argument as it is): one line, control characters escaped, as every error is."""
        for option in (o for action in self._actions if action.type is text for o in action.option_strings):
            if message == f"argument {option}: expected one argument":  # (`--prompt "-Hello"`: argparse read an option)
                message += f"; a text that starts with '-' is given as {option}=TEXT"
        self.exit(2, f"gbattn: error: {terminal_line(message)} (see: {help_of or self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # argparse reports a command's unknown option from the top parser, whose --help does not list the
        # command's options: point at the command's own help instead, and name the near miss of a misspelt
        # option among that command's options (`--tokenzier`: '--tokenizer'), as for a misspelt value.
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = getattr(parsed, "command", None)
            options = [option for action in self._parser_of(command)._actions for option in action.option_strings]
            typed = [text.split("=", 1)[0] for text in unknown if text.startswith("--")]
            # `--set lr=1e-3 d_model=64`: argparse took the first and left the rest over
            settings = [text for text in unknown if "=" in text and not text.startswith("-")]
            hint = (f"; each --set takes one KEY=VALUE: --set {settings[0]}"
                    if settings and "--set" in options else "")
            self.error(f"unrecognized arguments: {' '.join(unknown)}{did_you_mean(typed, options)}{hint}",
                       f"{self.prog} {command}" if command else None)
        return parsed

    def _parser_of(self, command: str | None) -> argparse.ArgumentParser:
        """The parser of ``command`` (this one's without a command)."""
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        return commands.get(command, self)

    def _get_values(self, action, arg_strings):
        # An empty value is a script's unset variable (`--attn "$VARIANT"`, `gbattn eval "$RUN"`), never a
        # choice: refused here, once for every option and argument, instead of meaning "not given" (the
        # default, silently) or, for a path, the current directory. (A command's own arguments are its parser's.)
        # A text argument (type=text) is empty only when it is "": its whitespace is text.
        blank = (lambda t: not t) if action.type is text else (lambda t: not t.strip())
        if action.nargs != argparse.PARSER and any(blank(t) for t in arg_strings):
            self.error(f"argument {'/'.join(action.option_strings) or action.dest}: is empty")
        if action.option_strings and isinstance(action, argparse._StoreAction):
            # An option that takes a value, given twice, kept the last one silently (`--only a --only b` trained b
            # alone; `--seeds 1 --seeds 2` seed 2): refused, as `--attn x --set attn=y` is. (--set adds up.)
            given = self.__dict__.setdefault("_given", {})
            if action.dest in given:
                several = (f" (it takes several values at once: {action.option_strings[0]} "
                           f"{' '.join([*given[action.dest], *arg_strings])})" if action.nargs in ("+", "*") else "")
                self.error(f"argument {'/'.join(action.option_strings)}: given twice ({' '.join(given[action.dest])}, "
                           f"then {' '.join(arg_strings)}): give it once{several}")
            given[action.dest] = list(arg_strings)
        return super()._get_values(action, arg_strings)

    def parse_known_args(self, args=None, namespace=None):
        self._given = {}  # dest -> the values of each option given so far in this parse (see _get_values)
        return super().parse_known_args(args, namespace)

    def _check_value(self, action, value):
        # argparse's own check (a command, --split, --checkpoint, --experiments), naming a near miss ('lis': list)
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(value, action.choices)} (choose from {choices})")


def text(value: str) -> str:
    """The type of an argument whose value is text (generate's --prompt), where a space or a newline is text,
    not a blank value: a character-level model continues "\\n" as nanoGPT's sample.py does."""
    return value


MAX_COUNT = 2**31 - 1  # counts (threads, steps, tokens, rows) beyond this are typos, and overflow C ints
# CPU threads: OpenMP starts them all on the first operation, and beyond what the OS allows it fails in
# libgomp or crashes (measured: --threads 20,000 exited with a libgomp message, 40,000 with a segfault).
MAX_THREADS = 1024


def at_least(minimum: int, maximum: int = MAX_COUNT):
    """An argparse type: an integer >= ``minimum`` (and <= ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value} must be <= {maximum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


SEED = at_least(0, MAX_INT)  # what torch.manual_seed and numpy's generators take
SEED.__name__ = "seed (an integer in [0, 2**63 - 1])"


def number_where(holds, words: str):
    """An argparse type: a number for which ``holds(value)`` is true, else '{value} must be {words}'."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not holds(value):  # NaN holds no bound
            raise argparse.ArgumentTypeError(f"{value} must be {words}")
        return value

    return parse


non_negative_number = number_where(lambda t: 0 <= t < float("inf"), "a finite number >= 0")  # a temperature
probability_mass = number_where(lambda p: 0 < p <= 1, "a number in (0, 1]")  # a nucleus sampling's top-p


def preset(p: argparse.ArgumentParser, training: bool = True) -> None:
    """--preset (``training``: the command trains, with the preset's recipe as its default)."""
    recipe = "; its training recipe is the default" if training else ""
    p.add_argument("--preset", default=None,
                   help=f"model preset{recipe} (see `gbattn list`; default paper-small)")


# `gbattn generate`'s sampling defaults, which `run.generate` (gbattn.load_run) shares (nanoGPT's sample.py's)
GENERATE_DEFAULTS = {"max_new_tokens": 100, "temperature": 0.8, "top_k": 200}

MODEL_SET_EXAMPLE = "--set d_model=288 --set attn.rounds=3 (the latter with --attn boosted)"


def model(p: argparse.ArgumentParser, training: bool = True) -> None:
    """--attn, --residual and --set, for every command that builds a model (``training``: --set also
    takes the training fields)."""
    p.add_argument("--attn", default=None, help="attention variant (see `gbattn list`; default standard)")
    p.add_argument("--residual", default=None, help="residual stream: plain (default), attnres-full or attnres-block")
    if training:
        sets(p, "a model or training field", f"--set lr=1e-3 {MODEL_SET_EXAMPLE}")
    else:
        sets(p, "a model field", MODEL_SET_EXAMPLE)


def sets(p: argparse.ArgumentParser, what: str, example: str) -> None:
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override {what}, e.g. {example}")


def device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="auto (default: CUDA if available), cpu, cuda or cuda:N")


def threads(p: argparse.ArgumentParser, resumed: bool = False) -> None:
    """``--threads``; ``resumed``: the command resumes runs, which keep their recorded value (train)."""
    p.add_argument("--threads", type=at_least(1, MAX_THREADS), default=None,
                   help="CPU threads (default: OMP_NUM_THREADS where it is set, else the cores not busy with other "
                        f"work{'; a resumed run: its recorded value' if resumed else ''}; README, 'Threads')")


def checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, choices=["best", "last"],
                   help="a run directory's best-validation weights (default) or its last checkpoint (an exported "
                        "directory holds the one it was exported with)")


def quiet(p: argparse.ArgumentParser, also: str = "") -> None:
    """``--quiet``; ``also``: what else the command leaves out (train's plan and summary lines, say)."""
    p.add_argument("--quiet", action="store_true",
                   help=f"no progress display{f', {also}' if also else ''} (warnings still go to stderr)")
