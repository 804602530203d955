"""Restart intensity, as Erlang's supervisors: at most MaxR actions in MaxT seconds per key.

Retries, fallbacks and pauses each look reasonable on their own; a step that
needs one after another is not recovering, and the next corrective action
should be an escalation. ``allow(key)`` is asked before each corrective
action: it says no once the key has had ``max_actions`` of them within the
last ``period_s`` seconds.

The key is the caller's: the governor asks per run and dependency (the step
that keeps failing), so independent faults spread over a long run's many calls
never add up to an escalation; the remediation gateway asks per run before it
restarts a worker.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from policies._window_counter import Limit, WindowCounter

__all__ = ["IntensitySettings", "RestartIntensity"]

#: Upper bounds of a policy's settings.
MAX_ACTIONS: Final = 10_000
MAX_PERIOD_S: Final = 86_400.0


@dataclass(frozen=True, slots=True)
class IntensitySettings:
    """At most ``max_actions`` corrective actions per run within ``period_s`` seconds.

    ``max_actions`` 0 escalates every action (Erlang's intensity 0).
    """

    max_actions: int = 10
    period_s: float = 60.0

    def __post_init__(self) -> None:
        value = self.max_actions
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"max_actions must be an integer, got {value!r}")
        if not 0 <= value <= MAX_ACTIONS:
            raise ValueError(f"max_actions must be between 0 and {MAX_ACTIONS}, got {value}")
        period = self.period_s
        if not isinstance(period, (int, float)) or isinstance(period, bool):
            raise ValueError(f"period_s must be a number of seconds, got {period!r}")
        if not math.isfinite(period) or not 0 < period <= MAX_PERIOD_S:
            raise ValueError(
                f"period_s must be more than 0 and at most {MAX_PERIOD_S:g} seconds, got {period}"
            )


class RestartIntensity:
    """Erlang-style restart intensity, per run.

    Lifecycle: a run gets a history on its first allowed action. Each
    ``allow(run_id)`` is one corrective action at ``clock()``: allowed, and
    recorded, when the run has had fewer than ``max_actions`` allowed actions
    in the last ``period_s`` seconds, both ends included (an action exactly
    ``period_s`` ago still counts, as Erlang's ``Now =< Then + Period``);
    otherwise denied and not recorded, so that escalating it does not count
    against the run a second time. ``forget(run_id)`` drops a finished run.

    Bounded: at most ``max_actions`` timestamps per run, at most ``max_runs``
    runs; a new run beyond that evicts the least recently active one (counted
    in ``evictions``), which starts afresh if it comes back.

    A clock that goes backwards stamps the action at the run's newest time (the
    history stays ordered, and nothing expires early); a non-finite reading is
    replaced by the last finite one.

    With a ``shared`` :class:`~policies._window_counter.WindowCounter` the
    count is a fleet's (every sidecar that sees the run's failures): ``allow``
    asks it, one round trip, atomic for the fleet; its window is bucketed, so
    an action leaves it between ``period_s`` and 1/10 of it earlier (at most
    60 buckets), where this one's is exact. When it has no answer (Redis
    away) this history decides; it records every action allowed either way.

    Thread-safety: meant for one thread (the sidecar's event loop); every method
    holds a lock all the same.
    """

    def __init__(
        self,
        settings: IntensitySettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_runs: int = 10_000,
        shared: WindowCounter | None = None,
    ) -> None:
        if not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs!r}")
        self.settings = settings or IntensitySettings()
        self.max_runs = max_runs
        self._clock = clock
        self._shared = shared
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, deque[float]] = OrderedDict()
        self._last_now = 0.0
        #: Runs evicted to make room (least recently active first).
        self.evictions = 0
        #: Actions refused (to be escalated instead).
        self.denied = 0

    def __len__(self) -> int:
        return len(self._runs)

    def allow(self, run_id: str) -> bool:
        """Record one corrective action for ``run_id``; False when it exceeds the intensity."""
        settings = self.settings
        fleet: bool | None = None  # the fleet's answer, when it has one
        if self._shared is not None:
            answer = self._shared.admit(
                f"intensity:{run_id}", settings.period_s, Limit(settings.max_actions)
            )
            fleet = None if answer is None else answer.allowed
        with self._lock:
            if fleet is False:
                self.denied += 1
                return False
            now = self._now()
            runs = self._runs
            stamps = runs.get(run_id)
            if stamps is None:
                if settings.max_actions == 0:
                    self.denied += 1
                    return False
                stamps = runs[run_id] = deque(maxlen=settings.max_actions)
                if len(runs) > self.max_runs:
                    runs.popitem(last=False)
                    self.evictions += 1
            else:
                runs.move_to_end(run_id)
                now = self._expire(stamps, now)
            if fleet is None and len(stamps) >= settings.max_actions:
                self.denied += 1
                return False
            stamps.append(now)
            return True

    def actions(self, run_id: str) -> int:
        """How many actions of ``run_id`` count against it now (does not change recency)."""
        with self._lock:
            stamps = self._runs.get(run_id)
            if stamps is None:
                return 0
            self._expire(stamps, self._now())
            return len(stamps)

    def forget(self, run_id: str) -> None:
        """Drop ``run_id``'s history (the run is over); a fleet's expires with its period."""
        with self._lock:
            self._runs.pop(run_id, None)

    def _now(self) -> float:
        now = self._clock()
        if math.isfinite(now):
            self._last_now = now
        return self._last_now

    def _expire(self, stamps: deque[float], now: float) -> float:
        """Drop the actions older than the period; ``now``, never before the newest action."""
        if stamps and now < stamps[-1]:
            now = stamps[-1]
        horizon = now - self.settings.period_s
        while stamps and stamps[0] < horizon:
            stamps.popleft()
        return now
