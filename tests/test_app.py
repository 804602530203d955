"""The sidecar wired in process: ingest to verdicts, start-up errors, ordered shutdown."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.errors import ConfigError
from supervisor.forward.telemetry import DecisionTracer
from supervisor.settings import Settings, load_settings
from supervisor.wiring import build_sidecar


def settings(tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "otlp_grpc_port": 0,
        "otlp_http_port": 0,
        "api_port": 0,
        "api_token": "tok",
        "token_file": str(tmp_path / "token"),
    }
    values.update(overrides)
    return load_settings(overrides=values)


def failing_request() -> ExportTraceServiceRequest:
    span = Span(
        trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
        span_id=bytes.fromhex("b7ad6b7169203331"),
        name="ChatCompletion",
        attributes=[
            KeyValue(key="openinference.span.kind", value=AnyValue(string_value="LLM")),
            KeyValue(key="llm.provider", value=AnyValue(string_value="openai")),
            KeyValue(key="llm.model_name", value=AnyValue(string_value="gpt-4o")),
        ],
        status=Status(
            code=Status.STATUS_CODE_ERROR,
            message="APITimeoutError: Request timed out.",
        ),
    )
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    resource.scope_spans.add().spans.append(span)
    return request


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def running(tmp_path: Path, exporter: InMemorySpanExporter) -> Iterator[BackgroundSidecar]:
    sidecar = build_sidecar(
        settings(tmp_path),
        load_policy(),
        tracer=DecisionTracer(None, exporter=exporter, schedule_delay_s=0.05),
    )
    background = BackgroundSidecar(sidecar)
    background.start()
    try:
        yield background
    finally:
        background.stop()


def test_a_failing_span_over_http_becomes_a_failure_a_decision_and_a_decide_span(
    running: BackgroundSidecar, exporter: InMemorySpanExporter
) -> None:
    ports = running.ports
    response = httpx.post(
        f"http://127.0.0.1:{ports.otlp_http}/v1/traces",
        content=failing_request().SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 200

    auth = {"Authorization": "Bearer tok"}
    deadline = time.monotonic() + 10
    failures: list[dict[str, object]] = []
    while not failures and time.monotonic() < deadline:
        failures = httpx.get(f"http://127.0.0.1:{ports.api}/v1/failures", headers=auth).json()[
            "failures"
        ]
        time.sleep(0.02)
    assert [(f["class"], f["kind"], f["dependency"], f["action"]) for f in failures] == [
        ("transient", "timeout", "openai:gpt-4o", "retry")
    ]
    running.stop()  # the ordered shutdown flushes the decision span
    (decide,) = exporter.get_finished_spans()
    assert decide.name == "spanvisor.decide"
    assert decide.parent is not None
    assert format(decide.parent.span_id, "016x") == "b7ad6b7169203331"
    assert decide.attributes is not None
    assert decide.attributes["spanvisor.failure.kind"] == "timeout"


def test_a_port_in_use_is_a_clear_start_up_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        background = BackgroundSidecar(
            build_sidecar(settings(tmp_path, otlp_http_port=port), load_policy())
        )
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            background.start()


def test_a_control_api_beyond_loopback_needs_a_configured_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="beyond loopback, without a token"):
        build_sidecar(settings(tmp_path, api_host="0.0.0.0", api_token=None), load_policy())


def test_a_breaker_change_is_a_span_a_metric_and_a_log_line(
    tmp_path: Path, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    sidecar = build_sidecar(
        settings(tmp_path),
        load_policy(),
        tracer=DecisionTracer(None, exporter=exporter, schedule_delay_s=0.05),
        metric_reader=reader,
    )
    try:
        with caplog.at_level("WARNING", logger="spanvisor.app"):
            sidecar.governor.isolate("openai:gpt-4o")
            sidecar.governor.close("openai:gpt-4o")
        sidecar.tracer.force_flush(5)

        spans = [s for s in exporter.get_finished_spans() if s.name == "spanvisor.breaker"]
        assert [(s.attributes or {}).get("spanvisor.breaker.to") for s in spans] == [
            "isolated",
            "closed",
        ]
        data = reader.get_metrics_data()
        assert data is not None
        [metric] = [
            m
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == "spanvisor.breaker.transitions"
        ]
        counted = {
            (p.attributes or {}).get("spanvisor.breaker.reason"): p.value
            for p in metric.data.data_points  # type: ignore[union-attr]
        }
        assert counted == {"isolated": 1, "closed_manually": 1}
        assert [r.getMessage() for r in caplog.records].count("circuit breaker changed state") == 2
        assert sidecar.stats()["breakers"]["changes"] == 2
    finally:
        sidecar.metrics.shutdown(1)
        sidecar.tracer.shutdown(1)
        sidecar.store.close()


REMEDIATE_TIMEOUTS = """\
version: 1
remediators:
  switch:
    use: fallback_switch
    verify_window_s: 30
policies:
  - name: switch_on_timeout
    match: {kind: timeout}
    action: remediate
    remediator: switch
  - name: chain
    match: {kind: never}
    action: fallback
    chain: {"openai:*": ["openai:gpt-4o", "anthropic:claude-3-5-sonnet"]}
rules:
  - name: never
    match: {span_name: "never-a-span-name"}
    class: permanent
    kind: never
"""


def test_a_remediate_decision_runs_a_remediation_traced_and_linked_to_its_span(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(REMEDIATE_TIMEOUTS)
    sidecar = build_sidecar(
        settings(tmp_path, policy=str(policy_file)),
        load_policy(policy_file),
        tracer=DecisionTracer(None, exporter=exporter, schedule_delay_s=0.05),
    )
    background = BackgroundSidecar(sidecar)
    background.start()
    try:
        ports = background.ports
        httpx.post(
            f"http://127.0.0.1:{ports.otlp_http}/v1/traces",
            content=failing_request().SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        ).raise_for_status()
        remediations = sidecar.remediations
        deadline = time.monotonic() + 15
        while len(remediations.watch) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # acted (switch_fallback), now watching the run
        assert len(remediations.watch) == 1
        # The run's next LLM call succeeds: the remediation is verified.
        recovered = failing_request()
        span = recovered.resource_spans[0].scope_spans[0].spans[0]
        span.span_id = bytes.fromhex("00000000000000aa")
        span.status.Clear()
        httpx.post(
            f"http://127.0.0.1:{ports.otlp_http}/v1/traces",
            content=recovered.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        ).raise_for_status()
        runner = remediations.runner
        assert runner is not None
        outcome = None
        while outcome is None and time.monotonic() < deadline:
            listed = runner.list()
            outcome = listed[0]["outcome"] if listed else None
            time.sleep(0.05)
        assert outcome == "succeeded"
        reported = sidecar.stats()["remediations"]
        assert (reported["running"], reported["dispatched"], reported["succeeded"]) == (True, 1, 1)
        commands = sidecar.store.commands()
        assert [c.command.type.value for c in commands] == ["switch_fallback"]
        assert commands[0].command.params["to"] == "anthropic:claude-3-5-sonnet"
    finally:
        background.stop()
    spans = exporter.get_finished_spans()
    (decide,) = [s for s in spans if s.name == "spanvisor.decide"]
    assert decide.attributes is not None
    remediation_trace = decide.attributes["spanvisor.remediation.trace_id"]
    (root,) = [s for s in spans if s.name == "spanvisor.remediate switch"]
    assert format(root.context.trace_id, "032x") == remediation_trace
    assert root.parent is None
    (link,) = root.links
    assert format(link.context.span_id, "016x") == "b7ad6b7169203331"
    assert format(link.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
