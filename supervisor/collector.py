"""Cyclic garbage collection between batches, not in the middle of one.

Why: CPython collects its young generations whenever allocations pass a
threshold, in whichever thread allocates, holding the GIL. In the sidecar
that was mostly the event loop in the middle of judging a batch. Almost
everything that survives a young collection is bounded state being renewed
(runs, seen spans, recent failures), so each collection traverses what the
last ones promoted: under ``bench/latency.py`` young collections took 5-38
ms, middle ones up to 107 ms, and they made most of the tail of
receipt-to-decision latency (a batch's handling p99 29-52 ms with automatic
collection, 20 ms with none).

So: small young collections (every ``young_threshold`` net allocations,
~1-7 ms here) between batches, where a pause delays no decision already
judged, only the next batch's wait; no middle-generation collections, so
survivors are traversed again only by the full collection on the timer.

Lifecycle: :meth:`Collector.take_over` (``spanvisor run`` calls it once
the sidecar has started) collects and freezes what start-up made, then
turns automatic collection off; from then on the pipeline worker calls
:meth:`between_batches` after each batch and a timer calls :meth:`tick`
every second (young collections when the loop is idle) and :meth:`full` at
``gc_full_interval_s``. Until ``take_over`` (tests, the demo's in-process
sidecar) every method leaves collection to CPython and only counts.

Memory stays bounded: young garbage is collected after at most
``young_threshold`` net allocations plus one batch, or one second; garbage
among older objects at the next full collection.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["Collector", "CollectorStats"]

#: Net allocations of tracked objects before a young collection (CPython's default: 700).
#: Under bench/latency.py, p99: 24 ms at 2,000; 33 ms at 5,000; 31-45 ms at 20,000.
YOUNG_THRESHOLD: Final = 2_000


@dataclass(frozen=True, slots=True)
class CollectorStats:
    managed: bool
    young: int
    full: int
    max_young_pause_ms: float
    #: Time spent in young and full collections since start: their share of the CPU.
    young_total_ms: float
    full_total_ms: float
    last_full_ms: float | None


class Collector:
    """When the cyclic collector runs in the sidecar; see the module."""

    def __init__(
        self,
        *,
        young_threshold: int = YOUNG_THRESHOLD,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.young_threshold = young_threshold
        self._clock = clock
        self.managed = False
        self._young = 0
        self._full = 0
        self._max_young_ms = 0.0
        self._young_total_ms = 0.0
        self._full_total_ms = 0.0
        self._last_full_ms: float | None = None

    def take_over(self) -> None:
        """Collect and freeze start-up's objects, then collect only when told to."""
        gc.collect()
        gc.freeze()
        gc.disable()
        self.managed = True

    def between_batches(self) -> None:
        """A batch is done: collect the young generation if enough was allocated."""
        if self.managed and gc.get_count()[0] >= self.young_threshold:
            self._collect_young()

    def tick(self) -> None:
        """The timer's turn: an idle loop still collects what its last batches left."""
        if self.managed and gc.get_count()[0] > 0:
            self._collect_young()

    def full(self) -> int:
        """Collect every generation; the number of unreachable objects found."""
        started = self._clock()
        found = gc.collect()
        self._full += 1
        self._last_full_ms = (self._clock() - started) * 1000
        self._full_total_ms += self._last_full_ms
        return found

    def stats(self) -> CollectorStats:
        return CollectorStats(
            managed=self.managed,
            young=self._young,
            full=self._full,
            max_young_pause_ms=round(self._max_young_ms, 3),
            young_total_ms=round(self._young_total_ms, 3),
            full_total_ms=round(self._full_total_ms, 3),
            last_full_ms=None if self._last_full_ms is None else round(self._last_full_ms, 3),
        )

    def _collect_young(self) -> None:
        started = self._clock()
        self._young += 1
        gc.collect(0)
        pause_ms = (self._clock() - started) * 1000
        self._young_total_ms += pause_ms
        self._max_young_ms = max(self._max_young_ms, pause_ms)
