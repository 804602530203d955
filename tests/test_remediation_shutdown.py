"""A sidecar stopped mid-remediation: the workflow stays pending and the next start resumes it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from remediators.base import Budget, RemediationContext, Remediator, Trigger, Verdict
from remediators.builtin import RestartWorker
from remediators.gateway import RecordingGateway
from remediators.runner import DurableRunner, RunnerSettings, build_request
from supervisor.records import remediation_ids


class Patient(Remediator):
    """Waits two seconds (durably), then asks for one retry."""

    name = "patient"
    tools = frozenset({"retry_step"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        await ctx.sleep(2.0)
        await ctx.call("retry_step")
        return Verdict.FAILED


class Retrier(Remediator):
    """Asks for one retry at once; the runner then verifies it."""

    name = "retrier"
    tools = frozenset({"retry_step"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        await ctx.call("retry_step")
        return Verdict.ACTED


def _status(db: Path, workflow: str) -> str:
    with sqlite3.connect(db) as conn:
        row = conn.execute(
            "SELECT status FROM workflow_status WHERE workflow_uuid = ?", (workflow,)
        ).fetchone()
    return str(row[0]) if row else ""


def _request(
    remediator: type[Remediator],
    trace_id: str,
    span_id: str,
    *,
    verify_window_s: float,
    use: str = "",
    params: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The remediation's id and its request: ``remediator`` for a timeout, nothing to follow."""
    workflow, trace = remediation_ids(trace_id, span_id, "r")
    trigger = Trigger(
        trace_id,
        span_id,
        "agent",
        "run",
        "transient",
        "timeout",
        "openai:gpt-4o",
        "r",
        "",
        "",
        {"remediation_id": workflow, "remediation_trace_id": trace},
    )
    request = build_request(
        trigger,
        remediator=remediator.name,
        use=use or f"{__name__}:{remediator.__name__}",
        tools=remediator.tools,
        budget=Budget(),
        params=params or {},
        verify_window_s=verify_window_s,
        on_unresolved="none",
        dispatched_at=time.time(),
    )
    return workflow, request


def test_a_stopped_runner_leaves_the_remediation_pending_and_the_next_resumes_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "remediations.sqlite"
    workflow, request = _request(Patient, "c" * 32, "d" * 16, verify_window_s=0)
    first_gateway = RecordingGateway()
    first = DurableRunner(first_gateway, RunnerSettings(database_url=f"sqlite:///{db}"))
    first.start()
    started = first.dispatch(request)
    assert started is not None
    started.result(10)
    first.close()  # mid-sleep
    assert _status(db, workflow) == "PENDING"
    assert not first_gateway.commands

    second_gateway = RecordingGateway()
    second = DurableRunner(second_gateway, RunnerSettings(database_url=f"sqlite:///{db}"))
    second.start()  # resumes what is pending
    try:
        deadline = time.monotonic() + 15
        while _status(db, workflow) != "SUCCESS" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _status(db, workflow) == "SUCCESS"
        assert [c["command"] for c in second_gateway.commands.values()] == ["retry_step"]
    finally:
        second.close()


def test_a_verification_window_resumed_after_a_stop_keeps_its_deadline(tmp_path: Path) -> None:
    # Stopped while verifying, the remediation waits out the rest of its window
    # when the next runner resumes it (the window counts from the recorded act),
    # not a whole new window from the restart.
    window_s, stopped_after_s = 6.0, 2.5
    db = tmp_path / "remediations.sqlite"
    workflow, request = _request(Retrier, "e" * 32, "f" * 16, verify_window_s=window_s)
    first_gateway = RecordingGateway()
    first = DurableRunner(first_gateway, RunnerSettings(database_url=f"sqlite:///{db}"))
    first.start()
    try:
        first.dispatch(request)
        deadline = time.monotonic() + 15
        # Watched from the remediation's start; the act (a command) comes a step later.
        while (
            workflow not in first_gateway.watched or not first_gateway.commands
        ) and time.monotonic() < deadline:
            time.sleep(0.02)
        acted_at = time.time()  # just after the act: the window's start, within polling
        assert [c["command"] for c in first_gateway.commands.values()] == ["retry_step"]
        while time.time() < acted_at + stopped_after_s:
            time.sleep(0.05)  # part of the window passes before the stop
    finally:
        first.close()
    assert _status(db, workflow) == "PENDING"

    second_gateway = RecordingGateway()
    second = DurableRunner(second_gateway, RunnerSettings(database_url=f"sqlite:///{db}"))
    second.start()
    resumed_at = time.time()
    try:
        deadline = time.monotonic() + 20
        while _status(db, workflow) != "SUCCESS" and time.monotonic() < deadline:
            time.sleep(0.05)
        ended_at = time.time()
        view = second.show(workflow)
    finally:
        second.close()
    assert view is not None
    assert (view["outcome"], view["reason"]) == ("failed", f"no recovery within {window_s:g} s")
    assert not second_gateway.commands  # the act was replayed, not repeated
    # Ended at the first window's end, well before a new window from the restart would.
    assert ended_at < acted_at + window_s + 2.0  # a new window would end after + 8.5
    assert ended_at - resumed_at < window_s - 1.0


def test_a_worker_restarted_before_a_stop_is_not_restarted_when_the_remediation_resumes(
    tmp_path: Path,
) -> None:
    # The restart is a tool call through the gateway, recorded as a durable step
    # under the remediation's key: the resumed remediation replays its result
    # (and the intensity check before it) and goes on verifying.
    db = tmp_path / "remediations.sqlite"
    restart = {"argv": ["/usr/local/bin/restart-worker", "{run_id}"]}
    workflow, request = _request(
        RestartWorker,
        "1" * 32,
        "2" * 16,
        verify_window_s=60.0,
        use="restart_worker",
        params=restart,
    )
    first_gateway = RecordingGateway()
    first = DurableRunner(first_gateway, RunnerSettings(database_url=f"sqlite:///{db}"))
    first.start()
    try:
        first.dispatch(request)
        deadline = time.monotonic() + 15

        # The run is watched from the remediation's start; the restart is a step later,
        # recorded once its step is (a stop before would run it again, rightly).
        def restart_recorded() -> bool:
            found = first.show(workflow) if first_gateway.restarts else None
            steps = [step["name"] for step in found["steps"]] if found else []
            return "tool:restart_worker" in steps

        while not restart_recorded() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workflow in first_gateway.watched  # restarted, now verifying
    finally:
        first.close()
    assert _status(db, workflow) == "PENDING"
    (restarted,) = first_gateway.restarts
    assert restarted["argv"] == restart["argv"] and restarted["run_id"] == "run"
    assert restarted["key"] == f"{workflow}/2/restart_worker"

    second_gateway = RecordingGateway()
    second = DurableRunner(second_gateway, RunnerSettings(database_url=f"sqlite:///{db}"))
    second.start()
    try:
        deadline = time.monotonic() + 15
        while workflow not in second_gateway.watched and time.monotonic() < deadline:
            time.sleep(0.02)
        second.notify_recovery(workflow, {"span_id": "3" * 16})
        while _status(db, workflow) != "SUCCESS" and time.monotonic() < deadline:
            time.sleep(0.05)
        view = second.show(workflow)
    finally:
        second.close()
    assert view is not None and view["outcome"] == "succeeded"
    assert second_gateway.restarts == []  # replayed, not run again
    assert second_gateway.restarts_left == 3  # nor was the intensity asked again
    steps = [step["name"] for step in view["steps"]]
    assert steps.count("tool:restart_worker") == 1
