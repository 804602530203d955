"""Defaults a fleet survives: staggered resumes, half-open trials, restart intensity
per step, retry floors, fallbacks declared once, and ``spanvisor init``."""

from __future__ import annotations

import random
import shutil
from importlib import resources
from pathlib import Path

import pytest

from policies import Governor, load_policy
from policies._breakers import BreakerBoard, BreakerSettings, BreakerState
from supervisor.cli.verbs import main
from supervisor.errors import PolicyError
from supervisor.records import Action, Decision, ErrorEvidence, Failure, FailureClass, Role


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def failure(
    run: str = "r1",
    dependency: str = "openai:gpt-4o",
    kind: str = "unavailable",
    klass: FailureClass = FailureClass.TRANSIENT,
    span: str = "b" * 16,
) -> Failure:
    return Failure(
        trace_id=f"{abs(hash(run)):032x}"[:32],
        span_id=span,
        parent_span_id="",
        service="agent",
        span_name="chat",
        run_id=run,
        role=Role.LLM,
        failure_class=klass,
        kind=kind,
        dependency=dependency,
        rule="r",
        message="503",
        evidence=ErrorEvidence(status_error=True, http_status=503),
        received_ns=0,
    )


def review(governor: Governor, f: Failure, attempt: int = 1) -> Decision:
    return governor.review(f, governor.policy.decide(f, attempt=attempt))


def open_breaker(governor: Governor, dependency: str = "openai:gpt-4o") -> None:
    governor.observe_calls([(i, dependency, False) for i in range(5)])
    assert governor.breaker_state(dependency) is BreakerState.OPEN


# -- staggered resumes -----------------------------------------------------------------


def test_runs_paused_behind_an_open_breaker_do_not_all_resume_at_once() -> None:
    clock = Clock()
    governor = Governor(load_policy(), clock=clock)
    open_breaker(governor)
    clock.now += 5.0

    delays = [
        float(str(review(governor, failure(run=f"run-{n}")).params["breaker_reopens_in_s"]))
        for n in range(40)
    ]

    assert delays[:3] == [25.0] * 3  # the trials: when the breaker half-opens
    later = delays[3:]
    assert all(25.0 + 7.5 <= d <= 25.0 + 30.0 for d in later)
    assert len(set(later)) == len(later)  # spread, not a herd
    # The same run asks again (its next failure): the same place, and a replay agrees.
    again = Governor(load_policy(), clock=clock)
    open_breaker(again)
    assert [
        again.review(failure(run=f"run-{n}"), Decision(Action.RETRY, "p")).params[
            "breaker_reopens_in_s"
        ]
        for n in range(40)
    ] == [d + 5.0 for d in delays]


def test_a_breaker_pause_states_its_deadline_and_counts_as_a_corrective_action() -> None:
    clock = Clock()
    governor = Governor(
        load_policy(text="version: 1\nrestart_intensity: {max_actions: 2, period_s: 60}\n"),
        clock=clock,
    )
    open_breaker(governor)

    paused = [review(governor, failure()) for _ in range(3)]

    assert [d.action for d in paused] == [Action.FAIL_FAST, Action.FAIL_FAST, Action.ESCALATE]
    assert (paused[0].params["pause_timeout_s"], paused[0].params["on_timeout"]) == (
        30.0,
        "resume",
    )
    escalated = paused[2].params
    assert escalated["proposed_action"] == "resume_run"
    assert (escalated["pause_timeout_s"], escalated["on_timeout"]) == (3600.0, "abort")


# -- half-open trials ------------------------------------------------------------------


def test_one_failed_trial_among_a_few_does_not_reopen_the_breaker() -> None:
    clock = Clock()
    board = BreakerBoard(BreakerSettings(2, 10.0, 2, half_open_trials=3), clock=clock)
    board.record_all("x", [False, False])
    clock.now += 10.0
    assert board.state("x") is BreakerState.HALF_OPEN

    assert board.record("x", False) is BreakerState.HALF_OPEN  # one of three: tolerated
    assert board.record("x", True) is BreakerState.HALF_OPEN
    assert board.record("x", True) is BreakerState.CLOSED

    board.record_all("x", [False, False])
    clock.now += 10.0
    assert board.record_all("x", [False, False]) is BreakerState.OPEN  # out of reach


def test_the_policy_gives_the_breaker_its_trials() -> None:
    clock = Clock()
    governor = Governor(load_policy(), clock=clock)
    open_breaker(governor)
    clock.now += 30.0
    governor.observe_calls([(0, "openai:gpt-4o", False)])  # one trial of three failed

    assert governor.breaker_state("openai:gpt-4o") is BreakerState.HALF_OPEN
    governor.observe_calls([(1, "openai:gpt-4o", True), (2, "openai:gpt-4o", True)])
    assert governor.breaker_state("openai:gpt-4o") is BreakerState.CLOSED


# -- restart intensity per step --------------------------------------------------------


def test_a_healthy_fleet_with_five_percent_faults_is_never_escalated() -> None:
    # 100 runs of 600 steps, a step every 2 s: one model call and one call of one of
    # six tools, each failing independently 5% of the time; a failed call is retried
    # and the retry fails 5% of the time too. The built-in policy, the governor fed
    # with every call as the pipeline feeds it.
    clock = Clock()
    governor = Governor(load_policy(), clock=clock)
    rng = random.Random(30)
    decisions: list[Decision] = []
    for run in range(100):
        clock.now = 1000.0 + run  # runs overlap in time; a run's history is its own
        for step in range(600):
            clock.now += 2.0
            for dependency, kind in (
                ("openai:gpt-4o", "unavailable"),
                (f"tool:t{step % 6}", "tool_error"),
            ):
                attempt = 1
                while rng.random() < 0.05 and attempt < 4:
                    governor.observe_calls([(0, dependency, False)])
                    f = failure(f"run-{run}", dependency, kind, span=f"{step:08x}{attempt:08x}")
                    decisions.append(review(governor, f, attempt))
                    attempt += 1
                governor.observe_calls([(1, dependency, True)] * 5)

    assert sum(d.action is Action.RETRY for d in decisions) > 1000
    # (A tool's second failure in a row is escalated by its own entry, retry once then
    # a person: that is the policy's answer to the step, not restart intensity's.)
    assert not [d.reason for d in decisions if "corrective actions" in d.reason]
    assert governor.intensity.denied == 0


def test_a_step_that_keeps_failing_is_escalated_with_a_deadline() -> None:
    governor = Governor(load_policy(text="version: 1\nbreakers: {enabled: false}\n"))
    governor.observe_calls([(i, "openai:gpt-4o", True) for i in range(1000)])  # budget
    governor.observe_calls([(i, "tool:search", True) for i in range(1000)])

    other = [review(governor, failure(dependency="tool:search", kind="tool_error"))]
    same = [review(governor, failure(span=f"{n:016x}")) for n in range(11)]

    assert [d.action for d in same[:10]] == [Action.RETRY] * 10
    assert same[10].action is Action.ESCALATE
    assert "for openai:gpt-4o" in same[10].reason
    assert (same[10].params["pause_timeout_s"], same[10].params["on_timeout"]) == (3600.0, "abort")
    assert other[0].action is Action.RETRY


# -- retry floors ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unavailable", "timeout", "connection"])
def test_the_first_retry_of_an_outage_waits_at_least_a_second(kind: str) -> None:
    policy = load_policy()
    delays = [
        float(str(policy.decide(failure(run=f"r{n}", kind=kind), attempt=1).params["delay_s"]))
        for n in range(500)
    ]

    assert min(delays) >= 1.0
    assert max(delays) <= 2.0
    assert max(delays) - min(delays) > 0.9  # still spread: jitter above the floor


# -- fallbacks declared once -----------------------------------------------------------

FALLBACKS = """\
version: 1
fallbacks:
  "openai:gpt-4o": ["openai:gpt-4o-mini", "anthropic:claude-haiku-4-5"]
retry_budget: {ratio: 0.1, min_retries: 1, window_s: 10}
"""


def test_one_fallbacks_line_serves_every_decision_that_falls_back() -> None:
    clock = Clock()
    governor = Governor(load_policy(text=FALLBACKS), clock=clock)
    policy = governor.policy

    spent = policy.decide(failure(), attempt=4)  # built-in retries spent: chain: {}
    assert (spent.action, spent.params["to"]) == (Action.FALLBACK, "openai:gpt-4o-mini")
    quota = policy.decide(failure(kind="quota_exhausted", klass=FailureClass.PERMANENT), attempt=1)
    assert quota.params["to"] == "openai:gpt-4o-mini"
    mini = policy.decide(failure(dependency="openai:gpt-4o-mini"), attempt=4)
    assert mini.params["to"] == "anthropic:claude-haiku-4-5"  # along the chain
    # The retry budget (one retry), then the open breaker: the same alternative.
    assert review(governor, failure(run="a")).action is Action.RETRY
    budget = review(governor, failure(run="b"))
    assert (budget.action, budget.params["to"]) == (Action.FALLBACK, "openai:gpt-4o-mini")
    open_breaker(governor)
    diverted = review(governor, failure(run="c"))
    assert (diverted.action, diverted.params["to"]) == (Action.FALLBACK, "openai:gpt-4o-mini")


def test_a_permanent_failure_is_never_paused_behind_an_open_breaker() -> None:
    governor = Governor(load_policy(text=FALLBACKS))
    for dependency in ("openai:gpt-4o", "openai:gpt-4o-mini", "anthropic:claude-haiku-4-5"):
        open_breaker(governor, dependency)
    quota = failure(kind="quota_exhausted", klass=FailureClass.PERMANENT)
    auth = failure(kind="auth", klass=FailureClass.PERMANENT)

    decisions = [review(governor, quota), review(governor, auth)]

    assert [d.action for d in decisions] == [Action.FAIL_FAST, Action.FAIL_FAST]
    assert not any("breaker_reopens_in_s" in d.params for d in decisions)
    assert review(governor, failure()).params["on_timeout"] == "resume"  # a 503 waits


@pytest.mark.parametrize(
    ("text", "path", "message"),
    [
        ('fallbacks: {"a:b": []}', 'fallbacks["a:b"]', "must not be empty"),
        ('fallbacks: {"a:b": ["a:b"]}', 'fallbacks["a:b"][0]', "its own fallback"),
        ('fallbacks: {"a:b": ["c:d", "c:d"]}', 'fallbacks["a:b"][1]', "listed twice"),
        ('fallbacks: {"a:b": {to: "c:d"}}', 'fallbacks["a:b"]', "valid list"),
        ('fallback: {"a:b": ["c:d"]}', "fallback", "did you mean 'fallbacks'"),
    ],
)
def test_bad_fallbacks_are_reported_with_their_path(text: str, path: str, message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(text=f"version: 1\n{text}\n")

    issues = [(i.path, i.message) for i in caught.value.issues]
    assert any(p == path and message in m for p, m in issues), issues


# -- spanvisor init --------------------------------------------------------------------


def test_init_writes_a_policy_that_validates_and_never_overwrites_by_mistake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "policy.yaml"

    assert main(["init", str(target)]) == 0
    assert main(["validate", str(target)]) == 0
    text = target.read_text(encoding="utf-8")
    for knob in ("fallbacks:", "breakers:", "restart_intensity:", "stalls:", "timeout_s:"):
        assert knob in text
    target.write_text("version: 1\n", encoding="utf-8")
    assert main(["init", str(target)]) == 2
    assert target.read_text(encoding="utf-8") == "version: 1\n"
    assert "--force" in capsys.readouterr().err
    assert main(["init", str(target), "--force"]) == 0
    assert target.read_text(encoding="utf-8") == text
    capsys.readouterr()
    assert main(["init", "-"]) == 0
    assert capsys.readouterr().out == text


def test_a_copy_of_the_builtin_policy_gets_one_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy.yaml"
    with resources.as_file(resources.files("policies") / "default_policy.yaml") as builtin:
        shutil.copyfile(builtin, copy)

    assert main(["validate", str(copy)]) == 1

    err = capsys.readouterr().err
    assert "1 error(s)" in err
    assert "copy of the built-in policy" in err and "spanvisor init" in err


def test_part_of_the_builtin_policy_copied_gets_the_same_message() -> None:
    import yaml

    builtin = yaml.safe_load(
        (resources.files("policies") / "default_policy.yaml").read_text(encoding="utf-8")
    )
    part = {"version": 1, "rules": builtin["rules"][:6]}  # no catch-alls, six names

    with pytest.raises(PolicyError) as caught:
        load_policy(text=yaml.safe_dump(part))

    [issue] = caught.value.issues
    assert "copy of the built-in policy" in issue.message
