"""The fake provider's published limit: OpenAI's 429s and x-ratelimit headers, per API key.

The real openai SDK (no retries) meets the limit; the clock is the test's, so
refill is shown without sleeping.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from supervisor.testing import FakeProvider, KeyCounts, PublishedLimit
from supervisor.testing.provider_limits import RateLimiter, go_duration, request_tokens
from tests.test_shared_counts import Clock

MESSAGES: Any = [{"role": "user", "content": "x" * 400}]  # 100 tokens by the estimate


@pytest.fixture
def clock() -> Clock:
    return Clock(1000.0)


@pytest.fixture
def provider(clock: Clock) -> Iterator[FakeProvider]:
    with FakeProvider(limit=PublishedLimit(rpm=3, tpm=1000), clock=clock) as server:
        yield server


def client(provider: FakeProvider, key: str = "sk-fake-team-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=provider.base_url, api_key=key, max_retries=0)


def ask(oai: openai.OpenAI, max_tokens: int = 50) -> Any:
    return oai.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, max_tokens=max_tokens
    )


def test_the_burst_is_one_minute_then_429_with_openai_body_and_headers(
    provider: FakeProvider,
) -> None:
    oai = client(provider)
    first = ask(oai)
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-reset-requests"] == "20s"
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert first.headers["x-ratelimit-remaining-tokens"] == "850"  # 100 prompt + 50 asked
    assert first.headers["x-ratelimit-reset-tokens"] == "9s"
    ask(oai)
    ask(oai)
    with pytest.raises(openai.RateLimitError) as refused:
        ask(oai)
    error = refused.value
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded"
    assert error.type == "requests"
    assert "requests per min (RPM): Limit 3, Used 3, Requested 1" in error.message
    assert "Please try again in 20s" in error.message
    headers = error.response.headers
    assert headers["retry-after"] == "20"
    assert headers["retry-after-ms"] == "20000"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1m0s"
    assert provider.limit_counts() == {
        "sk-fake-team-a": KeyCounts(accepted=3, refused_requests=1, tokens_accepted=450)
    }


def test_the_buckets_refill_continuously(provider: FakeProvider, clock: Clock) -> None:
    oai = client(provider)
    for _ in range(3):
        ask(oai)
    with pytest.raises(openai.RateLimitError):
        ask(oai)
    clock.now += 19.9
    with pytest.raises(openai.RateLimitError) as refused:
        ask(oai)
    assert refused.value.response.headers["retry-after-ms"] == "100"
    clock.now += 0.1
    assert ask(oai).headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_refuse_a_request_the_requests_would_take(
    provider: FakeProvider, clock: Clock
) -> None:
    oai = client(provider)
    ask(oai, max_tokens=800)  # 900 of 1000
    with pytest.raises(openai.RateLimitError) as refused:
        ask(oai, max_tokens=100)  # 200 more: 100 short, 6 s of refill
    assert refused.value.type == "tokens"
    assert "tokens per min (TPM): Limit 1000, Used 900, Requested 200" in refused.value.message
    assert refused.value.response.headers["retry-after-ms"] == "6000"
    clock.now += 6
    assert ask(oai, max_tokens=100).headers["x-ratelimit-remaining-requests"] == "1"
    counts = provider.limit_counts()["sk-fake-team-a"]
    assert (counts.accepted, counts.refused_tokens, counts.refused) == (2, 1, 1)


def test_each_api_key_has_its_own_limit(provider: FakeProvider) -> None:
    a, b = client(provider, "sk-fake-team-a"), client(provider, "sk-fake-team-b")
    for _ in range(3):
        ask(a)
    with pytest.raises(openai.RateLimitError):
        ask(a)
    assert ask(b).headers["x-ratelimit-remaining-requests"] == "2"
    assert provider.limit_counts()["sk-fake-team-b"].accepted == 1


def test_streamed_answers_carry_the_headers(provider: FakeProvider) -> None:
    oai = client(provider)
    with oai.chat.completions.with_streaming_response.create(
        model="gpt-4o", messages=MESSAGES, stream=True
    ) as response:
        assert response.headers["x-ratelimit-remaining-tokens"] == "900"
        assert list(response.iter_lines())


def test_without_a_limit_nothing_is_refused_and_no_headers() -> None:
    with FakeProvider() as provider:
        oai = client(provider)
        for _ in range(5):
            assert "x-ratelimit-limit-requests" not in ask(oai).headers
        assert provider.limit_counts() == {}


def test_the_keys_tracked_are_bounded(clock: Clock) -> None:
    limiter = RateLimiter(PublishedLimit(rpm=1, tpm=None, max_keys=2), clock=clock)
    assert not limiter.take("a", 0).refused
    assert limiter.take("a", 0).refused
    limiter.take("b", 0)
    limiter.take("c", 0)  # forgets "a", used least recently
    assert sorted(limiter.counts()) == ["b", "c"]
    assert not limiter.take("a", 0).refused  # back, full again


def test_the_token_estimate() -> None:
    params = {
        "messages": [
            {"role": "system", "content": "abcde"},
            {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image_url"}]},
        ],
        "max_completion_tokens": 10,
    }
    assert request_tokens(params) == 2 + 10  # ceil(8 / 4)
    assert request_tokens({"messages": [{"role": "user", "content": "a"}]}) == 1


def test_durations_as_openai_writes_them() -> None:
    assert [go_duration(s) for s in (0.0201, 1, 17.28, 60, 360, 61.5)] == [
        "21ms",
        "1s",
        "17.28s",
        "1m0s",
        "6m0s",
        "1m1.5s",
    ]
