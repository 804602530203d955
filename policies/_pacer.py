"""Calls the sidecar schedules for a dependency, spaced at the rate it accepts.

A breaker that half-opens, or a batch of failures retried together, would
send every paused run or retry back to the dependency at the same instant.
When the sidecar knows the dependency's current rate (a :class:`Capacity`:
admission's learned requests a minute, injected from the supervisor side),
each scheduled call takes the first free slot at or after the delay the
policy computed (its backoff, the breaker's resume time), at least ``60/rpm``
from every slot already given for that dependency: a "next free slot" pacer.
It never shortens a delay; with the rate unknown it changes none.

The slots given are kept as **blocks**: runs of slots with no room for
another between them (consecutive slots less than two intervals apart). A
new slot can only go outside a block, within one interval of its ends at
the nearest, so a block needs only its first and last slot and a count, and
finding a slot is a binary search and a walk over the few blocks that touch
it, however many runs one opening paused (a sorted list of every slot made
that a walk over every slot of the block: quadratic in the paused runs).

Bounded: slots already past are forgotten, each dependency keeps at most
``max_slots`` (past that the oldest is forgotten, its block moved on by one
interval), and at most ``max_dependencies`` are kept (the least recently
paced forgotten). Called from one thread (the governor's); the clock is
injected.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Protocol

__all__ = ["Capacity", "Pacer"]

#: Slots a dependency keeps (a breaker's paused runs of one opening, retries in flight).
MAX_SLOTS: Final = 10_000


class Capacity(Protocol):
    """A dependency's current rate in requests a minute; None: not known (nothing is paced)."""

    def __call__(self, dependency: str, /) -> float | None: ...


class _Blocks:
    """One dependency's slots: blocks sorted by time, each (first, last, how many)."""

    __slots__ = ("counts", "ends", "starts", "total")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.counts: list[int] = []
        self.total = 0

    def place(self, wanted: float, interval: float) -> float:
        """Take the first free slot at or after ``wanted``; it."""
        starts, ends = self.starts, self.ends
        j = bisect_left(starts, wanted + interval) - 1  # the last block starting too close
        if j >= 0 and ends[j] + interval > wanted:  # in its reach: after it, and any it touches
            lo, at, k = j, ends[j] + interval, j + 1
            while k < len(starts) and starts[k] - interval < at:
                at, k = ends[k] + interval, k + 1
        else:  # free: joins the block before when there is no room between them
            at, k = wanted, j + 1
            lo = j if j >= 0 and wanted - ends[j] < 2 * interval else j + 1
        hi = k + 1 if k < len(starts) and starts[k] - at < 2 * interval else k
        start = min(starts[lo], at) if lo < hi else at
        end = max(ends[hi - 1], at) if lo < hi else at
        count = sum(self.counts[lo:hi]) + 1
        starts[lo:hi], ends[lo:hi], self.counts[lo:hi] = [start], [end], [count]
        self.total += 1
        return at

    def forget_before(self, when: float) -> None:
        """Drop the blocks that ended at or before ``when`` (they conflict with nothing)."""
        gone = bisect_right(self.ends, when)
        if gone:
            self.total -= sum(self.counts[:gone])
            del self.starts[:gone], self.ends[:gone], self.counts[:gone]

    def forget_oldest(self, interval: float) -> None:
        """Forget the first slot: its block starts one interval later (or goes)."""
        self.total -= 1
        if self.counts[0] > 1:
            self.counts[0] -= 1
            self.starts[0] = min(self.starts[0] + interval, self.ends[0])
        else:
            del self.starts[0], self.ends[0], self.counts[0]


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
        #: dependency -> the slots (on ``clock``) given out.
        self._slots: OrderedDict[str, _Blocks] = OrderedDict()

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
        blocks = self._slots.get(dependency)
        if blocks is None:
            blocks = self._slots[dependency] = _Blocks()
            if len(self._slots) > self._max_dependencies:
                self._slots.popitem(last=False)
        self._slots.move_to_end(dependency)
        blocks.forget_before(now - interval)  # past: they conflict with nothing
        wanted = now + max(0.0, delay_s)
        at = blocks.place(wanted, interval)
        while blocks.total > self._max_slots:
            blocks.forget_oldest(interval)
        return delay_s if at == wanted else at - now

    def taken(self, dependency: str) -> int:
        """Slots of ``dependency`` given and not yet forgotten."""
        blocks = self._slots.get(dependency)
        return 0 if blocks is None else blocks.total

    def __len__(self) -> int:
        return len(self._slots)
