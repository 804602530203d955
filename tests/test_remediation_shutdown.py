"""A sidecar stopped mid-remediation: the workflow stays pending and the next start resumes it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from remediators.base import Budget, RemediationContext, Remediator, Trigger, Verdict
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


def _status(db: Path, workflow: str) -> str:
    with sqlite3.connect(db) as conn:
        row = conn.execute(
            "SELECT status FROM workflow_status WHERE workflow_uuid = ?", (workflow,)
        ).fetchone()
    return str(row[0]) if row else ""


def test_a_stopped_runner_leaves_the_remediation_pending_and_the_next_resumes_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "remediations.sqlite"
    trace_id, span_id = "c" * 32, "d" * 16
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
        remediator="patient",
        use=f"{__name__}:Patient",
        tools=frozenset({"retry_step"}),
        budget=Budget(),
        params={},
        verify_window_s=0,
        on_unresolved="none",
        dispatched_at=time.time(),
    )
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
