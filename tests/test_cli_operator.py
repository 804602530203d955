"""The operator verbs (approvals, breakers, commands, reload) against a running sidecar.

A real sidecar in process (real sockets, SQLite in tmp_path); the CLI talks
to its control API as an operator's shell would, and an agent's failing span
arrives over OTLP/HTTP.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.cli.verbs import main
from supervisor.settings import load_settings
from supervisor.wiring import build_sidecar

POLICY = """\
version: 1
policies:
  - name: ask-a-person
    match: {kind: auth}
    action: escalate
"""


def _auth_failure() -> bytes:
    span = Span(
        trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
        span_id=bytes.fromhex("b7ad6b7169203331"),
        name="chat gpt-4o",
        attributes=[
            KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="chat")),
            KeyValue(key="gen_ai.system", value=AnyValue(string_value="openai")),
            KeyValue(key="gen_ai.request.model", value=AnyValue(string_value="gpt-4o")),
            KeyValue(key="error.type", value=AnyValue(string_value="AuthenticationError")),
        ],
        status=Status(
            code=Status.STATUS_CODE_ERROR,
            message="Error code: 401 - {'error': {'code': 'invalid_api_key'}}",
        ),
    )
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    resource.scope_spans.add().spans.append(span)
    return request.SerializeToString()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[BackgroundSidecar, list[str], Path]]:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": "operator-token",
            "policy": str(policy_file),
            "agents": {"agent": {"pull": {}}},
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
    ports = background.start()
    remote = ["--api", f"http://127.0.0.1:{ports.api}", "--token", "operator-token"]
    try:
        yield background, remote, policy_file
    finally:
        background.stop()


def _until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_escalation_is_approved_from_the_cli(
    running: tuple[BackgroundSidecar, list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    background, remote, _ = running
    ports = background.ports
    answer = httpx.post(
        f"http://127.0.0.1:{ports.otlp_http}/v1/traces",
        content=_auth_failure(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert answer.status_code == 200
    store = background.sidecar.store
    _until(lambda: store.approvals(status="pending"))

    assert main(["approvals", *remote, "--output", "jsonl"]) == 0
    [listed] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (listed["status"], listed["what"]["kind"]) == ("pending", "auth")

    assert main(["approvals", "approve", listed["id"], *remote, "--by", "ops"]) == 0
    assert f"{listed['id']}: approved by ops" in capsys.readouterr().out
    assert main(["approvals", "deny", listed["id"], *remote]) == 2  # answered already
    assert "already answered" in capsys.readouterr().err

    assert main(["commands", *remote, "--output", "jsonl"]) == 0
    types = sorted(json.loads(line)["type"] for line in capsys.readouterr().out.splitlines())
    # The failed call was its trace's root: the run had ended, so nothing was paused.
    assert types == ["approval_result"]


def test_breakers_are_isolated_and_closed_from_the_cli(
    running: tuple[BackgroundSidecar, list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    background, remote, _ = running

    assert main(["breakers", "isolate", "openai:gpt-4o", *remote]) == 0
    assert "openai:gpt-4o: isolated" in capsys.readouterr().out
    assert background.sidecar.governor.breaker_state("openai:gpt-4o").value == "isolated"
    assert main(["breakers", *remote]) == 0
    assert "isolated" in capsys.readouterr().out
    assert main(["breakers", "close", "openai:gpt-4o", *remote]) == 0
    assert background.sidecar.governor.breaker_state("openai:gpt-4o").value == "closed"
    assert main(["breakers", "isolate", *remote]) == 2
    assert "needs a dependency" in capsys.readouterr().err


def test_a_bad_policy_file_is_rejected_on_reload_and_the_old_one_kept(
    running: tuple[BackgroundSidecar, list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    background, remote, policy_file = running
    before = background.sidecar.policy

    policy_file.write_text(
        "version: 1\npolicies:\n  - {name: x, action: retry, max_attempts: -1}\n"
    )
    assert main(["reload", *remote]) == 1
    assert "max_attempts" in capsys.readouterr().err
    assert background.sidecar.policy is before

    policy_file.write_text(POLICY.replace("escalate", "fail_fast"))
    assert main(["reload", *remote]) == 0
    assert background.sidecar.policy is not before
    assert background.sidecar.stats()["policy"]["reloads"] == {"ok": 1, "rejected": 1}


def test_operator_verbs_explain_what_went_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    closed = ["--api", "http://127.0.0.1:9", "--token", "x"]
    assert main(["breakers", *closed]) == 2
    assert "cannot reach the control API" in capsys.readouterr().err
    assert main(["approvals", "approve", *closed]) == 2
    assert "needs the request's id" in capsys.readouterr().err
