"""``POST /v1/admit`` on real sidecars sharing a real Redis, and ``guard(admit=True)``."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.client import SupervisorClient, guard
from supervisor.wiring import build_sidecar
from tests.redis_server import REDIS
from tests.test_app import settings as sidecar_settings
from tests.test_shared_breakers import AUTH

# No headroom: the tests count exact admissions.
POLICY = """\
version: 1
admission:
  default: {rpm: 1000, headroom: 0}
  keys:
    "openai:gpt-4o@team-a": {rpm: 2, headroom: 0}
"""
BODY = {"dependency": "openai:gpt-4o", "credential": "team-a", "service": "agent"}


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture
def fleet(tmp_path: Path, namespace: str, direct: Any) -> Iterator[list[BackgroundSidecar]]:
    url = f"redis://{REDIS[0]}:{REDIS[1]}/0"
    sidecars = []
    for name in ("a", "b"):
        settings = sidecar_settings(
            tmp_path / name,
            breaker_redis_url=url,
            breaker_redis_namespace=namespace,
            breaker_redis_timeout_s=0.25,
            state_path=str(tmp_path / name / "state.db"),
        )
        background = BackgroundSidecar(build_sidecar(settings, load_policy(text=POLICY)))
        background.start()
        sidecars.append(background)
    try:
        yield sidecars
    finally:
        for background in sidecars:
            background.stop()


def admit(sidecar: BackgroundSidecar, **body: Any) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{sidecar.ports.api}/v1/admit", headers=AUTH, json={**BODY, **body}
    )


@pytest.mark.slow
def test_two_sidecars_admit_within_one_limit_and_refuse_secrets(
    fleet: list[BackgroundSidecar],
) -> None:
    a, b = fleet
    found = [admit(s).json() for s in (a, b, a)]

    assert found[:2] == [{"go": True}, {"go": True}]
    assert found[2]["go"] is False and found[2]["why"] == "limit"
    assert 25_000 < found[2]["wait_ms"] <= 30_000  # one request refills in 30 s at 2 a minute
    assert admit(a, credential="team-b").json() == {"go": True}  # the default's 1000 a minute
    secret = admit(a, credential="sk-proj-abc123")
    assert secret.status_code == 400 and "sk-proj" not in secret.text
    assert httpx.post(f"http://127.0.0.1:{a.ports.api}/v1/admit", json=BODY).status_code == 401
    stats = httpx.get(f"http://127.0.0.1:{a.ports.api}/v1/stats", headers=AUTH).json()
    assert stats["admission"]["answered_locally"] == 0
    metrics = httpx.get(f"http://127.0.0.1:{a.ports.api}/metrics", headers=AUTH).text
    assert 'spanvisor_admissions_total{answer="wait"} 1.0' in metrics
    assert "spanvisor_admissions_local_total 0.0" in metrics


@pytest.mark.slow
def test_guard_with_admit_waits_the_advised_time_bounded(fleet: list[BackgroundSidecar]) -> None:
    sleeps = Sleeps()
    client = SupervisorClient(
        f"http://127.0.0.1:{fleet[0].ports.api}", "tok", timeout_s=2.0, sleep=sleeps
    )
    ask = guard("openai:gpt-4o", client=client, admit=True, credential="team-a", max_admit_wait_s=5)

    answers = [ask.call(lambda n: n, n) for n in range(3)]

    assert answers == [0, 1, 2]
    assert sleeps.delays == [5.0]  # the third waited, at most max_admit_wait_s, then went
    client.close()


@pytest.mark.slow
def test_the_client_names_its_service_and_services_share_a_contended_key(
    fleet: list[BackgroundSidecar],
) -> None:
    api = f"http://127.0.0.1:{fleet[0].ports.api}"
    planner, search = (SupervisorClient(api, "tok", service=name) for name in ("planner", "search"))
    first = [planner.admit("openai:gpt-4o", credential="team-a") for _ in range(3)]
    theirs = search.admit("openai:gpt-4o", credential="team-a")  # it has had none: it is next
    mine = planner.admit("openai:gpt-4o", credential="team-a")  # behind search: after its turn

    assert first[:2] == [0, 0] and 25_000 < first[2] <= 30_000  # 2 a minute, both taken
    assert 25_000 < theirs <= 30_000
    assert 55_000 < mine <= 60_000
    stats = httpx.get(f"{api}/v1/stats", headers=AUTH).json()["admission"]
    assert stats["refused_by"] == {"limit": 2, "priority": 0, "share": 1, "paused": 0}
    metrics = httpx.get(f"{api}/metrics", headers=AUTH).text
    assert 'spanvisor_admission_refusals_total{why="share"} 1.0' in metrics
    planner.close()
    search.close()


def rate_limited_spans(model: str, message: str) -> bytes:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    resource.scope_spans.add().spans.append(
        Span(
            trace_id=uuid.uuid4().bytes,
            span_id=(1).to_bytes(8, "big"),
            name="ChatCompletion",
            attributes=[
                KeyValue(key="openinference.span.kind", value=AnyValue(string_value="LLM")),
                KeyValue(key="llm.provider", value=AnyValue(string_value="openai")),
                KeyValue(key="llm.model_name", value=AnyValue(string_value=model)),
            ],
            status=Status(code=Status.STATUS_CODE_ERROR, message=message),
        )
    )
    return request.SerializeToString()


@pytest.mark.slow
def test_a_429_in_the_spans_pauses_the_key_for_the_whole_fleet(
    fleet: list[BackgroundSidecar],
) -> None:
    a, b = fleet
    message = "RateLimitError: Error code: 429 - Rate limit reached. Please try again in 20s."
    spans = rate_limited_spans("gpt-4o", message)

    def send(sidecar: BackgroundSidecar) -> None:
        response = httpx.post(
            f"http://127.0.0.1:{sidecar.ports.otlp_http}/v1/traces",
            content=spans,
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert response.status_code == 200

    def learned(sidecar: BackgroundSidecar) -> dict[str, Any]:
        stats = httpx.get(f"http://127.0.0.1:{sidecar.ports.api}/v1/stats", headers=AUTH)
        return dict(stats.json()["admission"])

    def wait_for(sidecar: BackgroundSidecar, field: str) -> None:
        deadline = time.monotonic() + 10
        while learned(sidecar)[field] != 1:
            assert time.monotonic() < deadline, "the 429 never reached the admitter"
            time.sleep(0.05)

    send(a)
    wait_for(a, "throttles")
    send(b)  # the same span again, at the other sidecar: counted once by the fleet
    wait_for(b, "repeated")

    found = [admit(s).json() for s in (a, b)]
    assert [f["why"] for f in found] == ["paused", "paused"]
    assert all(15_000 < f["wait_ms"] <= 20_000 for f in found)
    mine, theirs = learned(a), learned(b)
    assert (mine["throttles"], mine["decreases"], theirs["throttles"]) == (1, 1, 0)
    assert mine["learned_fleetwide"] and theirs["learned_locally"] == 0
    # b saw no 429 of its own: the fleet's share is applied, to the model and to the
    # credential's key asked for (its ceiling is 2 a minute; a 429 that named no
    # credential is every key's)
    shown = {m["model"]: (m["rpm"], m["fleetwide"]) for m in theirs["models"]}
    assert shown == {"openai:gpt-4o": (700, True), "openai:gpt-4o@team-a": (1.4, True)}


def test_guard_with_admit_does_not_wait_without_a_sidecar() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps = Sleeps()
    client = SupervisorClient(f"http://127.0.0.1:{port}", "tok", timeout_s=0.5, sleep=sleeps)
    assert client.admit("openai:gpt-4o") == 0
    assert guard("openai:gpt-4o", client=client, admit=True).call(lambda: "ok") == "ok"
    assert sleeps.delays == []

    async def go() -> str:
        assert await client.aadmit("openai:gpt-4o") == 0
        ask = guard("openai:gpt-4o", client=client, admit=True)

        async def call() -> str:
            return "ok"

        try:
            return await ask.acall(call)
        finally:
            await client.aclose()

    assert asyncio.run(go()) == "ok"
    with pytest.raises(ValueError, match="API key"):  # refused before anything is sent
        guard("openai:gpt-4o", client=client, admit=True, credential="sk-proj-abc")
    with pytest.raises(ValueError, match="priority"):
        client.admit("openai:gpt-4o", priority="urgent")
    client.close()
