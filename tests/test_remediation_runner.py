"""The durable runner on real DBOS (SQLite): allowlists, budgets, verification, tracing.

One runner serves the module (DBOS is one per process, and its start and stop
cost most of a second); each test dispatches remediations with ids of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from remediators.base import Budget, RemediationContext, Remediator, Trigger, Verdict
from remediators.gateway import RecordingGateway
from remediators.runner import DurableRunner, RunnerSettings, build_request
from remediators.tracing import PresetIdGenerator, root_span_id
from supervisor.records import remediation_ids

_counter = itertools.count(1)


class Overreach(Remediator):
    """Tries a tool it was not allowed, then one it was."""

    name = "overreach"
    tools = frozenset({"abort_run", "recent_spans"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        refused = await ctx.call("abort_run", reason="planted")
        assert refused.refused and not refused.ok
        return Verdict.FAILED


class Spender(Remediator):
    """Calls a read tool until its budget is spent."""

    name = "spender"
    tools = frozenset({"recent_spans"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        while True:
            await ctx.call("recent_spans", limit=5)


class Asker(Remediator):
    """Asks a person and reports what the answer was through its verdict."""

    name = "asker"
    tools = frozenset({"request_approval"})
    wait_s = 5.0  # for the answer

    async def run(self, ctx: RemediationContext) -> Verdict:
        asked = await ctx.call("request_approval", question="retry?")
        answer = await ctx.wait_for_approval(asked.value["approval_id"], self.wait_s)
        return Verdict.SUCCEEDED if answer and answer.get("approved") else Verdict.FAILED


class Sleeper(Remediator):
    """A long durable sleep, for cancellation."""

    name = "sleeper"
    tools = frozenset({"retry_step"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        await ctx.sleep(30)
        await ctx.call("retry_step")
        return Verdict.ACTED


class SlowReader(Remediator):
    """Reads the run's spans through a tool that is slow (see :class:`HoldingGateway`)."""

    name = "slow_reader"
    tools = frozenset({"recent_spans"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        await ctx.call("recent_spans", limit=HOLD)
        return Verdict.FAILED


#: ``recent_spans`` with this limit blocks until :attr:`HoldingGateway.release` is set.
HOLD = 37


class HoldingGateway(RecordingGateway):
    """A RecordingGateway whose ``recent_spans(limit=HOLD)`` blocks: a tool that hangs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()
        self.held = 0

    def recent_spans(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        if limit == HOLD:
            with self._lock:
                self.held += 1
            self.release.wait(30)
        return super().recent_spans(trigger, limit)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DurableRunner, Any]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=PresetIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = HoldingGateway(chains={"openai:gpt-4o": ["openai:gpt-4o", "anthropic:claude"]})
    db = Path(tmp_path_factory.mktemp("dbos")) / "remediations.sqlite"
    runner = DurableRunner(
        gateway,
        # DBOS's poller would find a message only after 30 s, past every wait
        # here: recoveries and approvals arrive because the runner wakes the
        # waiting remediation itself when it sends them.
        RunnerSettings(database_url=f"sqlite:///{db}", poll_interval_s=30.0),
        tracer=provider.get_tracer("test"),
    )
    runner.start()
    yield runner, exporter
    runner.close()


def _request(
    use: str,
    *,
    tools: frozenset[str] | None = None,
    budget: Budget | None = None,
    verify_s: float = 2.0,
    on_unresolved: str = "escalate",
) -> dict[str, Any]:
    n = next(_counter)
    trace_id, span_id = f"{n:032x}", f"{n:016x}"
    remediation, trace = remediation_ids(trace_id, span_id, "provider_rate_limit")
    trigger = Trigger(
        trace_id=trace_id,
        span_id=span_id,
        service="agent",
        run_id=trace_id,
        failure_class="transient",
        kind="rate_limit",
        dependency="openai:gpt-4o",
        rule="provider_rate_limit",
        message="429 Too Many Requests",
        span_name="chat gpt-4o",
        params={
            "remediator": use,
            "remediation_id": remediation,
            "remediation_trace_id": trace,
            "chain": ["openai:gpt-4o", "anthropic:claude"],
        },
    )
    cls_tools = {
        "fallback_switch": frozenset({"switch_fallback", "breaker_states", "request_approval"}),
    }
    return build_request(
        trigger,
        remediator=use.rsplit(":", 1)[-1],
        use=use,
        tools=tools if tools is not None else cls_tools.get(use, frozenset()),
        budget=budget or Budget(),
        params={},
        verify_window_s=verify_s,
        on_unresolved=on_unresolved,
        dispatched_at=time.time(),
    )


def _wait(runner: DurableRunner, rid: str, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = runner.show(rid)
        if view is not None and view["status"] not in ("PENDING", "ENQUEUED"):
            return view
        time.sleep(0.05)
    raise AssertionError(f"{rid} did not finish: {runner.show(rid)}")


def _spans_of(exporter: InMemorySpanExporter, trace_id: str) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and format(s.context.trace_id, "032x") == trace_id
    ]


def _until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_fallback_switch_acts_then_verifies_and_is_traced(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, exporter = rig
    gateway: Any = runner.gateway
    request = _request("fallback_switch")
    rid = request["id"]
    runner.dispatch(request)
    _until(lambda: rid in gateway.watched)  # acted, now verifying
    runner.notify_recovery(rid, {"span_id": "ff" * 8})
    view = _wait(runner, rid)
    assert view["outcome"] == "succeeded"
    switched = [c for c in gateway.commands.values() if c["command"] == "switch_fallback"]
    assert [c["params"]["to"] for c in switched if c["run_id"] == request["trigger"]["run_id"]] == [
        "anthropic:claude"
    ]
    assert rid not in gateway.watched  # unwatched after verification

    spans = _spans_of(exporter, request["trace_id"])
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "spanvisor.remediate fallback_switch"
    assert format(root.context.span_id, "016x") == root_span_id(rid)
    assert root.attributes is not None
    assert root.attributes["spanvisor.remediation.outcome"] == "succeeded"
    (link,) = root.links
    assert format(link.context.trace_id, "032x") == request["trigger"]["trace_id"]
    assert format(link.context.span_id, "016x") == request["trigger"]["span_id"]
    assert link.attributes is not None
    assert link.attributes["spanvisor.link.type"] == "triggered_by"
    assert link.attributes["spanvisor.failure.kind"] == "rate_limit"
    children = {s.name for s in spans if s.parent is not None}
    assert {"spanvisor.tool breaker_states", "spanvisor.tool switch_fallback"} <= children
    (waited,) = [s for s in spans if s.name == "spanvisor.wait recovery"]
    assert waited.attributes is not None
    assert waited.attributes["spanvisor.wait.recovered"] is True
    assert waited.attributes["spanvisor.wait.recovered_by"] == "ff" * 8  # the agent's span
    assert all(
        s.parent is not None and s.parent.span_id == root.context.span_id
        for s in spans
        if s is not root
    )


def test_the_same_remediation_dispatched_twice_runs_once(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, _ = rig
    gateway: Any = runner.gateway
    request = _request("fallback_switch", verify_s=0.2, on_unresolved="none")
    before = (runner.counts["dispatched"], runner.counts["duplicates"])  # the rig is shared
    first = runner.dispatch(request)
    assert first is not None
    first.result(10)
    runner.dispatch(request)  # while it runs, or after: the workflow id dedupes
    view = _wait(runner, request["id"])
    time.sleep(0.2)
    again = runner.dispatch(request)  # finished: DBOS finds its row and starts nothing
    assert again is not None and again.result(10) == request["id"]
    assert view["outcome"] == "failed"  # no recovery, nothing to follow with
    mine = [c for c in gateway.commands if c.startswith(request["id"])]
    assert len(mine) == 1
    counts = (runner.counts["dispatched"], runner.counts["duplicates"])
    assert (counts[0] - before[0], counts[1] - before[1]) == (1, 2)
    assert request["id"] not in runner._active  # a finished duplicate holds no slot


def test_tools_that_hang_do_not_hold_up_other_remediations(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    # More hanging tool calls than DBOS has threads: tools run on threads of
    # their own, so the database work of another remediation still gets done.
    runner, _ = rig
    gateway: Any = runner.gateway
    hanging = runner.settings.db_threads + 2
    assert hanging <= runner.settings.tool_threads
    slow = [
        _request(f"{__name__}:SlowReader", tools=frozenset({"recent_spans"}))
        for _ in range(hanging)
    ]
    try:
        for request in slow:
            runner.dispatch(request)
        _until(lambda: gateway.held == hanging)
        request = _request("fallback_switch", verify_s=0, on_unresolved="none")
        runner.dispatch(request)
        view = _wait(runner, request["id"])
        assert view["outcome"] == "failed"  # acted, no recovery window: nothing verified
        assert [
            c["command"]
            for c in gateway.commands.values()
            if c["run_id"] == request["trigger"]["run_id"]
        ] == ["switch_fallback"]
        assert all(runner.show(r["id"])["status"] == "PENDING" for r in slow)
    finally:
        gateway.release.set()
    assert all(_wait(runner, r["id"])["outcome"] == "failed" for r in slow)


def test_a_tool_outside_the_allowlist_is_refused_and_recorded_as_an_error(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, exporter = rig
    gateway: Any = runner.gateway
    request = _request(f"{__name__}:Overreach", tools=frozenset({"recent_spans"}))
    runner.dispatch(request)
    view = _wait(runner, request["id"])
    assert view["outcome"] == "refused"
    assert not [c for c in gateway.commands if c.startswith(request["id"])]
    (tool_span,) = [
        s for s in _spans_of(exporter, request["trace_id"]) if s.name == "spanvisor.tool abort_run"
    ]
    assert tool_span.status.status_code is StatusCode.ERROR
    assert tool_span.attributes is not None
    assert tool_span.attributes["spanvisor.tool.refused"] is True
    assert tool_span.attributes["spanvisor.tool.allowed"] is False
    assert "allowlist" in (tool_span.status.description or "")


def test_a_spent_budget_stops_the_remediator_and_escalates(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, exporter = rig
    gateway: Any = runner.gateway
    request = _request(
        f"{__name__}:Spender", tools=frozenset({"recent_spans"}), budget=Budget(tool_calls=3)
    )
    runner.dispatch(request)
    view = _wait(runner, request["id"])
    assert view["outcome"] == "escalated"
    assert "3 tool calls" in view["reason"]
    names = [s["name"] for s in view["steps"]]
    assert names.count("tool:recent_spans") == 3
    assert any(a["by"] == request["id"] for a in gateway.approvals.values())
    spans = _spans_of(exporter, request["trace_id"])
    assert "spanvisor.step escalate" in {s.name for s in spans if s.parent is not None}


def test_no_recovery_in_the_window_escalates(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, _ = rig
    request = _request("fallback_switch", verify_s=0.3)
    runner.dispatch(request)
    view = _wait(runner, request["id"])
    assert view["outcome"] == "escalated"
    assert "no recovery within 0.3 s" in view["reason"]


def _waiting_in_recv(remediation_id: str) -> bool:
    from dbos._dbos import _get_dbos_instance  # DBOS's waiter map, to send only once it waits

    waiters = _get_dbos_instance()._sys_db.notifications_map.snapshot()
    return any(components[0] == remediation_id for _, components, _ in waiters)


def test_an_approval_answer_wakes_the_waiting_remediation(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    """Sent once the remediation waits: only the runner's own wake-up can deliver it in time."""
    runner, _ = rig
    gateway: Any = runner.gateway
    request = _request(f"{__name__}:Asker", tools=frozenset({"request_approval"}))
    runner.dispatch(request)
    _until(lambda: _waiting_in_recv(request["id"]))
    sent = time.monotonic()
    runner.answer_approval(request["id"], {"approved": True})
    assert _wait(runner, request["id"])["outcome"] == "succeeded"  # the wait is 5 s, the poll 30 s
    assert time.monotonic() - sent < 4.0
    assert any(a["by"] == request["id"] for a in gateway.approvals.values())


def test_cancel_stops_a_waiting_remediation(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, _ = rig
    request = _request(f"{__name__}:Sleeper", tools=frozenset({"retry_step"}))
    started = runner.dispatch(request)
    assert started is not None
    started.result(10)
    assert runner.cancel(request["id"]) is True
    view = runner.show(request["id"])
    assert view is not None and view["status"] == "CANCELLED"
    assert runner.cancel(request["id"]) is False  # already finished
    assert runner.cancel("rem_unknown") is False
    listed: list[Mapping[str, Any]] = runner.list(limit=100)
    assert request["id"] in {w["id"] for w in listed}


def test_the_sqlite_database_commits_without_syncing_but_keeps_dboss_connection_setup(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    # The module's other tests run remediations through this engine.
    """WAL with synchronous=NORMAL on DBOS's own engine, and DBOS's connect hook still ran."""
    from dbos._dbos import _get_dbos_instance  # the engine DBOS made from our URL

    engine = _get_dbos_instance()._sys_db.engine
    with engine.connect() as connection:
        raw = connection.connection.dbapi_connection
        assert raw is not None
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert raw.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL; FULL is 2
        assert raw.execute("PRAGMA busy_timeout").fetchone() == (30000,)  # DBOS's hook
        assert raw.isolation_level == "IMMEDIATE"


#: Held by :class:`Summariser` until a test sets it: a model slow to write its summary.
SUMMARY_WRITTEN = threading.Event()


class Summariser(Remediator):
    """Asks for a retry, then takes its time over a summary (a durable step) before it is done."""

    name = "summariser"
    tools = frozenset({"retry_step"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        await ctx.call("retry_step")

        async def summary() -> str:
            await asyncio.get_running_loop().run_in_executor(None, SUMMARY_WRITTEN.wait, 10.0)
            return "asked for a retry"

        await ctx.step("summary", summary)
        return Verdict.ACTED


def test_a_recovery_while_the_remediator_is_still_at_work_counts(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    runner, exporter = rig
    gateway: Any = runner.gateway
    SUMMARY_WRITTEN.clear()
    request = _request(f"{__name__}:Summariser", tools=Summariser.tools, verify_s=0.5)
    rid = request["id"]
    try:
        runner.dispatch(request)
        _until(lambda: any(k.startswith(rid) for k in gateway.commands))  # the retry went out
        assert rid in gateway.watched  # watched from before the first command
        runner.notify_recovery(rid, {"span_id": "ab" * 8, "dependency": "openai:gpt-4o"})
    finally:
        SUMMARY_WRITTEN.set()
    view = _wait(runner, rid)
    assert (view["outcome"], view["reason"]) == ("succeeded", "the run recovered")
    assert not any(a["by"] == rid for a in gateway.approvals.values())
    assert rid not in gateway.watched
    (waited,) = [
        s for s in _spans_of(exporter, request["trace_id"]) if s.name == "spanvisor.wait recovery"
    ]
    assert waited.attributes is not None
    assert waited.attributes["spanvisor.wait.recovered_by"] == "ab" * 8
    assert waited.attributes["spanvisor.wait.recovery"] == "openai:gpt-4o"
    assert waited.attributes["spanvisor.wait.recovered_before_s"] >= 0


def test_the_list_pages_by_creation_time_for_the_control_api(
    rig: tuple[DurableRunner, InMemorySpanExporter],
) -> None:
    """Over the real DBOS tables: ``created_before`` keeps those created by then, and
    the control API's pages (keyed on time and id) show each remediation once."""
    import asyncio

    from supervisor.api.control import Control

    runner, _ = rig
    ids: list[str] = []
    for _ in range(3):
        request = _request(f"{__name__}:Sleeper", tools=frozenset({"retry_step"}))
        started = runner.dispatch(request)
        assert started is not None
        started.result(10)
        ids.append(request["id"])
    every = runner.list(limit=1000)
    created = {w["id"]: w["created_at"] for w in every}
    ours = [created[i] for i in ids]
    assert not set(ids) & {w["id"] for w in runner.list(1000, None, min(ours) - 1)}
    assert set(ids) <= {w["id"] for w in runner.list(1000, None, max(ours))}  # inclusive

    control = Control.__new__(Control)  # only the remediations part is asked
    control.remediations = type("R", (), {"runner": runner, "describe": dict})()
    shown: list[str] = []
    cursor = None
    while True:
        # One a page: DBOS may keep whole seconds, so these share a time; ids order them.
        page = asyncio.run(control.remediation_list(status=None, limit=1, cursor=cursor))
        shown += [r["id"] for r in page["remediations"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert shown == [
        w["id"] for w in sorted(every, key=lambda w: (w["created_at"], w["id"]), reverse=True)
    ]
    assert set(ids) <= set(shown)
    for rid in ids:
        runner.cancel(rid)
