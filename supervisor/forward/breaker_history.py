"""Each breaker's recent state changes, kept in memory for the operator console.

The board reports a change (:class:`policies.BreakerChange`) stamped with its
own clock, monotonic in the sidecar; the history stamps it again with the
wall clock, so a strip over "the last hours" can be drawn. Bounded twice:
at most ``per_dependency`` changes per dependency (the oldest dropped) and
at most ``max_dependencies`` dependencies (the one changed longest ago
dropped whole). What was dropped is never guessed: :meth:`BreakerHistory.timeline`
says from when on it knows (``known_since``).

**Breakers shared through Redis.** The state is the fleet's (read from
Redis), the changes are those this sidecar saw: its own, and another
sidecar's as reason ``shared_storage``, stamped when this sidecar noticed
(its next outcome or read of that dependency), not when it happened; a
change made and undone between two looks is not seen at all, and a
dependency only other sidecars use has no changes here. Each sidecar's
console shows its own view of the changes over the fleet's current state.

Thread-safety: the board calls from whichever thread moved the breaker, the
console reads on the event loop; one lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from policies import BreakerChange

#: Changes kept per dependency.
PER_DEPENDENCY = 64
#: Dependencies with changes kept.
MAX_DEPENDENCIES = 1000


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of one breaker, at a wall-clock time (unix seconds)."""

    at: float
    old: str
    new: str
    reason: str


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of time in one state; ``state`` ``unknown`` before the history knows."""

    start: float
    end: float
    state: str


@dataclass(frozen=True, slots=True)
class BreakerTimeline:
    """One breaker over ``[start, end]``: its state now and the changes seen in between.

    Before ``known_since`` (this sidecar's start, or changes dropped by the
    bounds) nothing is known. The state from ``known_since`` to the first
    change is that change's ``old``, or the state now when none was seen.
    """

    dependency: str
    start: float
    end: float
    state: str
    known_since: float
    transitions: tuple[Transition, ...]

    def segments(self) -> tuple[Segment, ...]:
        """The window cut into states, oldest first (empty stretches left out)."""
        cuts: list[Segment] = []
        known = min(max(self.known_since, self.start), self.end)
        if known > self.start:
            cuts.append(Segment(self.start, known, "unknown"))
        at = known
        state = self.transitions[0].old if self.transitions else self.state
        for change in self.transitions:
            when = min(max(change.at, known), self.end)
            if when > at:
                cuts.append(Segment(at, when, state))
            at, state = max(at, when), change.new
        if self.end > at:
            cuts.append(Segment(at, self.end, state))
        return tuple(cuts)


class BreakerHistory:
    """The recent changes of each breaker; see the module."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        per_dependency: int = PER_DEPENDENCY,
        max_dependencies: int = MAX_DEPENDENCIES,
    ) -> None:
        if per_dependency < 1 or max_dependencies < 1:
            raise ValueError("a breaker history keeps at least one change of one dependency")
        self._clock = clock
        self._per_dependency = per_dependency
        self._max_dependencies = max_dependencies
        self._lock = threading.Lock()
        self._rings: OrderedDict[str, deque[Transition]] = OrderedDict()
        #: Per dependency: the time of its newest change dropped by the ring's bound.
        self._dropped_at: dict[str, float] = {}
        #: When the history began (the sidecar's start): nothing is known before.
        self.started_at = clock()
        #: The newest change of every dependency dropped whole (0: none was).
        self._forgotten_at = 0.0
        #: Changes recorded since start.
        self.recorded = 0

    def __call__(self, change: BreakerChange) -> None:
        """Record ``change`` (a :class:`policies.BreakerBoard` ``on_change`` listener)."""
        seen = Transition(self._clock(), change.old.value, change.new.value, change.reason)
        with self._lock:
            self.recorded += 1
            ring = self._rings.pop(change.dependency, None)
            if ring is None:
                ring = deque(maxlen=self._per_dependency)
                while len(self._rings) >= self._max_dependencies:
                    name, gone = self._rings.popitem(last=False)  # changed longest ago
                    self._dropped_at.pop(name, None)
                    self._forgotten_at = max(self._forgotten_at, gone[-1].at)
            if len(ring) == ring.maxlen:
                self._dropped_at[change.dependency] = ring[0].at
            ring.append(seen)
            self._rings[change.dependency] = ring  # last: changed most recently

    def timeline(self, dependency: str, state: str, start: float, end: float) -> BreakerTimeline:
        """``dependency``'s changes in ``[start, end]``, around ``state`` (its state now)."""
        with self._lock:
            ring = list(self._rings.get(dependency, ()))
            known = max(self.started_at, self._forgotten_at, self._dropped_at.get(dependency, 0.0))
        inside = tuple(t for t in ring if start <= t.at <= end)
        return BreakerTimeline(dependency, start, end, state, known, inside)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rings)
