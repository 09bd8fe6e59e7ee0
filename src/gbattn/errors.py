"""Error types for user mistakes. The CLI prints their message on one line and exits 2."""


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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM that stopped work where nothing is lost: the message says what was kept and how to
    continue, and ``exit_code`` is the status a shell reports for the signal (130 or 143). A KeyboardInterrupt,
    not a UserError: a Python caller's ``except Exception`` (a sweep going on to its next run) lets it through."""

    exit_code = 130
