"""Progress display: a tqdm bar on a terminal, one plain line every ``interval`` seconds
otherwise (log files and CI stay readable), with the time left while the total is ahead."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from gbattn.terminal import note


class Progress:
    """``total``: the count when known; None shows the count so far (e.g. tokens of a file being read)."""

    def __init__(self, total: int | None, desc: str, initial: int = 0, unit: str = "step", disable: bool = False,
                 interval: float = 30.0) -> None:
        self.total, self.desc, self.n, self.unit = total, desc, initial, unit
        self.disable = disable
        self.interval = interval
        self.postfix = ""
        self._initial, self._start = initial, time.monotonic()
        self._last = self._start
        self._bar = None
        if not disable and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if postfix:
            self.postfix = " ".join(f"{k}={v}" for k, v in postfix.items())
        if self.disable:
            return
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(self.postfix, refresh=False)
            self._bar.update(n)
        elif time.monotonic() - self._last >= self.interval or (self.total is not None and self.n >= self.total):
            self._last = time.monotonic()
            of = "" if self.total is None else f"/{self.total}"
            parts = (f"{self.desc}: {self.n}{of} {self.unit}s", self.postfix, self._eta())
            note(" ".join(part for part in parts if part))

    def _eta(self) -> str:
        """'eta M:SS' at the rate since the start (what tqdm's bar shows), while the total is ahead."""
        if self.total is None or not self._initial < self.n < self.total or self._last <= self._start:
            return ""
        rate = (self.n - self._initial) / (self._last - self._start)
        return f"eta {tqdm.format_interval((self.total - self.n) / rate)}"

    def write(self, message: str) -> None:
        """``message`` on stderr, dropped where stderr cannot be written (:func:`note`): a line that failed ended the
        training it reported on, its evaluation's checkpoint lost."""
        if self.disable:
            return
        if self._bar is not None:
            try:
                self._bar.write(message, file=sys.stderr)  # (tqdm's own default is stdout: a piped output took it)
            except OSError:
                self.disable = True
        else:
            note(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
