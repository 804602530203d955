"""Cascades: one dependency failing across runs is one incident, and its breaker opens."""

from __future__ import annotations

from policies import BreakerState, Governor, load_policy
from policies._cascade import CascadeDetector, CascadeSettings
from supervisor.judge.pipeline import Pipeline
from supervisor.records import ErrorEvidence, Failure, FailureClass, Role
from tests.test_runs import llm, payload


def failure(run: str, n: int, dependency: str = "openai:gpt-4o") -> Failure:
    return Failure(
        trace_id=run * 32,
        span_id=f"{n:016x}",
        parent_span_id="",
        service="agent",
        span_name="chat",
        run_id=run * 32,
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind="unavailable",
        dependency=dependency,
        rule="r",
        message="503",
        evidence=ErrorEvidence(status_error=True),
        received_ns=0,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_enough_failures_from_enough_runs_start_one_episode() -> None:
    clock = Clock()
    detector = CascadeDetector(
        CascadeSettings(window_s=60, min_failures=6, min_runs=3, min_error_rate=0.5), clock=clock
    )
    detector.observe([], [failure("a", 1), failure("a", 2), failure("b", 3)])
    detector.observe(["openai:gpt-4o"], [failure("b", 4), failure("a", 5)])
    assert detector.cascades() == []  # 5 failures, 2 runs
    detector.observe([], [failure("c", 6)])
    (episode,) = detector.cascades()
    assert (episode.dependency, episode.failures, episode.calls) == ("openai:gpt-4o", 6, 7)
    assert episode.runs == ("a" * 32, "b" * 32, "c" * 32)
    assert episode.trigger.span_id == f"{6:016x}"
    detector.observe([], [failure("d", 7)])
    assert detector.cascades() == []  # the same episode: reported once
    clock.now += 120  # the window empties: the episode ends
    detector.observe([], [failure("e", 8)])
    assert detector.cascades() == []
    for n, run in enumerate("fghijk"):
        detector.observe([], [failure(run, 10 + n)])
    assert len(detector.cascades()) == 1  # a new episode is reported again


def test_a_dependency_that_mostly_succeeds_is_not_a_cascade() -> None:
    detector = CascadeDetector(CascadeSettings(min_failures=3, min_runs=3, min_error_rate=0.5))
    detector.observe([], [failure("a", 1)])  # its window exists from its first failure
    detector.observe(["openai:gpt-4o"] * 20, [failure("b", 2), failure("c", 3)])
    assert detector.cascades() == []


def test_the_pipeline_reports_a_cascade_once_and_opens_the_breaker() -> None:
    policy = load_policy(
        text="""\
version: 1
detectors:
  cascades: {min_failures: 4, min_runs: 3, window_s: 60}
breakers:
  default: {fail_max: 1000, reset_timeout_s: 30}
"""
    )
    governor = Governor(policy)
    pipeline = Pipeline(policy, governor=governor)
    spans = []
    for n in range(6):
        failing = llm("", **{"gen_ai.response.model": "gpt-4o"})
        failing.trace_id = bytes([n % 3 + 1]) * 16
        failing.status.code = 2
        failing.status.message = "InternalServerError: 503 Service Unavailable"
        spans.append(failing)
    outcomes = pipeline.process_payload(payload(*spans), received_ns=10**12)
    cascades = [o for o in outcomes if o.failure.rule == "builtin.detect.cascade"]
    (cascade,) = cascades
    own = [o for o in outcomes if o is not cascade]
    assert len(own) >= 4  # each run's own failures are still reported, each once
    assert len(cascade.failure.details["runs"]) == 3
    failures = cascade.failure.details["failures"]
    assert failures == len(own)  # a batch is observed at once: all of it counts
    assert f"failing across runs: {failures} of {failures} calls" in cascade.failure.message
    assert governor.breaker_state("openai:gpt-4o") is BreakerState.OPEN


def test_a_re_sent_failure_counts_once() -> None:
    detector = CascadeDetector(CascadeSettings(min_failures=3, min_runs=2))
    batch = [failure("a", 1), failure("b", 2)]
    for _ in range(5):
        detector.observe([], batch)  # the same two failing spans, judged again and again
    assert detector.cascades() == []


def test_a_batch_of_successes_counts_call_by_call_and_the_window_stays_bounded() -> None:
    clock = Clock()
    settings = CascadeSettings(window_s=60, min_failures=4, min_runs=2, min_error_rate=0.5)
    detector = CascadeDetector(settings, clock=clock, max_calls=8)
    detector.observe([], [failure("a", 1)])  # the dependency failed: its calls are counted
    # Five successes of one batch: five calls, error rate 1/6.
    detector.observe(["openai:gpt-4o"] * 5 + ["other:dep"], [failure("b", 2)])
    detector.observe([], [failure("a", 3), failure("b", 4)])
    # 9 calls, of which the last 8 are kept: the first failure fell out, 3 are left.
    assert detector.cascades() == []
    detector.observe([], [failure("a", 5)])
    # 8 calls: 4 failures and 4 of the batch's 5 successes (the oldest one forgotten).
    (episode,) = detector.cascades()
    assert (episode.failures, episode.calls, episode.error_rate) == (4, 8, 0.5)
    assert episode.runs == ("b" * 32, "a" * 32)
