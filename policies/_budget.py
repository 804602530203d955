"""Retry budgets per dependency, as Envoy's: retries stay a fraction of the traffic.

A per-attempt retry limit bounds one call; it does not stop a fleet of agents
from tripling the load on a dependency that is already failing. A budget
does: over a sliding window, a dependency may see at most
``max(min_retries, ratio * calls)`` retries, where ``calls`` is every observed
call of it (successes, failures and retried attempts alike). ``min_retries``
keeps a quiet dependency retryable at all.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from policies._window_counter import Limit, WindowCounter, window_buckets


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """A dependency's retry budget.

    Retries are allowed while the retries counted in the last ``window_s``
    seconds are fewer than ``max(min_retries, ratio * calls)`` over the same
    window.
    """

    ratio: float = 0.2
    min_retries: int = 3
    window_s: float = 10.0

    def __post_init__(self) -> None:
        _check_float("ratio", self.ratio, 0.0, 10.0, low_open=True)
        if not isinstance(self.min_retries, int) or isinstance(self.min_retries, bool):
            raise ValueError(f"min_retries must be an integer, got {self.min_retries!r}")
        if not 0 <= self.min_retries <= 1_000_000:
            raise ValueError(f"min_retries must be between 0 and 1000000, got {self.min_retries}")
        _check_float("window_s", self.window_s, 1.0, 3600.0, low_open=False)


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        low_text = f"more than {low:g}" if low_open else f"at least {low:g}"
        raise ValueError(f"{name} must be {low_text} and at most {high:g}, got {value}")


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """A dependency's budget now: the counts in its window and whether a retry would pass."""

    dependency: str
    calls: int
    retries: int
    #: ``max(min_retries, ratio * calls)``: retries are allowed while ``retries < limit``.
    limit: float
    allowed_now: bool


class _Window:
    """Bucketed counts of one dependency's last ``window_s`` seconds.

    ``buckets`` holds ``[index, calls, retries]`` for the buckets that saw
    anything, oldest first; ``calls`` / ``retries`` are their totals, kept as
    buckets come and go so that reading them is O(1).
    """

    __slots__ = ("buckets", "calls", "count", "last", "retries", "settings", "width")

    def __init__(self, settings: BudgetSettings) -> None:
        self.settings = settings
        self.count, self.width = window_buckets(settings.window_s)
        # Bounded by construction (expired buckets go before a new one comes);
        # maxlen only backs that up.
        self.buckets: deque[list[int]] = deque(maxlen=self.count)
        self.calls = 0
        self.retries = 0
        #: The newest bucket index seen, so that counting never runs back in time.
        self.last: int | None = None

    def advance(self, now: float) -> int:
        """Drop the buckets that left the window at ``now``; the current bucket's index."""
        last = self.last
        position = now / self.width
        if not math.isfinite(position):
            index = 0 if last is None else last  # a clock near float's limit: stand still
        else:
            index = math.floor(position)
            if last is not None and index < last:
                index = last  # the clock went back: count in the newest bucket, expire nothing
        self.last = index
        buckets = self.buckets
        horizon = index - self.count
        while buckets and buckets[0][0] <= horizon:
            _, calls, retries = buckets.popleft()
            self.calls -= calls
            self.retries -= retries
        return index

    def current(self, index: int) -> list[int]:
        buckets = self.buckets
        if buckets and buckets[-1][0] == index:
            return buckets[-1]
        bucket = [index, 0, 0]
        buckets.append(bucket)
        return bucket

    def limit(self) -> float:
        settings = self.settings
        return max(float(settings.min_retries), settings.ratio * self.calls)


class RetryBudget:
    """Envoy-style retry budgets, one sliding window per dependency.

    Lifecycle: a dependency gets a window on its first ``record_call`` (or its
    first allowed ``try_spend``). ``record_call`` counts each observed call of
    it; ``try_spend`` is asked before each retry and counts the retry only when
    ``retries < max(min_retries, ratio * calls)`` over the window. Counts leave
    the window with their bucket: between ``window_s`` and
    ``window_s * 9/10`` seconds after they were made (buckets are
    ``window_s`` / 10..60 wide, at most 60 of them per dependency).

    Bounded: at most ``max_dependencies`` windows; a new dependency beyond that
    evicts the least recently used one (counted in ``evictions``), which starts
    afresh if it comes back.

    A clock that goes backwards counts in the newest bucket and expires nothing
    until it catches up; a non-finite reading is replaced by the last finite one.

    ``settings`` is one ``BudgetSettings`` for every dependency, or a function of
    the dependency read when its window is created.

    With a ``shared`` :class:`~policies._window_counter.WindowCounter` the
    budget is a fleet's: ``record_call`` also hands the calls to it (sent with
    this sidecar's next retry of the dependency, so a success never waits on
    the network) and ``try_spend`` asks it, atomically for the fleet. When it
    has no answer (Redis away) this budget's own window decides; it counts
    every call and every retry allowed either way, so it is ready. A sidecar
    whose calls of a dependency were never followed by a retry of it has not
    told the fleet of them: the fleet's budget is then stricter, never looser.

    Thread-safety: meant for one thread (the sidecar's event loop); every method
    holds a lock all the same.
    """

    def __init__(
        self,
        settings: BudgetSettings | Callable[[str], BudgetSettings] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_dependencies: int = 10_000,
        shared: WindowCounter | None = None,
    ) -> None:
        if not isinstance(max_dependencies, int) or max_dependencies < 1:
            raise ValueError(f"max_dependencies must be at least 1, got {max_dependencies!r}")
        if settings is None:
            settings = BudgetSettings()
        if isinstance(settings, BudgetSettings):
            fixed = settings
            # object: a caller's callable may return anything; the check below says what.
            self._settings_for: Callable[[str], object] = lambda _dependency: fixed
        else:
            self._settings_for = settings
        self._clock = clock
        self._shared = shared
        #: The fleet's counts at the last retry it decided (what ``snapshot`` shows for it).
        self._fleet: BudgetSnapshot | None = None
        self._lock = threading.Lock()
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._last_now = 0.0
        self.max_dependencies = max_dependencies
        #: Windows evicted to make room (least recently used first).
        self.evictions = 0
        #: Retries refused by ``try_spend``.
        self.denied = 0

    def __len__(self) -> int:
        return len(self._windows)

    def record_call(self, dependency: str, count: int = 1) -> None:
        """Count ``count`` observed calls of ``dependency`` (successes or failures).

        A batch of spans is counted per dependency in one call: the budget
        needs how many calls, not their order.
        """
        if count < 1:
            return
        with self._lock:
            now = self._now()
            window = self._windows.get(dependency)
            if window is None:
                window = self._create(dependency)
            else:
                self._windows.move_to_end(dependency)
            bucket = window.current(window.advance(now))
            bucket[1] += count
            window.calls += count
        if self._shared is not None:
            self._shared.add(_calls_key(dependency), window.settings.window_s, count)

    def try_spend(self, dependency: str) -> bool:
        """Whether one more retry of ``dependency`` fits its budget; counts it if so."""
        if self._shared is not None:
            allowed = self._try_shared(self._shared, dependency)
            if allowed is not None:
                return allowed
        with self._lock:
            now = self._now()
            window = self._windows.get(dependency)
            if window is None:
                settings = self._settings(dependency)
                if settings.min_retries < 1:
                    # No calls and no floor: denied, and no window made just to say so.
                    self.denied += 1
                    return False
                window = self._create(dependency, settings)
            else:
                self._windows.move_to_end(dependency)
            index = window.advance(now)
            if window.retries >= window.limit():
                self.denied += 1
                return False
            window.current(index)[2] += 1
            window.retries += 1
            return True

    def _try_shared(self, shared: WindowCounter, dependency: str) -> bool | None:
        """The fleet's answer (None: none now); an allowed retry is counted here too."""
        with self._lock:
            window = self._windows.get(dependency)
            settings = window.settings if window is not None else self._settings(dependency)
        limit = Limit(settings.min_retries, settings.ratio, of=_calls_key(dependency))
        answer = shared.admit(f"budget:retries:{dependency}", settings.window_s, limit)
        with self._lock:
            if answer is None:
                self._fleet = None
                return None
            ceiling = max(float(settings.min_retries), settings.ratio * answer.of)
            self._fleet = BudgetSnapshot(
                dependency, answer.of, answer.count, ceiling, answer.count < ceiling
            )
            if not answer.allowed:
                self.denied += 1
                return False
            now = self._now()
            window = self._windows.get(dependency)
            if window is None:
                window = self._create(dependency, settings)
            else:
                self._windows.move_to_end(dependency)
            window.current(window.advance(now))[2] += 1
            window.retries += 1
        return True

    def snapshot(self, dependency: str) -> BudgetSnapshot:
        """``dependency``'s counts now (does not change recency or create a window).

        The fleet's, as of its answer, when the last retry asked about was this
        dependency's and the fleet decided it; this sidecar's otherwise.
        """
        with self._lock:
            fleet = self._fleet
            if fleet is not None and fleet.dependency == dependency:
                return fleet
            now = self._now()
            window = self._windows.get(dependency)
            if window is None:
                floor = float(self._settings(dependency).min_retries)
                return BudgetSnapshot(dependency, 0, 0, floor, floor > 0)
            window.advance(now)
            limit = window.limit()
            return BudgetSnapshot(
                dependency, window.calls, window.retries, limit, window.retries < limit
            )

    def _now(self) -> float:
        now = self._clock()
        if math.isfinite(now):
            self._last_now = now
        return self._last_now

    def _settings(self, dependency: str) -> BudgetSettings:
        settings = self._settings_for(dependency)
        if not isinstance(settings, BudgetSettings):
            raise TypeError(f"settings for {dependency!r} must be BudgetSettings, got {settings!r}")
        return settings

    def _create(self, dependency: str, settings: BudgetSettings | None = None) -> _Window:
        window = _Window(settings or self._settings(dependency))
        windows = self._windows
        windows[dependency] = window
        if len(windows) > self.max_dependencies:
            windows.popitem(last=False)
            self.evictions += 1
        return window


def _calls_key(dependency: str) -> str:
    """The fleet's key for a dependency's calls (the limit of its retries is a ratio of them)."""
    return f"budget:calls:{dependency}"
