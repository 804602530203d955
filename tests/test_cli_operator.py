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


def _failures(count: int, service: str = "agent") -> bytes:
    """``count`` failing LLM calls of ``service``, each its own span, in one request.

    Their run's root has not ended (it is not among them): an escalation pauses it,
    by a command to ``service``.
    """
    request = ExportTraceServiceRequest.FromString(_auth_failure())
    resource = request.resource_spans[0]
    resource.resource.attributes[0].value.string_value = service
    [span] = resource.scope_spans[0].spans
    span.parent_span_id = bytes.fromhex("00f067aa0ba902b7")
    for n in range(1, count):
        again = resource.scope_spans[0].spans.add()
        again.CopyFrom(span)
        again.span_id = (0xB7AD6B7169203331 + n).to_bytes(8, "big")
    return request.SerializeToString()


def _send(background: BackgroundSidecar, body: bytes) -> None:
    answer = httpx.post(
        f"http://127.0.0.1:{background.ports.otlp_http}/v1/traces",
        content=body,
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert answer.status_code == 200


@pytest.mark.slow
def test_incidents_are_the_stored_ones_and_survive_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": "operator-token",
            "policy": str(policy_file),
            "state_path": str(tmp_path / "state" / "state.db"),
            "agents": {"agent": {"pull": {}}},
        }
    )
    first = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
    first.start()
    try:
        _send(first, _failures(9))
        _until(lambda: len(first.sidecar.store.incidents()) == 9)
    finally:
        first.stop()

    second = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
    ports = second.start()
    remote = ["--api", f"http://127.0.0.1:{ports.api}", "--token", "operator-token"]
    try:
        assert main(["incidents", *remote, "--output", "jsonl"]) == 0
        listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(listed) == 9
        assert {i["kind"] for i in listed} == {"auth"}
        assert len({i["span_id"] for i in listed}) == 9

        assert main(["incidents", *remote, "--limit", "4"]) == 0
        out, err = capsys.readouterr()
        assert len(out.splitlines()) == 1 + 4  # the header and four
        assert "the first 4 shown; more with --limit N or --all" in err
        assert main(["incidents", *remote, "--limit", "4", "--all"]) == 0
        out, err = capsys.readouterr()
        assert (len(out.splitlines()), err) == (1 + 9, "")
    finally:
        second.stop()


def _leaves(tree: dict[str, object], prefix: str = "") -> dict[str, object]:
    found: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            found.update(_leaves(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def test_stats_name_each_fact_once(
    running: tuple[BackgroundSidecar, list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    background, remote, _ = running
    _send(background, _failures(3, service="ghost"))  # no channel: each command is dead
    store = background.sidecar.store
    _until(lambda: len(store.commands(status="dead")) == 3)

    _until(lambda: background.sidecar.stats()["delivery"]["commands"]["dead"] == 3)
    leaves = _leaves(background.sidecar.stats())

    # Dead letters, deliveries, failures judged and store errors: one counter each.
    for gone in (
        "delivery.dead_lettered",
        "delivery.delivered",
        "delivery.store_errors",
        "failures.total",
        "decisions.emitted",
    ):
        assert gone not in leaves, gone
    assert leaves["pipeline.failures"] == 3
    assert leaves["delivery.store.failed_attempts"] == 0
    assert leaves["delivery.push.in_flight"] == 0
    assert main(["commands", "--dead", *remote, "--output", "jsonl"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == leaves["delivery.commands.dead"]


REMEDIATING = """\
version: 1
remediators:
  switch: {use: fallback_switch}
policies:
  - name: fix-it
    match: {kind: unavailable}
    action: remediate
    remediator: switch
"""


@pytest.mark.parametrize(
    ("policy_text", "state_path", "state", "said"),
    [
        (
            REMEDIATING,
            "state.db",
            "idle",
            "no remediation has been decided since this sidecar started; the runner starts"
            " at the first `remediate` decision",
        ),
        (
            "version: 1\nbuiltin: false\npolicies:\n  - {name: all, action: fail_fast}\n",
            "state.db",
            "unused",
            "the policy in force has no `remediate` action",
        ),
        (REMEDIATING, ":memory:", "off", "there is no database to keep them in"),
    ],
)
def test_remediations_say_what_is_the_case_before_any_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    policy_text: str,
    state_path: str,
    state: str,
    said: str,
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy_text)
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": "operator-token",
            "policy": str(policy_file),
            "state_path": state_path if state_path == ":memory:" else str(tmp_path / state_path),
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
    ports = background.start()
    remote = ["--api", f"http://127.0.0.1:{ports.api}", "--token", "operator-token"]
    try:
        assert main(["remediations", *remote, "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert (answer["running"], answer["state"]) == (False, state)
        assert main(["remediations", *remote]) == 0
        out = capsys.readouterr().out
        assert said in out
        assert "or there is no state database" not in out  # no guessing between causes
    finally:
        background.stop()
