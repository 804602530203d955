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

In a fleet (a shared :class:`~policies._window_counter.WindowCounter`), the
window is the fleet's: each batch's failures of a dependency are counted in
it, one round trip per dependency that failed in the batch, and the episode
is reported once for the fleet, by the sidecar whose failure completes the
picture (the others see it going on). Successes never wait on the network:
they are handed to the counter, which sends them with this sidecar's next
failure of the same dependency (so a sidecar that only sees successes of
it does not lower the fleet's error rate). A failing span re-sent to another sidecar counts there
again. When the counter has no answer (Redis away), this sidecar's own
window decides, as without a fleet; it keeps counting either way.

Lifecycle: ``observe`` per batch with the batch's calls and failures (the
governor's thread); ``cascades`` drains what started. Bounded: at most
``max_dependencies`` windows (least recently used evicted, counted) and
``MAX_RUNS_LISTED`` run ids per episode. Injectable clock.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies._window_counter import CascadeTally, WindowCounter, cascade_calls
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
    #: Oldest first: (time, 0, run id, failing span) per failed call, and
    #: (time, n, "", "") for the n successful calls of one batch. One entry per
    #: batch, not per call: a busy dependency succeeds hundreds of times a batch.
    calls: deque[tuple[float, int, str, str]] = field(default_factory=deque)
    #: Calls in the window: the failures and every entry's successes.
    total: int = 0
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
        shared: WindowCounter | None = None,
    ) -> None:
        self.settings = settings or CascadeSettings()
        self._clock = clock
        self._shared = shared
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
        #: dependency -> its failures counted in this batch, and their runs.
        counted: dict[str, list[str]] = {}
        for failure in failures:
            if not failure.dependency:
                continue
            key = failure.breaker_key  # counted as its breaker counts it (calls are so keyed)
            window = self._window(key)
            span = failure.trace_id + failure.span_id
            if span in window.spans:
                continue  # the same failing span again: an exporter re-sent it
            window.spans.add(span)
            window.calls.append((now, 0, failure.run_id, span))
            window.failures += 1
            window.total += 1
            self._trim(window)
            touched[key] = failure
            counted.setdefault(key, []).append(failure.run_id)
        shared = self._shared
        for dependency, last in touched.items():
            window = self._windows[dependency]
            if shared is not None:
                runs = counted[dependency]
                tally = shared.tally(
                    dependency,
                    settings.window_s,
                    len(runs),
                    tuple(dict.fromkeys(run for run in runs if run)),
                    settings.min_failures / 2,
                )
                if tally is not None:
                    self._check_fleet(shared, dependency, window, last, tally)
                    continue
            self._check(dependency, window, last, now)  # alone, or the fleet cannot say

    def cascades(self) -> list[Cascade]:
        """The episodes that started since the last call."""
        started, self._started = self._started, []
        return started

    def _count_successes(self, successes: Sequence[str], now: float | None = None) -> None:
        windows = self._windows
        shared = self._shared
        if not successes or (not windows and shared is None):
            return
        stamp = self._clock() if now is None else now
        for dependency, count in Counter(successes).items():
            if shared is not None:  # sent with this sidecar's next failure of it
                shared.add(cascade_calls(dependency), self.settings.window_s, count)
            window = windows.get(dependency)  # only dependencies that failed lately
            if window is not None:
                window.calls.append((stamp, count, "", ""))
                window.total += count
                self._trim(window)

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
        return window

    def _trim(self, window: _Window) -> None:
        """Forget the oldest calls beyond ``max_calls`` (part of a batch's successes, if so)."""
        excess = window.total - self.max_calls
        while excess > 0:
            stamp, successes, run, span = window.calls[0]
            if successes > excess:
                window.calls[0] = (stamp, successes - excess, run, span)
                window.total -= excess
                return
            self._drop_oldest(window)
            excess = window.total - self.max_calls

    @staticmethod
    def _drop_oldest(window: _Window) -> None:
        _, successes, _, span = window.calls.popleft()
        if successes:
            window.total -= successes
        else:
            window.total -= 1
            window.failures -= 1
            window.spans.discard(span)

    def _check_fleet(
        self,
        shared: WindowCounter,
        dependency: str,
        window: _Window,
        last: Failure,
        tally: CascadeTally,
    ) -> None:
        """``_check`` on the fleet's window; the episode is reported by one sidecar."""
        settings = self.settings
        if tally.ended or tally.ongoing:
            window.active = tally.ongoing  # also what this window says if Redis goes away
            return
        failures, calls = tally.failures, tally.calls
        if failures < settings.min_failures or calls == 0 or tally.runs < settings.min_runs:
            return
        rate = failures / calls
        if rate < settings.min_error_rate:
            return
        window.active = True
        runs = shared.claim(dependency, settings.window_s)
        if runs is None:
            return  # another sidecar reported it first
        if not runs:  # the counter could not say: the runs this sidecar saw
            runs = tuple(
                dict.fromkeys(r for _, successes, r, _ in window.calls if not successes and r)
            )
        self._started.append(
            Cascade(
                dependency=dependency,
                failures=failures,
                calls=calls,
                error_rate=rate,
                runs=runs[:MAX_RUNS_LISTED],
                trigger=last,
            )
        )

    def _check(self, dependency: str, window: _Window, last: Failure, now: float) -> None:
        settings = self.settings
        horizon = now - settings.window_s
        while window.calls and window.calls[0][0] < horizon:
            self._drop_oldest(window)
        calls = window.total
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
        runs = list(
            dict.fromkeys(run for _, successes, run, _ in window.calls if not successes and run)
        )
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
