"""Where a run is in its life, asked of one place: ended stays ended, paused never stalls.

The spans come as real exporters send them: a run's spans in any order
within a request and across requests, a root before its children.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from policies import load_policy
from policies._detectors import DetectorSettings
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.records import Action
from supervisor.runs import PRESSURE_RULE, REANCHOR_RULE, RunTracker
from supervisor.runs.journal import RunJournal
from tests.test_runs import TRACE, feed, llm, payload, span, tool

FIXED = DetectorSettings(idle_seconds=60)
RETRY_503 = "InternalServerError: Error code: 503 - {'error': {'code': 'server_error'}}"
AUTH_401 = "AuthenticationError: Error code: 401 - {'error': {'code': 'invalid_api_key'}}"


def failing_llm(message: str) -> object:
    failed = llm()
    failed.status.code = 2
    failed.status.message = message
    return failed


def root(*, failed: bool = False, trace: bytes = TRACE) -> object:
    made = span(
        "invoke_agent", {"gen_ai.operation.name": "invoke_agent"}, trace=trace, parent=False
    )
    made.start_time_unix_nano, made.end_time_unix_nano = 0, 3
    if failed:
        made.status.code = 2
    return made


def judged(policy_text: str = "version: 1\n") -> tuple[RunTracker, Pipeline]:
    policy = load_policy(text=policy_text)
    tracker = RunTracker(
        settings=policy.detectors.for_service, models=policy.detectors.models, slo_grace_s=0
    )
    return tracker, Pipeline(policy, runs=tracker)


# -- ended stays ended ---------------------------------------------------------------


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_turn_that_ended_stays_ended_whatever_order_its_spans_come_in(
    order: tuple[int, ...],
) -> None:
    tracker = RunTracker(settings=lambda s: FIXED)
    spans = [root(), llm("done"), tool("search", {"q": "a"})]
    ordered = [spans[i] for i in order]
    feed(tracker, payload(*ordered[:2]), now=1000.0)
    feed(tracker, payload(*ordered[2:]), now=1002.0)  # the rest in the next request

    assert tracker.stalled(now=5000.0) == []
    assert tracker.snapshot(now=5000.0)[0].status == "ended"


def test_a_late_failure_reopens_an_ended_turn_only_when_the_run_is_told_to_go_on() -> None:
    tracker, pipeline = judged()
    assert pipeline.process_payload(payload(root()), received_ns=1000 * 10**9) == []
    (late,) = pipeline.process_payload(payload(failing_llm(AUTH_401)), received_ns=1001 * 10**9)
    assert late.decision.action is Action.FAIL_FAST  # abort: it stays ended
    assert tracker.stalled(now=5000.0) == []
    assert tracker.snapshot(now=5000.0)[0].status == "ended"

    (retried,) = pipeline.process_payload(payload(failing_llm(RETRY_503)), received_ns=5001 * 10**9)
    assert retried.decision.action is Action.RETRY  # the agent may wait for the verdict
    assert tracker.snapshot(now=5001.0)[0].status == "waiting"


@pytest.mark.parametrize("root_first", [True, False])
def test_a_revoked_key_and_its_failed_root_in_one_request_end_the_run(root_first: bool) -> None:
    tracker, pipeline = judged()
    spans = [failing_llm(AUTH_401), root(failed=True)]
    if root_first:
        spans.reverse()
    (outcome,) = pipeline.process_payload(payload(*spans), received_ns=1000 * 10**9)

    assert (outcome.failure.kind, outcome.decision.action) == ("auth", Action.FAIL_FAST)
    assert tracker.stalled(now=1000.0 + 3600) == []
    (view,) = tracker.snapshot(now=1000.0 + 3600)
    assert view.status == "ended"


def test_a_run_told_to_retry_whose_command_is_dead_lettered_ends() -> None:
    tracker, pipeline = judged()
    (outcome,) = pipeline.process_payload(
        payload(failing_llm(RETRY_503), root(failed=True)), received_ns=1000 * 10**9
    )
    assert outcome.decision.action is Action.RETRY
    assert tracker.snapshot(now=1000.0)[0].status == "waiting"

    tracker.notice(TRACE.hex(), "retry_step", 1001.0, {}, dead=True)  # no channel to the agent
    assert tracker.stalled(now=1000.0 + 3600) == []
    assert tracker.snapshot(now=1000.0 + 3600)[0].status == "ended"


# -- paused for a person -------------------------------------------------------------

ESCALATE_503 = """\
version: 1
policies:
  - name: ask
    match: {kind: unavailable}
    action: escalate
"""


def paused_run() -> tuple[RunTracker, Pipeline, Outcome]:
    tracker, pipeline = judged(ESCALATE_503)
    (outcome,) = pipeline.process_payload(payload(failing_llm(RETRY_503)), received_ns=1000 * 10**9)
    assert outcome.decision.action is Action.ESCALATE
    assert tracker.snapshot(now=1000.0)[0].status == "paused"
    return tracker, pipeline, outcome


def test_a_run_paused_for_a_person_never_stalls_until_its_deadline() -> None:
    tracker, _, _ = paused_run()
    assert tracker.stalled(now=1000.0 + 3599) == []  # the default pause: an hour
    assert tracker.stalled(now=1000.0 + 3601) == []  # then its outcome: aborted, not a stall
    assert tracker.snapshot(now=1000.0 + 3601)[0].status == "ended"


def test_a_paused_run_is_resumed_by_the_answer_and_then_watched_again() -> None:
    tracker, _, _ = paused_run()
    tracker.notice(TRACE.hex(), "approval_result", 1500.0, {"approved": True})
    assert tracker.stalled(now=1500.0) == []
    assert tracker.snapshot(now=1500.0)[0].status == "waiting"
    (stall,) = tracker.stalled(now=1500.0 + 121)  # one request seen: the floor times 4
    assert stall.kind == "stall"


def test_nothing_but_the_answer_moves_a_run_paused_for_a_person() -> None:
    tracker, pipeline, _ = paused_run()
    another = failing_llm(RETRY_503)
    (late,) = pipeline.process_payload(payload(another), received_ns=1010 * 10**9)
    assert late.decision.action is Action.NONE
    assert "paused for a person" in late.decision.reason
    tracker.notice(TRACE.hex(), "retry_step", 1011.0, {})  # a command from elsewhere
    tracker.stalled(now=1012.0)
    assert tracker.snapshot(now=1012.0)[0].status == "paused"


def test_a_denied_approval_ends_the_run() -> None:
    tracker, _, _ = paused_run()
    tracker.notice(TRACE.hex(), "approval_result", 1200.0, {"approved": False})
    assert tracker.stalled(now=9000.0) == []
    assert tracker.snapshot(now=1200.0)[0].status == "ended"


def test_a_pause_that_says_resume_resumes_at_its_deadline() -> None:
    tracker = RunTracker(settings=lambda s: FIXED)
    feed(tracker, payload(llm("a")), now=1000.0)
    tracker.commanded(TRACE.hex(), "pause_run", 1000.0, {"timeout_s": 30, "on_timeout": "resume"})
    assert tracker.stalled(now=1029.0) == []
    assert tracker.stalled(now=1031.0) == []  # waiting from 1030 on
    assert tracker.snapshot(now=1031.0)[0].status == "waiting"
    (stall,) = tracker.stalled(now=1030.0 + 61)
    assert stall.details["idle_s"] == 61


# -- a rhythm per service ------------------------------------------------------------


def run_with_gaps(tracker: RunTracker, service: str, gap: float, trace: bytes) -> float:
    now = 1000.0
    for _ in range(4):
        feed(tracker, payload(span("step", {}, trace=trace), service=service), now=now)
        tracker.settle(now)  # the request is judged, as the pipeline does
        now += gap
    return now - gap


def test_an_interactive_agent_is_found_in_tens_of_seconds_and_a_batch_job_left_alone() -> None:
    tracker = RunTracker()  # the built-in settings: no fixed idle_seconds
    chat_last = run_with_gaps(tracker, "chat", 5.0, b"\x01" * 16)
    batch_last = run_with_gaps(tracker, "batch", 120.0, b"\x02" * 16)

    assert tracker.stalled(now=chat_last + 29) == []
    (chat,) = tracker.stalled(now=chat_last + 31)  # the floor: 4 x 5 s is under 30 s
    assert chat.service == "chat" and chat.details["limit_s"] == 30

    assert tracker.stalled(now=batch_last + 470) == []  # 4 x 120 s
    (batch,) = tracker.stalled(now=batch_last + 481)
    assert batch.service == "batch" and batch.details["limit_s"] == 480


def test_a_new_run_of_a_known_service_gets_the_services_rhythm() -> None:
    tracker = RunTracker()
    run_with_gaps(tracker, "batch", 100.0, b"\x01" * 16)
    feed(tracker, payload(span("step", {}, trace=b"\x02" * 16), service="batch"), now=2000.0)
    found = [d for d in tracker.stalled(now=2000.0 + 350) if d.trace_id == (b"\x02" * 16).hex()]
    assert found == []  # its own rhythm is unknown; its service waits 100 s between steps


def test_a_policy_can_still_fix_the_limit() -> None:
    policy = load_policy(text="version: 1\ndetectors:\n  stalls: {idle_seconds: 900}\n")
    tracker = RunTracker(settings=policy.detectors.for_service)
    run_with_gaps(tracker, "chat", 5.0, TRACE)
    assert tracker.stalled(now=1015.0 + 899) == []
    assert len(tracker.stalled(now=1015.0 + 901)) == 1


# -- errors and SLOs -----------------------------------------------------------------


def test_predictions_and_reminders_are_not_errors_of_the_run() -> None:
    tracker = RunTracker()
    feed(tracker, payload(llm("a")), now=1000.0)
    tracker.failed(TRACE.hex(), PRESSURE_RULE)
    tracker.failed(TRACE.hex(), REANCHOR_RULE)
    assert tracker.snapshot(now=1000.0)[0].errors == 0
    tracker.failed(TRACE.hex(), "builtin.http.unavailable")
    assert tracker.snapshot(now=1000.0)[0].errors == 1


# -- a restart -----------------------------------------------------------------------


def test_open_runs_survive_a_restart_and_stall_after_it(tmp_path: Path) -> None:
    asked = llm(tool_calls=[{"id": "c1", "name": "charge_card", "arguments": {"amount": 5}}])
    before = RunTracker(settings=lambda s: FIXED, journaling=True)
    feed(before, payload(asked), now=1000.0)  # open, waiting for its tool
    ended = b"\x07" * 16
    feed(before, payload(root(trace=ended)), now=1000.0)
    journal = RunJournal.open(tmp_path / "state.db")
    journal.save(*before.journal_changes())
    journal.close()

    after = RunTracker(settings=lambda s: FIXED)
    journal = RunJournal.open(tmp_path / "state.db")
    assert after.restore(journal.load(100)) == 1  # the ended runs were not kept
    journal.close()
    assert after.stalled(now=1059.0) == []
    (stall,) = after.stalled(now=1061.0)
    assert stall.run_id == TRACE.hex()
    assert stall.details["unverified"] == ("charge_card(amount=5)",) or stall.details["unverified"][
        0
    ].startswith("charge_card(")


def test_a_journal_row_that_cannot_be_read_is_skipped_and_counted(tmp_path: Path) -> None:
    journal = RunJournal.open(tmp_path / "state.db")
    journal.save(*RunTracker().journal_changes())
    journal._db.execute(  # a row written by something else, or damaged
        "INSERT INTO open_runs (run_id, body, last_seen) VALUES ('r', '{\"phase\": 1}', 0)"
    )
    assert journal.load(10) == []
    assert journal.unreadable == 1
    journal.close()


def test_the_journal_is_written_when_a_run_changes_not_at_every_span() -> None:
    tracker = RunTracker(settings=lambda s: FIXED, journaling=True)
    feed(tracker, payload(llm("a")), now=1000.0)
    tracker.settle(1000.0)
    written, gone = tracker.journal_changes()
    assert [w.run_id for w in written] == [TRACE.hex()] and gone == []

    feed(tracker, payload(llm("b")), now=1002.0)  # busy, within the slack: not again
    tracker.settle(1002.0)
    assert tracker.journal_changes() == ([], [])
    tracker.commanded(TRACE.hex(), "retry_step", 1010.0, {})  # a new phase: at once
    (waiting,) = tracker.journal_changes()[0]
    assert (waiting.phase, waiting.go_on_at) == ("waiting", 1010.0)

    feed(tracker, payload(root()), now=1020.0)  # it ended: deleted from the journal
    tracker.settle(1020.0)
    assert tracker.journal_changes() == ([], [TRACE.hex()])

    short = b"\x05" * 16  # a run that began and ended between two saves: never written
    feed(tracker, payload(span("x", {}, trace=short), root(trace=short)), now=1030.0)
    tracker.settle(1030.0)
    assert tracker.journal_changes() == ([], [])


def test_without_a_journal_no_changed_run_is_remembered() -> None:
    tracker = RunTracker(settings=lambda s: FIXED)  # state in memory: nothing reads changes
    for n in range(50):
        feed(tracker, payload(span("x", {}, trace=bytes([n + 1]) * 16)), now=1000.0 + n)
        tracker.settle(1000.0 + n)
    assert tracker.journal_changes() == ([], [])
