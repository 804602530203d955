"""Remediations of a fleet sharing one PostgreSQL database (real DBOS, real PostgreSQL).

The runner here is sidecar A's. Sidecar B is what another process does to the
same database: a remediation it started (the same span judged by both, so
the same workflow id), and an approval answered through its API while its
own runner is not up (DBOS's client, as :meth:`Remediations.answered` sends it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from dbos import DBOSClient

from remediators.base import Budget, RemediationContext, Remediator, Trigger, Verdict
from remediators.dbos_database import search_path_schema
from remediators.gateway import RecordingGateway
from remediators.runner import _WORKFLOW, DurableRunner, RunnerSettings, build_request
from supervisor.records import remediation_ids
from supervisor.remediation.engine import Remediations
from tests.postgres import fresh_schema
from tests.test_app import settings
from tests.test_remediation_runner import Asker as AskerOnce

_counter = itertools.count(1)


class Asker(AskerOnce):
    """Asks a person; an answer may come through another sidecar, so it waits longer."""

    wait_s = 20.0


class Quick(Remediator):
    """Ends at once."""

    name = "quick"
    tools = frozenset()

    async def run(self, ctx: RemediationContext) -> Verdict:
        return Verdict.SUCCEEDED


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with fresh_schema() as found:
        yield found


@pytest.fixture(scope="module")
def runner(url: str) -> Iterator[DurableRunner]:
    found = DurableRunner(
        RecordingGateway(),
        # Two at once: two duplicates counted as this sidecar's would fill it.
        RunnerSettings(database_url=url, executor_id="sidecar-a", max_active=2),
    )
    found.start()
    yield found
    found.close()


def _request(use: str) -> dict[str, Any]:
    n = next(_counter) + int(time.time() * 1000) % 10**9 * 1000
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
        message="429",
        span_name="chat",
        params={"remediator": use, "remediation_id": remediation, "remediation_trace_id": trace},
    )
    return build_request(
        trigger,
        remediator="r",
        use=use,
        tools=frozenset({"request_approval"}),
        budget=Budget(),
        params={},
        verify_window_s=0.0,
        on_unresolved="none",
        dispatched_at=time.time(),
    )


def _wait(runner: DurableRunner, rid: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = runner.show(rid)
        if view is not None and view["status"] not in ("PENDING", "ENQUEUED"):
            return view
        time.sleep(0.05)
    raise AssertionError(f"{rid} did not finish: {runner.show(rid)}")


def _started_by_the_other_sidecar(url: str, request: dict[str, Any]) -> None:
    """The workflow row sidecar B writes when it starts the same remediation first."""
    client = DBOSClient(system_database_url=url, dbos_system_schema=search_path_schema(url))
    try:
        client.enqueue(
            {
                "queue_name": "elsewhere",  # no queue of A's: A never takes it
                "workflow_name": _WORKFLOW,
                "workflow_id": request["id"],
                "application_name": "spanvisor",
            },
            request,
        )
    finally:
        client.destroy()
    with psycopg.connect(url, autocommit=True) as db:  # B runs it now
        db.execute(
            "UPDATE workflow_status SET status = 'PENDING', executor_id = 'sidecar-b'"
            " WHERE workflow_uuid = %s",
            (request["id"],),
        )


def test_remediations_another_sidecar_runs_do_not_hold_this_ones_slots(
    runner: DurableRunner, url: str
) -> None:
    theirs = [_request(f"{__name__}:Quick") for _ in range(2)]
    for request in theirs:
        _started_by_the_other_sidecar(url, request)
        started = runner.dispatch(request)  # the same span, judged here too
        assert started is not None
        assert started.result(10) == request["id"]
    assert runner.stats()["active"] == 0
    busy = runner.counts["busy"]
    mine = [_request(f"{__name__}:Quick") for _ in range(2)]
    for request in mine:
        assert runner.dispatch(request) is not None
    for request in mine:
        view = _wait(runner, request["id"])
        assert (view["outcome"], view["executor_id"]) == ("succeeded", "sidecar-a")
    assert runner.counts["busy"] == busy
    assert runner.show(theirs[0]["id"])["executor_id"] == "sidecar-b"  # type: ignore[index]


def test_an_answer_given_where_no_runner_is_up_reaches_the_remediation(
    runner: DurableRunner, url: str, tmp_path: Path
) -> None:
    request = _request(f"{__name__}:Asker")
    assert runner.dispatch(request) is not None
    gateway: Any = runner.gateway
    deadline = time.monotonic() + 10
    while not any(a["by"] == request["id"] for a in gateway.approvals.values()):
        assert time.monotonic() < deadline, "no approval requested"
        time.sleep(0.05)
    # Sidecar B: the same database, its runner not started.
    other = Remediations(
        settings(tmp_path, database_url=url, instance_id="sidecar-b"),
        actor=None,  # type: ignore[arg-type]
        governor=None,  # type: ignore[arg-type]
        policy=lambda: None,  # type: ignore[arg-type,return-value]
    )
    assert other.runner is None
    other.answered({"remediation_id": request["id"], "status": "approved", "id": "apr_1"})
    other.close()  # waits for the answer to be sent
    view = _wait(runner, request["id"])
    assert view["outcome"] == "succeeded"
    assert any(
        s["output"] == {"approved": True, "id": "apr_1"}
        for s in runner.show(request["id"])["steps"]
    )  # type: ignore[index]
