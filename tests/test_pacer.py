"""Resumes and retries of a dependency are spaced at its capacity, never sooner than planned."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from policies import load_policy
from policies._breakers import BreakerState
from policies._governor import Governor
from policies._pacer import Pacer
from supervisor.records import Action, Decision, Failure
from tests.test_governor import decide as review
from tests.test_governor import failure as governor_failure

DEP = "openai:gpt-4o"

RETRIES = """\
version: 1
builtin: false
policies:
  - name: rt
    match: {kind: unavailable}
    action: retry
    max_attempts: 5
    wait: {type: fixed, seconds: 1}
retry_budget: {enabled: false}
breakers: {default: {fail_max: 1000}}
"""

JITTERED = RETRIES.replace("{type: fixed, seconds: 1}", "{type: exponential, min: 1, max: 4}")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rate(rpm: float | None, only: str = DEP) -> Callable[[str], float | None]:
    return lambda dependency: rpm if dependency == only else None


def failure(run: str, dependency: str = DEP, span: str = "b" * 16) -> Failure:
    """A 503 of ``run``, in a trace of its own."""
    found = governor_failure(dependency=dependency, run=run)
    return replace(found, trace_id=f"{abs(hash(run)):032x}"[:32], span_id=span)


def resumes(governor: Governor, runs: int = 50) -> list[float]:
    governor.observe_calls([(i, DEP, False) for i in range(5)])
    assert governor.breaker_state(DEP) is BreakerState.OPEN
    return [
        float(str(review(governor, failure(f"run-{n}")).params["breaker_reopens_in_s"]))
        for n in range(runs)
    ]


# -- the pacer ---------------------------------------------------------------------------


def test_the_pacer_gives_the_next_free_slot_and_never_shortens_a_delay() -> None:
    clock = Clock()
    pacer = Pacer(rate(60), clock=clock)  # one call a second
    assert [pacer.pace(DEP, 2.0) for _ in range(3)] == [2.0, 3.0, 4.0]
    assert pacer.pace(DEP, 0.5) == 0.5  # a gap before the first slot still fits
    assert pacer.pace(DEP, 0.6) == 5.0  # 0.6 is too close to 0.5 and 2, 3, 4 are taken
    assert pacer.pace(DEP, 10.0) == 10.0  # far enough from every slot
    assert pacer.pace("anthropic:claude", 2.0) == 2.0  # rate unknown: as asked
    clock.now += 60  # every slot past: forgotten
    assert pacer.pace(DEP, 2.0) == 2.0


def test_the_pacer_is_bounded() -> None:
    clock = Clock()
    pacer = Pacer(lambda _dependency: 60.0, clock=clock, max_dependencies=3, max_slots=4)
    for n in range(10):
        pacer.pace(f"p:m{n}", 1.0)
    assert len(pacer) == 3
    assert [pacer.pace(DEP, 0.0) for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert pacer.taken(DEP) == 4  # the oldest forgotten
    assert pacer.pace(DEP, 0.0) == 0.0  # the forgotten slot is free again (and forgotten)
    assert pacer.pace(DEP, 1.0) == 5.0  # the others are still taken


def _reference_pace(slots: list[float], now: float, delay_s: float, interval: float) -> float:
    """The pacer's rule on a plain sorted list of every slot (quadratic, obviously right)."""
    del slots[: bisect.bisect_right(slots, now - interval)]
    wanted = at = now + max(0.0, delay_s)
    i = bisect.bisect_right(slots, at - interval)
    while i < len(slots) and slots[i] < at + interval:
        at = slots[i] + interval
        i += 1
    slots.insert(i, at)
    return delay_s if at == wanted else at - now


@pytest.mark.parametrize("seed", range(20))
def test_the_blocks_give_the_slots_a_list_of_every_slot_gives(seed: int) -> None:
    """Blocks keep only each run of slots' ends; the answers are a full list's."""
    rng = random.Random(seed)
    clock = Clock()
    interval = rng.choice([0.1, 1.0, 2.5])
    pacer = Pacer(lambda _dependency: 60 / interval, clock=clock)
    slots: list[float] = []
    for _ in range(400):
        clock.now += rng.choice([0.0, 0.0, 0.3, 2.0, 7.0])
        delay = rng.choice([0.0, rng.uniform(0, 5), rng.uniform(0, 60), 30.0])
        expected = _reference_pace(slots, clock.now, delay, interval)
        assert pacer.pace(DEP, delay) == pytest.approx(expected, abs=1e-9)
    assert pacer.taken(DEP) >= len(slots)  # a block partly past is kept whole


def test_ten_thousand_paused_runs_make_one_block() -> None:
    """One opening pausing many runs: one block, each new slot placed after it by a search
    (``bench/stages.py`` measures the cost), not by a walk over every slot."""
    pacer = Pacer(lambda _dependency: 60.0, clock=Clock())
    delays = [pacer.pace(DEP, 30.0) for _ in range(10_000)]
    assert delays == [30.0 + n for n in range(10_000)]
    assert len(pacer._slots[DEP].starts) == 1


@pytest.mark.parametrize("rpm", [None, 0.0, float("nan"), float("inf")])
def test_an_unknown_or_absurd_rate_paces_nothing(rpm: float | None) -> None:
    pacer = Pacer(rate(rpm), clock=Clock())
    assert [pacer.pace(DEP, 1.0) for _ in range(3)] == [1.0, 1.0, 1.0]


# -- breaker resumes -----------------------------------------------------------------------


def test_fifty_paused_runs_resume_at_most_at_the_dependency_rate() -> None:
    clock = Clock()
    delays = resumes(Governor(load_policy(), clock=clock, capacity=rate(60)))

    half_open = 30.0  # the built-in breaker's reset_timeout_s
    ordered = sorted(delays)
    assert all(b - a >= 1.0 - 1e-6 for a, b in itertools.pairwise(ordered))
    assert all(d >= half_open + k - 1e-6 for k, d in enumerate(ordered))
    assert ordered[0] == half_open  # the first trial when it half-opens
    assert ordered[-1] > half_open + 49 - 1e-6  # 50 runs need 49 s at 60 rpm: over the 30 s spread

    # A stable order: the same runs asked in the same order get the same times...
    again = Governor(load_policy(), clock=clock, capacity=rate(60))
    assert resumes(again) == delays
    # ...and a run asked again (its next failure) keeps its slot.
    clock.now += 2.0
    governor = again
    for n in (0, 7, 49):
        asked = review(governor, failure(f"run-{n}")).params["breaker_reopens_in_s"]
        assert asked == pytest.approx(delays[n] - 2.0, abs=1e-3)


def test_a_fast_dependency_keeps_the_policy_spread() -> None:
    """The spread is the minimum: capacity to spare changes nothing but near-collisions."""
    plain = resumes(Governor(load_policy(), clock=Clock()), runs=10)
    fast = resumes(Governor(load_policy(), clock=Clock(), capacity=rate(6000)), runs=10)
    # The hash places, moved only off another run's 10 ms.
    assert all(0 <= f - p < 0.1 for f, p in zip(fast[3:], plain[3:], strict=True))
    assert plain[:3] == [30.0] * 3
    assert fast[:3] == [30.0, 30.01, 30.02]  # the trials, one interval apart


def test_without_a_known_rate_resumes_are_as_before() -> None:
    plain = resumes(Governor(load_policy(), clock=Clock()))
    assert resumes(Governor(load_policy(), clock=Clock(), capacity=rate(None))) == plain
    assert resumes(Governor(load_policy(), clock=Clock(), capacity=rate(60, "x:y"))) == plain


# -- retries ---------------------------------------------------------------------------------


def test_twenty_retries_of_one_dependency_in_one_batch_leave_one_interval_apart() -> None:
    governor = Governor(load_policy(text=RETRIES), clock=Clock(), capacity=rate(60))
    decisions = [review(governor, failure(f"run-{n}")) for n in range(20)]
    assert {d.action for d in decisions} == {Action.RETRY}
    assert [d.params["delay_s"] for d in decisions] == [float(n) for n in range(1, 21)]
    assert "spaced at the rate of openai:gpt-4o: retry in 2s" in decisions[1].reason
    # Another dependency has its own slots; one of unknown rate is not paced.
    other = review(governor, failure("run-x", dependency="anthropic:claude"))
    assert other.params["delay_s"] == 1.0


def test_paced_retries_are_never_shorter_than_their_backoff() -> None:
    policy = load_policy(text=JITTERED)
    plain = Governor(policy, clock=Clock())
    paced = Governor(policy, clock=Clock(), capacity=rate(30))  # one call every 2 s
    runs = [failure(f"run-{n}") for n in range(20)]
    before = [review(plain, f, attempt=3).params["delay_s"] for f in runs]  # in 1..4 s
    after = [review(paced, f, attempt=3).params["delay_s"] for f in runs]
    assert all(float(str(a)) >= float(str(b)) for a, b in zip(after, before, strict=True))
    ordered = sorted(float(str(a)) for a in after)
    assert all(b - a >= 2.0 - 1e-6 for a, b in itertools.pairwise(ordered))
    assert ordered[-1] >= 1.0 + 19 * 2.0  # twenty calls at 30 rpm: 38 s from the first
    assert len(set(before)) > 1  # jittered: the pacer fills around them


def test_without_a_known_rate_retries_are_as_before() -> None:
    policy = load_policy(text=JITTERED)
    runs = [failure(f"run-{n}") for n in range(20)]
    plain = Governor(policy, clock=Clock())
    unknown = Governor(policy, clock=Clock(), capacity=rate(None))
    assert [review(unknown, f, attempt=3) for f in runs] == [
        review(plain, f, attempt=3) for f in runs
    ]


def test_observe_only_retries_take_no_slot() -> None:
    governor = Governor(load_policy(text=RETRIES), clock=Clock(), capacity=rate(60))
    f = failure("r")
    watched = governor.policy.decide(f, attempt=1)
    observed = Decision(watched.action, watched.policy, watched.params, watched.reason, True)
    assert [governor.review(f, observed).params["delay_s"] for _ in range(3)] == [1.0] * 3
