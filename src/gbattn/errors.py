"""Error types for user mistakes (the CLI prints their message on one line and exits 2) and for a stop asked for
(:class:`Interrupted`, exit 130 or 143), with their helpers: the signal handler that raises a stop, an optional
module's import naming the extra that installs it, a value shown bounded in a message (:func:`shown`), and text an
ASCII locale misread (:func:`locale_misread`)."""

import importlib
import os
import reprlib
import signal
import sys


class _Bounded(reprlib.Repr):
    """reprlib's bounded repr, which takes a subclass of dict, list, ... (an OrderedDict, which torch's safe loader
    reads) as its base class: reprlib gave those the built-in repr, unbounded."""

    def repr1(self, x, level: int) -> str:
        for base in (dict, list, tuple, set, frozenset):
            if isinstance(x, base) and type(x) is not base:
                return getattr(self, f"repr_{base.__name__}")(x, level)
        return super().repr1(x, level)


def shown(value, width: int = 80) -> str:
    """``repr(value)`` for a message about a value read from a file, at most ``width`` characters, and bounded in
    the work it takes: a pickled checkpoint can hold a list of 100 references to a list of 100 references ... (3 KB
    that repr expands to 10**12 items), or one nested thousands deep (a RecursionError)."""
    short = _Bounded()
    short.maxlevel = 3
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = short.maxfrozenset = short.maxdeque = 4
    short.maxstring = short.maxother = width
    short.maxlong = 40
    text = short.repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


class UserError(Exception):
    """A mistake the user can fix (bad option, missing file); never a bug (README, "Trust")."""


class ConfigError(UserError, ValueError):
    """A bad configuration value: the message names the field and the allowed values (README, "Trust")."""


class DataError(UserError, ValueError):
    """Data that cannot be found or read (README, "Data")."""


class DataNotFound(DataError):
    """``--data`` names no file, directory or known corpus."""


class CheckpointError(UserError, RuntimeError):
    """A run directory or checkpoint that is missing, truncated or corrupted (README, "Trust")."""


def optional_module(module: str, extra: str, needs: str):
    """``module`` (of an optional dependency) imported for what ``needs`` says ("figures need"), or a one-line
    UserError with the pip line of gbattn's extra ``extra``: where the package is not installed, and where it is but
    fails to import (one that does not fit its own dependencies: datasets 2.14.0 with pyarrow 26, matplotlib 3.7
    with numpy 2), which was a traceback, or "not installed" with a pip line that changed nothing."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == package:
            raise UserError(f"{needs} {package}, which is not installed: pip install 'gbattn[{extra}]'") from None
        cause = e
    except Exception as e:  # (any error of the package's own code as it loads)
        cause = e
    detail = " ".join(str(cause).split())[:160]
    raise UserError(f"{needs} {package}, which is installed but fails to import ({type(cause).__name__}: {detail}): "
                    f"install versions that work together: pip install -U 'gbattn[{extra}]'") from None


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a training loop (which checkpoints and stops on its own): unwinds as Ctrl-C does, so
    locks and temporary files are released, and the command exits 143 with one line."""


def terminated_handler():
    """SIGTERM's handler for this process: raises Terminated (the command unwinds and exits 143). A process
    forked from this one inherits the handler; there SIGTERM ends the process as its default does: a
    multiprocessing pool's ``terminate()`` stops its workers with SIGTERM (lm-eval's bootstrap of a
    perplexity's standard error, at the end of every such task), and each printed a traceback of Terminated."""
    owner = os.getpid()

    def terminated(signum, frame) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    return terminated


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM that stopped work where nothing is lost: the message says what was kept and how to
    continue, and ``exit_code`` is the status a shell reports for the signal (130 or 143). A KeyboardInterrupt,
    not a UserError: a Python caller's ``except Exception`` (a sweep going on to its next run) lets it through."""

    exit_code = 130


def locale_misread(text: str) -> str | None:
    """Where ``text`` holds bytes Python could not decode that are UTF-8 (an argument read in an ASCII locale, LC_ALL=C
    without Python's UTF-8 mode: "café" as "caf\\udcc3\\udca9"), what to do about it; None otherwise (another
    encoding's bytes, a lone surrogate, or text that is fine)."""
    try:
        os.fsencode(text).decode("utf-8")
    except UnicodeError:
        return None
    return (f"the bytes are UTF-8, but Python read them in this locale's {sys.getfilesystemencoding()}: set a UTF-8 "
            f"locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1")
