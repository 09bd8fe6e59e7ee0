"""``python -m gbattn ...``: the ``gbattn`` command."""

import sys

from gbattn.cli import main

sys.exit(main())
