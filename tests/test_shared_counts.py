"""Retry budgets, restart intensity and cascades counted by a fleet in a real Redis.

Two governors are two sidecars: each has its own link to the Redis at
127.0.0.1:6379 (through a loopback proxy that can drop or hang), and both
count under one namespace of the test's own. Their clocks are fake and
shared, so that windows are the test's to move.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from policies import Admission, Cascade, Governor, Limit, load_policy
from supervisor.records import Action, Failure
from supervisor.shared_breakers import RedisLink
from supervisor.shared_counts import MAX_PENDING_KEYS, RedisWindowCounter
from tests.test_governor import decide, failure
from tests.test_shared_breakers import (
    AUTH,
    REDIS,
    RedisProxy,
    sidecar,
)

T = TypeVar("T")

POLICY = """\
version: 1
policies:
  - name: rt
    match: {kind: unavailable}
    action: retry
    max_attempts: 100
    wait: {type: fixed, seconds: 1}
breakers: {default: {fail_max: 1000, reset_timeout_s: 10}}
detectors:
  cascades: {min_failures: 4, min_runs: 3, window_s: 60}
"""
BUDGET = (
    POLICY
    + """\
retry_budget: {ratio: 0.5, min_retries: 3, window_s: 10}
restart_intensity: {enabled: false}
"""
)
INTENSITY = (
    POLICY
    + """\
retry_budget: {enabled: false}
restart_intensity: {max_actions: 3, period_s: 60}
"""
)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingLink(RedisLink):
    """The breakers' link, counting the operations it is asked for."""

    asked = 0

    def run(self, op: Callable[[Any], T]) -> T:
        self.asked += 1
        return super().run(op)


class Sidecar:
    """A governor with the fleet counter a sidecar builds (its own link, the shared namespace)."""

    def __init__(
        self, url: str, namespace: str, text: str, clock: Clock, *, retry_s: float = 0.3
    ) -> None:
        # As shared_breakers makes it: short timeouts, never retried.
        client = redis.Redis.from_url(
            url, socket_connect_timeout=0.2, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)
        )
        self.link = CountingLink(client, where="test", retry_s=retry_s, clock=clock)
        self.counter = RedisWindowCounter(self.link, namespace, clock=clock)
        self.governor = Governor(load_policy(text=text), clock=clock, shared_counts=self.counter)


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000.0)


@pytest.fixture
def two(proxy: RedisProxy, namespace: str, clock: Clock) -> Callable[[str], list[Sidecar]]:
    def make(text: str) -> list[Sidecar]:
        return [Sidecar(proxy.url, namespace, text, clock) for _ in range(2)]

    return make


def actions(sidecars: list[Sidecar], failures: list[Failure]) -> list[Action]:
    """Each failure decided by the next sidecar in turn."""
    return [decide(sidecars[n % len(sidecars)].governor, f).action for n, f in enumerate(failures)]


# -- retry budgets --------------------------------------------------------------------------


def test_two_sidecars_together_allow_the_budgets_floor_once(
    two: Callable[[str], list[Sidecar]],
) -> None:
    a, b = two(BUDGET)
    found = actions([a, b], [failure(dependency="tool:a", run=f"r{n}") for n in range(8)])

    # Each alone would allow its own min_retries (3): six between them.
    assert found.count(Action.RETRY) == 3
    assert found[:3] == [Action.RETRY] * 3
    assert a.governor.budget.denied + b.governor.budget.denied == 5
    spent = decide(a.governor, failure(dependency="tool:a", run="r9"))
    assert "retry budget of tool:a spent (3 retries for 0 calls in 10s)" in spent.reason


def test_the_budget_is_a_ratio_of_every_sidecars_calls(
    two: Callable[[str], list[Sidecar]], clock: Clock
) -> None:
    a, b = two(BUDGET)
    a.governor.observe_calls([(n, "tool:a", True) for n in range(20)])  # b saw none

    found = actions([a, b], [failure(dependency="tool:a", run=f"r{n}") for n in range(20)])

    # Half of the fleet's 20 calls; alone, a would allow 10 and b its floor of 3 more.
    assert found.count(Action.RETRY) == 10
    clock.now += 11  # the window moved on: the floor again
    assert actions([b], [failure(dependency="tool:a", run="later")]) == [Action.RETRY]


# -- restart intensity -----------------------------------------------------------------------


def test_restart_intensity_escalates_at_the_fleets_count(
    two: Callable[[str], list[Sidecar]], clock: Clock
) -> None:
    a, b = two(INTENSITY)
    found = actions([a, b, b, a], [failure(run="r1")] * 4)

    assert found == [Action.RETRY] * 3 + [Action.ESCALATE]  # not six: one run, one count
    assert actions([b], [failure(run="r2")]) == [Action.RETRY]  # per run
    clock.now += 61
    assert actions([b], [failure(run="r1")]) == [Action.RETRY]  # the period is over


# -- cascades --------------------------------------------------------------------------------


def failing(run: str, n: int) -> Failure:
    """A failure of ``run`` in a span of its own (the same span twice counts once)."""
    return replace(failure(run=run), span_id=f"{n:016x}")


def test_a_cascade_split_across_two_sidecars_is_found_and_reported_once(
    two: Callable[[str], list[Sidecar]],
) -> None:
    a, b = two(POLICY)
    assert a.governor.observe_cascades([], [failing("r1", 1), failing("r2", 2)]) == []

    started: list[Cascade] = b.governor.observe_cascades([], [failing("r3", 3), failing("r3", 4)])

    # Each saw two failures: alone, neither would have seen a cascade (4 failures, 3 runs).
    (cascade,) = started
    assert (cascade.dependency, cascade.failures, cascade.calls) == ("openai:gpt-4o", 4, 4)
    assert sorted(cascade.runs) == ["r1", "r2", "r3"]
    assert a.governor.observe_cascades([], [failing("r4", 5)]) == []  # reported once
    assert a.governor.breaker_state("openai:gpt-4o").value == "closed"  # a's breaker: b tripped


def test_the_fleets_successes_count_in_the_error_rate(
    two: Callable[[str], list[Sidecar]],
) -> None:
    a, b = two(POLICY)
    a.governor.observe_cascades(["openai:gpt-4o"] * 10, [])  # sent with a's next failure
    a.governor.observe_cascades([], [failing("r1", 1)])

    failures = [failing("r2", 2), failing("r3", 3), failing("r4", 4), failing("r4", 5)]
    started = b.governor.observe_cascades([], failures)

    assert started == []  # 5 failures of 15 calls: under 0.5 (alone, b would see 4 of 4)


# -- Redis away --------------------------------------------------------------------------------


def test_with_redis_hanging_decisions_go_on_with_local_counts_within_the_timeout(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    a, b = (Sidecar(proxy.url, namespace, BUDGET, clock, retry_s=5.0) for _ in range(2))
    proxy.set("hang")
    started = time.monotonic()

    found = actions([a, b], [failure(dependency="tool:a", run=f"r{n}") for n in range(8)])
    cascades = a.governor.observe_cascades([], [failing(f"r{n}", n) for n in range(4)])

    assert time.monotonic() - started < 1.0  # one timeout per link, then not asked
    assert found.count(Action.RETRY) == 6  # each sidecar's own floor: counted locally
    assert [c.dependency for c in cascades] == ["openai:gpt-4o"]  # found locally
    assert not a.link.stats().reachable
    assert a.link.stats().outages == 1


def test_when_redis_returns_counting_goes_back_to_it(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    a, b = (Sidecar(proxy.url, namespace, INTENSITY, clock, retry_s=0.2) for _ in range(2))
    proxy.set("drop")
    assert actions([a], [failure(run="r1")] * 2) == [Action.RETRY] * 2  # counted locally only
    proxy.set("forward")
    clock.now += 0.5  # past the links' retry_s: the next operation probes Redis again

    found = actions([a, b, a, b], [failure(run="r1")] * 4)

    # Redis has none of a's two actions (not merged): three more, fleet-wide, then escalate.
    assert found == [Action.RETRY] * 3 + [Action.ESCALATE]
    assert a.link.stats().reachable and b.link.stats().reachable


def test_calls_not_sent_while_redis_is_away_go_with_the_next_answer(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    a = Sidecar(proxy.url, namespace, BUDGET, clock, retry_s=0.2)
    a.governor.observe_calls([(n, "tool:a", True) for n in range(20)])
    proxy.set("drop")
    assert (
        a.counter.admit("budget:retries:tool:a", 10, Limit(3, 0.5, "budget:calls:tool:a")) is None
    )
    assert a.counter.claim("tool:a", 60) == ()  # no one to ask: this sidecar reports it
    proxy.set("forward")
    clock.now += 0.5

    answer = a.counter.admit("budget:retries:tool:a", 10, Limit(3, 0.5, "budget:calls:tool:a"))

    assert answer == Admission(allowed=True, count=1, of=20)


# -- the success path and bounds ---------------------------------------------------------------


def test_successes_never_ask_redis_failures_ask_once(
    two: Callable[[str], list[Sidecar]],
) -> None:
    a, _ = two(BUDGET.replace("restart_intensity: {enabled: false}", ""))
    calls = [(n, f"tool:{n % 7}", True) for n in range(500)]
    for _ in range(20):
        a.governor.observe_calls(calls)
        a.governor.observe_cascades([d for _, d, _ in calls], [])
    assert a.link.asked == 0

    a.governor.observe_cascades([], [failing("r1", 1)])  # one tally
    decide(a.governor, failure(dependency="tool:1"))  # intensity, then budget
    assert a.link.asked == 3


def test_keys_in_redis_expire_and_waiting_events_are_bounded(
    proxy: RedisProxy, namespace: str, direct: Any, clock: Clock
) -> None:
    a = Sidecar(proxy.url, namespace, BUDGET, clock)
    a.governor.observe_calls([(0, "tool:a", True)] * 4)
    decide(a.governor, failure(dependency="tool:a"))
    a.governor.observe_cascades([], [failing("r1", 1)])

    keys = list(direct.scan_iter(match=f"{namespace}:count:*"))
    assert len(keys) >= 4  # budget calls and retries, cascade failures, calls and runs
    assert all(0 < direct.pttl(key) <= 60_000 for key in keys)

    counter = RedisWindowCounter(a.link, namespace, clock=clock, max_pending_keys=3)
    for n in range(10):
        counter.add(f"k{n}", 10.0)
    assert len(counter._pending) == 3
    assert MAX_PENDING_KEYS >= 1000


# -- two sidecars ------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_sidecars_answer_decide_within_one_budget(
    tmp_path: Path, namespace: str, direct: Any
) -> None:
    url = f"redis://{REDIS[0]}:{REDIS[1]}/0"
    first = sidecar(tmp_path / "a", url, namespace)
    second = sidecar(tmp_path / "b", url, namespace)
    try:
        answers = []
        for n in range(8):
            api = (first, second)[n % 2].ports.api
            answers.append(
                httpx.post(
                    f"http://127.0.0.1:{api}/v1/decide",
                    headers=AUTH,
                    json={"dependency": "tool:search", "message": "APITimeoutError: timed out"},
                ).json()["action"]
            )

        # The default budget's floor, 3 retries: for the fleet, not 3 for each sidecar.
        assert answers.count("retry") == 3, answers
        assert direct.exists(f"{namespace}:count:budget:retries:tool:search")
    finally:
        first.stop()
        second.stop()
