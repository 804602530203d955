"""A fleet's runs in the shared store: each sidecar publishes its own, either lists them all.

Two sidecars here are two stores on one fresh PostgreSQL schema, each with its
own real :class:`~supervisor.runs.RunTracker` fed encoded spans, its
:class:`~supervisor.runs.publish.RunPublisher` and its control API's
operations (:class:`~supervisor.api.control.Control`). Clocks are injected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import Store
from supervisor.act.store_runs import StoredRuns
from supervisor.api.control import Control
from supervisor.api.server import build_control_app
from supervisor.normalize import read_spans
from supervisor.runs import RunTracker
from supervisor.runs.publish import RunPublisher
from supervisor.ui.app import ConsoleOptions
from tests.postgres import fresh_schema
from tests.tcp_proxy import TcpProxy
from tests.test_ui import BASE, TOKEN, Page

NOW = 1_000.0


@pytest.fixture
def url() -> Iterator[str]:
    with fresh_schema() as found:
        yield found


class Sidecar:
    """What of a sidecar publishes and lists runs: its store, tracker, publisher, Control."""

    def __init__(self, url: str, name: str, *, max_per_round: int = 2_000) -> None:
        self.now = NOW
        self.store = Store.open(url, instance_id=name)
        self.tracker = RunTracker(clock=lambda: self.now)
        self.publisher = RunPublisher(
            self.tracker,
            StoredRuns(self.store),
            max_per_round=max_per_round,
            clock=lambda: self.now,
        )
        policy = load_policy(text="version: 1\npolicies: []\n")
        self.control = Control(
            store=self.store,
            actor=Actor(self.store, {}),
            governor=Governor(policy),
            policy=lambda: policy,
            failures=RecentFailures(10),
            stats=dict,
            ready=lambda: True,
            reload=dict,
            runs=self.tracker,
            clock=lambda: self.now,
            fleet_runs=self.publisher.table,
        )

    def see(self, trace: int, service: str, at: float, session: str = "", spans: int = 1) -> None:
        for n, item in enumerate(read_spans(_request(trace, service, session, spans))):
            self.tracker.observe(item, at + n, [])
        self.tracker.settle(at)  # the batch is judged

    def publish(self) -> int:
        return asyncio.run(self.publisher.round())

    def list(self, **filters: object) -> dict[str, object]:
        args = {"status": None, "service": None, "limit": 100, **filters}
        return asyncio.run(self.control.run_list(**args))  # type: ignore[arg-type]


@pytest.fixture
def pair(url: str) -> Iterator[tuple[Sidecar, Sidecar]]:
    a, b = Sidecar(url, "sidecar-a"), Sidecar(url, "sidecar-b")
    try:
        yield a, b
    finally:
        a.store.close()
        b.store.close()


def _request(trace: int, service: str, session: str, spans: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value=service))
    )
    scope = resource.scope_spans.add()
    for n in range(spans):
        span = scope.spans.add(
            trace_id=trace.to_bytes(16, "big"),
            span_id=(n + 2).to_bytes(8, "big"),
            parent_span_id=(1).to_bytes(8, "big"),
            name="execute_tool search",
        )
        span.attributes.extend(
            [
                KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="execute_tool")),
                KeyValue(key="gen_ai.tool.name", value=AnyValue(string_value="search")),
            ]
        )
        if session:
            span.attributes.append(
                KeyValue(key="gen_ai.conversation.id", value=AnyValue(string_value=session))
            )
    return request.SerializeToString()


def _ids(answer: dict[str, object]) -> list[tuple[str, str]]:
    runs = answer["runs"]
    assert isinstance(runs, list)
    return [(r["run_id"], r["tracked_by"]) for r in runs]


def test_either_sidecar_lists_the_runs_both_publish_saying_which_tracks_each(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    a.see(1, "checkout", NOW, session="sess-a")
    b.see(2, "search", NOW + 5, session="sess-b", spans=3)
    a.now = b.now = NOW + 10

    assert (a.publish(), b.publish()) == (1, 1)

    expected = [("sess-b", "sidecar-b"), ("sess-a", "sidecar-a")]  # most recently active first
    assert _ids(a.list()) == _ids(b.list()) == expected
    listed = a.list()
    assert listed["fleet"] is True
    runs = listed["runs"]
    assert isinstance(runs, list)
    first: dict[str, object] = runs[0]
    local = b.tracker.find("sess-b")
    assert local is not None
    assert first == {**local.to_json(), "tracked_by": "sidecar-b"}  # the same fields, and whose
    assert first["spans"] == 3 and first["idle_s"] == 3.0  # idle as of the reader's clock
    assert _ids(b.list(service="checkout")) == [("sess-a", "sidecar-a")]
    assert _ids(b.list(status="ended")) == []


def test_the_fleet_s_runs_are_paged_by_cursor_without_repeats(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    for n in range(5):
        (a if n % 2 else b).see(10 + n, "svc", NOW + n, session=f"s{n}")
    a.publish()
    b.publish()

    seen: list[str] = []
    cursor = None
    for _ in range(10):
        page = a.list(limit=2, cursor=cursor)
        seen += [run_id for run_id, _ in _ids(page)]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ["s4", "s3", "s2", "s1", "s0"]


def test_a_run_tracked_only_by_another_sidecar_is_found_by_its_id(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    b.see(3, "search", NOW, session="elsewhere")
    b.publish()

    assert a.tracker.find("elsewhere") is None
    found = asyncio.run(a.control.run("elsewhere"))
    assert found is not None and found["tracked_by"] == "sidecar-b"
    assert asyncio.run(a.control.run("nowhere")) is None


def test_a_session_tracked_by_two_sidecars_has_one_row_the_latest_publisher_s(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    a.see(4, "agent", NOW, session="shared", spans=2)
    b.see(5, "agent", NOW + 1, session="shared", spans=5)
    b.publish()
    a.publish()  # later: its fields win

    assert _ids(b.list()) == [("shared", "sidecar-a")]
    assert b.list()["runs"][0]["spans"] == 2  # type: ignore[index]


def test_the_console_lists_the_fleet_s_runs_with_the_sidecar_tracking_each(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    a.see(6, "checkout", NOW, session="sess-a")
    b.see(7, "search", NOW + 1, session="sess-b")
    a.publish()
    b.publish()
    app = build_control_app(token=TOKEN, control=a.control, console=ConsoleOptions())
    client = TestClient(app, base_url=BASE, headers={"Authorization": f"Bearer {TOKEN}"})

    page = Page(client.get("/ui/runs").text)
    rows = [e["data-run-id"] for t, e in page.elements if t == "tr" and "data-run-id" in e]
    assert rows == ["sess-b", "sess-a"]
    assert "Tracked by" in page.all_text and "sidecar-b" in page.all_text
    run = Page(client.get("/ui/runs/sess-b").text)  # tracked by the other sidecar
    assert "does not track this run" not in run.all_text


def test_only_changed_runs_are_published_and_a_round_is_bounded(url: str) -> None:
    a = Sidecar(url, "sidecar-a", max_per_round=2)
    try:
        for n in range(3):
            a.see(20 + n, "svc", NOW + n, session=f"r{n}")
        assert [a.publish(), a.publish(), a.publish()] == [2, 1, 0]  # the rest, then nothing
        a.see(20, "svc", NOW + 10, session="r0")
        assert a.publish() == 1  # one run changed
        assert len(a.list()["runs"]) == 3  # type: ignore[arg-type]
    finally:
        a.store.close()


def test_published_runs_are_pruned_after_the_store_s_retention(url: str) -> None:
    a = Sidecar(url, "sidecar-a")
    try:
        a.see(30, "svc", NOW, session="old")
        a.see(31, "svc", NOW + 100, session="new")
        a.publish()
        a.store.prune(NOW + 50 + a.store.retention_s)
        assert _ids(a.list()) == [("new", "sidecar-a")]
    finally:
        a.store.close()


def test_a_publish_while_the_store_is_away_does_not_raise_and_is_done_when_it_is_back(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = TcpProxy(("127.0.0.1", 5432))
    a = Sidecar(url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), "sidecar-a")
    reader = Sidecar(url, "reader")
    try:
        a.see(40, "svc", NOW, session="kept")
        proxy.set("drop")
        with caplog.at_level(logging.WARNING, logger="spanvisor.runs"):
            assert [a.publish(), a.publish()] == [0, 0]
        failed = [r for r in caplog.records if "publishing runs" in r.getMessage()]
        assert len(failed) == 1  # once per outage
        assert a.publisher.stats() == {"published": 0, "failures": 2}
        proxy.set("forward")
        assert a.publish() == 1  # what failed is given again
        assert _ids(reader.list()) == [("kept", "sidecar-a")]
    finally:
        proxy.set("forward")
        a.store.close()
        reader.store.close()
        proxy.close()
