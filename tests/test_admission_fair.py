"""Fair shares between services on one key, in a real Redis and in the local bucket.

Agents are simulated on a fake clock: each asks, and asks again right after a
``go`` (or after its own pause) or after the advised wait, so minutes of
contention take a second. The Lua script and :class:`LocalBucket` are fed one
sequence and must give the same answers.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from policies import load_policy
from supervisor.admission import Admitter, Ceiling, LocalBucket, Take, admission_key
from supervisor.admission.bucket import MAX_SERVICE_CHARS, MAX_SERVICES
from supervisor.admission.shared import RedisBucket
from supervisor.errors import PolicyError
from supervisor.shared_breakers import RedisLink
from tests.redis_server import REDIS
from tests.test_shared_counts import Clock

KEY = admission_key("openai:gpt-4o", "team-a")
URL = f"redis://{REDIS[0]}:{REDIS[1]}/0"


@dataclass(frozen=True)
class Agent:
    service: str
    weight: float = 1.0
    priority: str = "normal"
    pause_ms: int = 0  # after a go, before asking again (0: hammering)


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000.0)


@pytest.fixture
def shared(namespace: str, clock: Clock) -> Iterator[Admitter]:
    client = redis.Redis.from_url(URL, socket_timeout=1.0)
    link = RedisLink(client, where="test", retry_s=5.0, clock=clock)
    yield Admitter(Ceiling(rpm=300), shared=RedisBucket(link, namespace, clock=clock), clock=clock)
    client.close()


@dataclass
class Seen:
    goes: Counter[str]  # per service, after count_from
    refused: Counter[str]  # by why
    waits: list[int]  # every wait advised (ms)
    delays: dict[str, list[int]]  # per service: from a call's first question to its go (ms)


def simulate(
    admitter: Admitter,
    clock: Clock,
    agents: list[Agent],
    *,
    seconds: int,
    count_from: int,
    shared: bool = True,
) -> Seen:
    """What ``agents`` got from ``admitter`` in ``seconds`` of contention."""
    start = round(clock.now * 1000)
    queue = [(start + i, i) for i in range(len(agents))]
    asked = [start + i for i in range(len(agents))]
    seen = Seen(Counter(), Counter(), [], {a.service: [] for a in agents})
    while queue:
        when, i = heapq.heappop(queue)
        if when > start + seconds * 1000:
            break
        clock.now = when / 1000
        agent = agents[i]
        found = admitter.admit(
            KEY, service=agent.service, weight=agent.weight, priority=agent.priority
        )
        assert found.shared is shared
        if found.go:
            if when >= start + count_from * 1000:
                seen.goes[agent.service] += 1
                seen.delays[agent.service].append(when - asked[i])
            heapq.heappush(queue, (when + agent.pause_ms, i))
            asked[i] = when + agent.pause_ms
        else:
            seen.refused[found.why] += 1
            seen.waits.append(found.wait_ms)
            heapq.heappush(queue, (when + found.wait_ms, i))
    return seen


def hammering(service: str, weight: float = 1.0, agents: int = 3, **kw: Any) -> list[Agent]:
    return [Agent(service, weight, **kw) for _ in range(agents)]


def test_three_services_weighted_1_1_2_get_a_quarter_a_quarter_and_half(
    shared: Admitter, clock: Clock
) -> None:
    agents = hammering("a") + hammering("b") + hammering("c", 2)

    seen = simulate(shared, clock, agents, seconds=240, count_from=60)

    goes, total = seen.goes, sum(seen.goes.values())
    assert total == pytest.approx(300 * 3, abs=3)  # contended: the full rate, nothing idle
    assert goes["a"] / total == pytest.approx(0.25, abs=0.02)
    assert goes["b"] / total == pytest.approx(0.25, abs=0.02)
    assert goes["c"] / total == pytest.approx(0.50, abs=0.02)
    assert seen.refused["share"] > 0
    assert max(seen.waits) <= 4 * 200  # a few requests' refill (200 ms each at 300 a minute)


def test_a_service_asking_for_little_gets_all_it_asks(shared: Admitter, clock: Clock) -> None:
    # 30 a minute asked, under its third of 300: every one goes, within one refill.
    light = [Agent("light", pause_ms=2000)]
    agents = hammering("heavy-1") + hammering("heavy-2") + light

    seen = simulate(shared, clock, agents, seconds=240, count_from=60)

    assert max(seen.delays["light"]) <= 200  # at most the refill of the request it asks
    assert seen.goes["light"] >= 80  # a call each 2 s and its wait (<= 0.2 s): 180 s / 2.2 s
    assert seen.goes["heavy-1"] == pytest.approx(seen.goes["heavy-2"], abs=6)
    assert sum(seen.goes.values()) == pytest.approx(300 * 3, abs=3)
    assert max(seen.delays["heavy-1"]) > 200


def test_a_lone_service_gets_the_full_rate(shared: Admitter, clock: Clock) -> None:
    seen = simulate(shared, clock, hammering("solo", agents=4), seconds=180, count_from=60)

    assert seen.goes["solo"] == pytest.approx(300 * 2, abs=2)
    assert seen.refused["share"] == 0


def test_priorities_come_before_weights(shared: Admitter, clock: Clock) -> None:
    agents = hammering("urgent", 1, priority="high") + hammering("heavy", 10)

    seen = simulate(shared, clock, agents, seconds=120, count_from=60)

    assert seen.goes["urgent"] >= 0.95 * 300
    assert seen.refused["priority"] > 0


def test_a_weight_is_relative_within_a_priority_only(shared: Admitter, clock: Clock) -> None:
    low = hammering("x", 1, priority="low") + hammering("y", 3, priority="low")

    goes = simulate(shared, clock, low, seconds=180, count_from=60).goes

    assert goes["y"] / (goes["x"] + goes["y"]) == pytest.approx(0.75, abs=0.02)


def test_the_script_and_the_local_bucket_give_the_same_answers(namespace: str, direct: Any) -> None:
    clock = Clock(2_000_000.0)
    link = RedisLink(redis.Redis.from_url(URL), where="test", retry_s=5.0, clock=clock)
    fleet, local = RedisBucket(link, namespace, clock=clock), LocalBucket(clock=clock)
    rng = random.Random(7)
    services = ["a", "b", "c", "d", "é-ünïcode"]
    weights = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 3.0, "é-ünïcode": 1.0}
    now_ms = 2_000_000_000
    answers: list[tuple[Take, Take]] = []
    for _ in range(3000):
        now_ms += rng.choice([0, 0, 1, 7, 50, 200, 1000, 90_000 if rng.random() < 0.01 else 3])
        clock.now = now_ms / 1000
        key = rng.choice(["k1", "k2"])
        rpm, tpm = (60.0, 6000.0) if key == "k1" else (600.0, None)
        service = rng.choice(services)
        ask: dict[str, Any] = {
            "n": 1,
            "t": rng.choice([0, 10, 100, 1000]),
            "priority": rng.choice([0, 1, 1, 1, 2]),
            "service": service,
            "weight": weights[service],
        }
        shared_take = fleet.take(key, "openai:gpt-4o", rpm, tpm, **ask)
        assert shared_take is not None
        answers.append((shared_take, local.take(key, rpm, tpm, **ask)))

    assert [s for s, _ in answers] == [mine for _, mine in answers]
    whys = Counter(s.why for s, _ in answers)
    assert whys[""] > 300 and whys["limit"] > 100 and whys["share"] > 100 and whys["priority"] > 10


def test_a_weight_of_zero_is_refused(shared: Admitter) -> None:
    with pytest.raises(ValueError, match="above 0"):
        shared.admit(KEY, service="x", weight=0)


def test_many_service_names_stay_bounded(
    shared: Admitter, clock: Clock, namespace: str, direct: Any
) -> None:
    local = LocalBucket(clock=clock)
    for n in range(1000):
        clock.now += 0.001
        service = f"svc-{n}" + "x" * (10_000 if n % 100 == 0 else 0)
        shared.admit(KEY, service=service)
        local.take(str(KEY), 300, None, n=1, t=0, priority=1, service=service)

    fields = direct.hkeys(f"{namespace}:admit:fair:{KEY}")
    entries = [f for f in fields if not f.startswith(b"V")]
    assert len(entries) == MAX_SERVICES
    assert max(len(f) for f in fields) <= MAX_SERVICE_CHARS + 2
    assert b"1|svc-999" in entries and b"1|svc-0" not in entries  # the least recent went
    assert len(local._levels[str(KEY)].shares) == MAX_SERVICES


def test_the_local_bucket_shares_by_weight_too(clock: Clock) -> None:
    # Redis away: the sidecar's own bucket, same arithmetic.
    admitter = Admitter(Ceiling(rpm=300), clock=clock)
    agents = hammering("a") + hammering("b", 3)

    goes = simulate(admitter, clock, agents, seconds=180, count_from=60, shared=False).goes

    assert goes["b"] / sum(goes.values()) == pytest.approx(0.75, abs=0.02)


@pytest.mark.parametrize(
    ("services", "error"),
    [
        ("{planner: {weight: 0}}", "greater than 0"),
        ("{planner: {weight: 2, share: 1}}", "share"),
        ("{'': {weight: 2}}", "at least 1 character"),
        ("{planner: 2}", "valid dictionary"),
    ],
)
def test_the_policy_refuses_bad_weights(services: str, error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        load_policy(text=f"version: 1\nadmission:\n  services: {services}\n")


def test_the_policy_bounds_the_services_and_gives_weights() -> None:
    many = ", ".join(f"s{n}: {{weight: 2}}" for n in range(257))
    with pytest.raises(PolicyError, match="256"):
        load_policy(text=f"version: 1\nadmission:\n  services: {{{many}}}\n")
    spec = load_policy(
        text="version: 1\nadmission:\n  services: {planner: {weight: 2.5}}\n"
    ).limits.admission
    assert (spec.weight("planner"), spec.weight("other"), spec.weight("")) == (2.5, 1.0, 1.0)
