"""Calls the sidecar schedules for a dependency, spaced at the rate it accepts.

A breaker that half-opens, or a batch of failures retried together, would
send every paused run or retry back to the dependency at the same instant.
When the sidecar knows the dependency's current rate (a :class:`Capacity`:
admission's learned requests a minute, injected from the supervisor side),
each scheduled call takes the first free slot at or after the delay the
policy computed (its backoff, the breaker's resume time), at least ``60/rpm``
from every slot already given for that dependency: a "next free slot" pacer.
It never shortens a delay; with the rate unknown it changes none.

Bounded: slots already past are forgotten, each dependency keeps at most
``max_slots`` (the oldest dropped), and at most ``max_dependencies`` are
kept (the least recently paced forgotten). Called from one thread (the
governor's); the clock is injected.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Protocol

__all__ = ["Capacity", "Pacer"]

#: Slots a dependency keeps (a breaker's paused runs of one opening, retries in flight).
MAX_SLOTS: Final = 10_000


class Capacity(Protocol):
    """A dependency's current rate in requests a minute; None: not known (nothing is paced)."""

    def __call__(self, dependency: str, /) -> float | None: ...


class Pacer:
    """The next free slot of each dependency; see the module."""

    def __init__(
        self,
        capacity: Capacity | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_dependencies: int = 10_000,
        max_slots: int = MAX_SLOTS,
    ) -> None:
        #: Settable: the supervisor injects admission's rates (None: nothing is paced).
        self.capacity = capacity
        self._clock = clock
        self._max_dependencies = max_dependencies
        self._max_slots = max_slots
        #: dependency -> the times (on ``clock``) given out, sorted.
        self._slots: OrderedDict[str, list[float]] = OrderedDict()

    def interval(self, dependency: str) -> float | None:
        """Seconds between two calls of ``dependency`` at its rate; None: rate unknown."""
        if self.capacity is None:
            return None
        rpm = self.capacity(dependency)
        if rpm is None or not math.isfinite(rpm) or rpm <= 0:
            return None
        return 60.0 / rpm

    def pace(self, dependency: str, delay_s: float) -> float:
        """Seconds to wait, from now, before a call of ``dependency`` the policy delays by
        ``delay_s``: no less, and at least one interval from every slot given (taken).

        ``delay_s`` itself when the rate is unknown.
        """
        interval = self.interval(dependency)
        if interval is None:
            return delay_s
        now = self._clock()
        slots = self._slots.get(dependency)
        if slots is None:
            slots = self._slots[dependency] = []
            if len(self._slots) > self._max_dependencies:
                self._slots.popitem(last=False)
        self._slots.move_to_end(dependency)
        del slots[: bisect_right(slots, now - interval)]  # past: they conflict with nothing
        wanted = at = now + max(0.0, delay_s)
        i = bisect_right(slots, at - interval)
        while i < len(slots) and slots[i] < at + interval:
            at = slots[i] + interval  # taken, or too close: the slot after it
            i += 1
        slots.insert(i, at)
        if len(slots) > self._max_slots:
            del slots[0]
        return delay_s if at == wanted else at - now

    def __len__(self) -> int:
        return len(self._slots)
