"""Budgets forecast from the burn rate: a run (or a service's runs) stopped before the cap.

The arithmetic (:mod:`policies._forecast`, :mod:`policies._service_spend`) is
pure and takes its times as arguments; the pipeline tests feed spans made by
the real OTel SDK, with the times a run of LLM calls and tool calls would
give them, and an injected time of receipt (nothing sleeps).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Tracer, set_span_in_context
from pydantic import ValidationError

from policies import load_policy
from policies._forecast import Burn, forecast
from policies._model_table import ModelTable
from policies._schema_budgets import ModelInfoSpec, RunBudgetSpec, ServiceBudgetSpec
from policies._service_spend import ServiceSpend
from policies._spend import RunSpend
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.runs import RunTracker
from supervisor.runs.fleet import FleetRuns

T0 = 1_700_000_000.0
#: gpt-4o in the built-in table: $2.50 and $10.00 per million input and output tokens.
CALL_TOKENS = (4000, 500)
CALL_USD = (4000 * 2.5 + 500 * 10.0) / 1e6  # $0.015


# -- the burn rate -------------------------------------------------------------------


def test_a_steady_burn_is_measured_from_the_first_call_on() -> None:
    burn = Burn(T0)  # the first call ended at T0: the rate counts the calls after it
    assert burn.rates() is None
    for n in range(1, 31):  # $0.015 and 4,500 tokens every 10 s
        burn.add(T0 + 10 * n, CALL_USD, 4500)
        rates = burn.rates()
        assert rates is not None
        # Young or old, the rate is the run's: 0.0015 $/s, within the decay's lumpiness.
        assert rates[0] == pytest.approx(0.0015, rel=0.1), n
        assert rates[1] == pytest.approx(450, rel=0.1), n


def test_the_rate_follows_the_recent_calls_and_decays_in_a_pause() -> None:
    burn = Burn(T0, tau_s=60)
    for n in range(1, 13):
        burn.add(T0 + 10 * n, 0.01, 100)
    slow = burn.rates()
    for n in range(13, 73):  # ten times faster for the next minute
        burn.add(T0 + 120 + (n - 12), 0.01, 100)
    fast = burn.rates()
    assert slow is not None and fast is not None
    assert fast[0] > 5 * slow[0]
    burn.add(T0 + 180 + 300, 0.0, 0)  # five minutes later, a call that cost nothing
    after_pause = burn.rates()
    assert after_pause is not None and after_pause[0] < fast[0] * math.exp(-4)


def test_calls_that_end_together_give_no_rate_and_late_spans_do_not_go_back() -> None:
    burn = Burn(T0)
    burn.add(T0, 1.0, 10)
    assert burn.rates() is None  # no time has passed: no rate yet
    burn.add(T0 + 10, 1.0, 10)
    burn.add(T0 + 5, 1.0, 10)  # a span that arrived late counts with the latest
    assert burn.last == T0 + 10
    rates = burn.rates()
    assert rates is not None and rates[0] > 0


# -- the forecast --------------------------------------------------------------------


def test_due_within_the_horizon_or_at_the_next_call_and_never_once_crossed() -> None:
    near = forecast(kind="max_cost_usd", spent=0.6, cap=1.0, rate=0.01, calls=60, horizon_s=60)
    assert near is not None and near.due == "horizon" and near.eta_s == pytest.approx(40)
    far = forecast(kind="max_cost_usd", spent=0.2, cap=1.0, rate=0.01, calls=20, horizon_s=60)
    assert far is not None and far.due == "" and far.eta_s == pytest.approx(80)
    # No rate yet (calls that ended together), but the next call would cross it.
    big = forecast(kind="max_tokens", spent=800, cap=1000, rate=None, calls=2, horizon_s=60)
    assert big is not None and (big.due, big.eta_s, big.per_call) == ("next_call", None, 400)
    small = forecast(kind="max_tokens", spent=600, cap=1000, rate=None, calls=2, horizon_s=60)
    assert small is not None and small.due == ""  # 900 after the next call: within it
    # At the cap exactly is within it; above it is the crossing's to report.
    assert forecast(kind="max_tokens", spent=1001, cap=1000, rate=1, calls=1, horizon_s=60) is None
    assert forecast(kind="max_tokens", spent=10, cap=None, rate=1, calls=1, horizon_s=60) is None
    assert forecast(kind="max_tokens", spent=0, cap=10, rate=None, calls=0, horizon_s=60) is None
    # forecast_s 0: never due, the outlook still said.
    off = forecast(kind="max_cost_usd", spent=0.99, cap=1.0, rate=1.0, calls=99, horizon_s=0)
    assert off is not None and off.due == "" and off.eta_s == pytest.approx(0.01)
    assert "max_cost_usd: $0.6000 of $1.0000 spent at $0.0100/s, the cap in 40 s" in (
        near.describe()
    )


@pytest.fixture
def table() -> ModelTable:
    return ModelTable(
        {"m*": ModelInfoSpec(context_window=10**6, input_per_mtok=2.5, output_per_mtok=10.0)}
    )


def test_a_run_s_forecast_is_due_once_and_the_crossing_stays_the_backstop(
    table: ModelTable,
) -> None:
    budget = RunBudgetSpec(max_cost_usd=0.1, forecast_s=30)
    spend = RunSpend()
    due = []
    for n in range(8):
        spend.add("m", *CALL_TOKENS, table)
        spend.burned(T0 + 10 * n, CALL_USD, sum(CALL_TOKENS))
        crossed = spend.crossed(budget)
        found = spend.forecast_due(budget) if crossed is None else None
        due.append((n + 1, found.due if found else "", crossed))
    # At 1.5 mUSD/s the cap ($0.10) is 30 s away once $0.055 is spent: after call 4.
    assert due == [
        (1, "", None),
        (2, "", None),
        (3, "", None),
        (4, "horizon", None),
        (5, "", None),  # reported once per run
        (6, "", None),
        (7, "", "max_cost_usd"),  # went on (a person said so): crossed, reported as ever
        (8, "", None),
    ]
    assert spend.outlook() is None  # above the cap: nothing left to forecast


def test_the_nearest_cap_is_the_run_s_outlook(table: ModelTable) -> None:
    budget = RunBudgetSpec(max_cost_usd=10.0, max_tokens=20_000, forecast_s=10)
    spend = RunSpend()
    for n in range(3):
        spend.add("m", *CALL_TOKENS, table)
        spend.burned(T0 + 10 * n, CALL_USD, sum(CALL_TOKENS))
        due = spend.forecast_due(budget)
    outlook = spend.outlook()
    assert due is None and outlook is not None
    assert outlook.kind == "max_tokens"  # 13,500 of 20,000 at 450/s: 14 s away
    spend.add("m", *CALL_TOKENS, table)
    spend.burned(T0 + 30, CALL_USD, sum(CALL_TOKENS))
    due = spend.forecast_due(budget)
    assert due is not None and (due.kind, due.due) == ("max_tokens", "next_call")


# -- a service's window ----------------------------------------------------------------


def test_a_service_s_window_forgets_old_spend_and_forecasts_its_cap() -> None:
    spec = ServiceBudgetSpec(max_cost_usd=1.0, window_s=600, forecast_s=60)
    services = ServiceSpend()
    first = services.charge("planner", spec, now=T0, cost=0.4, tokens=100)
    assert first.cost_usd == 0.4 and not first.stop  # $0.80 after one more: within it
    big = services.charge("planner", spec, now=T0 + 1, cost=0.4, tokens=100)
    assert big.due is not None and big.due.due == "next_call"  # $0.80 + $0.40 > $1
    later = services.charge("planner", spec, now=T0 + 700, cost=0.01, tokens=10)
    assert later.cost_usd == pytest.approx(0.01) and later.calls == 1  # the $0.80 left
    found = []
    for n in range(1, 100):
        outlook = services.charge("planner", spec, now=T0 + 700 + n, cost=0.01, tokens=10)
        if outlook.stop:
            found.append((n, outlook.cost_usd, outlook.due.due if outlook.due else ""))
            break
    # $0.01/s: the cap is 60 s away at $0.40 spent; after the long quiet the decayed rate
    # takes its time constant (60 s) to catch up, so the stop comes later, before the cap.
    ((n, spent, why),) = found
    assert why == "horizon" and spent < 1.0 and 40 <= n <= 65
    crossed = services.charge("planner", spec, now=T0 + 800, cost=5.0, tokens=10)
    assert crossed.crossed == "max_cost_usd" and crossed.stop
    assert "max_cost_usd: service planner spent" in crossed.describe(spec)


def test_services_are_counted_apart_and_bounded() -> None:
    spec = ServiceBudgetSpec(max_tokens=1000, window_s=60)
    services = ServiceSpend(max_services=2)
    services.charge("a", spec, now=T0, cost=0, tokens=900)
    assert services.charge("b", spec, now=T0, cost=0, tokens=100).tokens == 100
    services.charge("c", spec, now=T0, cost=0, tokens=1)
    assert len(services) == 2 and services.forgotten == 1
    assert services.charge("a", spec, now=T0, cost=0, tokens=1).tokens == 1  # "a" was forgotten


@pytest.mark.parametrize(
    "data",
    [{}, {"max_cost_usd": 1, "window_s": 10}, {"max_tokens": 5, "forecast_s": -1}],
)
def test_service_budget_spec_errors(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ServiceBudgetSpec.model_validate(data)


def test_forecast_defaults() -> None:
    assert RunBudgetSpec().forecast_s == 60.0
    assert RunBudgetSpec(forecast_s=0).forecast_s == 0
    spec = ServiceBudgetSpec(max_cost_usd=50)
    assert (spec.window_s, spec.forecast_s, spec.action) == (86_400.0, 60.0, "escalate")


# -- the pipeline, on spans made by the real OTel SDK ----------------------------------


class Agent:
    """Runs of LLM and tool calls, their spans made by the SDK and judged as they end."""

    def __init__(self, policy_text: str, fleet: FleetRuns | None = None) -> None:
        self.exporter = InMemorySpanExporter()
        policy = load_policy(text=policy_text)
        self.tracker = RunTracker(
            settings=policy.detectors.for_service, models=policy.detectors.models, fleet=fleet
        )
        self.pipeline = Pipeline(policy, runs=self.tracker)
        self.outcomes: list[Outcome] = []
        self._tracers: dict[str, Tracer] = {}

    def tracer(self, service: str) -> Tracer:
        if service not in self._tracers:
            provider = TracerProvider(resource=Resource.create({"service.name": service}))
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            self._tracers[service] = provider.get_tracer("agent")
        return self._tracers[service]

    def begin(self, service: str, at: float) -> Span:
        return self.tracer(service).start_span("invoke_agent", start_time=int(at * 1e9))

    def step(self, service: str, root: Span, at: float) -> None:
        """One LLM call (2 s) and the tool it asks for (8 s), exported when it ends."""
        tracer, context = self.tracer(service), set_span_in_context(root)
        llm = tracer.start_span("chat gpt-4o", context=context, start_time=int(at * 1e9))
        llm.set_attributes(
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.usage.input_tokens": CALL_TOKENS[0],
                "gen_ai.usage.output_tokens": CALL_TOKENS[1],
            }
        )
        llm.end(end_time=int((at + 2) * 1e9))
        tool = tracer.start_span(
            "execute_tool search", context=context, start_time=int((at + 2) * 1e9)
        )
        tool.set_attributes({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"})
        tool.end(end_time=int((at + 10) * 1e9))
        self.export(at + 10)

    def export(self, now: float) -> None:
        spans = self.exporter.get_finished_spans()
        self.exporter.clear()
        payload = encode_spans(spans).SerializeToString()
        self.outcomes += self.pipeline.process_payload(payload, received_ns=int(now * 1e9))

    def budget_outcomes(self) -> Iterator[Outcome]:
        return (o for o in self.outcomes if o.failure.kind.startswith("budget_"))


def test_a_run_is_stopped_before_its_cap_not_after() -> None:
    agent = Agent(
        "version: 1\nrun_budget: {max_cost_usd: 0.1, forecast_s: 30, action: abort_run}\n"
    )
    root = agent.begin("agent", T0)
    for n in range(8):  # the agent goes on regardless: the crossing is reported too
        agent.step("agent", root, T0 + 10 * n)
    forecast_stop, crossing = agent.budget_outcomes()
    failure = forecast_stop.failure
    assert (failure.kind, failure.failure_class.value, failure.rule) == (
        "budget_forecast",
        "permanent",
        "builtin.detect.run_budget",
    )
    assert forecast_stop.decision.action.value == "fail_fast"  # abort_run: before the cap
    details: dict[str, Any] = dict(failure.details)
    assert details["cost_usd"] == pytest.approx(4 * CALL_USD)
    assert details["cost_usd"] < 0.1  # stopped before the cap
    assert details["forecast"]["due"] == "horizon"
    assert details["forecast"]["rate_per_s"] == pytest.approx(0.0015, rel=0.1)
    assert details["forecast"]["eta_s"] <= 30
    # When the cap is reached at that rate: after the 4th call ended (T0 + 32 s).
    assert details["forecast"]["cap_at"] == pytest.approx(T0 + 32 + details["forecast"]["eta_s"])
    assert failure.message.startswith("max_cost_usd: $0.0600 of $0.1000 spent at $0.0016/s")
    assert crossing.failure.kind == "budget_exceeded"
    assert crossing.failure.details["cost_usd"] == pytest.approx(7 * CALL_USD)
    (view,) = agent.tracker.snapshot(now=T0 + 80)
    assert view.to_json()["forecast"] is None  # above the cap now
    assert agent.tracker.stats()["budget_forecasts"] == 1


def test_the_run_s_forecast_is_shown_with_its_spend() -> None:
    agent = Agent("version: 1\nrun_budget: {max_cost_usd: 1.0}\n")
    root = agent.begin("agent", T0)
    for n in range(3):
        agent.step("agent", root, T0 + 10 * n)
    assert list(agent.budget_outcomes()) == []
    (view,) = agent.tracker.snapshot(now=T0 + 30)
    shown = view.to_json()["forecast"]
    assert shown is not None
    assert (shown["kind"], shown["cap"], shown["due"]) == ("max_cost_usd", 1.0, "")
    assert shown["spent"] == pytest.approx(3 * CALL_USD)
    assert shown["eta_s"] == pytest.approx((1.0 - 3 * CALL_USD) / shown["rate_per_s"], rel=1e-3)


def test_forecast_s_0_stops_a_run_only_once_it_crossed() -> None:
    agent = Agent("version: 1\nrun_budget: {max_cost_usd: 0.1, forecast_s: 0}\n")
    root = agent.begin("agent", T0)
    for n in range(8):
        agent.step("agent", root, T0 + 10 * n)
    (only,) = agent.budget_outcomes()
    assert only.failure.kind == "budget_exceeded" and only.decision.action.value == "escalate"


SERVICE_POLICY = """\
version: 1
service_budgets:
  "planner*": {max_cost_usd: 0.2, window_s: 3600, forecast_s: 30, action: abort_run}
  "writer": {max_cost_usd: 100}
"""


def test_a_service_s_runs_are_stopped_before_the_service_s_cap() -> None:
    agent = Agent(SERVICE_POLICY)
    runs = [agent.begin("planner-eu", T0 + k) for k in range(3)]
    writer = agent.begin("writer", T0)
    stopped: dict[str, float] = {}
    for n in range(4):
        for k, root in enumerate(runs):
            agent.step("planner-eu", root, T0 + 10 * n + k)
        agent.step("writer", writer, T0 + 10 * n)
    late = agent.begin("planner-eu", T0 + 40)  # a run that starts after the service's stop
    agent.step("planner-eu", late, T0 + 40)
    for outcome in agent.budget_outcomes():
        failure = outcome.failure
        assert (failure.kind, failure.rule, failure.service) == (
            "budget_forecast",
            "builtin.detect.service_budget",
            "planner-eu",
        )
        assert outcome.decision.action.value == "fail_fast"  # the service budget's action
        assert failure.run_id not in stopped  # each run once
        stopped[failure.run_id] = float(cast("float", failure.details["window_cost_usd"]))
    traces = [f"{r.get_span_context().trace_id:032x}" for r in [*runs, late]]
    # Every planner run, those running and the one that began later; never the writer.
    assert sorted(stopped) == sorted(traces)
    assert all(spent < 0.2 for spent in stopped.values())  # before the service's cap
    stats = agent.tracker.stats()
    assert (stats["service_budget_stops"], stats["service_budgets_tracked"]) == (4, 2)


def test_a_service_budget_escalates_by_default_and_only_its_own_services() -> None:
    policy = load_policy(
        text="version: 1\nrun_budget: {max_tokens: 10, action: abort_run}\n"
        "service_budgets: {'planner': {max_tokens: 50}}\n"
    )
    settings = policy.detectors.for_service
    budget = settings("planner").service_budget
    assert budget is not None and budget.max_tokens == 50
    assert settings("planner-eu").service_budget is None
    assert settings("planner").budget is not None  # the run budget holds as well
