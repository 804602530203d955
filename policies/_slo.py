"""Run SLOs per service: success, duration and cost over two sliding windows.

Finished runs roll up into a success rate, a duration and a cost per run over
a short and a long sliding window, with error-budget burn rates and the
multi-window fast-burn rule of SRE practice (:class:`SloTracker`,
:class:`SloStatus`; the rule itself is documented on
:class:`policies._schema_budgets.SloSpec`). Callers pass run outcomes and the
sidecar's own clock; nothing here knows about spans.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from policies._schema_budgets import MAX_SLO_WINDOW_S, SloSpec

__all__ = ["DURATION_ACCURACY", "SLO_BUCKETS", "SloStatus", "SloTracker"]

#: A window is cut into this many buckets: a run leaves the window between
#: ``window_s * (1 - 1/SLO_BUCKETS)`` and ``window_s`` seconds after it was recorded.
SLO_BUCKETS = 60

#: Durations are kept in log-spaced bins (as DDSketch): a percentile read back is
#: within ``DURATION_ACCURACY`` (relative) of the recorded duration it stands for.
DURATION_ACCURACY = 0.01
_GAMMA = (1 + DURATION_ACCURACY) / (1 - DURATION_ACCURACY)
_LOG_GAMMA = math.log(_GAMMA)
#: Durations below this are recorded as 0; above MAX_SLO_WINDOW_S, as that.
_MIN_DURATION_S = 1e-3
_ZERO_KEY = -(1 << 30)


def _duration_key(duration_s: float | None) -> int | None:
    if duration_s is None or not isinstance(duration_s, (int, float)):
        return None
    if not math.isfinite(duration_s) or duration_s < 0:
        return None
    if duration_s < _MIN_DURATION_S:
        return _ZERO_KEY
    return math.ceil(math.log(min(duration_s, MAX_SLO_WINDOW_S)) / _LOG_GAMMA)


def _duration_value(key: int) -> float:
    if key == _ZERO_KEY:
        return 0.0
    return 2.0 * _GAMMA**key / (_GAMMA + 1.0)


class _Bucket:
    __slots__ = ("bad", "cost", "costly", "durations", "failed", "index", "priced", "runs", "slow")

    def __init__(self, index: int) -> None:
        self.index = index
        self.runs = 0
        self.bad = 0
        self.failed = 0
        self.slow = 0
        self.costly = 0
        self.priced = 0
        self.cost = 0.0
        self.durations: dict[int, int] = {}


class _Window:
    """Bucketed run counts of one service's last ``window_s`` seconds.

    ``buckets`` holds the buckets that saw a run, oldest first (at most
    ``SLO_BUCKETS``); the integer totals are kept as buckets come and go, so
    the burn rate is O(1). ``detailed`` windows also keep the breakdown, the
    costs and a duration histogram (the long window does, the short one only
    counts).
    """

    __slots__ = (
        "bad",
        "buckets",
        "costly",
        "detailed",
        "durations",
        "failed",
        "last",
        "priced",
        "runs",
        "slow",
        "width",
    )

    def __init__(self, window_s: float, *, detailed: bool) -> None:
        self.width = window_s / SLO_BUCKETS
        self.detailed = detailed
        self.buckets: deque[_Bucket] = deque(maxlen=SLO_BUCKETS)
        self.last: int | None = None
        self.runs = 0
        self.bad = 0
        self.failed = 0
        self.slow = 0
        self.costly = 0
        self.priced = 0
        self.durations: dict[int, int] = {}

    def advance(self, now: float) -> int:
        """Drop the buckets that left the window at ``now``; the current bucket's index."""
        last = self.last
        position = now / self.width
        if not math.isfinite(position):
            index = 0 if last is None else last
        else:
            index = math.floor(position)
            if last is not None and index < last:
                index = last  # the clock went back: count in the newest bucket
        self.last = index
        buckets = self.buckets
        horizon = index - SLO_BUCKETS
        while buckets and buckets[0].index <= horizon:
            self._drop(buckets.popleft())
        return index

    def _drop(self, bucket: _Bucket) -> None:
        self.runs -= bucket.runs
        self.bad -= bucket.bad
        self.failed -= bucket.failed
        self.slow -= bucket.slow
        self.costly -= bucket.costly
        self.priced -= bucket.priced
        durations = self.durations
        for key, count in bucket.durations.items():
            left = durations[key] - count
            if left:
                durations[key] = left
            else:
                del durations[key]

    def add(
        self,
        index: int,
        *,
        failed: bool,
        slow: bool,
        costly: bool,
        cost_usd: float | None,
        duration_key: int | None,
    ) -> None:
        buckets = self.buckets
        if buckets and buckets[-1].index == index:
            bucket = buckets[-1]
        else:
            bucket = _Bucket(index)
            buckets.append(bucket)
        bad = failed or slow or costly
        bucket.runs += 1
        self.runs += 1
        bucket.bad += bad
        self.bad += bad
        if not self.detailed:
            return
        bucket.failed += failed
        self.failed += failed
        bucket.slow += slow
        self.slow += slow
        bucket.costly += costly
        self.costly += costly
        if cost_usd is not None:
            bucket.priced += 1
            self.priced += 1
            bucket.cost += cost_usd
        if duration_key is not None:
            bucket.durations[duration_key] = bucket.durations.get(duration_key, 0) + 1
            self.durations[duration_key] = self.durations.get(duration_key, 0) + 1

    def burn(self, target: float) -> float:
        if self.runs == 0:
            return 0.0
        return (self.bad / self.runs) / (1.0 - target)

    def success(self) -> float | None:
        return None if self.runs == 0 else (self.runs - self.bad) / self.runs

    def mean_cost(self) -> float | None:
        if self.priced == 0:
            return None
        return math.fsum(bucket.cost for bucket in self.buckets) / self.priced

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile of the recorded durations (within DURATION_ACCURACY)."""
        durations = self.durations
        total = sum(durations.values())
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0
        for key in sorted(durations):
            seen += durations[key]
            if seen >= rank:
                return _duration_value(key)
        return _duration_value(max(durations))  # not reached: seen ends at total


@dataclass(frozen=True, slots=True)
class SloStatus:
    """A service's SLO now, over the short and the long window.

    Success rates are the share of good runs (None with no runs); burn rates
    are ``(1 - success) / (1 - target)`` (0 with no runs). ``fast_burn`` is the
    multi-window rule: both burn rates above ``burn_alert`` and at least
    ``min_runs`` runs in the long window. The breakdown of bad runs, the
    duration percentiles and the mean cost are over the long window; durations
    are within 1 % of the recorded ones (log-spaced bins), and the mean cost is
    over the runs whose cost was known (``priced_runs``).
    """

    service: str
    success_target: float
    burn_alert: float
    short_window_s: float
    long_window_s: float
    runs_short: int
    runs_long: int
    bad_short: int
    bad_long: int
    success_rate_short: float | None
    success_rate_long: float | None
    burn_rate_short: float
    burn_rate_long: float
    fast_burn: bool
    #: Of the long window's bad runs: failed, too slow, too costly (a run may be several).
    failed_long: int
    slow_long: int
    costly_long: int
    duration_p50_s: float | None
    duration_p95_s: float | None
    mean_cost_usd: float | None
    priced_runs: int

    def to_json(self) -> dict[str, object]:
        """For the API and ``spanvisor runs``: plain JSON values, rates rounded."""

        def rounded(value: float | None, digits: int = 6) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "service": self.service,
            "success_target": self.success_target,
            "burn_alert": self.burn_alert,
            "windows_s": {"short": self.short_window_s, "long": self.long_window_s},
            "runs": {"short": self.runs_short, "long": self.runs_long},
            "bad_runs": {"short": self.bad_short, "long": self.bad_long},
            "success_rate": {
                "short": rounded(self.success_rate_short),
                "long": rounded(self.success_rate_long),
            },
            "burn_rate": {
                "short": rounded(self.burn_rate_short, 4),
                "long": rounded(self.burn_rate_long, 4),
            },
            "fast_burn": self.fast_burn,
            "bad_long": {
                "failed": self.failed_long,
                "slow": self.slow_long,
                "costly": self.costly_long,
            },
            "duration_s": {
                "p50": rounded(self.duration_p50_s, 3),
                "p95": rounded(self.duration_p95_s, 3),
            },
            "mean_cost_usd": rounded(self.mean_cost_usd),
            "priced_runs": self.priced_runs,
        }


class _Service:
    __slots__ = ("long", "short", "spec")

    def __init__(self, spec: SloSpec) -> None:
        self.spec = spec
        self.short = _Window(spec.short_window_s, detailed=False)
        self.long = _Window(spec.long_window_s, detailed=True)


class SloTracker:
    """Run SLOs per service over two sliding windows, with multi-window burn alerts.

    Lifecycle: a service gets its windows on its first ``record_run`` (a
    finished run: succeeded or not, how long it took, what it cost).
    ``status`` and ``burning`` read a service at ``now`` without changing its
    recency or creating it (an unknown service has no runs and does not burn).
    Runs leave each window with their bucket, between ``window_s * 59/60`` and
    ``window_s`` seconds after they were recorded (``SLO_BUCKETS`` buckets per
    window, buckets without runs take no room).

    Time: every method takes ``now`` (seconds, one time base for all calls),
    defaulting to ``clock()``. Use the sidecar's own clock, not span
    timestamps, which come from the agents' clocks. A ``now`` that goes
    backwards counts in the newest bucket and expires nothing until time
    catches up; a non-finite one is replaced by the last finite one.

    Bounded: at most ``max_services`` services; a new one beyond that evicts
    the least recently recorded one (counted in ``evictions``), which starts
    afresh if it comes back.

    ``spec`` is one ``SloSpec`` for every service, or a function of the
    service read when its windows are created. ``set_spec`` (a policy reload)
    keeps the history of a service whose window lengths did not change and
    starts the others afresh.

    Thread-safety: meant for one thread; every method holds a lock all the same.
    """

    def __init__(
        self,
        spec: SloSpec | Callable[[str], SloSpec] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_services: int = 1000,
    ) -> None:
        if not isinstance(max_services, int) or max_services < 1:
            raise ValueError(f"max_services must be at least 1, got {max_services!r}")
        self._spec_for = self._resolver(spec)
        self._clock = clock
        self.max_services = max_services
        self._services: OrderedDict[str, _Service] = OrderedDict()
        self._lock = threading.Lock()
        self._last_now = 0.0
        #: Services evicted to make room (least recently recorded first).
        self.evictions = 0
        #: Services whose history a ``set_spec`` dropped (their windows changed length).
        self.resets = 0

    def __len__(self) -> int:
        return len(self._services)

    def services(self) -> list[str]:
        """The services tracked, least recently recorded first."""
        with self._lock:
            return list(self._services)

    def set_spec(self, spec: SloSpec | Callable[[str], SloSpec] | None) -> None:
        """Use ``spec`` from now on (a policy reload); see the class docstring."""
        resolver = self._resolver(spec)
        with self._lock:
            self._spec_for = resolver
            for name, service in list(self._services.items()):
                new = self._spec(name)
                old = service.spec
                if (new.short_window_s, new.long_window_s) == (
                    old.short_window_s,
                    old.long_window_s,
                ):
                    service.spec = new
                else:
                    self._services[name] = _Service(new)
                    self.resets += 1

    def record_run(
        self,
        service: str,
        ok: bool,
        duration_s: float | None,
        cost_usd: float | None,
        now: float | None = None,
    ) -> None:
        """Count one finished run of ``service``.

        ``ok``: the run succeeded. ``duration_s`` (None when unknown) and
        ``cost_usd`` (None when unknown or partial) feed the percentiles and
        the mean cost, and make the run bad when above the spec's limits.
        """
        with self._lock:
            moment = self._now(now)
            entry = self._services.get(service)
            if entry is None:
                entry = self._services[service] = _Service(self._spec(service))
                if len(self._services) > self.max_services:
                    self._services.popitem(last=False)
                    self.evictions += 1
            else:
                self._services.move_to_end(service)
            spec = entry.spec
            duration_key = _duration_key(duration_s)
            if cost_usd is not None and not (
                isinstance(cost_usd, (int, float)) and math.isfinite(cost_usd) and cost_usd >= 0
            ):
                cost_usd = None
            slow = (
                spec.max_duration_s is not None
                and duration_key is not None
                and duration_s is not None  # for mypy: a key means a finite duration
                and duration_s > spec.max_duration_s
            )
            costly = (
                spec.max_cost_usd_per_run is not None
                and cost_usd is not None
                and cost_usd > spec.max_cost_usd_per_run
            )
            for window in (entry.short, entry.long):
                window.add(
                    window.advance(moment),
                    failed=not ok,
                    slow=slow,
                    costly=costly,
                    cost_usd=cost_usd,
                    duration_key=duration_key,
                )

    def status(self, service: str, now: float | None = None) -> SloStatus:
        """``service``'s SLO at ``now`` (does not change recency or create it)."""
        with self._lock:
            moment = self._now(now)
            entry = self._services.get(service)
            if entry is None:
                spec = self._spec(service)
                short = _Window(spec.short_window_s, detailed=False)
                long = _Window(spec.long_window_s, detailed=True)
            else:
                spec, short, long = entry.spec, entry.short, entry.long
                short.advance(moment)
                long.advance(moment)
            target = spec.success_target
            burn_short, burn_long = short.burn(target), long.burn(target)
            return SloStatus(
                service=service,
                success_target=target,
                burn_alert=spec.burn_alert,
                short_window_s=spec.short_window_s,
                long_window_s=spec.long_window_s,
                runs_short=short.runs,
                runs_long=long.runs,
                bad_short=short.bad,
                bad_long=long.bad,
                success_rate_short=short.success(),
                success_rate_long=long.success(),
                burn_rate_short=burn_short,
                burn_rate_long=burn_long,
                fast_burn=self._fast(spec, short, long),
                failed_long=long.failed,
                slow_long=long.slow,
                costly_long=long.costly,
                duration_p50_s=long.percentile(0.5),
                duration_p95_s=long.percentile(0.95),
                mean_cost_usd=long.mean_cost(),
                priced_runs=long.priced,
            )

    def burning(self, service: str, now: float | None = None) -> bool:
        """Whether ``service`` burns its error budget fast now (a policy condition; O(1))."""
        with self._lock:
            moment = self._now(now)
            entry = self._services.get(service)
            if entry is None:
                return False
            entry.short.advance(moment)
            entry.long.advance(moment)
            return self._fast(entry.spec, entry.short, entry.long)

    @staticmethod
    def _fast(spec: SloSpec, short: _Window, long: _Window) -> bool:
        if long.runs < spec.min_runs:
            return False
        target = spec.success_target
        return short.burn(target) > spec.burn_alert and long.burn(target) > spec.burn_alert

    @staticmethod
    def _resolver(spec: SloSpec | Callable[[str], SloSpec] | None) -> Callable[[str], SloSpec]:
        if spec is None:
            spec = SloSpec()
        if isinstance(spec, SloSpec):
            fixed = spec
            return lambda _service: fixed
        return spec

    def _spec(self, service: str) -> SloSpec:
        spec = self._spec_for(service)
        if not isinstance(spec, SloSpec):
            raise TypeError(f"SLO spec for {service!r} must be SloSpec, got {spec!r}")
        return spec

    def _now(self, now: float | None) -> float:
        value = self._clock() if now is None else now
        if isinstance(value, (int, float)) and math.isfinite(value):
            self._last_now = float(value)
        return self._last_now
