"""Context pressure, run budgets and per-service SLOs: the long-horizon money and time checks.

Three detectors share one model table (``model_tables.yaml``, overridable per
policy), which gives a model's context window and its price per million input
and output tokens:

- **Context pressure**: an LLM call whose input tokens reach ``share`` of the
  model's window predicts a ``model / context_overflow`` before the provider
  refuses the next, longer call (:func:`context_pressure`).
- **Run budgets**: a run's tokens and cost add up from its spans' token usage
  (:class:`RunSpend`, one per run, kept in a bounded :class:`RunLedger`);
  crossing ``max_tokens`` or ``max_cost_usd`` is a ``permanent /
  budget_exceeded``, reported once per kind.
- **SLOs per service**: finished runs roll up into a success rate, a duration
  and a cost per run over a short and a long sliding window, with error-budget
  burn rates and the multi-window fast-burn rule of SRE practice
  (:class:`SloTracker`, :class:`SloStatus`).

Nothing here does I/O besides reading the packaged table once, nothing here
knows about spans or commands: callers pass model names, token counts and run
outcomes, and get numbers and verdicts back.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from policies._glob import GlobSet, check_glob
from policies._spend import MAX_MODEL_NAME, ModelInfo, RunSpend, clamp_tokens
from policies._yamldoc import parse

__all__ = [
    "ContextPressureSpec",
    "ModelInfo",
    "ModelInfoSpec",
    "ModelTable",
    "ModelTableFile",
    "RunBudgetSpec",
    "RunLedger",
    "RunSpend",
    "SloSpec",
    "SloStatus",
    "SloTracker",
    "context_pressure",
]

#: The packaged table, next to this module.
MODEL_TABLE_FILE = "model_tables.yaml"
MODEL_TABLE_SOURCE = "<builtin model table>"
MAX_WINDOW_TOKENS = 100_000_000
MAX_PRICE_PER_MTOK = 100_000.0
MAX_SLO_WINDOW_S = 30 * 86_400.0
#: A window is cut into this many buckets: a run leaves the window between
#: ``window_s * (1 - 1/SLO_BUCKETS)`` and ``window_s`` seconds after it was recorded.
SLO_BUCKETS = 60

#: Leading vendor prefixes of Bedrock-style ids: ``us.anthropic.``, ``meta.``, ``mistral.``.
_VENDOR_PREFIX = re.compile(r"(?:[a-z]+\.)+")


# ---------------------------------------------------------------------------
# Policy-file models
# ---------------------------------------------------------------------------

# The same strictness and glob check as policies._schema, declared here rather
# than imported so that _schema can import these models into PolicyFile.
Glob = Annotated[str, AfterValidator(check_glob)]


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, populate_by_name=False
    )


class ModelInfoSpec(_Strict):
    """One model's context window and list prices (USD per million tokens).

    Prices come together or not at all: a model without them (self-hosted,
    experimental, unknown) still has a window for context pressure, and its
    calls make a run's cost *partial*. A self-hosted model that costs nothing
    is ``input_per_mtok: 0, output_per_mtok: 0``.
    """

    context_window: int = Field(
        gt=0, le=MAX_WINDOW_TOKENS, description="Input tokens the model accepts, in all."
    )
    input_per_mtok: float | None = Field(
        default=None, ge=0, le=MAX_PRICE_PER_MTOK, description="USD per 1M input tokens."
    )
    output_per_mtok: float | None = Field(
        default=None, ge=0, le=MAX_PRICE_PER_MTOK, description="USD per 1M output tokens."
    )

    @model_validator(mode="after")
    def _prices_together(self) -> ModelInfoSpec:
        if (self.input_per_mtok is None) != (self.output_per_mtok is None):
            raise ValueError("give both input_per_mtok and output_per_mtok, or neither")
        return self


ModelOverrides = Annotated[dict[Glob, ModelInfoSpec], Field(max_length=256)]


class ModelTableFile(_Strict):
    """The packaged ``model_tables.yaml``: ordered globs over model names, first match wins."""

    version: Literal[1]
    models: Annotated[dict[Glob, ModelInfoSpec], Field(min_length=1, max_length=1000)]


class ContextPressureSpec(_Strict):
    """Predict a context overflow: an LLM call's input tokens reach ``share`` of the window.

    ``models`` overrides or extends the built-in model table (windows *and*
    prices, so it also serves run budgets and SLO costs): its globs are tried
    before the built-in ones, in order, first match wins.
    """

    enabled: bool = True
    share: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Fraction of the context window whose use counts as pressure (0 < share <= 1).",
    )
    models: ModelOverrides = Field(
        default_factory=dict,
        description="Model-name glob -> {context_window, input_per_mtok, output_per_mtok};"
        " tried before the built-in table, first match wins.",
    )


class RunBudgetSpec(_Strict):
    """What one run may spend before it is stopped: ``permanent / budget_exceeded``.

    A budget is crossed when the run's spend goes *above* the limit (a run
    that spends exactly ``max_tokens`` is within it). Unset limits are not
    checked; with neither set there is no budget. Cost is counted only for
    models the table prices; tokens of the others still count.
    """

    max_tokens: int | None = Field(
        default=None, gt=0, le=10**12, description="Input plus output tokens per run."
    )
    max_cost_usd: float | None = Field(default=None, gt=0, le=1_000_000, description="USD per run.")
    action: Literal["escalate", "abort_run"] = Field(
        default="escalate", description="What a crossed budget leads to."
    )


class SloSpec(_Strict):
    """A service's run SLO, judged over a short and a long sliding window.

    A run is *good* when it succeeded and, where they are set, took no longer
    than ``max_duration_s`` and cost no more than ``max_cost_usd_per_run``. The
    SLO is that a share ``success_target`` of runs are good; its error budget is
    ``1 - success_target``.

    The *burn rate* of a window is how fast it spends that budget: the share of
    bad runs divided by the budget, ``(1 - success) / (1 - target)``. A burn
    rate of 1 spends the budget exactly over the SLO period; 14.4 spends 2 % of a
    30-day budget in one hour, the "fast burn" threshold of Google's SRE
    workbook (chapter "Alerting on SLOs"), paired there with a 1-hour long window
    and a 5-minute short one, the defaults here.

    The alert is the workbook's multi-window rule: burning fast means *both*
    windows burn above ``burn_alert``. The long window says the budget is really
    going; the short one says it is still going now, so the condition clears
    within minutes of a recovery instead of an hour later. ``min_runs`` keeps a
    quiet service from burning on one failed run out of one: the long window
    needs that many runs before it can burn at all.

    ``burn_alert`` must be below ``1 / (1 - success_target)``, the burn rate of
    a window where every run is bad, or the alert could never fire (with a 0.9
    target the highest burn rate is 10, below the default 14.4).
    """

    success_target: float = Field(
        default=0.95, gt=0, lt=1, description="Share of runs that must be good (0 < target < 1)."
    )
    max_duration_s: float | None = Field(
        default=None, gt=0, le=MAX_SLO_WINDOW_S, description="A run longer than this is bad."
    )
    max_cost_usd_per_run: float | None = Field(
        default=None, gt=0, le=1_000_000, description="A run that costs more is bad."
    )
    short_window_s: float = Field(default=300.0, ge=60, le=86_400)
    long_window_s: float = Field(default=3600.0, ge=60, le=MAX_SLO_WINDOW_S)
    burn_alert: float = Field(
        default=14.4,
        gt=0,
        le=1000,
        description="Burn rate above which both windows must be to burn fast (14.4: Google SRE).",
    )
    min_runs: int = Field(
        default=10, ge=1, le=1_000_000, description="Runs the long window needs to burn at all."
    )

    @model_validator(mode="after")
    def _coherent(self) -> SloSpec:
        if self.long_window_s <= self.short_window_s:
            raise ValueError(
                f"long_window_s ({self.long_window_s:g}) must be longer than"
                f" short_window_s ({self.short_window_s:g})"
            )
        ceiling = 1.0 / (1.0 - self.success_target)
        if self.burn_alert >= ceiling:
            raise ValueError(
                f"burn_alert {self.burn_alert:g} can never be reached: with success_target"
                f" {self.success_target:g} the highest burn rate is {ceiling:.4g}"
            )
        return self


# ---------------------------------------------------------------------------
# Model table
# ---------------------------------------------------------------------------


@functools.cache
def builtin_models() -> tuple[tuple[str, ModelInfoSpec], ...]:
    """The packaged table's entries, in order (read and validated once)."""
    text = resources.files("policies").joinpath(MODEL_TABLE_FILE).read_text(encoding="utf-8")
    spec = ModelTableFile.model_validate(parse(text, MODEL_TABLE_SOURCE).data)
    return tuple(spec.models.items())


def _candidates(model: str) -> tuple[str, ...]:
    """The spellings a model name is tried in: as reported, after its last '/', unprefixed."""
    name = model.strip().lower()
    if not name or len(name) > MAX_MODEL_NAME:
        return ()
    found = [name]
    tail = name.rsplit("/", 1)[-1]
    if tail and tail != name:
        found.append(tail)
    bare = _VENDOR_PREFIX.sub("", tail, count=1) if _VENDOR_PREFIX.match(tail) else tail
    if bare and bare not in found:
        found.append(bare)
    return tuple(found)


class ModelTable:
    """Ordered model-name globs -> :class:`ModelInfo`; the first matching glob wins.

    Matching is case-insensitive. A name is tried as reported, then after its
    last ``/`` (``models/gemini-1.5-pro``, ``anthropic/claude-3.5-sonnet``),
    then without leading vendor prefixes (``us.anthropic.claude-...``,
    ``meta.llama3-...``); the globs are tried in order, each against all three
    spellings, so an earlier glob (an override) always beats a later one.

    Model names come from spans, so lookups are memoised in a bounded LRU of
    ``memo_size`` names (evictions counted); names longer than
    ``MAX_MODEL_NAME`` are not looked up. The table itself never changes: a
    policy reload builds a new one.
    """

    def __init__(
        self,
        entries: Mapping[str, ModelInfoSpec] | Iterable[tuple[str, ModelInfoSpec]],
        *,
        memo_size: int = 1024,
    ) -> None:
        if not isinstance(memo_size, int) or memo_size < 1:
            raise ValueError(f"memo_size must be at least 1, got {memo_size!r}")
        items = entries.items() if isinstance(entries, Mapping) else entries
        self._entries: tuple[tuple[GlobSet, ModelInfo], ...] = tuple(
            (
                GlobSet([pattern.lower()]),
                ModelInfo(pattern, spec.context_window, spec.input_per_mtok, spec.output_per_mtok),
            )
            for pattern, spec in items
        )
        self.memo_size = memo_size
        self._memo: OrderedDict[str, ModelInfo | None] = OrderedDict()
        self._lock = threading.Lock()
        #: Names dropped from the memo to make room.
        self.memo_evictions = 0

    @classmethod
    def builtin(cls, overrides: Mapping[str, ModelInfoSpec] | None = None) -> ModelTable:
        """The packaged table, with ``overrides`` (a policy's globs) tried first."""
        entries = list((overrides or {}).items())
        entries.extend(builtin_models())
        return cls(entries)

    @property
    def patterns(self) -> tuple[str, ...]:
        """The globs, in the order they are tried."""
        return tuple(info.pattern for _, info in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model: str) -> ModelInfo | None:
        """The first entry whose glob matches ``model``; None for unknown models."""
        if not isinstance(model, str):
            return None
        memo = self._memo
        with self._lock:
            if model in memo:
                memo.move_to_end(model)
                return memo[model]
        names = _candidates(model)
        found: ModelInfo | None = None
        if names:
            for matches, info in self._entries:
                if any(matches(name) for name in names):
                    found = info
                    break
        if len(model) <= MAX_MODEL_NAME:
            with self._lock:
                memo[model] = found
                if len(memo) > self.memo_size:
                    memo.popitem(last=False)
                    self.memo_evictions += 1
        return found

    def cost_usd(
        self, model: str, input_tokens: int | None, output_tokens: int | None
    ) -> float | None:
        """USD for one call; None when the model is unknown or has no price.

        ``None`` or negative token counts count as 0. No cache or batch
        discounts, lowest price tier: an estimate at list price.
        """
        info = self.lookup(model)
        if info is None:
            return None
        return info.cost_usd(clamp_tokens(input_tokens), clamp_tokens(output_tokens))


def context_pressure(
    model: str, input_tokens: int | None, share: float, table: ModelTable
) -> tuple[float, int] | None:
    """``(fraction of the window used, window)`` when ``input_tokens`` reach ``share`` of it.

    None below the share, for an unknown model, or without input tokens. The
    fraction may exceed 1 (the provider accepted more than the table says:
    the table is out of date, or the call went to a larger variant).
    """
    if not (isinstance(share, (int, float)) and 0 < share <= 1):
        raise ValueError(f"share must be more than 0 and at most 1, got {share!r}")
    tokens = clamp_tokens(input_tokens)
    if tokens == 0:
        return None
    info = table.lookup(model)
    if info is None:
        return None
    fraction = tokens / info.context_window
    if fraction >= share:
        return fraction, info.context_window
    return None


# ---------------------------------------------------------------------------
# Run budgets
# ---------------------------------------------------------------------------


class RunLedger:
    """A bounded map of run id -> :class:`RunSpend`.

    Lifecycle: a run gets a ``RunSpend`` on its first ``add``; ``forget`` drops
    it when the run is over and returns its final spend (for the SLO's cost per
    run). Bounded: at most ``max_runs`` runs; a new run beyond that evicts the
    least recently active one (counted in ``evictions``), whose spend starts
    again from zero if it comes back, so its budget may be reported again.

    ``table`` is read on every ``add``; a policy reload may replace it.
    Thread-safety: meant for one thread; every method holds a lock all the same.
    """

    def __init__(self, table: ModelTable, *, max_runs: int = 10_000) -> None:
        if not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs!r}")
        self.table = table
        self.max_runs = max_runs
        self._runs: OrderedDict[str, RunSpend] = OrderedDict()
        self._lock = threading.Lock()
        #: Runs evicted to make room (least recently active first).
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._runs)

    def add(
        self, run_id: str, model: str, input_tokens: int | None, output_tokens: int | None
    ) -> RunSpend:
        """Count one LLM call of ``run_id``; the run's spend after it."""
        with self._lock:
            runs = self._runs
            spend = runs.get(run_id)
            if spend is None:
                spend = runs[run_id] = RunSpend()
                if len(runs) > self.max_runs:
                    runs.popitem(last=False)
                    self.evictions += 1
            else:
                runs.move_to_end(run_id)
            spend.add(model, input_tokens, output_tokens, self.table)
            return spend

    def get(self, run_id: str) -> RunSpend | None:
        """``run_id``'s spend (does not change recency)."""
        with self._lock:
            return self._runs.get(run_id)

    def forget(self, run_id: str) -> RunSpend | None:
        """Drop ``run_id`` (the run is over); its final spend, if it had one."""
        with self._lock:
            return self._runs.pop(run_id, None)


# ---------------------------------------------------------------------------
# SLOs
# ---------------------------------------------------------------------------

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
