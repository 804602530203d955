"""The recovery benchmark's fake provider: a FaultSchedule whose model follows the scenario.

:class:`FaultSchedule` (``supervisor.testing.fault_schedule``) is the
OpenAI-compatible endpoint the agents call; its ``answer`` hook is given
every chat request and returns the reply, fault or answer, which
:class:`~supervisor.testing.fake_provider.FakeProvider` then shapes exactly as
the provider would (429 with ``retry-after``, 503, 401 ``invalid_api_key``,
404 ``model_not_found``, tool calls). The choice is
:func:`bench._recovery_scenario.decide`: deterministic per logical call and
attempt, plus the outage window on the clock of the arm.

Every request is logged in memory (bounded by the benchmark's size: a few
hundred thousand small tuples at most) for the figures.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import Counter
from dataclasses import dataclass

from bench._recovery_scenario import Scenario, Verdict, decide, read_request
from supervisor.testing.fake_provider import Reply
from supervisor.testing.fault_schedule import FaultSchedule, ProviderRequest

#: Most requests one arm may log: far above what the largest scale makes.
MAX_LOGGED = 2_000_000


@dataclass(frozen=True, slots=True)
class Call:
    """One request the provider answered."""

    t: float  # Unix time of arrival
    run: str
    turn: int
    step: int
    model: str
    attempt: int  # 1-based, per logical call (run, turn), whatever the model
    fault: str  # "" for a success

    @property
    def ok(self) -> bool:
        return not self.fault


def reply_for(verdict: Verdict, scenario: Scenario, model: str) -> Reply:
    """The provider's answer for the fake model's verdict."""
    fault = verdict.fault
    if fault == "auth":
        return Reply.unauthorized()
    if fault == "not_found":
        return Reply.not_found(model=model)
    if fault in ("outage", "transient_503"):
        return Reply.server_error(503)
    if fault == "transient_429":
        return Reply.rate_limited(retry_after_s=scenario.retry_after_s, model=model)
    if verdict.tool:
        return Reply.tool_call(verdict.tool, dict(verdict.arguments))
    return Reply.text(verdict.text)


class BenchProvider:
    """The fake provider for one arm: started at the arm's start, its calls logged."""

    def __init__(self, scenario: Scenario, t0: float) -> None:
        self.scenario = scenario
        self.t0 = t0
        self.calls: list[Call] = []
        self.unparsed = 0
        #: Connections the agents dropped mid-request (their worker was killed).
        self.connection_errors = 0
        self._attempts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.schedule = FaultSchedule(answer=self._answer, max_log=64)

    def _answer(self, request: ProviderRequest) -> Reply:
        asked = read_request(request.body)
        if asked is None:
            with self._lock:
                self.unparsed += 1
            return Reply.invalid_request("not a request of the recovery benchmark")
        with self._lock:
            self._attempts[asked.key] += 1
            attempt = self._attempts[asked.key]
        verdict = decide(self.scenario, asked, attempt, request.wall - self.t0)
        with self._lock:
            if len(self.calls) < MAX_LOGGED:
                self.calls.append(
                    Call(
                        request.wall,
                        asked.run,
                        asked.turn,
                        asked.step,
                        asked.model,
                        attempt,
                        verdict.fault,
                    )
                )
        return reply_for(verdict, self.scenario, asked.model)

    def start(self) -> BenchProvider:
        self.schedule.start()
        # A worker killed mid-request resets its connections: expected here, so
        # counted rather than printed as a traceback (socketserver's default).
        for server in (self.schedule.http_server, self.schedule.provider.http_server):
            server.handle_error = self._connection_error  # type: ignore[method-assign,assignment]
        return self

    def _connection_error(self, _request: object, _address: object) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            with self._lock:
                self.connection_errors += 1
            return
        traceback.print_exc()

    def stop(self) -> None:
        self.schedule.stop()

    @property
    def base_url(self) -> str:
        return self.schedule.base_url

    def snapshot(self) -> list[Call]:
        with self._lock:
            return list(self.calls)
