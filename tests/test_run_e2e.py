"""`spanvisor run` as a real process: a real instrumented agent in, verdicts and spans out."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from supervisor.testing.fake_provider import FakeProvider, Reply
from supervisor.testing.otlp_recorder import OtlpRecorder
from supervisor.testing.sidecar_process import wait_until

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningSidecar:
    process: subprocess.Popen[str]
    grpc_port: int
    http_port: int
    api: str
    token: str

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(
            f"{self.api}{path}",
            params=params,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=5,
        )
        response.raise_for_status()
        return response.json()


@pytest.fixture
def recorder() -> Iterator[OtlpRecorder]:
    with OtlpRecorder() as rec:
        yield rec


@pytest.fixture
def sidecar(recorder: OtlpRecorder, tmp_path: Any) -> Iterator[RunningSidecar]:
    grpc_port, http_port, api_port = free_port(), free_port(), free_port()
    token = secrets.token_urlsafe(16)
    env = {
        **os.environ,
        "SPANVISOR_OTLP_GRPC_PORT": str(grpc_port),
        "SPANVISOR_OTLP_HTTP_PORT": str(http_port),
        "SPANVISOR_API_PORT": str(api_port),
        "SPANVISOR_API_TOKEN": token,
        "SPANVISOR_TOKEN_FILE": str(tmp_path / "token"),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": recorder.http_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "run"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    api = f"http://127.0.0.1:{api_port}"
    running = RunningSidecar(process, grpc_port, http_port, api, token)

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"sidecar exited: {process.communicate()[1]}")
        try:
            return httpx.get(f"{api}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 15.0, "the sidecar to be healthy")
    try:
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def run_agent_step(sidecar: RunningSidecar, provider: FakeProvider) -> None:
    """A real openai client, instrumented with OpenInference, exporting over gRPC."""
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": "e2e-agent"}))
    tracer_provider.add_span_processor(
        SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"127.0.0.1:{sidecar.grpc_port}", insecure=True)
        )
    )
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    try:
        client = openai.OpenAI(base_url=provider.base_url, api_key="sk-test", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
            )
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "fine"
    finally:
        instrumentor.uninstrument()
        tracer_provider.shutdown()


def test_failure_is_classified_forwarded_and_decided_then_sigterm_exits_0(
    sidecar: RunningSidecar, recorder: OtlpRecorder
) -> None:
    with FakeProvider(default=Reply.text("fine")) as provider:
        provider.script(Reply.rate_limited(retry_after_s=2))
        run_agent_step(sidecar, provider)

    failures = wait_until(
        lambda: sidecar.get("/v1/failures")["failures"], 15.0, "a failure in /v1/failures"
    )
    assert len(failures) == 1
    failure = failures[0]
    assert (failure["class"], failure["kind"], failure["dependency"]) == (
        "transient",
        "rate_limit",
        "openai:gpt-4o-mini",
    )
    assert failure["service"] == "e2e-agent"
    assert failure["action"] == "retry"
    assert failure["params"]["delay_s"] >= 2.0  # the server's retry-after is honoured

    # The agent's own spans arrive downstream unchanged, and the decision next to them.
    spans = recorder.wait_for_spans(
        lambda got: any(s.name == "spanvisor.decide" for s in got) and len(got) >= 3,
        timeout_s=20,
    )
    by_name: dict[str, list[Any]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    decide = by_name["spanvisor.decide"][0]
    assert decide.trace_id.hex() == failure["trace_id"]
    assert decide.parent_span_id.hex() == failure["span_id"]
    attrs = {kv.key: kv.value for kv in decide.attributes}
    assert attrs["spanvisor.failure.class"].string_value == "transient"
    assert attrs["spanvisor.failure.kind"].string_value == "rate_limit"
    assert attrs["spanvisor.action"].string_value == "retry"
    agent_spans = [s for s in spans if s.name != "spanvisor.decide"]
    assert len(agent_spans) == 2  # the failed and the successful LLM call, forwarded as sent

    stats = sidecar.get("/v1/stats")
    assert stats["pipeline"]["failures"] == 1
    assert stats["forward"]["forwarded_spans"] >= 2

    sidecar.process.send_signal(signal.SIGTERM)
    _, err = sidecar.process.communicate(timeout=30)
    assert sidecar.process.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(line["msg"] == "spanvisor stopped" for line in lines)
    assert any(line.get("event") == "failure" for line in lines)


def test_control_api_requires_the_token(sidecar: RunningSidecar) -> None:
    response = httpx.get(f"{sidecar.api}/v1/failures", timeout=5)
    assert response.status_code == 401
    wrong = httpx.get(
        f"{sidecar.api}/v1/failures", headers={"Authorization": "Bearer nope"}, timeout=5
    )
    assert wrong.status_code == 401
    assert httpx.get(f"{sidecar.api}/healthz", timeout=5).status_code == 200
