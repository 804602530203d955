"""Context pressure, run budgets and SLOs: the model table, spend, ledger and SLO tracker."""

from __future__ import annotations

import math
import re

import pytest
from pydantic import ValidationError

from policies._model_table import ModelTable, builtin_models, context_pressure
from policies._run_ledger import RunLedger
from policies._schema_budgets import ContextPressureSpec, ModelInfoSpec, RunBudgetSpec, SloSpec
from policies._slo import SLO_BUCKETS, SloTracker
from policies._spend import RunSpend


def info(
    window: int, price_in: float | None = None, price_out: float | None = None
) -> ModelInfoSpec:
    return ModelInfoSpec(context_window=window, input_per_mtok=price_in, output_per_mtok=price_out)


@pytest.fixture
def table() -> ModelTable:
    return ModelTable(
        {
            "small-mini*": info(1000, 1.0, 4.0),
            "small*": info(2000, 10.0, 30.0),
            "free-*": info(4000, 0.0, 0.0),
            "unpriced-*": info(8000),
        }
    )


# --- model table ---------------------------------------------------------------


def test_builtin_table_loads_with_every_family() -> None:
    patterns = [p for p, _ in builtin_models()]
    table = ModelTable.builtin()
    assert len(table) == len(patterns) > 40
    for model in (
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4.1",
        "gpt-4.1-mini",
        "gpt-4.1-nano",
        "o1",
        "o3",
        "o4-mini",
        "gpt-3.5-turbo",
        "claude-3-5-sonnet-20241022",
        "claude-3-5-haiku-20241022",
        "claude-3-7-sonnet-20250219",
        "claude-sonnet-4-20250514",
        "claude-opus-4-20250514",
        "claude-3-haiku-20240307",
        "claude-3-opus-20240229",
        "gemini-1.5-pro",
        "gemini-1.5-flash",
        "gemini-2.0-flash",
        "gemini-2.5-pro",
        "gemini-2.5-flash",
        "mistral-large-latest",
        "mistral-small-latest",
        "meta-llama/Llama-3.3-70B-Instruct",
        "llama-3.1-8b-instant",
    ):
        found = table.lookup(model)
        assert found is not None, model
        assert found.priced, model


def _sample(pattern: str) -> str:
    """A name the glob matches literally: '*' dropped, '?' as 'x', a set as its first member."""
    name = re.sub(r"\[!?(.)[^\]]*\]", r"\1", pattern)
    return name.replace("*", "").replace("?", "x")


def test_builtin_order_shadows_no_entry() -> None:
    table = ModelTable.builtin()
    for pattern in table.patterns:
        found = table.lookup(_sample(pattern))
        assert found is not None and found.pattern == pattern, (pattern, found)


def test_builtin_specific_before_broad() -> None:
    table = ModelTable.builtin()
    mini = table.lookup("gpt-4o-mini-2024-07-18")
    full = table.lookup("gpt-4o-2024-08-06")
    assert mini is not None and full is not None
    assert mini.pattern == "gpt-4o-mini*"
    assert full.pattern == "gpt-4o*"
    assert mini.input_per_mtok is not None and full.input_per_mtok is not None
    assert mini.input_per_mtok < full.input_per_mtok


@pytest.mark.parametrize(
    ("model", "pattern"),
    [
        ("GPT-4o-Mini", "gpt-4o-mini*"),
        ("openai/gpt-4o-mini", "gpt-4o-mini*"),
        ("models/gemini-1.5-pro-002", "gemini-1.5-pro*"),
        ("anthropic/claude-3.5-sonnet", "claude-3[.-]5-sonnet*"),
        ("us.anthropic.claude-3-5-sonnet-20240620-v1:0", "claude-3[.-]5-sonnet*"),
        ("claude-3-5-sonnet-v2@20241022", "claude-3[.-]5-sonnet*"),
        ("mistral.mistral-large-2407-v1:0", "mistral-large*"),
        ("gpt-35-turbo", "gpt-3*5-turbo*"),
    ],
)
def test_builtin_name_spellings(model: str, pattern: str) -> None:
    found = ModelTable.builtin().lookup(model)
    assert found is not None and found.pattern == pattern


def test_first_match_wins_so_order_matters() -> None:
    broad_first = ModelTable({"small*": info(2000), "small-mini*": info(1000)})
    found = broad_first.lookup("small-mini-2")
    assert found is not None and found.pattern == "small*"


def test_overrides_come_before_builtin() -> None:
    table = ModelTable.builtin(
        {"gpt-4o*": info(64_000, 1.0, 2.0), "My-Deployment*": info(32_000, 0.5, 0.5)}
    )
    assert table.patterns[:2] == ("gpt-4o*", "My-Deployment*")
    # The override's glob is tried before the built-in "gpt-4o-mini*" too.
    for model in ("gpt-4o", "gpt-4o-mini"):
        found = table.lookup(model)
        assert found is not None and found.context_window == 64_000
    custom = table.lookup("my-deployment-prod")  # case-insensitive
    assert custom is not None and custom.pattern == "My-Deployment*"
    # Untouched models still resolve to the built-in table.
    claude = table.lookup("claude-3-haiku-20240307")
    assert claude is not None and claude.pattern == "claude-3-haiku*"


def test_unknown_model(table: ModelTable) -> None:
    assert table.lookup("big-model") is None
    assert table.lookup("") is None
    assert table.lookup("small" + "x" * 300) is None  # too long to be a model name
    assert table.cost_usd("big-model", 1000, 1000) is None
    assert table.cost_usd("unpriced-1", 1000, 1000) is None


def test_cost(table: ModelTable) -> None:
    # 1500 * $10/M + 200 * $30/M = 0.015 + 0.006
    assert table.cost_usd("small-2", 1500, 200) == pytest.approx(0.021)
    # 1500 * $1/M + 200 * $4/M = 0.0015 + 0.0008
    assert table.cost_usd("small-mini-1", 1500, 200) == pytest.approx(0.0023)
    assert table.cost_usd("small-2", None, 200) == pytest.approx(0.006)
    assert table.cost_usd("small-2", -5, None) == 0.0
    assert table.cost_usd("free-7b", 10**6, 10**6) == 0.0


def test_memo_is_bounded(table: ModelTable) -> None:
    bounded = ModelTable({"small*": info(2000, 1.0, 1.0)}, memo_size=2)
    for name in ("small-a", "small-b", "small-c", "other"):
        assert (bounded.lookup(name) is None) == (name == "other")
    assert bounded.memo_evictions == 2
    assert len(bounded._memo) == 2
    # Evicted names are looked up again, with the same answer.
    again = bounded.lookup("small-a")
    assert again is not None and again.pattern == "small*"
    with pytest.raises(ValueError):
        ModelTable({}, memo_size=0)


# --- context pressure ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "share", "expected"),
    [
        (899, 0.9, None),
        (900, 0.9, (0.9, 1000)),
        (950, 0.9, (0.95, 1000)),
        (1200, 0.9, (1.2, 1000)),
        (999, 1.0, None),
        (1000, 1.0, (1.0, 1000)),
        (1, 0.001, (0.001, 1000)),
        (0, 0.001, None),
        (None, 0.5, None),
        (-10, 0.5, None),
    ],
)
def test_context_pressure_edges(
    table: ModelTable, tokens: int | None, share: float, expected: tuple[float, int] | None
) -> None:
    found = context_pressure("small-mini-x", tokens, share, table)
    if expected is None:
        assert found is None
    else:
        assert found is not None
        assert found[0] == pytest.approx(expected[0])
        assert found[1] == expected[1]


def test_context_pressure_unknown_model_and_bad_share(table: ModelTable) -> None:
    assert context_pressure("big-model", 10**9, 0.5, table) is None
    for share in (0.0, -0.1, 1.01, math.nan):
        with pytest.raises(ValueError):
            context_pressure("small-2", 100, share, table)


def test_context_pressure_builtin_window() -> None:
    found = context_pressure("gpt-4o-mini", 120_000, 0.9, ModelTable.builtin())
    assert found is not None
    assert found[0] == pytest.approx(120_000 / 128_000)
    assert found[1] == 128_000


# --- run budgets ---------------------------------------------------------------


def test_spend_adds_tokens_and_cost(table: ModelTable) -> None:
    spend = RunSpend()
    assert spend.add("small-2", 1000, 100, table) == pytest.approx(0.013)
    assert spend.add("small-mini", 2000, 500, table) == pytest.approx(0.004)
    assert spend.add("small-2", None, None, table) == 0.0  # no usage: not a call
    assert (spend.calls, spend.input_tokens, spend.output_tokens) == (2, 3000, 600)
    assert spend.tokens == 3600
    assert spend.cost_usd == pytest.approx(0.017)
    assert not spend.partial
    assert spend.to_json()["cost_partial"] is False


def test_spend_unknown_model_is_partial(table: ModelTable) -> None:
    spend = RunSpend()
    spend.add("small-2", 1000, 0, table)
    assert spend.add("mystery-model", 5000, 5000, table) is None
    assert spend.add("unpriced-x", 10, 10, table) is None
    assert spend.tokens == 11_020
    assert spend.cost_usd == pytest.approx(0.01)
    assert spend.partial and spend.unpriced_calls == 2
    assert spend.unpriced_models == ["mystery-model", "unpriced-x"]
    assert "partial" in spend.describe()


def test_budget_crossed_once_per_kind(table: ModelTable) -> None:
    budget = RunBudgetSpec(max_tokens=10_000, max_cost_usd=0.5)
    spend = RunSpend()
    spend.add("small-1", 10_000, 0, table)  # exactly max_tokens, $0.10
    assert spend.crossed(budget) is None
    spend.add("small-1", 1, 0, table)
    assert spend.crossed(budget) == "max_tokens"
    assert spend.crossed(budget) is None
    spend.add("small-1", 10_000, 0, table)  # $0.20: still tokens only
    assert spend.crossed(budget) is None
    spend.add("small-1", 0, 10_000, table)  # +$0.30 = $0.60
    assert spend.crossed(budget) == "max_cost_usd"
    spend.add("small-1", 0, 10_000, table)
    assert spend.crossed(budget) is None
    assert spend.over(budget) == ("max_tokens", "max_cost_usd")
    text = spend.describe(budget)
    assert "max_tokens 10,000" in text and "max_cost_usd $0.5" in text


def test_budget_both_kinds_at_once_and_no_limits(table: ModelTable) -> None:
    spend = RunSpend()
    spend.add("small-1", 100_000, 0, table)  # $1.00
    assert spend.crossed(RunBudgetSpec()) is None
    assert spend.crossed(RunBudgetSpec(max_tokens=1000, max_cost_usd=0.5)) == (
        "max_tokens+max_cost_usd"
    )
    assert spend.crossed(RunBudgetSpec(max_tokens=1000, max_cost_usd=0.5)) is None


def test_ledger_is_bounded(table: ModelTable) -> None:
    ledger = RunLedger(table, max_runs=2)
    ledger.add("a", "small-1", 100, 0)
    ledger.add("b", "small-1", 100, 0)
    assert ledger.add("a", "small-1", 100, 0).tokens == 200  # a is now the most recent
    ledger.add("c", "small-1", 100, 0)
    assert ledger.evictions == 1 and len(ledger) == 2
    assert ledger.get("b") is None
    final = ledger.forget("a")
    assert final is not None and final.tokens == 200
    assert ledger.forget("a") is None


# --- SLOs ----------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tracker(**spec: object) -> tuple[SloTracker, Clock]:
    clock = Clock(3_600_000.0)
    return SloTracker(SloSpec.model_validate(spec), clock=clock), clock


def record(slo: SloTracker, ok: int = 0, bad: int = 0, service: str = "svc") -> None:
    for _ in range(ok):
        slo.record_run(service, True, 10.0, 0.01)
    for _ in range(bad):
        slo.record_run(service, False, 10.0, 0.01)


def test_burn_rate_math() -> None:
    slo, _ = tracker()  # target 0.95: error budget 0.05
    record(slo, ok=17, bad=3)
    status = slo.status("svc")
    assert (status.runs_short, status.runs_long, status.bad_long) == (20, 20, 3)
    assert status.success_rate_long == pytest.approx(0.85)
    # (1 - 0.85) / (1 - 0.95) = 0.15 / 0.05
    assert status.burn_rate_short == pytest.approx(3.0)
    assert status.burn_rate_long == pytest.approx(3.0)
    assert not status.fast_burn and not slo.burning("svc")


def test_burn_rate_other_target() -> None:
    slo, _ = tracker(success_target=0.99, min_runs=1)
    record(slo, ok=196, bad=4)
    status = slo.status("svc")
    # 4/200 = 0.02 bad; budget 0.01 -> burn 2
    assert status.burn_rate_long == pytest.approx(2.0)
    assert status.success_rate_short == pytest.approx(0.98)


def test_fast_burn_needs_both_windows() -> None:
    slo, clock = tracker()
    record(slo, ok=100)
    clock.now += 3000
    record(slo, bad=5)
    status = slo.status("svc")
    # short: 5 runs, all bad -> burn 20; long: 5 bad of 105 -> (5/105)/0.05
    assert status.burn_rate_short == pytest.approx(20.0)
    assert status.burn_rate_long == pytest.approx((5 / 105) / 0.05)
    assert not status.fast_burn and not slo.burning("svc")


def test_fast_burn_both_high_then_short_recovers() -> None:
    slo, clock = tracker()
    record(slo, ok=2, bad=10)
    status = slo.status("svc")
    # 10/12 bad -> (10/12)/0.05 = 16.67 > 14.4 in both windows
    assert status.burn_rate_long == pytest.approx(50 / 3)
    assert status.fast_burn and slo.burning("svc")
    clock.now += 400  # the short window has emptied
    assert slo.status("svc").runs_short == 0
    record(slo, ok=1)
    status = slo.status("svc")
    assert status.burn_rate_short == 0.0
    assert status.burn_rate_long == pytest.approx((10 / 13) / 0.05)
    assert status.burn_rate_long > 14.4
    assert not status.fast_burn and not slo.burning("svc")


def test_fast_burn_threshold_is_strict() -> None:
    slo, _ = tracker(success_target=0.5, burn_alert=1.5, min_runs=1)
    record(slo, ok=1, bad=3)  # 0.75 / 0.5 = 1.5 exactly: not above
    assert slo.status("svc").burn_rate_long == 1.5
    assert not slo.burning("svc")
    record(slo, bad=1)  # 0.8 / 0.5 = 1.6
    assert slo.burning("svc")


def test_min_runs_in_long_window() -> None:
    slo, _ = tracker(min_runs=10)
    record(slo, bad=9)
    assert slo.status("svc").burn_rate_long == pytest.approx(20.0)
    assert not slo.burning("svc")
    record(slo, bad=1)
    assert slo.burning("svc")


def test_runs_age_out_of_each_window() -> None:
    slo, clock = tracker(short_window_s=300, long_window_s=3600)
    start = clock.now  # a bucket boundary of both windows (5 s and 60 s wide)
    record(slo, bad=1)
    clock.now = start + 300 * (1 - 1 / SLO_BUCKETS) - 0.001
    assert slo.status("svc").runs_short == 1
    clock.now = start + 300
    status = slo.status("svc")
    assert (status.runs_short, status.runs_long) == (0, 1)
    assert status.success_rate_short is None and status.burn_rate_short == 0.0
    clock.now = start + 3599.999
    assert slo.status("svc").runs_long == 1
    clock.now = start + 3600
    status = slo.status("svc")
    assert status.runs_long == 0 and status.bad_long == 0
    assert status.duration_p50_s is None and status.mean_cost_usd is None


def test_explicit_now_and_clock_going_back() -> None:
    slo, _ = tracker()
    slo.record_run("svc", False, 1.0, None, now=5000.0)
    slo.record_run("svc", True, 1.0, None, now=100.0)  # back in time: counted as at 5000
    assert slo.status("svc", now=5000.0).runs_short == 2
    assert slo.status("svc", now=5000.0 + 300).runs_short == 0
    assert slo.status("svc", now=math.nan).runs_long == 2  # NaN: the last finite time


def test_duration_percentiles_and_mean_cost() -> None:
    slo, _ = tracker()
    costs = [0.1, 0.2, None, 0.3]
    for seconds in range(1, 101):
        slo.record_run("svc", True, float(seconds), costs[seconds % 4])
    status = slo.status("svc")
    assert status.duration_p50_s == pytest.approx(50.0, rel=0.011)
    assert status.duration_p95_s == pytest.approx(95.0, rel=0.011)
    assert status.priced_runs == 75
    assert status.mean_cost_usd == pytest.approx(0.2)
    slo.record_run("fast", True, 0.0, None)
    slo.record_run("fast", True, math.inf, None)  # not a duration: the run still counts
    fast = slo.status("fast")
    assert fast.runs_long == 2 and fast.duration_p95_s == 0.0


def test_slow_and_costly_runs_are_bad() -> None:
    slo, _ = tracker(max_duration_s=60, max_cost_usd_per_run=1.0)
    slo.record_run("svc", True, 60.0, 1.0)  # at the limits: good
    slo.record_run("svc", True, 61.0, 0.5)  # slow
    slo.record_run("svc", True, 5.0, 1.5)  # costly
    slo.record_run("svc", False, 90.0, 2.0)  # all three
    slo.record_run("svc", True, None, None)  # unknown: good
    status = slo.status("svc")
    assert (status.runs_long, status.bad_long) == (5, 3)
    assert (status.failed_long, status.slow_long, status.costly_long) == (1, 2, 2)
    assert status.success_rate_long == pytest.approx(0.4)
    body = status.to_json()
    assert body["bad_long"] == {"failed": 1, "slow": 2, "costly": 2}
    assert body["runs"] == {"short": 5, "long": 5}


def test_services_are_bounded_and_unknown_ones_are_quiet() -> None:
    clock = Clock()
    slo = SloTracker(SloSpec(min_runs=1), clock=clock, max_services=2)
    record(slo, bad=3, service="a")
    record(slo, bad=3, service="b")
    record(slo, ok=1, service="a")  # a is now the most recent
    record(slo, ok=1, service="c")
    assert slo.evictions == 1 and len(slo) == 2
    assert slo.services() == ["a", "c"]
    gone = slo.status("b")
    assert gone.runs_long == 0 and not gone.fast_burn
    assert not slo.burning("b")
    assert len(slo) == 2  # reading did not create it
    with pytest.raises(ValueError):
        SloTracker(max_services=0)


def test_spec_per_service_and_set_spec() -> None:
    clock = Clock()
    strict = SloSpec(success_target=0.99, min_runs=1)
    slo = SloTracker(lambda s: strict if s == "pay" else SloSpec(), clock=clock)
    record(slo, ok=1, service="pay")
    record(slo, ok=1, service="chat")
    assert slo.status("pay").success_target == 0.99
    assert slo.status("chat").success_target == 0.95
    # Same windows: history kept, the new target applies.
    slo.set_spec(SloSpec(success_target=0.9, burn_alert=5))
    assert slo.status("pay").runs_long == 1
    assert slo.status("pay").success_target == 0.9
    # Other windows: started afresh.
    slo.set_spec(SloSpec(short_window_s=60, long_window_s=600))
    assert slo.status("pay").runs_long == 0
    assert slo.resets == 2
    bad = SloTracker(lambda _s: "nope", clock=clock)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError):
        bad.record_run("x", True, 1.0, None)


# --- spec validation -----------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        {"context_window": 1000, "input_per_mtok": -1.0, "output_per_mtok": 1.0},
        {"context_window": 1000, "input_per_mtok": 1.0, "output_per_mtok": -0.01},
        {"context_window": 1000, "input_per_mtok": 1.0},
        {"context_window": 0},
        {"context_window": "1000"},
        {"context_window": 1000, "input_per_mtok": math.inf, "output_per_mtok": 1.0},
        {"context_window": 1000, "price": 1.0},
    ],
)
def test_model_info_spec_errors(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ModelInfoSpec.model_validate(data)


@pytest.mark.parametrize(
    "data",
    [
        {"share": 0},
        {"share": 0.0},
        {"share": 1.5},
        {"share": -0.5},
        {"models": {"gpt-[": {"context_window": 10}}},
        {"models": {"x*": {"context_window": 10, "input_per_mtok": -1, "output_per_mtok": 0}}},
    ],
)
def test_context_pressure_spec_errors(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ContextPressureSpec.model_validate(data)


def test_context_pressure_spec_defaults_and_overrides() -> None:
    spec = ContextPressureSpec.model_validate(
        {"share": 1, "models": {"mine*": {"context_window": 10}, "gpt-4o*": {"context_window": 5}}}
    )
    assert spec.enabled and spec.share == 1
    assert list(spec.models) == ["mine*", "gpt-4o*"]  # order kept: first match wins
    assert ContextPressureSpec().share == 0.9
    table = ModelTable.builtin(spec.models)
    assert context_pressure("mine-1", 10, spec.share, table) == (1.0, 10)


@pytest.mark.parametrize(
    "data",
    [
        {"short_window_s": 600, "long_window_s": 300},
        {"short_window_s": 600, "long_window_s": 600},
        {"success_target": 1},
        {"success_target": 0},
        {"success_target": 0.9},  # highest burn rate 10 < the default burn_alert 14.4
        {"burn_alert": 0},
        {"max_duration_s": 0},
        {"max_cost_usd_per_run": -1},
        {"short_window_s": 10},
        {"min_runs": 0},
        {"window": 10},
    ],
)
def test_slo_spec_errors(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SloSpec.model_validate(data)


def test_slo_spec_defaults() -> None:
    spec = SloSpec()
    assert (spec.success_target, spec.short_window_s, spec.long_window_s, spec.burn_alert) == (
        0.95,
        300.0,
        3600.0,
        14.4,
    )
    assert SloSpec(success_target=0.9, burn_alert=9.9).burn_alert == 9.9


@pytest.mark.parametrize(
    "data",
    [
        {"max_tokens": 0},
        {"max_tokens": 1.5},
        {"max_cost_usd": 0},
        {"max_cost_usd": -2.0},
        {"action": "retry"},
        {"action": "fail_fast"},
    ],
)
def test_run_budget_spec_errors(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        RunBudgetSpec.model_validate(data)


def test_run_budget_spec_defaults() -> None:
    spec = RunBudgetSpec.model_validate({"max_cost_usd": 5, "action": "abort_run"})
    assert spec.max_tokens is None and spec.max_cost_usd == 5.0 and spec.action == "abort_run"
    assert RunBudgetSpec().action == "escalate"
