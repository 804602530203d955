"""OTLP receivers beyond loopback: a bearer token checked on HTTP and gRPC, or an explicit opt-out.

Real OpenTelemetry exporters, configured with headers the way
``OTEL_EXPORTER_OTLP_HEADERS`` configures them, against a sidecar started in
process on real sockets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util.re import parse_env_headers

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.errors import ConfigError
from supervisor.settings import Settings, load_settings
from supervisor.wiring import build_sidecar

OTLP_TOKEN = "otlp-token-0123456789abcdef"
API_TOKEN = "api-token-0123456789abcdef"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def settings(tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "otlp_grpc_port": 0,
        "otlp_http_port": 0,
        "api_port": 0,
        "api_token": API_TOKEN,
        "token_file": str(tmp_path / "token"),
        "state_path": ":memory:",
    }
    values.update(overrides)
    return load_settings(overrides=values)


def spans(n: int = 2) -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(n):
        with tracer.start_as_current_span(f"step {i}"):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def env_headers(value: str) -> dict[str, str]:
    """Headers as the exporters read ``OTEL_EXPORTER_OTLP_HEADERS``."""
    return parse_env_headers(value, liberal=True)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[BackgroundSidecar]:
    # Loopback, so the test exposes nothing; a configured token is required on any host.
    sidecar = build_sidecar(settings(tmp_path, otlp_token=OTLP_TOKEN), load_policy())
    background = BackgroundSidecar(sidecar)
    background.start()
    try:
        yield background
    finally:
        background.stop()


def accepted_spans(running: BackgroundSidecar) -> int:
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    stats = httpx.get(f"http://127.0.0.1:{running.ports.api}/v1/stats", headers=auth).json()
    return int(stats["ingest"]["accepted_spans"])


def stats(running: BackgroundSidecar) -> dict[str, object]:
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    answer = httpx.get(f"http://127.0.0.1:{running.ports.api}/v1/stats", headers=auth).json()
    assert answer["policy"]["regex_timeouts"] >= 0  # rule regexes stopped at their limit
    return dict(answer["otlp_auth"])


def test_http_exporter_with_the_token_is_accepted_without_it_refused(
    guarded: BackgroundSidecar,
) -> None:
    url = f"http://127.0.0.1:{guarded.ports.otlp_http}/v1/traces"
    good = HttpSpanExporter(
        endpoint=url, headers=env_headers(f"Authorization=Bearer%20{OTLP_TOKEN}"), timeout=10
    )
    bad = HttpSpanExporter(endpoint=url, headers={"authorization": "Bearer wrong"}, timeout=10)
    none = HttpSpanExporter(endpoint=url, timeout=10)
    try:
        assert good.export(spans(3)) == SpanExportResult.SUCCESS
        assert bad.export(spans()) == SpanExportResult.FAILURE
        assert none.export(spans()) == SpanExportResult.FAILURE
    finally:
        for exporter in (good, bad, none):
            exporter.shutdown()
    assert accepted_spans(guarded) == 3
    assert stats(guarded) == {"required": True, "refused": 2}
    answer = httpx.post(url, content=b"", headers={"Content-Type": "application/x-protobuf"})
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"].startswith("Bearer")


def test_grpc_exporter_with_the_token_is_accepted_without_it_refused(
    guarded: BackgroundSidecar,
) -> None:
    endpoint = f"http://127.0.0.1:{guarded.ports.otlp_grpc}"
    good = GrpcSpanExporter(
        endpoint=endpoint,
        insecure=True,
        headers=env_headers(f"Authorization=Bearer%20{OTLP_TOKEN}"),
        timeout=10,
    )
    bad = GrpcSpanExporter(
        endpoint=endpoint, insecure=True, headers={"authorization": "Bearer x"}, timeout=10
    )
    try:
        assert good.export(spans(4)) == SpanExportResult.SUCCESS
        assert bad.export(spans()) == SpanExportResult.FAILURE
    finally:
        good.shutdown()
        bad.shutdown()
    assert accepted_spans(guarded) == 4
    with (
        grpc.insecure_channel(f"127.0.0.1:{guarded.ports.otlp_grpc}") as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        channel.unary_unary(EXPORT)(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stats(guarded) == {"required": True, "refused": 2}


def test_otlp_beyond_loopback_without_a_token_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SPANVISOR_OTLP_TOKEN"):
        build_sidecar(settings(tmp_path, host="0.0.0.0"), load_policy())


def test_a_short_otlp_token_beyond_loopback_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        build_sidecar(settings(tmp_path, host="0.0.0.0", otlp_token="short"), load_policy())


def test_the_explicit_opt_out_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="spanvisor.wiring"):
        sidecar = build_sidecar(
            settings(tmp_path, host="0.0.0.0", otlp_unauthenticated=True), load_policy()
        )
    sidecar.metrics.shutdown(1)
    sidecar.tracer.shutdown(1)
    sidecar.store.close()
    assert "without authentication" in caplog.text


def test_the_otlp_token_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPANVISOR_OTLP_TOKEN", OTLP_TOKEN)
    assert settings(tmp_path).otlp_token == OTLP_TOKEN


def test_refusals_cost_no_more_than_the_answer(guarded: BackgroundSidecar) -> None:
    """A refused request is answered before its body is read: a huge one is refused at once."""
    url = f"http://127.0.0.1:{guarded.ports.otlp_http}/v1/traces"
    start = time.monotonic()
    answer = httpx.post(
        url,
        content=b"\0" * (4 * 1024 * 1024),
        headers={"Content-Type": "application/x-protobuf"},
        timeout=10,
    )
    assert answer.status_code == 401
    assert time.monotonic() - start < 5
