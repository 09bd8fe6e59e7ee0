"""Error types for user mistakes. The CLI prints their message on one line and exits 2."""

import os
import signal


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
