"""A durable remediation survives ``kill -9`` of a real ``spanvisor run``.

A real sidecar process gets a failing LLM span (a timeout) over OTLP/HTTP; its
policy remediates timeouts with ``retry_step`` after a 4 s durable sleep. The
process is killed (SIGKILL) in the middle of that sleep, and a new process is
started on the same state file and the same remediation database (DBOS, the
default ``remediations.sqlite`` beside the state). What is pinned:

* the same workflow resumes and keeps its sleep's deadline: the agent gets its
  ``retry_step`` command about 4 s after the original dispatch, not 4 s after
  the restart, and gets it exactly once (one Idempotency-Key, one request);
* the database holds one workflow, one ``tool:retry_step`` step, one sleep;
* the failing span sent again to the new process starts nothing;
* a later success of the same dependency in the run verifies it: ``succeeded``;
* the remediation's trace reaches a real OTLP receiver (the settings'
  ``downstream``) complete and once: a root span linked to the triggering span,
  named by the ``spanvisor.decide`` span, with every step's span under it, even
  though the killed process had started that root and never ended it.

Both tests read one scenario (a module fixture): a crash costs one run.
"""

from __future__ import annotations

import json
import secrets
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from supervisor.act import signing
from supervisor.testing.otlp_recorder import OtlpRecorder
from supervisor.testing.sidecar_process import wait_until
from tests.test_dispatch import Delivery, WebhookReceiver
from tests.test_exactly_once import Sidecar

pytestmark = pytest.mark.slow

SECRET = "remediation-crash-webhook-secret"
TRIGGER_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRIGGER_SPAN = "b7ad6b7169203331"
RECOVERED_SPAN = "00000000000000aa"
DELAY_S = 4.0
REMEDIATOR = "retry_later"
WORKFLOW = "spanvisor.remediate"


def remediation_policy(delay_s: float, *, rest: str = "") -> str:
    """Timeouts remediated by a ``retry_step`` after ``delay_s``; ``rest``: more policies.

    Only the remediation decides: no breaker, budget or intensity gets in the way.
    """
    return f"""\
version: 1
breakers: {{enabled: false}}
retry_budget: {{enabled: false}}
restart_intensity: {{enabled: false}}
remediators:
  {REMEDIATOR}:
    use: retry_step
    params: {{delay_s: {delay_s:g}}}
    verify_window_s: 60
    on_unresolved: none
policies:
  - name: remediate_timeouts
    match: {{kind: timeout}}
    action: remediate
    remediator: {REMEDIATOR}
{rest}"""


POLICY = remediation_policy(DELAY_S)


def llm_request(span_id: str, *, failed: bool) -> bytes:
    """One OpenInference LLM span of the agent's run, as an exporter sends it."""
    span = Span(
        trace_id=bytes.fromhex(TRIGGER_TRACE),
        span_id=bytes.fromhex(span_id),
        name="ChatCompletion",
        attributes=[
            KeyValue(key="openinference.span.kind", value=AnyValue(string_value="LLM")),
            KeyValue(key="llm.provider", value=AnyValue(string_value="openai")),
            KeyValue(key="llm.model_name", value=AnyValue(string_value="gpt-4o")),
        ],
    )
    if failed:
        span.status.CopyFrom(
            Status(code=Status.STATUS_CODE_ERROR, message="APITimeoutError: Request timed out.")
        )
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    )
    resource.scope_spans.add().spans.append(span)
    return bytes(request.SerializeToString())


# -- the remediation database (DBOS's system tables) ------------------------------


class Workflows:
    """Reads DBOS's ``workflow_status`` and ``operation_outputs`` in the SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        if not self.path.exists():
            return []
        db = sqlite3.connect(self.path, timeout=10)
        try:
            return list(db.execute(sql, args))
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # DBOS is creating its tables
                return []
            raise
        finally:
            db.close()

    def workflows(self) -> list[tuple[str, str]]:
        """(id, status) of every remediation workflow."""
        rows = self._rows(
            "SELECT workflow_uuid, status FROM workflow_status WHERE name = ?", WORKFLOW
        )
        return [(str(r[0]), str(r[1])) for r in rows]

    def rows_of(self, workflow_id: str) -> int:
        rows = self._rows(
            "SELECT count(*) FROM workflow_status WHERE workflow_uuid = ?", workflow_id
        )
        return int(rows[0][0])

    def steps(self, workflow_id: str) -> list[str]:
        """The function names of the recorded steps, in order."""
        rows = self._rows(
            "SELECT function_name FROM operation_outputs WHERE workflow_uuid = ?"
            " ORDER BY function_id",
            workflow_id,
        )
        return [str(r[0]) for r in rows]

    def sleep_deadline(self, workflow_id: str) -> float:
        """The wake-up time (unix seconds) the first durable sleep recorded when it began."""
        rows = self._rows(
            "SELECT output FROM operation_outputs WHERE workflow_uuid = ?"
            " AND function_name = 'DBOS.sleep' ORDER BY function_id LIMIT 1",
            workflow_id,
        )
        return float(json.loads(rows[0][0]))


# -- real sidecar processes -----------------------------------------------------------


class Sidecars:
    """``spanvisor run`` processes on one state file; what is left is killed at the end."""

    def __init__(self, tmp: Path, webhook_url: str, downstream: str) -> None:
        self.tmp = tmp
        self.settings = {
            "host": "127.0.0.1",
            "api_token": secrets.token_urlsafe(16),
            "token_file": str(tmp / "api-token"),
            "state_path": str(tmp / "state.db"),
            "policy_poll_s": 0,
            "agents": {"*": {"webhook": {"url": webhook_url, "secret": SECRET, "timeout_s": 10}}},
            "downstream": {"endpoint": downstream, "protocol": "http/protobuf", "timeout_s": 5},
        }
        self.started: list[Sidecar] = []

    @property
    def database(self) -> Path:
        """Where the remediation workflows are kept: beside the state, by default."""
        return self.tmp / "remediations.sqlite"

    def start(self) -> Sidecar:
        """A new process (new ports) on the same state file, once healthy."""
        sidecar = Sidecar(
            self.settings,
            self.tmp,
            policy=POLICY,
            name=f"spanvisor-{len(self.started)}",
            startup_timeout_s=60,
        )
        self.started.append(sidecar)
        sidecar.start()
        return sidecar

    def close(self) -> None:
        for sidecar in self.started:
            sidecar.kill()


def remediations(sidecar: Sidecar) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = sidecar.get("/v1/remediations", limit=100)["remediations"]
    return found


def retry_commands(deliveries: list[Delivery], remediation_id: str) -> list[Delivery]:
    """The ``retry_step`` commands the agent got for this remediation."""
    return [
        d
        for d in deliveries
        if d.json().get("type") == "retry_step"
        and d.json().get("params", {}).get("remediation_id") == remediation_id
    ]


# -- the scenario --------------------------------------------------------------------


@dataclass
class Observed:
    """What the crash scenario saw, for the tests to judge."""

    remediation_id: str = ""
    #: Wall-clock times (unix seconds).
    sent_at: float = 0.0
    killed_at: float = 0.0
    restarted_at: float = 0.0
    ready_at: float = 0.0
    sleep_deadline: float = 0.0
    #: The first sleep's deadline as recorded at the end (after the restart).
    deadline_at_end: float = 0.0
    retry_arrived_at: float = 0.0
    #: Before the kill.
    statuses_before_kill: list[tuple[str, str]] = field(default_factory=list)
    steps_before_kill: list[str] = field(default_factory=list)
    delivered_before_kill: list[Delivery] = field(repr=False, default_factory=list)
    exit_code: int | None = None
    #: After the restart, once the command arrived and was recorded.
    workflows_after_retry: list[tuple[str, str]] = field(default_factory=list)
    steps_after_retry: list[str] = field(default_factory=list)
    #: After the failing span was sent again to the new process.
    resent_stats: dict[str, Any] = field(repr=False, default_factory=dict)
    workflows_after_resend: list[tuple[str, str]] = field(default_factory=list)
    deliveries_after_resend: list[Delivery] = field(repr=False, default_factory=list)
    commands_after_resend: list[dict[str, Any]] = field(repr=False, default_factory=list)
    #: At the end.
    listed: list[dict[str, Any]] = field(repr=False, default_factory=list)
    workflow_rows: int = 0
    final_steps: list[str] = field(default_factory=list)
    deliveries: list[Delivery] = field(repr=False, default_factory=list)
    incidents: list[dict[str, Any]] = field(repr=False, default_factory=list)
    second_exit_code: int | None = None
    spans: list[Any] = field(repr=False, default_factory=list)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    """A remediation killed mid-sleep, resumed by a new process, then verified."""
    seen = Observed()
    wall = time.time() - time.monotonic()  # Delivery.at (monotonic) to unix seconds
    tmp = tmp_path_factory.mktemp("remediation-crash")
    with OtlpRecorder() as recorder, WebhookReceiver() as receiver:
        sidecars = Sidecars(tmp, receiver.url, recorder.http_endpoint)
        db = Workflows(sidecars.database)
        try:
            first = sidecars.start()
            seen.sent_at = time.time()
            first.send([llm_request(TRIGGER_SPAN, failed=True)])

            def sleeping() -> str | None:
                pending = [w for w, status in db.workflows() if status == "PENDING"]
                return pending[0] if pending and "DBOS.sleep" in db.steps(pending[0]) else None

            rid = seen.remediation_id = wait_until(sleeping, 60, "the remediation's durable sleep")
            # The decision span is exported (every second) before the process dies...
            recorder.wait_for_spans(
                lambda got: any(s.name == "spanvisor.decide" for s in got), timeout_s=30
            )
            seen.sleep_deadline = db.sleep_deadline(rid)
            # ...and the kill comes well inside the sleep, so that a sleep started
            # again by the next process would end visibly later than this one.
            wait_until(
                lambda: time.time() >= seen.sleep_deadline - DELAY_S + 1.5,
                60,
                "the sleep to be well under way",
            )
            seen.statuses_before_kill = db.workflows()
            seen.steps_before_kill = db.steps(rid)
            seen.exit_code = first.kill()
            seen.killed_at = time.time()
            seen.delivered_before_kill = receiver.seen()

            seen.restarted_at = time.time()
            second = sidecars.start()
            seen.ready_at = time.time()

            retried = wait_until(
                lambda: retry_commands(receiver.seen(), rid), 60, "the retry_step command"
            )
            seen.retry_arrived_at = retried[0].at + wall
            wait_until(
                lambda: "tool:retry_step" in db.steps(rid), 60, "the retry_step step recorded"
            )
            seen.workflows_after_retry = db.workflows()
            seen.steps_after_retry = db.steps(rid)

            # The exporter sends the failing span again, now to the new process.
            second.send([llm_request(TRIGGER_SPAN, failed=True)])
            wait_until(
                lambda: second.stats()["remediations"].get("duplicates", 0) >= 1,
                60,
                "the re-sent failure handed to remediations",
            )
            seen.resent_stats = second.stats()
            seen.workflows_after_resend = db.workflows()
            seen.deliveries_after_resend = receiver.seen()
            seen.commands_after_resend = second.commands()

            # The run's next call to the same model succeeds: the remediation is verified.
            second.send([llm_request(RECOVERED_SPAN, failed=False)])
            wait_until(
                lambda: [r for r in remediations(second) if r.get("outcome")],
                60,
                "the remediation's outcome",
            )
            seen.listed = remediations(second)
            seen.workflow_rows = db.rows_of(rid)
            seen.final_steps = db.steps(rid)
            seen.deadline_at_end = db.sleep_deadline(rid)
            seen.incidents = second.incidents()
            # A clean stop flushes the sidecar's own spans: the recorder has them all.
            second.process.send_signal(signal.SIGTERM)
            seen.second_exit_code = second.process.wait(30)
            seen.deliveries = receiver.seen()
            seen.spans = recorder.spans()
        finally:
            sidecars.close()
        yield seen


# -- 1: durable, exactly once -------------------------------------------------------


def test_kill_9_mid_remediation_resumes_without_repeating_steps(crashed: Observed) -> None:
    seen, rid = crashed, crashed.remediation_id
    # Killed mid-sleep: the workflow pending, only its sleep recorded, nothing sent.
    assert seen.exit_code == -signal.SIGKILL
    assert seen.statuses_before_kill == [(rid, "PENDING")]
    assert seen.steps_before_kill == ["DBOS.sleep"]
    assert seen.killed_at < seen.sleep_deadline
    assert seen.delivered_before_kill == []

    # The sleep's deadline was kept: it was set about 4 s after the original
    # dispatch, and the command came at it (or as soon as the new process was up,
    # had it come up later) -- not a whole new sleep after the restart.
    assert DELAY_S <= seen.sleep_deadline - seen.sent_at <= DELAY_S + 5.0
    assert seen.deadline_at_end == seen.sleep_deadline  # replayed, not recorded again
    assert seen.retry_arrived_at >= seen.sleep_deadline - 0.05
    assert seen.retry_arrived_at <= max(seen.sleep_deadline, seen.ready_at) + 1.5
    # A new whole sleep would have started when the new process launched (just
    # before it was ready); under load a restart can take longer than the sleep.
    assert seen.retry_arrived_at < seen.ready_at + DELAY_S / 2

    # One workflow, one sleep, one retry_step: resumed, not started again.
    assert seen.workflows_after_retry == [(rid, "PENDING")]
    assert seen.steps_after_retry[:3] == ["DBOS.sleep", "waited:sleep", "tool:retry_step"]

    # The same failure again, to the new process: refused, nothing started or sent.
    assert seen.resent_stats["delivery"]["duplicate_incidents"] == 1
    assert seen.resent_stats["remediations"]["duplicates"] == 1
    assert seen.workflows_after_resend == [(rid, "PENDING")]
    assert len(retry_commands(seen.deliveries_after_resend, rid)) == 1
    assert [c["type"] for c in seen.commands_after_resend] == ["retry_step"]

    # Verified by the run's later success.
    (listed,) = seen.listed
    assert (listed["id"], listed["status"], listed["outcome"]) == (rid, "SUCCESS", "succeeded")
    assert seen.workflow_rows == 1
    # Each step once, in order: the backoff, the retry, then the verification
    # (one step: the wait for the run's recovery, recorded with its answer).
    assert seen.final_steps == [
        "DBOS.sleep",
        "waited:sleep",
        "tool:retry_step",
        "waited:recovery",
    ]
    (incident,) = seen.incidents
    assert incident["action"] == "remediate"

    # The agent got exactly one command, once: one request, one Idempotency-Key.
    (command,) = seen.deliveries
    assert retry_commands(seen.deliveries, rid) == [command]
    assert Counter(d.key for d in seen.deliveries) == {command.key: 1}
    assert command.key
    assert signing.verify(SECRET, command.headers, command.body) == command.message_id
    body = command.json()
    assert body["trigger"] == {"trace_id": TRIGGER_TRACE, "span_id": TRIGGER_SPAN}
    assert body["idempotency_key"] == command.key
    assert seen.second_exit_code == 0


# -- 2: the remediation's trace ----------------------------------------------------------


def attributes(span: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        found[kv.key] = getattr(kv.value, which) if which else None
    return found


def test_remediation_trace_reaches_a_real_otlp_receiver_linked_to_the_trigger(
    crashed: Observed,
) -> None:
    spans = crashed.spans
    root_name = f"spanvisor.remediate {REMEDIATOR}"
    # The root was started by the killed process too, which never ended it:
    # only the one the new process ended was exported.
    (root,) = [s for s in spans if s.name == root_name]

    # The decision span is a child of the triggering span, in the agent's trace,
    # and names the remediation's trace (the new process decided the re-sent span
    # again: every decision span names the same trace).
    decides = [s for s in spans if s.name == "spanvisor.decide"]
    assert decides
    for decide in decides:
        assert (decide.trace_id.hex(), decide.parent_span_id.hex()) == (
            TRIGGER_TRACE,
            TRIGGER_SPAN,
        )
        assert attributes(decide)["spanvisor.remediation.trace_id"] == root.trace_id.hex()
    assert root.trace_id.hex() != TRIGGER_TRACE
    assert root.parent_span_id == b""

    # Linked to the span that triggered it.
    (link,) = root.links
    assert (link.trace_id.hex(), link.span_id.hex()) == (TRIGGER_TRACE, TRIGGER_SPAN)
    link_attributes = attributes(link)
    assert link_attributes["spanvisor.link.type"] == "triggered_by"
    assert link_attributes["spanvisor.failure.class"] == "transient"
    assert link_attributes["spanvisor.failure.kind"] == "timeout"

    root_attributes = attributes(root)
    assert root_attributes["spanvisor.remediation.outcome"] == "succeeded"
    assert root_attributes["spanvisor.remediation.id"] == crashed.remediation_id
    # It began at the original dispatch, before the kill, though the new process made it.
    assert abs(root.start_time_unix_nano / 1e9 - crashed.sent_at) < 2.0
    assert root.start_time_unix_nano / 1e9 < crashed.killed_at

    # Every other span of the remediation trace is the root's child, each step once.
    others = [s for s in spans if s.trace_id == root.trace_id and s is not root]
    assert Counter(s.name for s in others) == {
        "spanvisor.wait sleep": 1,
        "spanvisor.tool retry_step": 1,
        "spanvisor.wait recovery": 1,
    }
    for span in others:
        assert span.parent_span_id == root.span_id, span.name
    (tool,) = [s for s in others if s.name == "spanvisor.tool retry_step"]
    assert attributes(tool)["spanvisor.tool.name"] == "retry_step"
