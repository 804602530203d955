"""The AIMD learner and the admission key, alone (a fake clock, nothing shared)."""

from __future__ import annotations

import pytest

from supervisor.admission import Admitter, Ceiling, CredentialRefused, Learner, admission_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_429_multiplies_the_limit_by_0_7_not_below_the_floor() -> None:
    clock = Clock()
    learner = Learner(Ceiling(rpm=100, tpm=10_000, floor=0.4), clock=clock)
    learner.throttled()
    assert learner.rpm() == pytest.approx(70)
    assert learner.tpm() == pytest.approx(7000)
    clock.now += 2  # past the burst's gap: another congestion event
    learner.throttled()
    assert learner.rpm() == pytest.approx(49)
    clock.now += 2
    learner.throttled()
    assert learner.rpm() == pytest.approx(40)  # the floor


def test_ten_429s_of_one_burst_decrease_once() -> None:
    clock = Clock()
    learner = Learner(Ceiling(rpm=100, decrease_gap_s=2.0), clock=clock)
    cuts = []
    for _ in range(10):  # ten calls in flight, their 429s within a second
        cuts.append(learner.throttled())
        clock.now += 0.1
    assert cuts == [True] + [False] * 9
    assert learner.rpm() == pytest.approx(70)  # not 100 * 0.7**10
    clock.now += 2.0  # the gap is counted from the decrease, not from the last 429
    assert learner.throttled()
    assert learner.rpm() == pytest.approx(49)


def test_each_window_without_429_adds_a_step_up_to_the_ceiling() -> None:
    clock = Clock()
    learner = Learner(Ceiling(rpm=100, step=0.1, window_s=60), clock=clock)
    learner.throttled()
    clock.now += 59
    assert learner.rpm() == pytest.approx(70)
    clock.now += 1
    assert learner.rpm() == pytest.approx(80)
    clock.now += 600
    assert learner.rpm() == pytest.approx(100)


def test_retry_after_pauses_until_then() -> None:
    clock = Clock()
    learner = Learner(Ceiling(rpm=100), clock=clock)
    learner.throttled(retry_after_s=12)
    assert learner.pause_left_s() == pytest.approx(12)
    clock.now += 12
    assert learner.pause_left_s() == 0


def test_a_key_is_provider_model_and_a_credential_name_never_a_secret() -> None:
    key = admission_key("openai:gpt-4o", "team-a")
    assert (key.provider, key.model, str(key)) == ("openai", "gpt-4o", "openai:gpt-4o@team-a")
    assert str(admission_key("openai:gpt-4o")) == "openai:gpt-4o"
    for secret in ("sk-abc123", "sk-ant-api03-x", "AIzaSyA", "gsk_abc"):
        with pytest.raises(CredentialRefused):
            admission_key("openai:gpt-4o", secret)
    with pytest.raises(CredentialRefused):
        admission_key("openai:gpt-4o", "a b:c")
    with pytest.raises(ValueError, match="provider:model"):
        admission_key("openai")


def test_new_ceilings_keep_what_was_learned_as_a_share_and_no_redis_is_local() -> None:
    clock = Clock()
    admitter = Admitter(Ceiling(rpm=10), clock=clock)
    key = admission_key("openai:gpt-4o")
    admitter.throttled("openai:gpt-4o")  # 70% of the ceiling, from now on

    assert sum(admitter.admit(key).go for _ in range(20)) == 7
    admitter.configure(Ceiling(rpm=100), {"openai:gpt-4o@team-a": Ceiling(rpm=1000)})
    clock.now += 60  # a full bucket again, and a step (5%) given back
    assert sum(admitter.admit(key).go for _ in range(200)) == 75
    assert (
        sum(admitter.admit(admission_key("openai:gpt-4o", "team-a")).go for _ in range(900)) == 750
    )
    late = admitter.admit(key, priority="low")
    # The normal calls refused above are waiting: a low one waits behind them.
    assert (late.go, late.why, late.shared) == (False, "priority", False)
    assert admitter.stats().answered_locally == admitter.stats().admitted + admitter.stats().refused


def test_a_429_span_seen_twice_counts_once_without_redis() -> None:
    admitter = Admitter(Ceiling(rpm=100), clock=Clock())
    admitter.throttled("openai:gpt-4o", span="trace/span")
    admitter.throttled("openai:gpt-4o", span="trace/span")  # a redelivered batch
    stats = admitter.stats()
    assert (stats.throttles, stats.repeated, stats.decreases) == (1, 1, 1)
    assert (stats.learned_fleetwide, stats.learned_locally) == (False, 0)
    assert stats.models[0].rpm == 70
