"""The governor revises the policy's decisions with breakers, budgets and intensity."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import load_policy
from policies._governor import Governor
from supervisor.records import (
    Action,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
)

POLICY = """\
version: 1
policies:
  - name: fb
    match: {kind: rate_limit}
    action: fallback
    chain: {"openai:*": ["openai:gpt-4o", "openai:gpt-4o-mini", "anthropic:claude"]}
  - name: rt
    match: {kind: unavailable}
    action: retry
    max_attempts: 10
    wait: {type: fixed, seconds: 1}
breakers: {default: {fail_max: 3, reset_timeout_s: 10, success_threshold: 1}}
retry_budget: {ratio: 0.5, min_retries: 1, window_s: 10}
restart_intensity: {max_actions: 3, period_s: 60}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def governor(clock: Clock) -> Governor:
    return Governor(load_policy(text=POLICY), clock=clock)


def failure(
    kind: str = "unavailable", dependency: str = "openai:gpt-4o", run: str = "r1"
) -> Failure:
    return Failure(
        trace_id="a" * 32,
        span_id="b" * 16,
        parent_span_id="",
        service="agent",
        span_name="chat",
        run_id=run,
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind=kind,
        dependency=dependency,
        rule="r",
        message="503",
        evidence=ErrorEvidence(status_error=True, http_status=503),
        received_ns=0,
    )


def decide(governor: Governor, f: Failure, attempt: int = 1) -> Decision:
    return governor.review(f, governor.policy.decide(f, attempt=attempt))


def fail(governor: Governor, dependency: str, times: int) -> None:
    governor.observe_calls([(i, dependency, False) for i in range(times)])


def test_an_open_breaker_turns_a_retry_into_a_fallback_along_the_chain(
    governor: Governor,
) -> None:
    fail(governor, "openai:gpt-4o", 3)

    decision = decide(governor, failure())

    assert (decision.action, decision.params["to"]) == (Action.FALLBACK, "openai:gpt-4o-mini")
    assert decision.params["breaker"] == "open"
    assert "breaker of openai:gpt-4o is open" in decision.reason


def test_open_alternatives_are_skipped_and_none_left_means_fail_fast_until_half_open(
    governor: Governor, clock: Clock
) -> None:
    for dependency in ("openai:gpt-4o", "openai:gpt-4o-mini"):
        fail(governor, dependency, 3)
    assert decide(governor, failure()).params["to"] == "anthropic:claude"
    fail(governor, "anthropic:claude", 3)
    clock.now += 4

    decision = decide(governor, failure())

    assert decision.action is Action.FAIL_FAST
    assert decision.params["breaker_reopens_in_s"] == 6.0  # the run pauses, then resumes
    clock.now += 6
    assert governor.breaker_state("openai:gpt-4o").value == "half_open"
    assert decide(governor, failure()).action is Action.RETRY  # a trial goes through


def test_a_fallback_to_an_open_breaker_moves_on(governor: Governor) -> None:
    fail(governor, "openai:gpt-4o-mini", 3)

    decision = decide(governor, failure(kind="rate_limit"))

    assert (decision.action, decision.params["to"]) == (Action.FALLBACK, "anthropic:claude")


def test_an_isolated_breaker_fails_fast_without_a_resume_time(governor: Governor) -> None:
    governor.isolate("tool:search")

    decision = decide(governor, failure(dependency="tool:search"))

    assert decision.action is Action.FAIL_FAST
    assert decision.params == {"breaker": "isolated", "attempt": 1, "max_attempts": 10}


def test_successes_between_failures_keep_the_breaker_closed(governor: Governor) -> None:
    calls = [(1, "x:y", False), (2, "x:y", False), (3, "x:y", True), (4, "x:y", False)]
    governor.observe_calls(list(reversed(calls)))  # the order they ended counts, not arrival

    assert governor.breaker_state("x:y").value == "closed"
    governor.observe_calls([(5, "x:y", False), (6, "x:y", False)])
    assert governor.breaker_state("x:y").value == "open"


def test_too_many_corrective_actions_in_a_run_are_escalated(governor: Governor) -> None:
    governor.observe_calls([(i, "openai:gpt-4o", True) for i in range(100)])  # budget to spare
    actions = [decide(governor, failure(), attempt=n).action for n in range(1, 5)]

    assert actions[:3] == [Action.RETRY] * 3
    assert actions[3] is Action.ESCALATE
    last = decide(governor, failure(run="other"))
    assert last.action is Action.RETRY  # intensity is per run


def test_retries_over_the_budget_fall_back_or_fail_fast(governor: Governor) -> None:
    governor.observe_calls([(i, "tool:a", True) for i in range(4)])  # budget: 2 retries

    actions = [decide(governor, failure(dependency="tool:a", run=f"r{n}")).action for n in range(3)]

    assert actions == [Action.RETRY, Action.RETRY, Action.FAIL_FAST]
    spent = decide(governor, failure(run="r9"))  # gpt-4o has a chain: fall back instead
    assert spent.action is Action.RETRY  # its own budget: the floor of one
    spent = decide(governor, failure(run="r10"))
    assert (spent.action, spent.params["to"]) == (Action.FALLBACK, "openai:gpt-4o-mini")
    assert "retry budget of openai:gpt-4o spent" in spent.reason


def test_observe_only_decisions_spend_nothing(governor: Governor) -> None:
    f = failure(dependency="tool:b")
    for _ in range(5):
        observed = replace(governor.policy.decide(f, attempt=1), observe_only=True)
        assert governor.review(f, observed).action is Action.RETRY
    assert governor.budget.snapshot("tool:b").retries == 0
    assert governor.intensity.actions("r1") == 0


def test_two_sidecars_share_breakers_through_redis(tmp_path: Path) -> None:
    import uuid

    from supervisor.wiring import _shared_breakers
    from tests.test_app import settings

    namespace = f"spanvisor-test-{uuid.uuid4().hex}"  # keys of its own: tests may share Redis
    storage, link = _shared_breakers(
        settings(
            tmp_path,
            breaker_redis_url="redis://127.0.0.1:6379/0",
            breaker_redis_namespace=namespace,
        )
    )
    assert storage is not None and link is not None
    if not link.stats().reachable:
        pytest.skip("no Redis on 127.0.0.1:6379")
    dependency = "openai:gpt-4o"
    policy = load_policy(text=POLICY)
    first, second = (
        Governor(policy, breaker_storage=storage),
        Governor(policy, breaker_storage=storage),
    )
    try:
        fail(first, dependency, 2)
        fail(second, dependency, 1)  # the third failure in the fleet trips it for both

        assert second.breaker_state(dependency).value == "open"
        assert first.breaker_state(dependency).value == "open"
        fail(first, "openai:gpt-4o-mini", 3)  # the first alternative is down too
        # A third that has seen nothing of either reviews against both open breakers.
        third = Governor(policy, breaker_storage=storage)
        decision = third.review(failure(), Decision(action=Action.RETRY, policy="p", reason=""))
        assert (decision.action, decision.params["to"]) == (Action.FALLBACK, "anthropic:claude")
    finally:
        import redis

        client = redis.Redis(host="127.0.0.1", port=6379)
        keys = list(client.scan_iter(match=f"{namespace}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_an_outage_asks_no_person_escalations_become_fallbacks(governor: Governor) -> None:
    fail(governor, "openai:gpt-4o", 3)
    escalated = Decision(action=Action.ESCALATE, policy="p", reason="retries exhausted")

    decision = governor.review(failure(), escalated)

    assert (decision.action, decision.params["to"]) == (Action.FALLBACK, "openai:gpt-4o-mini")


@pytest.mark.parametrize("kind", ["stall", "approval_required", "reasoning_loop"])
def test_an_open_breaker_leaves_a_failure_of_the_run_alone(governor: Governor, kind: str) -> None:
    # A stalled run's last model is down: the run still needs resume_run and its list
    # of unverified work, and an interrupt still needs a person, not a fallback.
    fail(governor, "openai:gpt-4o", 3)
    remediate = Decision(action=Action.REMEDIATE, policy="p", reason="", params={"x": 1})

    assert governor.review(failure(kind=kind), remediate) is remediate


def test_watched_breakers_are_bounded_by_the_board() -> None:
    from policies._breakers import BreakerBoard

    governor = Governor(load_policy(text=POLICY), max_dependencies=3)
    assert isinstance(governor.board, BreakerBoard)
    for n in range(10):  # dependency names are the agents' to choose
        governor.observe_calls([(0, f"tool:t{n}", False)])
        governor.observe_calls([(1, f"tool:t{n}", True)])  # reset: nothing left to watch
    assert len(governor._watched) <= 3
    for n in range(10, 20):
        governor.observe_calls([(0, f"tool:t{n}", False)])  # failures stay counted
    assert len(governor._watched) <= 3


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 50), st.sampled_from(["openai:gpt-4o", "tool:search"]), st.booleans()
            ),
            max_size=15,
        ),
        max_size=5,
    )
)
def test_a_batch_of_calls_moves_breakers_as_its_calls_one_by_one_would(
    batches: list[list[tuple[int, str, bool]]],
) -> None:
    clock = Clock()
    together = Governor(load_policy(text=POLICY), clock=clock)
    apart = Governor(load_policy(text=POLICY), clock=clock)
    for calls in batches:
        together.observe_calls(calls)
        for call in sorted(calls, key=lambda c: c[0]):  # in the order the calls ended
            apart.observe_calls([call])
        assert together.board.snapshot() == apart.board.snapshot()
        clock.now += 4  # breakers half-open 10 s after opening


def test_fallback_chains_are_remembered_within_a_bound_and_answer_the_same() -> None:
    from policies._policy import _MAX_REMEMBERED_CHAINS

    policy = load_policy(text=POLICY)
    chain = ("openai:gpt-4o", "openai:gpt-4o-mini", "anthropic:claude")
    # More dependencies than the memo holds (span-named): each answer is the same
    # remembered, forgotten or asked again.
    for i in range(_MAX_REMEMBERED_CHAINS + 10):
        assert policy.fallback_chain(f"openai:model-{i}") == chain
        assert policy.fallback_chain(f"acme:model-{i}") is None
        assert len(policy._chains) <= _MAX_REMEMBERED_CHAINS
    assert policy.fallback_chain("openai:model-0") == chain
