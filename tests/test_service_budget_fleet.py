"""A service's budget held by the fleet: its spend counted in the sidecars' shared Redis.

Each sidecar is a pipeline with its run tracker and fleet counts, as the wiring
builds them, sharing the test Redis under a namespace of their own; the spans
are made by the real OTel SDK with gen_ai usage tokens, received at injected
times. Redis away goes through a loopback proxy that drops connections.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.trace import Span, set_span_in_context

from policies import ServiceBudgetSpec
from supervisor.judge.pipeline import Outcome
from supervisor.runs.fleet import FleetRuns
from supervisor.runs.fleet_services import FleetServices
from supervisor.shared_breakers import RedisLink, shared_breakers
from tests.redis_server import REDIS, RedisProxy
from tests.test_budget_forecast import Agent

URL = f"redis://{REDIS[0]}:{REDIS[1]}/0"
T0 = 1_700_000_000.0
#: gpt-4o in the built-in table: $2.50 and $10.00 per million input and output tokens.
CALL_USD = (4000 * 2.5 + 500 * 10.0) / 1e6  # $0.015
#: Crossed at the 7th call: one sidecar seeing half of them never crosses it.
CAPPED = """\
version: 1
service_budgets:
  "planner*": {max_cost_usd: 0.1, window_s: 3600, forecast_s: 0, action: abort_run}
"""
SERVICE_RULE = "builtin.detect.service_budget"


class Sidecar(Agent):
    """One sidecar: a pipeline judging the LLM calls of its agents' runs, fleet-wide."""

    def __init__(
        self, namespace: str, policy: str = CAPPED, *, url: str = URL, retry_s: float = 5.0
    ) -> None:
        _, link = shared_breakers(
            url, namespace=namespace, timeout_s=0.25, retry_s=retry_s, required=False
        )
        assert link is not None
        self.link: RedisLink = link
        self.fleet = FleetRuns(link, f"{namespace}:runs")
        super().__init__(policy, fleet=self.fleet)

    def call(self, service: str, root: Span, at: float, session: str = "") -> list[Outcome]:
        """One LLM call of 2 s under ``root``, exported when it ends: the service stops."""
        tracer = self.tracer(service)
        llm = tracer.start_span(
            "chat gpt-4o", context=set_span_in_context(root), start_time=int(at * 1e9)
        )
        llm.set_attributes(
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.usage.input_tokens": 4000,
                "gen_ai.usage.output_tokens": 500,
            }
        )
        if session:
            llm.set_attribute("session.id", session)
        llm.end(end_time=int((at + 2) * 1e9))
        spans = self.exporter.get_finished_spans()
        self.exporter.clear()
        payload = encode_spans(spans).SerializeToString()
        outcomes = self.pipeline.process_payload(payload, received_ns=int((at + 2) * 1e9))
        return [o for o in outcomes if o.failure.rule == SERVICE_RULE]


def test_two_sidecars_each_seeing_half_stop_the_service_at_the_fleet_s_cap(
    namespace: str, direct: Any
) -> None:
    a, b = Sidecar(namespace), Sidecar(namespace)
    run_a, run_b = a.begin("planner-eu", T0), b.begin("planner-eu", T0)
    stops: list[tuple[str, int, Outcome]] = []
    for n in range(5):  # the calls alternate: a, b, a, b, ... 10 s apart
        stops += [("a", 2 * n, o) for o in a.call("planner-eu", run_a, T0 + 20 * n)]
        stops += [("b", 2 * n + 1, o) for o in b.call("planner-eu", run_b, T0 + 20 * n + 10)]
    # The 7th call crosses $0.10 fleet-wide; b sees a's calls up to its last round trip,
    # and stops its run at its 4th (the fleet's 8th), a at its 5th: each run once.
    assert [(who, n) for who, n, _ in stops] == [("b", 7), ("a", 8)]
    for _, n, outcome in stops:
        failure = outcome.failure
        assert (failure.kind, failure.service) == ("budget_exceeded", "planner-eu")
        assert outcome.decision.action.value == "fail_fast"
        # The fleet's calls but the other sidecar's latest (one round trip behind on it).
        assert failure.details["window_cost_usd"] == pytest.approx(n * CALL_USD)
        assert failure.message.startswith("max_cost_usd: service planner-eu spent")
    # One key for the service under the namespace, hashed, expiring with the window.
    (key,) = direct.scan_iter(match=f"{namespace}:runs:service:*")
    assert 0 < direct.pttl(key) <= 3_600_000
    costs = [float(v.split()[0]) for f, v in direct.hgetall(key).items() if _bucket(f)]
    assert sum(costs) == pytest.approx(10 * CALL_USD)

    # The same calls on one sidecar each, no fleet: neither crosses the cap.
    for who in ("a", "b"):
        alone = Sidecar(f"{namespace}:alone-{who}", url="redis://127.0.0.1:1/0", retry_s=60)
        root = alone.begin("planner-eu", T0)
        assert [o for n in range(5) for o in alone.call("planner-eu", root, T0 + 20 * n)] == []


def test_the_forecast_uses_the_fleet_s_burn_rate(namespace: str) -> None:
    policy = CAPPED.replace("max_cost_usd: 0.1", "max_cost_usd: 0.2").replace(
        "forecast_s: 0", "forecast_s: 20"
    )
    a, b = Sidecar(namespace, policy), Sidecar(namespace, policy)
    run_a, run_b = a.begin("planner", T0), b.begin("planner", T0)
    stops = []
    for n in range(8):  # a call every 5 s fleet-wide: $0.003/s; each sidecar's half of it
        stops += a.call("planner", run_a, T0 + 10 * n)
        stops += b.call("planner", run_b, T0 + 10 * n + 5)
    first = stops[0].failure
    assert first.kind == "budget_forecast"
    details: dict[str, Any] = dict(first.details)
    forecast = details["forecast"]
    assert forecast["due"] == "horizon"
    assert forecast["rate_per_s"] == pytest.approx(0.003, rel=0.15)  # the fleet's rate
    assert details["window_cost_usd"] < 0.2  # before the cap
    assert len({o.failure.run_id for o in stops}) == len(stops) == 2


def test_redis_away_counts_locally_and_the_spend_catches_up(
    namespace: str, proxy: RedisProxy, direct: Any
) -> None:
    a = Sidecar(namespace, url=proxy.url, retry_s=0.3)
    b = Sidecar(namespace)
    run_a, run_b = a.begin("planner", T0), b.begin("planner", T0)
    proxy.set("drop")
    for n in range(4):  # $0.06 while Redis is away: the local count decides, not crossed
        assert a.call("planner", run_a, T0 + 10 * n) == []
    assert a.fleet.services.backlog == 1 and not a.link.stats().reachable
    other = a.begin("planner", T0 + 40)  # the local count decides, against the fleet's cap
    for n in range(2):
        assert a.call("planner", other, T0 + 40 + n) == []
    assert b.call("planner", run_b, T0 + 50) + b.call("planner", run_b, T0 + 60) == []

    proxy.set("forward")
    time.sleep(0.35)  # the link asks Redis again after retry_s
    # a's next batch sends its backlog too: 7 calls of a's and 2 of b's.
    (here,) = a.call("planner", run_a, T0 + 70)  # its own 7th call: crossed here
    assert here.failure.details["window_calls"] == 7
    assert a.fleet.services.backlog == 0
    (key,) = direct.scan_iter(match=f"{namespace}:runs:service:*")
    calls = sum(int(v.split()[2]) for f, v in direct.hgetall(key).items() if _bucket(f))
    assert calls == 9
    # b's view is a round trip behind: its next call adopts the fleet's 10 calls, and
    # the one after crosses with a's backlog in it (b alone: 4 calls, $0.06).
    assert b.call("planner", run_b, T0 + 80) == []
    (late,) = b.call("planner", run_b, T0 + 90)
    assert late.failure.details["window_calls"] == 11


def test_a_session_run_on_two_sidecars_is_stopped_once_fleet_wide(namespace: str) -> None:
    a, b = Sidecar(namespace), Sidecar(namespace)
    stops: list[Outcome] = []
    for n in range(6):  # one session; each call in a trace of its own, on a or b in turn
        side = (a, b)[n % 2]
        stops += side.call("planner", side.begin("planner", T0 + 10 * n), T0 + 10 * n, "s-1")
    # The 7th call and after cross: found by both sidecars' counts, reported once.
    for n in range(6, 10):
        side = (a, b)[n % 2]
        stops += side.call("planner", side.begin("planner", T0 + 10 * n), T0 + 10 * n, "s-1")
    assert len(stops) == 1 and stops[0].failure.run_id.endswith("s-1")
    found = a.tracker.stats()["service_budget_stops"] + b.tracker.stats()["service_budget_stops"]
    assert found == 2  # each sidecar's own count found it


def test_the_backlog_is_bounded_and_counts_what_it_drops() -> None:
    spec = ServiceBudgetSpec(max_cost_usd=1.0, window_s=60)
    services = FleetServices("ns", max_backlog=1)
    for n, service in enumerate(("planner", "writer")):
        assert services.charge(service, spec, now=T0 + n, cost=0.01, tokens=10) is None
    services.answered(services.take(catch_up=True), None)  # Redis did not answer
    assert (services.backlog, services.backlog_dropped) == (1, 1)
    for n in range(200):  # a call every 2 s while away: a window's worth of buckets kept
        services.charge("planner", spec, now=T0 + 2 * n, cost=0.01, tokens=10)
        services.answered(services.take(catch_up=True), None)
    (sent,) = services.wire(services.take(catch_up=True))
    assert len(sent["s"]) <= 60 and services.backlog_dropped > 1
    assert str(sent["k"]).startswith("ns:service:{") and "planner" not in str(sent["k"])


def _bucket(field: bytes) -> bool:
    """Whether a field of a service's hash is one of its window's buckets."""
    return field[:1] == b"b" and field[1:].isdigit()


def test_the_fleet_s_spend_leaves_its_window(namespace: str, direct: Any) -> None:
    policy = CAPPED.replace("window_s: 3600", "window_s: 60")
    a, b = Sidecar(namespace, policy), Sidecar(namespace, policy)
    run_a, run_b = a.begin("planner", T0), b.begin("planner", T0)
    stops = []
    for n in range(5):  # 10 calls within 50 s: crossed at the fleet's 8th
        stops += a.call("planner", run_a, T0 + 10 * n)
        stops += b.call("planner", run_b, T0 + 10 * n + 5)
    assert len(stops) == 2
    # Two minutes later the window holds only what is new: new runs go on as usual.
    fresh = a.begin("planner", T0 + 170), b.begin("planner", T0 + 170)
    assert a.call("planner", fresh[0], T0 + 170) + b.call("planner", fresh[1], T0 + 175) == []
    (key,) = direct.scan_iter(match=f"{namespace}:runs:service:*")
    assert sum(1 for field in direct.hkeys(key) if _bucket(field)) == 2  # the old ones gone
    assert 0 < direct.pttl(key) <= 60_000
