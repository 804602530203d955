"""What a fleet learns together: the AIMD share of a model in a real Redis.

The Lua script and the pure learner run on one sequence of events and must
agree to the last bit; two admitters on one namespace share what one of
them learned; a burst of 429s cuts once; a 429 seen twice counts once; Redis
away leaves each sidecar its own learner. Clocks are the test's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from supervisor.admission import Admitter, Ceiling, admission_key
from supervisor.admission.learner import LearnedState, recover, throttle
from supervisor.admission.shared import RedisBucket
from supervisor.admission.shared_learning import RedisLearning
from supervisor.shared_breakers import RedisLink
from tests.redis_server import REDIS
from tests.test_shared_counts import Clock

MODEL = "openai:gpt-4o"
KEY = admission_key(MODEL, "team-a")
URL = f"redis://{REDIS[0]}:{REDIS[1]}/0"


def link(url: str, clock: Clock) -> RedisLink:
    client = redis.Redis.from_url(
        url, socket_connect_timeout=0.25, socket_timeout=0.25, retry=Retry(NoBackoff(), 0)
    )
    return RedisLink(client, where="test", retry_s=5.0, clock=clock)


def sidecar(namespace: str, clock: Clock, ceiling: Ceiling, url: str = URL) -> Admitter:
    found = link(url, clock)
    return Admitter(
        ceiling,
        shared=RedisBucket(found, namespace, clock=clock),
        learning=RedisLearning(found, namespace, clock=clock),
        clock=clock,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock(1_700_000_000.0)


def test_the_script_and_the_pure_learner_agree_on_one_sequence(
    namespace: str, clock: Clock
) -> None:
    ceiling = Ceiling(rpm=100, decrease=0.7, floor=0.1, step=0.05, window_s=60, decrease_gap_s=2)
    learning = RedisLearning(link(URL, clock), namespace, clock=clock)
    # 429s in bursts, apart, across windows, down to the floor and back up: seconds after start.
    events = [0, 0.3, 1.9, 2.0, 2.1, 5, 9, 13.5, 17, 21, 25, 29, 33, 37, 41, 45]
    events += [45 + 61, 45 + 61 + 1.5, 45 + 61 + 200.7, 600, 600.001, 1234.5, 1236.5]
    state = LearnedState(1.0, clock.now)
    start = clock.now
    seen: list[tuple[float, bool]] = []
    for at in events:
        clock.now = start + at
        state, decreased = throttle(state, ceiling, clock.now)
        learned = learning.throttled(MODEL, ceiling)
        assert learned is not None
        assert (learned.state.fraction, learned.state.decreased_at) == (
            state.fraction,
            state.decreased_at,
        ), at
        assert learned.state.since == state.since and learned.decreased == decreased, at
        seen.append((state.fraction, decreased))
    assert min(f for f, _ in seen) == 0.1  # down to the floor
    assert [d for _, d in seen].count(False) >= 4  # bursts that did not cut again
    assert seen[-3][0] > 0.1  # and back up after quiet windows
    clock.now += 3600
    stored = learning.read(MODEL)
    assert stored is not None
    assert recover(stored, ceiling, clock.now) == recover(state, ceiling, clock.now)
    assert recover(stored, ceiling, clock.now).fraction == 1.0


def test_what_one_sidecar_learns_the_other_applies_within_a_second(
    namespace: str, clock: Clock
) -> None:
    a, b = (sidecar(namespace, clock, Ceiling(rpm=600)) for _ in range(2))
    assert a.admit(KEY).go and b.admit(KEY).go  # b reads the fleet's share: 100%

    a.throttled(MODEL, span="t1/s1")

    assert b.stats().models[0].rpm == 600  # b's read is a second old at most...
    clock.now += 1.0
    assert b.admit(KEY).go
    limit = b.stats().models[0]
    assert (limit.rpm, limit.fraction, limit.fleetwide) == (420, 0.7, True)
    assert a.stats().models[0].rpm == 420
    assert b.stats().learned_fleetwide and b.stats().throttles == 0  # b saw no 429 itself
    clock.now += 60  # a window without a 429, for the whole fleet
    assert b.admit(KEY).go
    assert b.stats().models[0].rpm == pytest.approx(450)


def test_a_burst_of_429s_from_two_sidecars_cuts_once_and_a_span_counts_once(
    namespace: str, clock: Clock
) -> None:
    a, b = (sidecar(namespace, clock, Ceiling(rpm=1000)) for _ in range(2))
    for n in range(10):  # ten calls in flight, their 429s reach either sidecar
        (a if n % 2 else b).throttled(MODEL, span=f"t/{n}")
        clock.now += 0.05
    a.throttled(MODEL, span="t/3")  # a redelivered batch
    b.throttled(MODEL, span="t/3")  # the same span, at the other sidecar

    clock.now += 1.0
    assert a.admit(KEY).go
    assert a.stats().models[0].fraction == 0.7  # not 0.7 ** 10
    stats = [s.stats() for s in (a, b)]
    assert sum(s.decreases for s in stats) == 1
    assert sum(s.throttles for s in stats) == 10
    assert sum(s.repeated for s in stats) == 2
    assert sum(s.learned_locally for s in stats) == 0


def test_redis_away_each_sidecar_learns_alone_and_counts_it(clock: Clock) -> None:
    down = sidecar("unused", clock, Ceiling(rpm=100), url="redis://127.0.0.1:1/0")
    down.throttled(MODEL, span="t/1")
    decision = down.admit(KEY)
    stats = down.stats()
    assert decision.go and not decision.shared
    assert (stats.learned_locally, stats.decreases) == (1, 1)
    assert stats.models[0].rpm == 70 and not stats.models[0].fleetwide


class CountedLearning(RedisLearning):
    reads = 0

    def read_all(self, names: Sequence[str]) -> tuple[LearnedState, ...] | None:
        self.reads += 1
        return super().read_all(names)


def test_the_fraction_is_read_at_most_once_a_second(namespace: str, clock: Clock) -> None:
    found = link(URL, clock)
    learning = CountedLearning(found, namespace, clock=clock)
    a = Admitter(
        Ceiling(rpm=100_000),
        shared=RedisBucket(found, namespace, clock=clock),
        learning=learning,
        clock=clock,
    )
    for _ in range(50):
        assert a.admit(KEY).go
        clock.now += 0.05
    # at 0, 1 and 2 seconds (2.5 s of admissions): the model's and the credential's
    # states in one round trip
    assert learning.reads == 3


def test_no_state_in_redis_reads_as_the_full_ceiling(namespace: str, clock: Clock) -> None:
    learning = RedisLearning(link(URL, clock), namespace, clock=clock)
    state = learning.read("anthropic:claude")
    assert state is not None and state.fraction == 1.0
    assert state.decreased_at == -math.inf
