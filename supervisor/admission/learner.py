"""A key's limit, learned by AIMD from the provider's 429s.

The configured limit is a ceiling. A 429 multiplies the effective limit by
``decrease`` (0.7; not below ``floor`` times the ceiling) and, with a
Retry-After, pauses the whole key until then; each ``window_s`` that passes
without a 429 adds ``step`` times the ceiling back, up to the ceiling. Pure:
the clock is injected, nothing is shared (each sidecar learns from the 429s
its own pipeline classifies).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Ceiling", "Learner"]


@dataclass(frozen=True, slots=True)
class Ceiling:
    """A key's configured limit; the learner never goes above it."""

    rpm: float
    tpm: float | None = None  # None: tokens are not limited
    decrease: float = 0.7
    floor: float = 0.1  # of the ceiling
    step: float = 0.05  # of the ceiling, per window without a 429
    window_s: float = 60.0


class Learner:
    """The effective limit of one key; see the module."""

    def __init__(self, ceiling: Ceiling, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ceiling = ceiling
        self._clock = clock
        self._fraction = 1.0
        self._since = clock()  # start of the current window without a 429
        self.paused_until = 0.0

    def fraction(self) -> float:
        """The effective limit as a fraction of the ceiling, windows without 429 added back."""
        now = self._clock()
        windows = math.floor((now - self._since) / self.ceiling.window_s)
        if windows > 0 and self._fraction < 1.0:
            self._fraction = min(1.0, self._fraction + windows * self.ceiling.step)
        if windows > 0:
            self._since += windows * self.ceiling.window_s
        return self._fraction

    def rpm(self) -> float:
        return self.ceiling.rpm * self.fraction()

    def tpm(self) -> float | None:
        tpm = self.ceiling.tpm
        return None if tpm is None else tpm * self.fraction()

    def throttled(self, retry_after_s: float | None = None) -> None:
        """A 429: decrease, restart the window; a Retry-After pauses the key until then."""
        self.fraction()
        c = self.ceiling
        self._fraction = max(c.floor, self._fraction * c.decrease)
        now = self._clock()
        self._since = now
        if retry_after_s is not None and retry_after_s > 0:
            self.paused_until = max(self.paused_until, now + retry_after_s)

    def pause_left_s(self) -> float:
        return max(0.0, self.paused_until - self._clock())
