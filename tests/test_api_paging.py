"""Every list of the control API pages with an opaque cursor, stable under inserts.

Over a real Control (an in-memory store, a real governor and run tracker):
each list answers ``next_cursor`` until its last page, pages neither repeat
nor skip an item however many are added meanwhile, and a cursor from another
list, or a mangled one, is refused naming the cursor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import Store
from supervisor.api.control import Control
from supervisor.api.server import build_control_app
from supervisor.normalize import read_spans
from supervisor.records import Action
from supervisor.runs import RunTracker
from supervisor.settings import AgentDelivery, PullChannel
from tests.test_api import AUTH, _outcome


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Parts:
    def __init__(self) -> None:
        self.clock = Clock()
        self.store = Store.open(":memory:")
        policy = load_policy()
        self.governor = Governor(policy)
        self.actor = Actor(
            self.store, {"agent": AgentDelivery(pull=PullChannel())}, clock=self.clock
        )
        self.failures = RecentFailures(10_000)
        self.runs = RunTracker(clock=self.clock)
        control = Control(
            store=self.store,
            actor=self.actor,
            governor=self.governor,
            policy=lambda: policy,
            failures=self.failures,
            stats=dict,
            ready=lambda: True,
            reload=dict,
            runs=self.runs,
        )
        self.client = TestClient(build_control_app(token="t0k3n", control=control))
        self.made = 0

    def fail(self, count: int, *, service: str = "agent", action: Action = Action.ESCALATE) -> None:
        """``count`` new failures, stored (incident, command, approval) and listed in memory."""
        outcomes = []
        for _ in range(count):
            self.made += 1
            outcome = _outcome(action, span=f"{self.made:016x}")
            outcome = replace(outcome, failure=replace(outcome.failure, service=service))
            outcomes.append(outcome)
            self.failures.add(outcome)
        self.clock.now += 1
        self.actor.record(outcomes)

    def page(self, path: str, key: str, **params: Any) -> tuple[list[dict[str, Any]], Any]:
        answer = self.client.get(path, headers=AUTH, params=params)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        return body[key], body["next_cursor"]


@pytest.fixture
def parts() -> Parts:
    return Parts()


def _every_page(
    parts: Parts,
    path: str,
    key: str,
    ident: Callable[[dict[str, Any]], str],
    limit: int,
    **params: Any,
) -> list[list[str]]:
    pages: list[list[str]] = []
    cursor = None
    while True:
        found, cursor = parts.page(path, key, limit=limit, cursor=cursor, **params)
        pages.append([ident(item) for item in found])
        if cursor is None:
            return pages


STORE_LISTS: list[tuple[str, str, Callable[[dict[str, Any]], str], dict[str, Any]]] = [
    ("/v1/incidents", "incidents", lambda i: i["span_id"], {}),
    ("/v1/approvals", "approvals", lambda a: a["id"], {}),
    ("/v1/commands/log", "commands", lambda c: c["id"], {"service": "agent"}),
]


@pytest.mark.parametrize(("path", "key", "ident", "params"), STORE_LISTS)
def test_a_store_list_pages_past_1000_without_repeating_or_skipping(
    parts: Parts,
    path: str,
    key: str,
    ident: Callable[[dict[str, Any]], str],
    params: dict[str, Any],
) -> None:
    parts.fail(1_205)

    pages = _every_page(parts, path, key, ident, 1000, **params)

    assert [len(p) for p in pages] == [1000, 205]
    every = [i for p in pages for i in p]
    assert len(set(every)) == 1_205
    first, _ = parts.page(path, key, limit=1_000, **params)
    assert [ident(i) for i in first] == pages[0]  # newest first, the same each time


@pytest.mark.parametrize(("path", "key", "ident", "params"), STORE_LISTS)
def test_items_added_while_paging_shift_no_page(
    parts: Parts,
    path: str,
    key: str,
    ident: Callable[[dict[str, Any]], str],
    params: dict[str, Any],
) -> None:
    parts.fail(7)
    before = [i for p in _every_page(parts, path, key, ident, 7, **params) for i in p]

    first, cursor = parts.page(path, key, limit=3, **params)
    parts.fail(5)  # newer than every page's start
    second, cursor = parts.page(path, key, limit=3, cursor=cursor, **params)
    third, cursor = parts.page(path, key, limit=3, cursor=cursor, **params)

    assert cursor is None  # the last page says so
    assert [ident(i) for i in first + second + third] == before


def test_dead_letters_page_too(parts: Parts) -> None:
    parts.fail(5, service="ghost")  # no channel: each command is stored dead
    parts.fail(2)  # delivered by pull: not dead

    pages = _every_page(parts, "/v1/dead-letters", "dead_letters", lambda c: c["id"], 2)

    assert [len(p) for p in pages] == [2, 2, 1]
    assert len({i for p in pages for i in p}) == 5


def test_recent_failures_page_to_older_ones_newest_last(parts: Parts) -> None:
    parts.fail(5)

    newest, cursor = parts.page("/v1/failures", "failures", limit=2)
    parts.fail(3)
    older, cursor = parts.page("/v1/failures", "failures", limit=2, cursor=cursor)
    oldest, cursor = parts.page("/v1/failures", "failures", limit=2, cursor=cursor)

    spans = [[int(f["span_id"], 16) for f in page] for page in (newest, older, oldest)]
    assert spans == [[4, 5], [2, 3], [1]]
    assert cursor is None


def test_breakers_page_by_name(parts: Parts) -> None:
    for n in range(5):
        assert parts.governor.isolate(f"tool:t{n}")

    pages = _every_page(parts, "/v1/breakers", "breakers", lambda b: b["dependency"], 2)

    assert pages == [["tool:t0", "tool:t1"], ["tool:t2", "tool:t3"], ["tool:t4"]]


def _runs_request(count: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    scope = resource.scope_spans.add()
    for n in range(1, count + 1):
        scope.spans.add(trace_id=n.to_bytes(16, "big"), span_id=n.to_bytes(8, "big"), name="step")
    return request.SerializeToString()


def test_runs_page_most_recently_active_first(parts: Parts) -> None:
    # Runs 2 and 3 have their last span at the same time: the run id orders them.
    times = [1_001.0, 1_002.0, 1_002.0, 1_003.0, 1_004.0]
    for item, at in zip(read_spans(_runs_request(5)), times, strict=True):
        parts.runs.observe(item, at, [])
    every = [r["run_id"] for r in parts.page("/v1/runs", "runs", limit=10)[0]]

    first, cursor = parts.page("/v1/runs", "runs", limit=3)  # ends between runs 3 and 2
    parts.runs.observe(next(iter(read_spans(_runs_request(1)))), 1_010.0, [])  # run 1 again
    second, cursor = parts.page("/v1/runs", "runs", limit=3, cursor=cursor)

    assert len(every) == 5
    # Run 1, active again, moved ahead of the cursor (it was not reached): the pages
    # end with the run that was after the cursor, and none is shown twice.
    assert [r["run_id"] for r in first + second] == every[:4]
    assert cursor is None


def test_a_cursor_from_another_list_or_mangled_is_refused(parts: Parts) -> None:
    parts.fail(3)
    _, cursor = parts.page("/v1/incidents", "incidents", limit=1)

    for path in ("/v1/approvals", "/v1/commands/log", "/v1/runs", "/v1/breakers", "/v1/failures"):
        answer = parts.client.get(path, headers=AUTH, params={"cursor": cursor})
        assert answer.status_code == 400, path
        assert "cursor" in answer.json()["error"] and "next_cursor" in answer.json()["error"]
    for bad in ("x", "!!!", "W10", "a" * 600):
        answer = parts.client.get("/v1/incidents", headers=AUTH, params={"cursor": bad})
        assert answer.status_code == 400 and "cursor" in answer.json()["error"], bad
