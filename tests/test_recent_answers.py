"""Answers kept a few seconds: one read for many callers, none kept when it fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from supervisor.api.recent_answers import RecentAnswers


def test_callers_at_the_same_time_share_one_read_and_later_ones_its_answer() -> None:
    now = [0.0]
    kept: RecentAnswers[int] = RecentAnswers(10.0, clock=lambda: now[0])
    started = 0

    async def read() -> int:
        nonlocal started
        started += 1
        await asyncio.sleep(0)
        return started

    async def scenario() -> list[int]:
        together = await asyncio.gather(*(kept.get("day", read) for _ in range(5)))
        now[0] = 9.9
        later = await kept.get("day", read)
        now[0] = 10.0
        expired = await kept.get("day", read)
        return [*together, later, expired]

    assert asyncio.run(scenario()) == [1, 1, 1, 1, 1, 1, 2]
    assert kept.reads == 2


def test_a_failed_read_is_not_kept_and_keys_are_bounded() -> None:
    kept: RecentAnswers[str] = RecentAnswers(10.0, max_entries=2, clock=lambda: 0.0)

    async def fail() -> str:
        raise RuntimeError("store away")

    async def scenario() -> None:
        with pytest.raises(RuntimeError):
            await kept.get("a", fail)
        assert await kept.get("a", _value("a")) == "a"  # read again, not the error
        await kept.get("b", _value("b"))
        await kept.get("c", _value("c"))  # "a" is the oldest: dropped
        assert await kept.get("a", _value("a again")) == "a again"

    asyncio.run(scenario())


def _value(answer: str) -> Callable[[], Awaitable[str]]:
    async def read() -> str:
        return answer

    return read
