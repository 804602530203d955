"""Window counters: events under a key, counted over the last ``window_s`` seconds.

Retry budgets, restart intensity and cascades each count events in sliding
windows. In one sidecar their own windows do (:mod:`policies._budget`,
:mod:`policies._intensity`, :mod:`policies._cascade`: the local counter,
always kept). A fleet of sidecars counts them together through a
:class:`WindowCounter` (the sidecar's is Redis's, shared with the breakers):
each of those modules asks it first and decides with its own windows when
it has no answer (``None``: no shared counter reachable now).

Events are of two speeds. ``add`` is the success path (every call a batch
saw): it is kept here and sent with the next question about the same key,
so that counting a success never waits on the network. ``admit`` and
``tally`` are the failure path: one round trip each, atomic across the fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "Admission",
    "CascadeTally",
    "Limit",
    "WindowCounter",
    "cascade_calls",
    "window_buckets",
]

#: A window is cut into this many buckets at most (a wide window gets wide buckets) ...
MAX_BUCKETS: Final = 60
#: ... and at least this many (a narrow one gets sub-second buckets), so a count
#: leaves the window between ``window_s`` and ``window_s * (1 - 1/MIN_BUCKETS)``
#: after it was made.
MIN_BUCKETS: Final = 10


def window_buckets(window_s: float) -> tuple[int, float]:
    """How many buckets a window of ``window_s`` is cut into, and their width."""
    count = min(MAX_BUCKETS, max(MIN_BUCKETS, math.ceil(window_s)))
    return count, window_s / count


@dataclass(frozen=True, slots=True)
class Limit:
    """At most ``max(floor, ratio * count(of))`` events in the window (``of``: another key)."""

    floor: int
    ratio: float = 0.0
    of: str | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """An ``admit``'s answer, with the window's counts after it."""

    allowed: bool
    #: Events in the window (with this one when allowed).
    count: int
    #: Events in the window of ``Limit.of`` (0 without one).
    of: int


@dataclass(frozen=True, slots=True)
class CascadeTally:
    """A dependency's fleet-wide window, as a cascade detector reads it."""

    failures: int
    calls: int
    runs: int
    #: An episode is going on (reported by some sidecar), and did not just end.
    ongoing: bool
    #: The episode ended with this tally (fewer than ``end_below`` failures).
    ended: bool


def cascade_calls(dependency: str) -> str:
    """The key of ``dependency``'s calls as a cascade counts them (``tally`` reads it)."""
    return f"cascade:calls:{dependency}"


class WindowCounter(Protocol):
    """Sliding-window counts shared by a fleet; ``None`` answers mean "count locally"."""

    def add(self, key: str, window_s: float, n: int = 1) -> None:
        """``n`` events now under ``key``; sent with the next ``admit``/``tally`` of ``key``."""

    def admit(self, key: str, window_s: float, limit: Limit) -> Admission | None:
        """One event under ``key`` when the window holds fewer than ``limit``; whether added."""

    def tally(
        self,
        dependency: str,
        window_s: float,
        failures: int,
        runs: tuple[str, ...],
        end_below: float,
    ) -> CascadeTally | None:
        """Count ``failures`` of ``dependency`` (from ``runs``); its window now.

        An ongoing episode ends here when the failures are fewer than ``end_below``.
        """

    def claim(self, dependency: str, window_s: float) -> tuple[str, ...] | None:
        """Start an episode of ``dependency``: the runs it hit when this sidecar reports it.

        ``None`` when another sidecar started it first; empty when the counter cannot
        be asked (this sidecar reports it, with the runs it saw).
        """
