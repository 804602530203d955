"""Progress of a long local verb (``replay``) on stderr, so stdout stays its output.

On a terminal one line is redrawn in place twice a second; anywhere else (a
log, a pipe) a line is added every 5 seconds. Nothing is written for work
that ends before the first interval.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

#: Seconds between two progress lines: on a terminal, and elsewhere.
TERMINAL_EVERY_S = 0.5
LOG_EVERY_S = 5.0


class Progress:
    """Counts spans and failures; says how far it got every so often."""

    def __init__(
        self,
        what: str,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float | None = None,
    ) -> None:
        self._what = what
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._tty = self._stream.isatty()
        self._every = (
            every_s if every_s is not None else (TERMINAL_EVERY_S if self._tty else LOG_EVERY_S)
        )
        self._started = clock()
        self._next = self._started + self._every
        self._shown = False
        self.spans = 0
        self.failures = 0

    def add(self, spans: int = 0, failures: int = 0) -> None:
        self.spans += spans
        self.failures += failures
        now = self._clock()
        if now >= self._next:
            self._next = now + self._every
            self._say(now, end="\r" if self._tty else "\n")

    def done(self) -> None:
        """The last count, when progress was shown at all (a terminal's line is ended)."""
        if self._shown:
            self._say(self._clock(), end="\n")

    def _say(self, now: float, end: str) -> None:
        took = now - self._started
        rate = self.spans / took if took > 0 else 0.0
        self._stream.write(
            f"spanvisor: {self._what}: {self.spans:,} spans, {self.failures:,} failures,"
            f" {took:.1f} s ({rate:,.0f} spans/s){end}"
        )
        self._stream.flush()
        self._shown = True
