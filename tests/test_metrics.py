"""``/metrics``: the Prometheus exposition of a running sidecar, and the dashboard built on it.

The sidecars here are real (ports bound, the span sent by the OpenTelemetry
SDK's OTLP/gRPC exporter); the exposition is read back with
``prometheus_client``'s own parser, and the dashboard's queries with a PromQL
parser, so a renamed metric or a typo in a query fails here.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from policies import load_policy
from supervisor.act.failure_log import MAX_KINDS, RecentFailures
from supervisor.api.metrics import MAX_BREAKER_SERIES, exposition
from supervisor.app import BackgroundSidecar
from supervisor.bounded import CappedCounts
from supervisor.forward.downstream import Downstream
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action, Decision, ErrorEvidence, Failure, FailureClass, Role
from supervisor.wiring import build_sidecar
from tests.test_app import settings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
AUTH = {"Authorization": "Bearer tok"}
#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def running(tmp_path: Path) -> Iterator[BackgroundSidecar]:
    background = BackgroundSidecar(build_sidecar(settings(tmp_path), load_policy()))
    background.start()
    try:
        yield background
    finally:
        background.stop()


def scrape(sidecar: BackgroundSidecar) -> str:
    answer = httpx.get(f"http://127.0.0.1:{sidecar.ports.api}/metrics", headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return answer.text


def samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def series(text: str) -> Series:
    return {(s.name, frozenset(s.labels.items())): s.value for s in samples(text)}


def value(found: Series, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def send_failing_span_over_grpc(sidecar: BackgroundSidecar) -> None:
    """An LLM call that timed out, as an agent's OpenTelemetry SDK exports it."""
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{sidecar.ports.otlp_grpc}", insecure=True)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        with provider.get_tracer("agent").start_as_current_span(
            "ChatCompletion",
            attributes={
                "openinference.span.kind": "LLM",
                "llm.provider": "openai",
                "llm.model_name": "gpt-4o",
            },
        ) as span:
            span.set_status(Status(StatusCode.ERROR, "APITimeoutError: Request timed out."))
    finally:
        provider.shutdown()


def scrape_until(sidecar: BackgroundSidecar, name: str, **labels: str) -> str:
    """The first scrape in which the ``name`` series with ``labels`` is above 0."""
    deadline = time.monotonic() + 10
    while True:
        text = scrape(sidecar)
        if value(series(text), name, **labels) > 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_the_exposition_parses_and_moves_when_a_failing_span_arrives(
    running: BackgroundSidecar,
) -> None:
    before = series(scrape(running))
    failure = {"class": "transient", "kind": "timeout"}
    assert value(before, "spanvisor_failures_total", **failure) == 0

    send_failing_span_over_grpc(running)
    after = series(scrape_until(running, "spanvisor_failures_total", **failure))

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("spanvisor_spans_received_total", transport="grpc") == 1
    assert moved("spanvisor_spans_received_total", transport="http/protobuf") == 0
    assert moved("spanvisor_failures_total", **failure) == 1
    assert moved("spanvisor_decisions_total", action="retry", observe_only="false") == 1
    assert moved("spanvisor_ingest_log_written_bytes_total") > 0
    assert moved("spanvisor_spans_rejected_total", transport="grpc") == 0
    dependency = {"dependency": "openai:gpt-4o"}
    assert value(after, "spanvisor_breaker_state", **dependency, state="closed") == 1
    assert value(after, "spanvisor_breaker_state", **dependency, state="open") == 0
    assert value(after, "spanvisor_breakers", state="closed") == 1
    assert value(after, "spanvisor_breaker_series_cut") == 0
    # /v1/stats reads the same counters.
    stats = httpx.get(f"http://127.0.0.1:{running.ports.api}/v1/stats", headers=AUTH).json()
    assert stats["pipeline"]["failures"] == value(after, "spanvisor_failures_total", **failure)
    assert stats["ingest"]["accepted_spans"] == sum(
        v for (name, _), v in after.items() if name == "spanvisor_spans_received_total"
    )


def test_spans_rejected_are_counted_by_the_transport_they_came_over(
    running: BackgroundSidecar,
) -> None:
    bad = {"traceId": "0" * 32, "spanId": "00000000000000a1", "name": "zero trace id"}
    body = {"resourceSpans": [{"scopeSpans": [{"spans": [bad]}]}]}
    answer = httpx.post(f"http://127.0.0.1:{running.ports.otlp_http}/v1/traces", json=body)
    assert answer.status_code == 200
    assert answer.json()["partialSuccess"]["rejectedSpans"] in (1, "1")

    found = series(scrape(running))
    assert value(found, "spanvisor_spans_rejected_total", transport="http/json") == 1
    assert value(found, "spanvisor_spans_rejected_total", transport="grpc") == 0
    assert value(found, "spanvisor_spans_received_total", transport="http/json") == 0


def test_metrics_need_the_bearer_token_and_liveness_does_not(running: BackgroundSidecar) -> None:
    base = f"http://127.0.0.1:{running.ports.api}"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = httpx.get(f"{base}/metrics", headers=headers)
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == 'Bearer realm="spanvisor"'
    assert httpx.get(f"{base}/healthz").status_code == 200


def selectors(query: str) -> dict[str, set[str]]:
    """The metric names a PromQL query selects, each with the labels it matches on."""
    found: dict[str, set[str]] = {}

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {query!r}"
            found.setdefault(node.name, set()).update(m.name for m in node.matchers.matchers)

    promql_parser.walk(promql_parser.parse(query), visit)  # raises ValueError on a bad query
    return found


def dashboard_queries() -> list[str]:
    """Every PromQL expression in the dashboard, Grafana's interval variables filled in."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    return [re.sub(r"\$__(rate_interval|interval|range)\b", "5m", q) for q in queries]


def test_every_dashboard_query_parses_and_uses_only_metrics_a_running_sidecar_exports(
    running: BackgroundSidecar,
) -> None:
    send_failing_span_over_grpc(running)
    text = scrape_until(
        running, "spanvisor_failures_total", **{"class": "transient", "kind": "timeout"}
    )
    exported: dict[str, set[str]] = {}
    for sample in samples(text):
        exported.setdefault(sample.name, set()).update(sample.labels)

    used: dict[str, set[str]] = {}
    for query in dashboard_queries():
        for name, labels in selectors(query).items():
            used.setdefault(name, set()).update(labels)

    assert used, "the dashboard has no queries"
    missing = sorted(set(used) - set(exported))
    assert not missing, f"the dashboard uses metrics the sidecar does not export: {missing}"
    for name, labels in used.items():
        unknown = labels - exported[name] - TARGET_LABELS
        assert not unknown, f"{name} has no label {sorted(unknown)}"
    # The instance variable's query names an exported metric too.
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    for variable in board["templating"]["list"]:
        found = re.search(r"label_values\((\w+),", variable.get("definition", ""))
        if found:
            assert found.group(1) in exported


def test_the_dashboard_check_sees_every_selector_and_refuses_a_bad_query() -> None:
    """Names come from the parsed query (not from a pattern that a function name would fool)."""
    query = (
        'sum by (class) (rate(spanvisor_failure_total{class="x"}[5m]))'
        " / on() group_left max(up{job=~'a'} offset 5m)"
    )
    assert selectors(query) == {"spanvisor_failure_total": {"class"}, "up": {"job"}}
    with pytest.raises(ValueError):
        selectors("sum(rate(spanvisor_failures_total[5m])")
    with pytest.raises(AssertionError, match="without a metric name"):
        selectors('{__name__="spanvisor_failures_total"}')


def outcome(kind: str, action: Action = Action.RETRY) -> Outcome:
    failure = Failure(
        trace_id="0" * 31 + "1",
        span_id="0" * 15 + "1",
        parent_span_id="",
        service="agent",
        span_name="call",
        run_id="r",
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind=kind,
        dependency="openai:gpt-4o",
        rule="r",
        message="",
        evidence=ErrorEvidence(),
        received_ns=0,
    )
    return Outcome(failure, Decision(action=action, policy="p"))


def test_failure_kinds_past_the_cap_count_as_other_and_as_cut() -> None:
    failures = RecentFailures(10)
    for n in range(MAX_KINDS + 5):
        failures.add(outcome(f"kind{n}"))
    failures.add(outcome("kind0", Action.FALLBACK))  # a kind already counted stays apart

    counts = dict(failures.by_kind.items())
    assert len(counts) == MAX_KINDS + 1
    assert counts[("transient", "other")] == 5
    assert counts[("transient", "kind0")] == 2
    assert failures.by_kind.cut == 5
    assert failures.by_action == {("retry", False): MAX_KINDS + 5, ("fallback", False): 1}
    assert failures.total == failures.by_kind.total == MAX_KINDS + 6


def test_capped_counts_refuse_a_capacity_below_one() -> None:
    with pytest.raises(ValueError, match="capacity"):
        CappedCounts[str](0)


def test_breaker_series_are_capped_with_the_breakers_not_closed_first(tmp_path: Path) -> None:
    sidecar = build_sidecar(settings(tmp_path), load_policy())
    try:
        board = sidecar.governor.board
        for n in range(MAX_BREAKER_SERIES + 20):
            board.record(f"tool:t{n:03d}", ok=True)
        board.isolate("tool:t119")  # sorts last: shown all the same
        found = series(exposition(sidecar.metric_sources())().decode())
    finally:
        sidecar.metrics.shutdown(1)
        sidecar.tracer.shutdown(1)
        sidecar.store.close()

    shown = {
        dict(labels)["dependency"]
        for (name, labels), _ in found.items()
        if name == "spanvisor_breaker_state"
    }
    assert len(shown) == MAX_BREAKER_SERIES
    assert "tool:t119" in shown and "tool:t099" not in shown
    assert value(found, "spanvisor_breaker_state", dependency="tool:t119", state="isolated") == 1
    assert value(found, "spanvisor_breaker_series_cut") == 20
    assert value(found, "spanvisor_breakers", state="closed") == MAX_BREAKER_SERIES + 19
    assert value(found, "spanvisor_breakers", state="isolated") == 1
    assert (
        value(found, "spanvisor_breaker_transitions_total", **{"from": "closed", "to": "isolated"})
        == 1
    )


def test_relay_metrics_are_there_only_with_a_downstream(tmp_path: Path) -> None:
    def exposed(downstream: Downstream | None) -> Series:
        sidecar = build_sidecar(settings(tmp_path), load_policy(), downstream=downstream)
        try:
            if sidecar.forwarder is not None:
                sidecar.forwarder.offer(b"x" * 100, 3)  # queued: the forwarder is not started
            return series(exposition(sidecar.metric_sources())().decode())
        finally:
            sidecar.metrics.shutdown(1)
            sidecar.tracer.shutdown(1)
            sidecar.store.close()

    assert not any(name.startswith("spanvisor_forward") for name, _ in exposed(None))
    found = exposed(Downstream("http://127.0.0.1:9/v1/traces", "http/protobuf"))
    assert value(found, "spanvisor_forward_queue_bytes") == 100
    assert value(found, "spanvisor_forward_spans_total") == 0
    assert value(found, "spanvisor_forward_dropped_spans_total") == 0
