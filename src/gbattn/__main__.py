"""``python -m gbattn ...``: the ``gbattn`` command."""

from gbattn.cli import run

run()
