"""Admission by a fleet in a real Redis: two sidecars, one limit.

Each sidecar has its own link to the Redis at 127.0.0.1:6379 (through a
loopback proxy that can hang) and both use one namespace of the test's own;
their clock is fake and shared, so that minutes are the test's to move.
"""

from __future__ import annotations

import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from supervisor.admission import Admitter, Ceiling, admission_key
from supervisor.admission.shared import RedisBucket
from supervisor.shared_breakers import RedisLink
from tests.redis_server import RedisProxy
from tests.test_shared_counts import Clock

KEY = admission_key("openai:gpt-4o", "team-a")


def sidecar(url: str, namespace: str, clock: Clock, ceiling: Ceiling) -> tuple[Admitter, RedisLink]:
    # As the breakers' link is built: short timeouts, never retried.
    client = redis.Redis.from_url(
        url, socket_connect_timeout=0.25, socket_timeout=0.25, retry=Retry(NoBackoff(), 0)
    )
    link = RedisLink(client, where="test", retry_s=5.0, clock=clock)
    return Admitter(ceiling, shared=RedisBucket(link, namespace, clock=clock), clock=clock), link


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000.0)


def test_two_sidecars_share_one_limit_60_a_minute(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    (a, _), (b, _) = (sidecar(proxy.url, namespace, clock, Ceiling(rpm=60)) for _ in range(2))

    first = [(a if n % 2 else b).admit(KEY).go for n in range(80)]
    refused = a.admit(KEY)
    clock.now += 60  # a minute refills the bucket: 60 more, no more
    second = [(b if n % 2 else a).admit(KEY).go for n in range(80)]

    assert first.count(True) == 60 and first[:60] == [True] * 60
    assert not refused.go and refused.why == "limit" and refused.shared
    assert refused.wait_ms == 1000  # one request refills in a second at 60 a minute
    assert second.count(True) == 60
    assert a.stats().answered_locally == b.stats().answered_locally == 0


def test_tokens_per_minute_limit_too(proxy: RedisProxy, namespace: str, clock: Clock) -> None:
    (a, _), (b, _) = (
        sidecar(proxy.url, namespace, clock, Ceiling(rpm=1000, tpm=6000)) for _ in range(2)
    )
    assert a.admit(KEY, tokens=4000).go
    late = b.admit(KEY, tokens=4000)
    assert not late.go and late.wait_ms == 20_000  # 2000 tokens at 100 a second
    clock.now += 20
    assert b.admit(KEY, tokens=4000).go


def test_a_429_lowers_the_limit_and_retry_after_pauses_the_key_fleet_wide(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    (a, _), (b, _) = (sidecar(proxy.url, namespace, clock, Ceiling(rpm=100)) for _ in range(2))
    assert a.admit(KEY).go

    a.throttled("openai:gpt-4o", retry_after_s=30)

    mine, theirs = a.admit(KEY), b.admit(KEY)
    assert (mine.go, mine.why, mine.wait_ms) == (False, "paused", 30_000)
    assert (theirs.go, theirs.why, theirs.wait_ms) == (False, "paused", 30_000)
    clock.now += 30  # the pause over: a's limit is now 70 (b's, which saw no 429, still 100)
    assert sum(a.admit(KEY).go for _ in range(100)) == 70
    clock.now += 60  # a minute without a 429 gives a step (5% of the ceiling) back
    assert sum(a.admit(KEY).go for _ in range(100)) == 75


def test_a_low_priority_call_waits_while_a_high_one_is_waiting(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    (a, _), (b, _) = (sidecar(proxy.url, namespace, clock, Ceiling(rpm=60)) for _ in range(2))
    for _ in range(60):
        assert a.admit(KEY, priority="low").go
    high = a.admit(KEY, priority="high")
    assert not high.go and high.why == "limit"
    clock.now += 0.5
    low = b.admit(KEY, priority="low")
    assert (low.go, low.why, low.wait_ms) == (False, "priority", 500)
    clock.now += 0.5
    assert b.admit(KEY, priority="high").go  # the refill goes to the high one


def test_with_redis_hanging_a_local_bucket_answers_within_the_timeout(
    proxy: RedisProxy, namespace: str, clock: Clock
) -> None:
    a, link = sidecar(proxy.url, namespace, clock, Ceiling(rpm=10))
    proxy.set("hang")
    started = time.monotonic()

    found = [a.admit(KEY) for _ in range(12)]

    assert time.monotonic() - started < 1.0  # one timeout, then the link does not ask
    assert [d.go for d in found] == [True] * 10 + [False] * 2
    assert not any(d.shared for d in found)
    assert a.stats().answered_locally == 12
    assert not link.stats().reachable
