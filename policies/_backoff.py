"""Retry delays: tenacity's schedules, with jitter that replays identically.

The schedule (fixed, or exponential within [min, max]) is tenacity's own
``wait_fixed`` / ``wait_exponential``, and ``stop_after_attempt`` decides when
the attempts are spent. tenacity's randomised waits draw from the global RNG,
which would make a decision differ between a live run and its replay, so the
jitter fraction comes from a hash of the failure's trace id, span id and the
policy entry's name instead: the same failure always gets the same delay,
while different failures still spread out like random jitter.
"""

from __future__ import annotations

import hashlib
from typing import Final, Literal

from tenacity import RetryCallState, Retrying, stop_after_attempt, wait_exponential, wait_fixed
from tenacity.wait import wait_base

from policies._schema import ExponentialWait, FixedWait

Jitter = Literal["none", "full", "equal"]

#: Attempts whose waits a Backoff remembers.
_MAX_REMEMBERED: Final = 64

#: Only a carrier for RetryCallState; never runs anything.
_RETRYING: Final = Retrying()


def jitter_fraction(trace_id: str, span_id: str, policy: str) -> float:
    """A fraction in [0, 1) fixed by the failure and the policy entry (not random)."""
    digest = hashlib.blake2b(
        f"{trace_id}/{span_id}/{policy}".encode("utf-8", "surrogatepass"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class Backoff:
    """When to stop and how long to wait after a failed attempt."""

    __slots__ = ("_ceilings", "_floor", "_stop", "_wait", "jitter", "max_attempts")

    def __init__(self, spec: FixedWait | ExponentialWait, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self._stop = stop_after_attempt(max_attempts)
        #: Attempt -> tenacity's wait before jitter, or None past the last attempt: both
        #: depend on the attempt only, and asking tenacity builds a RetryCallState.
        self._ceilings: dict[int, float | None] = {}
        self._wait: wait_base
        if isinstance(spec, FixedWait):
            self._wait = wait_fixed(spec.seconds)
            self._floor = 0.0
            self.jitter: Jitter = spec.jitter
        else:
            self._wait = wait_exponential(
                multiplier=spec.multiplier, min=spec.min, max=spec.max, exp_base=spec.exp_base
            )
            self._floor = spec.min
            self.jitter = spec.jitter or "full"

    def delay(self, attempt: int, fraction: float) -> float | None:
        """Seconds to wait after failed ``attempt`` (1-based), or None when it was the last.

        ``fraction`` in [0, 1) places the delay within the jitter's range.
        """
        ceilings = self._ceilings
        if attempt in ceilings:
            ceiling = ceilings[attempt]
        else:
            ceiling = self._ceiling(attempt)
            if len(ceilings) < _MAX_REMEMBERED:  # attempts count up from 1: a few entries
                ceilings[attempt] = ceiling
        if ceiling is None:
            return None
        if self.jitter == "full":
            # tenacity's wait_random_exponential: uniform between min and the ceiling.
            return self._floor + fraction * max(0.0, ceiling - self._floor)
        if self.jitter == "equal":
            return max(self._floor, ceiling / 2 + fraction * ceiling / 2)
        return ceiling

    def _ceiling(self, attempt: int) -> float | None:
        state = _state(attempt)
        return None if self._stop(state) else float(self._wait(state))


def _state(attempt: int) -> RetryCallState:
    state = RetryCallState(retry_object=_RETRYING, fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return state
