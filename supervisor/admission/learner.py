"""A key's limit, learned by AIMD from the provider's 429s.

The configured limit is a ceiling. A 429 multiplies the effective limit by
``decrease`` (0.7; not below ``floor`` times the ceiling) and, with a
Retry-After, pauses the whole key until then; each ``window_s`` that passes
without a 429 adds ``step`` times the ceiling back, up to the ceiling.

**One decrease per burst**: calls in flight together meet the same
congestion, and their 429s arrive together; a 429 within ``decrease_gap_s``
of the last decrease is that same event (as TCP decreases once per round
trip): it restarts the quiet window, it does not decrease again.

The arithmetic is :func:`recover` and :func:`throttle`, pure functions of a
:class:`LearnedState` and a time; :class:`Learner` keeps one state in memory
(this sidecar's), :mod:`.shared_learning` the fleet's in Redis, with a Lua
script that mirrors them step for step (a test runs both on one sequence).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Ceiling", "LearnedState", "Learner", "recover", "throttle"]


@dataclass(frozen=True, slots=True)
class Ceiling:
    """A key's configured limit; the learner never goes above it."""

    rpm: float
    tpm: float | None = None  # None: tokens are not limited
    decrease: float = 0.7
    floor: float = 0.1  # of the ceiling
    step: float = 0.05  # of the ceiling, per window without a 429
    window_s: float = 60.0
    #: 429s this soon after a decrease are the same congestion event.
    decrease_gap_s: float = 2.0
    #: Admitted this share below the limit (the provider counts on its own clock).
    headroom: float = 0.0


@dataclass(frozen=True, slots=True)
class LearnedState:
    """What a model learned: its share of the ceiling and when things happened (seconds)."""

    fraction: float
    since: float  # start of the current window without a 429
    decreased_at: float = -math.inf  # the last decrease


def recover(state: LearnedState, c: Ceiling, now: float) -> LearnedState:
    """``state`` with the whole windows without a 429 since ``state.since`` given back."""
    windows = math.floor((now - state.since) / c.window_s)
    if windows <= 0:
        return state
    fraction = state.fraction
    if fraction < 1.0:
        fraction = min(1.0, fraction + windows * c.step)
    return LearnedState(fraction, state.since + windows * c.window_s, state.decreased_at)


def throttle(state: LearnedState, c: Ceiling, now: float) -> tuple[LearnedState, bool]:
    """A 429 at ``now``: the new state, and whether it decreased (not the same burst)."""
    state = recover(state, c, now)
    if now - state.decreased_at < c.decrease_gap_s:
        return LearnedState(state.fraction, now, state.decreased_at), False
    return LearnedState(max(c.floor, state.fraction * c.decrease), now, now), True


class Learner:
    """The effective limit of one key, in memory; see the module."""

    def __init__(self, ceiling: Ceiling, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ceiling = ceiling
        self._clock = clock
        self.state = LearnedState(1.0, clock())
        self.paused_until = 0.0

    def fraction(self) -> float:
        """The effective limit as a fraction of the ceiling, windows without 429 added back."""
        self.state = recover(self.state, self.ceiling, self._clock())
        return self.state.fraction

    def rpm(self) -> float:
        return self.ceiling.rpm * self.fraction()

    def tpm(self) -> float | None:
        tpm = self.ceiling.tpm
        return None if tpm is None else tpm * self.fraction()

    def throttled(self, retry_after_s: float | None = None) -> bool:
        """A 429: decrease (once per burst), restart the window; a Retry-After pauses
        the key until then. True: it decreased."""
        now = self._clock()
        self.state, decreased = throttle(self.state, self.ceiling, now)
        self.pause(retry_after_s)
        return decreased

    def pause(self, retry_after_s: float | None) -> None:
        if retry_after_s is not None and retry_after_s > 0:
            self.paused_until = max(self.paused_until, self._clock() + retry_after_s)

    def pause_left_s(self) -> float:
        return max(0.0, self.paused_until - self._clock())
