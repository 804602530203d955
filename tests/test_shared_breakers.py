"""Breakers shared through a real Redis: several boards, Redis away, Redis hanging, Redis back.

Redis is the one at 127.0.0.1:6379, reached through a loopback proxy that the
tests can make forward, drop every connection (Redis away), or accept and
never answer (Redis hanging). Each test uses keys of its own, deleted at the end.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from policies._breakers import BreakerBoard, BreakerSettings, BreakerState
from supervisor.app import BackgroundSidecar
from supervisor.cli.verbs import main
from supervisor.errors import ConfigError
from supervisor.shared_breakers import BreakerIndex, RedisLink, shared_breakers
from supervisor.wiring import build_sidecar
from tests.redis_server import REDIS, RedisProxy
from tests.test_app import settings as sidecar_settings

redis = pytest.importorskip("redis")

OPEN, CLOSED, HALF_OPEN, ISOLATED = (
    BreakerState.OPEN,
    BreakerState.CLOSED,
    BreakerState.HALF_OPEN,
    BreakerState.ISOLATED,
)
AUTH = {"Authorization": "Bearer tok"}


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


SETTINGS = BreakerSettings(fail_max=2, reset_timeout_s=10.0, success_threshold=2)


def boards(
    url: str, namespace: str, count: int = 2, *, retry_s: float = 0.2, timeout_s: float = 0.2
) -> list[tuple[BreakerBoard, Clock, RedisLink]]:
    """Boards of ``count`` sidecars sharing Redis, each with its own clock and link."""
    made = []
    for n in range(count):
        storage, link = shared_breakers(
            url, namespace=namespace, timeout_s=timeout_s, retry_s=retry_s, required=False
        )
        clock = Clock(1000.0 * (n + 1))
        made.append((BreakerBoard(SETTINGS, clock=clock, storage_factory=storage), clock, link))
    return made


def _until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


# -- boards ----------------------------------------------------------------------------------


def test_a_board_that_never_saw_a_dependency_reads_its_open_breaker(
    proxy: RedisProxy, namespace: str
) -> None:
    (a, _, _), (b, _, _) = boards(proxy.url, namespace)
    assert a.record_all("tool:x", [False, False]) is OPEN

    assert b.state("tool:x") is OPEN
    assert b.info("tool:x").reopens_at is not None
    assert b.state("tool:y") is CLOSED  # closed everywhere: read, not tracked
    assert len(b) == 1


def test_isolate_and_close_act_on_every_board(proxy: RedisProxy, namespace: str) -> None:
    (a, _, _), (b, clock_b, _) = boards(proxy.url, namespace)
    assert b.record("tool:x", False) is CLOSED  # b tracks it too

    assert a.isolate("tool:x")
    assert b.state("tool:x") is ISOLATED
    assert boards(proxy.url, namespace, 1)[0][0].state("tool:x") is ISOLATED  # a third, untracked
    clock_b.now += 3600  # isolation has no timeout, on any board
    assert b.state("tool:x") is ISOLATED

    b.close("tool:x")
    assert a.state("tool:x") is CLOSED
    assert a.info("tool:x").failures == 0


def test_a_look_from_another_board_does_not_undo_half_open_trials(
    proxy: RedisProxy, namespace: str
) -> None:
    (a, clock_a, _), (b, _, _) = boards(proxy.url, namespace)
    a.record_all("tool:x", [False, False])
    assert b.state("tool:x") is OPEN
    clock_a.now += 10
    assert a.record("tool:x", True) is HALF_OPEN  # the first of two trials

    assert b.state("tool:x") is HALF_OPEN  # b looks
    assert a.record("tool:x", True) is CLOSED  # the second trial closes it, as for one board
    assert b.state("tool:x") is CLOSED


def test_failures_counted_elsewhere_survive_another_board_noticing_the_close(
    proxy: RedisProxy, namespace: str
) -> None:
    (a, clock_a, _), (b, _, _) = boards(proxy.url, namespace)
    a.record_all("tool:x", [False, False])
    assert b.state("tool:x") is OPEN
    clock_a.now += 10
    assert a.record_all("tool:x", [True, True]) is CLOSED
    assert a.record("tool:x", False) is CLOSED  # one failure counted since the close

    assert b.state("tool:x") is CLOSED  # b notices the close: a's failure still counts
    assert b.record("tool:x", False) is OPEN


def test_redis_away_an_open_breaker_stays_open_nothing_raises_and_it_is_said_once(
    proxy: RedisProxy, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "spanvisor.breakers.redis")
    (a, _, link), (b, _, _) = boards(proxy.url, namespace, retry_s=0.3)
    a.record_all("tool:x", [False, False])
    proxy.set("drop")

    assert a.state("tool:x") is OPEN
    for _ in range(50):  # a dependency never seen: counted locally, nothing raises
        a.record("tool:new", True)
    assert a.record_all("tool:new", [False, False]) is OPEN
    assert a.isolate("tool:iso")
    stats = link.stats()
    assert (stats.reachable, stats.outages) == (False, 1)
    assert stats.skipped > 0
    away = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(away) == 1 and "deciding with this sidecar's own" in away[0].getMessage()

    proxy.set("forward")
    time.sleep(0.35)
    assert a.state("tool:new") is OPEN  # reconciled: opened meanwhile, written
    assert a.state("tool:iso") is ISOLATED
    assert link.stats().reachable
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(back) == 1
    assert b.state("tool:new") is OPEN  # the fleet sees what a decided alone
    assert b.state("tool:iso") is ISOLATED
    assert b.state("tool:x") is OPEN


def test_open_wins_when_redis_comes_back(proxy: RedisProxy, namespace: str, direct: object) -> None:
    (a, _, _), (b, _, _) = boards(proxy.url, namespace, retry_s=0.3)
    a.record("tool:x", False)  # one failure shared
    proxy.set("drop")
    assert a.record("tool:x", False) is OPEN  # the second, seen by a alone
    proxy.set("forward")
    b.close("tool:y")  # b, through Redis meanwhile: the shared tool:x is still closed
    assert b.state("tool:x") is CLOSED
    time.sleep(0.35)

    assert a.state("tool:x") is OPEN  # a's open kept over the shared closed
    assert b.state("tool:x") is OPEN
    state = direct.get(f"{namespace}:breaker:tool:x:pybreaker:state")  # type: ignore[attr-defined]
    assert state == b"open"


def test_a_hanging_redis_costs_one_timeout_not_one_per_operation(
    proxy: RedisProxy, namespace: str
) -> None:
    ((a, _, link),) = boards(proxy.url, namespace, 1, retry_s=5.0, timeout_s=0.2)
    proxy.set("hang")
    started = time.monotonic()
    assert a.record_all("tool:x", [False, False]) is OPEN
    assert a.state("tool:y") is CLOSED
    assert a.isolate("tool:z")
    assert time.monotonic() - started < 1.0
    assert link.stats().outages == 1


def test_required_redis_refuses_to_start_and_otherwise_starts_local(closed_port: int) -> None:
    url = f"redis://127.0.0.1:{closed_port}/0"
    with pytest.raises(
        ConfigError, match=f"cannot reach the breakers' Redis at 127.0.0.1:{closed_port}"
    ):
        shared_breakers(url, namespace="n", timeout_s=0.2, retry_s=1.0, required=True)
    storage, link = shared_breakers(url, namespace="n", timeout_s=0.2, retry_s=1.0, required=False)
    assert not link.stats().reachable
    board = BreakerBoard(SETTINGS, storage_factory=storage)
    assert board.record_all("tool:x", [False, False]) is OPEN


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- real sidecars ---------------------------------------------------------------------------


def failing_spans(dependency_model: str, count: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    scope = resource.scope_spans.add()
    for n in range(count):
        scope.spans.append(
            Span(
                trace_id=uuid.uuid4().bytes,
                span_id=(n + 1).to_bytes(8, "big"),
                name="ChatCompletion",
                attributes=[
                    KeyValue(key="openinference.span.kind", value=AnyValue(string_value="LLM")),
                    KeyValue(key="llm.provider", value=AnyValue(string_value="openai")),
                    KeyValue(key="llm.model_name", value=AnyValue(string_value=dependency_model)),
                ],
                status=Status(
                    code=Status.STATUS_CODE_ERROR, message="APITimeoutError: Request timed out."
                ),
            )
        )
    return request.SerializeToString()


def sidecar(tmp_path: Path, url: str, namespace: str, **more: object) -> BackgroundSidecar:
    values: dict[str, object] = {
        "breaker_redis_url": url,
        "breaker_redis_namespace": namespace,
        "breaker_redis_timeout_s": 0.2,
        "breaker_redis_retry_s": 30.0,
        "state_path": str(tmp_path / "state.db"),
        **more,
    }
    background = BackgroundSidecar(
        build_sidecar(sidecar_settings(tmp_path, **values), load_policy())
    )
    background.start()
    return background


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drop", "hang"])
def test_a_sidecar_loses_no_batch_and_decides_fast_while_redis_is_away(
    tmp_path: Path, proxy: RedisProxy, namespace: str, mode: str
) -> None:
    running = sidecar(tmp_path, proxy.url, namespace)
    try:
        ports = running.ports
        proxy.set(mode)
        response = httpx.post(
            f"http://127.0.0.1:{ports.otlp_http}/v1/traces",
            content=failing_spans("gpt-untracked", 3),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert response.status_code == 200
        api = f"http://127.0.0.1:{ports.api}"

        def judged() -> bool:
            failures = httpx.get(f"{api}/v1/failures", headers=AUTH).json()["failures"]
            return len(failures) == 3 and all(f["action"] for f in failures)

        _until(judged)
        started = time.monotonic()
        answer = httpx.post(
            f"{api}/v1/decide",
            headers=AUTH,
            json={"dependency": "openai:gpt-other", "message": "APITimeoutError: timed out"},
        )
        assert answer.status_code == 200
        assert time.monotonic() - started < 1.0
        stats = httpx.get(f"{api}/v1/stats", headers=AUTH).json()
        assert stats["pipeline"]["errors"] == 0
        shared = stats["breakers"]["shared"]
        assert (shared["reachable"], shared["outages"]) == (False, 1)
        metrics = httpx.get(f"{api}/metrics", headers=AUTH).text
        assert "spanvisor_breaker_redis_up 0.0" in metrics
        assert "spanvisor_breaker_redis_outages_total 1.0" in metrics
    finally:
        running.stop()


@pytest.mark.slow
def test_a_sidecar_starts_without_redis_unless_told_it_must(
    tmp_path: Path, closed_port: int, namespace: str
) -> None:
    url = f"redis://127.0.0.1:{closed_port}/0"
    with pytest.raises(ConfigError, match="cannot reach the breakers' Redis"):
        sidecar(tmp_path, url, namespace, breaker_redis_required=True)
    running = sidecar(tmp_path, url, namespace)
    try:
        api = f"http://127.0.0.1:{running.ports.api}"
        answer = httpx.post(
            f"{api}/v1/decide",
            headers=AUTH,
            json={"dependency": "openai:gpt-4o", "message": "APITimeoutError: timed out"},
        )
        assert answer.json()["action"] == "retry"
        shared = httpx.get(f"{api}/v1/stats", headers=AUTH).json()["breakers"]["shared"]
        assert (shared["reachable"], shared["outages"], shared["errors"]) == (False, 1, 1)
        assert shared["skipped"] >= 1  # asked no more: local state decided
    finally:
        running.stop()


@pytest.mark.slow
def test_two_sidecars_isolate_and_close_for_each_other(
    tmp_path: Path, namespace: str, direct: object
) -> None:
    url = f"redis://{REDIS[0]}:{REDIS[1]}/0"
    first = sidecar(tmp_path / "a", url, namespace)
    second = sidecar(tmp_path / "b", url, namespace)
    try:
        a = f"http://127.0.0.1:{first.ports.api}"
        b = f"http://127.0.0.1:{second.ports.api}"
        dependency = "openai:gpt-4o"
        isolated = httpx.post(f"{a}/v1/breakers/{dependency}/isolate", headers=AUTH)
        assert isolated.json()["state"] == "isolated"

        assert httpx.get(f"{b}/v1/breakers/{dependency}", headers=AUTH).json()["state"] == (
            "isolated"
        )
        answer = httpx.post(
            f"{b}/v1/decide",
            headers=AUTH,
            json={"dependency": dependency, "message": "APITimeoutError: timed out"},
        ).json()
        assert answer["action"] != "retry"
        assert answer["breaker"]["state"] == "isolated"

        httpx.post(f"{b}/v1/breakers/{dependency}/close", headers=AUTH)
        assert httpx.get(f"{a}/v1/breakers/{dependency}", headers=AUTH).json()["state"] == (
            "closed"
        )
    finally:
        first.stop()
        second.stop()


def test_reading_a_breaker_no_one_has_used_writes_nothing(
    proxy: RedisProxy, namespace: str, direct: object
) -> None:
    ((a, _, _),) = boards(proxy.url, namespace, 1)
    assert a.state("tool:never") is CLOSED
    assert a.info("tool:never").failures == 0
    assert list(direct.scan_iter(match=f"{namespace}:*")) == []  # type: ignore[attr-defined]


def test_a_redis_that_lost_its_keys_gets_this_sidecars_open_breaker_back(
    proxy: RedisProxy, namespace: str, direct: object
) -> None:
    (a, _, _), (b, _, _) = boards(proxy.url, namespace)
    a.record_all("tool:x", [False, False])
    direct.delete(*direct.scan_iter(match=f"{namespace}:*"))  # type: ignore[attr-defined]

    assert a.state("tool:x") is OPEN
    assert b.state("tool:x") is OPEN


# -- the fleet's list ------------------------------------------------------------------------


def test_the_index_lists_breakers_written_anywhere_and_keeps_a_bounded_newest_set(
    proxy: RedisProxy, namespace: str
) -> None:
    (a, _, _), (_, _, link_b) = boards(proxy.url, namespace)
    a.record_all("tool:x", [False, False])
    a.isolate("tool:y")
    assert link_b.index is not None
    assert sorted(link_b.index.names() or []) == ["tool:x", "tool:y"]

    clock = Clock(0.0)
    small = BreakerIndex(link_b, f"{namespace}:small", limit=3, clock=clock)
    for n in range(5):
        clock.now = float(n)
        assert small.add(f"dep:{n}")
    assert sorted(small.names() or []) == ["dep:2", "dep:3", "dep:4"]  # the oldest trimmed

    proxy.set("drop")
    assert link_b.index.names() is None  # Redis away: no list, not an empty one


@pytest.mark.slow
def test_a_sidecar_lists_the_fleets_breakers_and_says_when_the_list_is_its_own(
    tmp_path: Path,
    proxy: RedisProxy,
    namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"redis://{REDIS[0]}:{REDIS[1]}/0"
    first = sidecar(tmp_path / "a", url, namespace)
    second = sidecar(tmp_path / "b", proxy.url, namespace)  # its Redis can be cut
    try:
        a = f"http://127.0.0.1:{first.ports.api}"
        b = f"http://127.0.0.1:{second.ports.api}"
        remote = ["--api", b, "--token", "tok"]
        httpx.post(f"{a}/v1/breakers/tool:elsewhere/isolate", headers=AUTH).raise_for_status()
        httpx.post(f"{b}/v1/breakers/tool:here/isolate", headers=AUTH).raise_for_status()
        httpx.post(f"{b}/v1/breakers/tool:here/close", headers=AUTH).raise_for_status()

        fleet = httpx.get(f"{b}/v1/breakers", headers=AUTH).json()
        assert fleet["scope"] == "fleet" and "why" not in fleet
        rows = {r["dependency"]: r for r in fleet["breakers"]}
        assert rows["tool:elsewhere"]["state"] == "isolated"  # never seen on b: read in Redis
        assert rows["tool:elsewhere"]["tracked_here"] is False
        assert (rows["tool:here"]["state"], rows["tool:here"]["tracked_here"]) == ("closed", True)
        paged = httpx.get(f"{b}/v1/breakers", headers=AUTH, params={"limit": 1}).json()
        assert [r["dependency"] for r in paged["breakers"]] == ["tool:elsewhere"]
        rest = httpx.get(
            f"{b}/v1/breakers", headers=AUTH, params={"cursor": paged["next_cursor"]}
        ).json()
        assert [r["dependency"] for r in rest["breakers"]] == ["tool:here"]

        assert main(["breakers", *remote]) == 0
        shown = capsys.readouterr()
        assert "tool:elsewhere" in shown.out and "isolated" in shown.out
        assert shown.err == ""

        proxy.set("drop")  # b's Redis away: its own breakers, said to be its own
        local = httpx.get(f"{b}/v1/breakers", headers=AUTH).json()
        assert local["scope"] == "local"
        assert "this sidecar's own breakers only" in local["why"]
        assert main(["breakers", *remote]) == 0
        assert "this sidecar's own breakers only" in capsys.readouterr().err
    finally:
        first.stop()
        second.stop()
