"""The death of the process that started this one (torchrun, a comparison): a child that outlives it stops.
Imports nothing but the standard library, so that a torchrun worker asks for it before importing torch."""

from __future__ import annotations

import signal


def stop_with_parent() -> None:
    """Receive SIGTERM when the process that started this one dies (Linux's PR_SET_PDEATHSIG; elsewhere
    nothing): a comparison's run or a torchrun worker whose launcher was killed then checkpoints and stops,
    as on SIGTERM, rather than training on unseen. The kernel sends it once per thread of the dying parent
    (as it hands the child from one to the next), so it may come several times."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def parent_death_signal() -> int:
    """The signal this process receives when its parent dies: SIGTERM where :func:`stop_with_parent` asked for
    it (it lasts across exec: a comparison asks for it before its run's ``gbattn train`` starts), else 0."""
    try:
        import ctypes

        value = ctypes.c_int(0)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
        return value.value
    except OSError:
        return 0
