"""Cascades: one dependency failing across many runs at once, reported once.

When a provider goes down, every run calling it fails; reporting each run's
failure is right (each run needs a decision), but the operator needs one
incident that says "openai:gpt-4o is failing for 14 runs" and the breaker
should open for all of them before each run's own failures would open it.

A dependency is in a cascade when, within the last ``window_s``, it had at
least ``min_failures`` failed calls from at least ``min_runs`` runs and its
error rate (failures over calls) is at least ``min_error_rate``. The episode
is reported once, when it starts; it ends when the window holds fewer than
half the failures (hysteresis), and a later one is reported again.

Lifecycle: ``observe`` per batch with the batch's calls and failures (the
governor's thread); ``cascades`` drains what started. Bounded: at most
``max_dependencies`` windows (least recently used evicted, counted) and
``MAX_RUNS_LISTED`` run ids per episode. Injectable clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from supervisor.records import Failure

__all__ = ["Cascade", "CascadeDetector", "CascadeSettings"]

MAX_RUNS_LISTED = 50


@dataclass(frozen=True, slots=True)
class CascadeSettings:
    enabled: bool = True
    window_s: float = 60.0
    min_failures: int = 10
    min_runs: int = 3
    min_error_rate: float = 0.5


@dataclass(frozen=True, slots=True)
class Cascade:
    """An episode that started: the last failure seen, and the runs it hit."""

    dependency: str
    failures: int
    calls: int
    error_rate: float
    runs: tuple[str, ...]
    #: The failure that completed the picture: where the incident is reported.
    trigger: Failure


@dataclass
class _Window:
    #: (time, ok, run id or "", failing span or "") per call, oldest first
    calls: deque[tuple[float, bool, str, str]] = field(default_factory=deque)
    failures: int = 0
    active: bool = False
    #: The failing spans in the window: a span judged again (re-sent) counts once.
    spans: set[str] = field(default_factory=set)


class CascadeDetector:
    """Per-dependency sliding windows of call outcomes; see the module docstring."""

    def __init__(
        self,
        settings: CascadeSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_dependencies: int = 1024,
        max_calls: int = 10_000,
    ) -> None:
        self.settings = settings or CascadeSettings()
        self._clock = clock
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._started: list[Cascade] = []
        self.max_dependencies = max_dependencies
        self.max_calls = max_calls
        self.evictions = 0

    def observe(self, successes: Sequence[str], failures: Sequence[Failure]) -> None:
        """A batch's successful calls (their dependencies) and its failures."""
        settings = self.settings
        if not settings.enabled or not failures:
            if settings.enabled:
                self._count_successes(successes)
            return
        now = self._clock()
        self._count_successes(successes, now)
        touched: dict[str, Failure] = {}
        for failure in failures:
            if not failure.dependency:
                continue
            window = self._window(failure.dependency)
            span = failure.trace_id + failure.span_id
            if span in window.spans:
                continue  # the same failing span again: an exporter re-sent it
            window.spans.add(span)
            window.calls.append((now, False, failure.run_id, span))
            window.failures += 1
            touched[failure.dependency] = failure
        for dependency, last in touched.items():
            self._check(dependency, self._windows[dependency], last, now)

    def cascades(self) -> list[Cascade]:
        """The episodes that started since the last call."""
        started, self._started = self._started, []
        return started

    def _count_successes(self, successes: Sequence[str], now: float | None = None) -> None:
        windows = self._windows
        if not windows:
            return
        stamp = self._clock() if now is None else now
        for dependency in successes:
            window = windows.get(dependency)  # only dependencies that failed lately
            if window is not None:
                window.calls.append((stamp, True, "", ""))
                if len(window.calls) > self.max_calls:
                    self._drop_oldest(window)

    def _window(self, dependency: str) -> _Window:
        windows = self._windows
        window = windows.get(dependency)
        if window is None:
            while len(windows) >= self.max_dependencies:
                windows.popitem(last=False)
                self.evictions += 1
            window = windows[dependency] = _Window()
        else:
            windows.move_to_end(dependency)
        if len(window.calls) > self.max_calls:
            self._drop_oldest(window)
        return window

    @staticmethod
    def _drop_oldest(window: _Window) -> None:
        _, ok, _, span = window.calls.popleft()
        if not ok:
            window.failures -= 1
            window.spans.discard(span)

    def _check(self, dependency: str, window: _Window, last: Failure, now: float) -> None:
        settings = self.settings
        horizon = now - settings.window_s
        while window.calls and window.calls[0][0] < horizon:
            self._drop_oldest(window)
        calls = len(window.calls)
        failures = window.failures
        if window.active:
            if failures < settings.min_failures / 2:
                window.active = False  # the episode is over; a later one is reported again
            return
        if failures < settings.min_failures or calls == 0:
            return
        rate = failures / calls
        if rate < settings.min_error_rate:
            return
        runs = list(dict.fromkeys(run for _, ok, run, _ in window.calls if not ok and run))
        if len(runs) < settings.min_runs:
            return
        window.active = True
        self._started.append(
            Cascade(
                dependency=dependency,
                failures=failures,
                calls=calls,
                error_rate=rate,
                runs=tuple(runs[:MAX_RUNS_LISTED]),
                trigger=last,
            )
        )
