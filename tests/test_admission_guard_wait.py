"""``guard(admit=True)`` keeps asking while the fleet's bucket is contended, within its bound."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.client import SupervisorClient, guard


class Contended(SupervisorClient):
    """A sidecar whose bucket refuses ``refusals`` times (each: wait 1 s), then admits."""

    def __init__(self, refusals: int) -> None:
        self.slept: list[float] = []
        super().__init__("http://127.0.0.1:9", "tok", sleep=self.slept.append)
        self.refusals = refusals
        self.asked = 0

    def breaker_state(self, dependency: str) -> str:
        return "closed"

    async def abreaker_state(self, dependency: str) -> str:
        return "closed"

    def admit(self, dependency: str, **body: Any) -> int:
        self.asked += 1
        return 1000 if self.asked <= self.refusals else 0

    async def aadmit(self, dependency: str, **body: Any) -> int:
        return self.admit(dependency, **body)


def test_a_contended_call_waits_its_turn_past_twenty_refusals() -> None:
    client = Contended(refusals=45)  # a fleet's queue: refused once a refill, for 45 s
    ask = guard(
        "openai:gpt-4o", client=client, admit=True, credential="team-a", max_admit_wait_s=60
    )

    assert ask.call(lambda: "answer") == "answer"
    assert client.asked == 46  # admitted at last: the call went counted by the bucket
    assert client.slept == [1.0] * 45


def test_the_wait_bound_still_holds_and_async_waits_alike() -> None:
    client = Contended(refusals=100)
    ask = guard(
        "openai:gpt-4o", client=client, admit=True, credential="team-a", max_admit_wait_s=30
    )

    async def answer() -> str:
        return "answer"

    async def slept(seconds: float) -> None:
        client.slept.append(seconds)

    client.async_sleep = slept
    assert asyncio.run(ask.acall(answer)) == "answer"
    assert sum(client.slept) == 30.0 and client.asked == 31


def test_tiny_waits_are_slept_at_least_ten_milliseconds() -> None:
    client = Contended(refusals=3)
    client.admit = lambda dependency, **body: 0 if len(client.slept) >= 3 else 1  # type: ignore[method-assign]
    guard("openai:gpt-4o", client=client, admit=True).call(lambda: None)
    assert client.slept == [0.01, 0.01, 0.01]
