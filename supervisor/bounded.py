"""Bounded containers: every cache in the sidecar has a size and counts what it evicts."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """A least-recently-set map of at most ``capacity`` entries.

    Setting a key moves it to the young end; the oldest entry is evicted when
    full and counted in ``evictions`` (eviction is never silent).
    """

    __slots__ = ("_data", "capacity", "evictions")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.evictions = 0
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        return self._data.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def set(self, key: K, value: V) -> None:
        data = self._data
        if key in data:
            data.move_to_end(key)
        data[key] = value
        if len(data) > self.capacity:
            data.popitem(last=False)
            self.evictions += 1

    def pop(self, key: K) -> V | None:
        return self._data.pop(key, None)

    def values(self) -> list[V]:
        """A snapshot of the values, oldest first."""
        return list(self._data.values())


class LatencyWindow:
    """The last ``capacity`` latency samples (ms), for percentiles on demand."""

    __slots__ = ("_ordered", "_ordered_at", "_samples", "count")

    def __init__(self, capacity: int = 10_000) -> None:
        self._samples: deque[float] = deque(maxlen=capacity)
        self.count = 0
        #: The samples sorted, as of ``_ordered_at`` samples added: a stats scrape asks
        #: for several quantiles at once, and sorting 10,000 samples for each was most
        #: of its cost.
        self._ordered: list[float] = []
        self._ordered_at = 0

    def add(self, value_ms: float) -> None:
        self._samples.append(value_ms)
        self.count += 1

    def percentile(self, q: float) -> float | None:
        """The ``q``-quantile (0..1) by nearest rank, or None without samples."""
        if not self._samples:
            return None
        if self._ordered_at != self.count:
            self._ordered = sorted(self._samples)
            self._ordered_at = self.count
        ordered = self._ordered
        rank = min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))
        return ordered[rank]


class CappedCounts(Generic[K]):
    """Counts by key for at most ``capacity`` keys, for metrics' label sets.

    A key not seen before on a full counter is counted under the ``fallback``
    the caller gives instead (which may go past the capacity: callers keep
    their fallbacks few), and in ``cut``: the totals stay right, what is lost is
    only the detail, and never silently.
    """

    __slots__ = ("_counts", "capacity", "cut")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.cut = 0
        self._counts: dict[K, int] = {}

    def add(self, key: K, fallback: K, n: int = 1) -> None:
        counts = self._counts
        if key not in counts and len(counts) >= self.capacity:
            self.cut += n
            key = fallback
        counts[key] = counts.get(key, 0) + n

    def items(self) -> list[tuple[K, int]]:
        """A snapshot of the counts, in the order the keys were first seen."""
        return list(self._counts.items())

    @property
    def total(self) -> int:
        return sum(self._counts.values())
