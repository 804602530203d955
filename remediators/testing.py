"""A remediation context with the runner's rules, kept in memory: for testing remediators.

:class:`FakeContext` enforces the allowlist, argument checks and budgets as the
durable runner does and executes calls on a
:class:`~remediators.gateway.RecordingGateway`; step results and errors go
through pickle, as a durable step's do. Waits return what the test scripts
(``recovers``, ``answer``) at once, and are listed in ``waited``.
"""

from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from remediators.base import Budget, BudgetSpent, ToolResult, Trigger
from remediators.gateway import RecordingGateway
from remediators.tools import check_arguments, execute

__all__ = ["FakeContext"]

T = TypeVar("T")


class FakeContext:
    """A :class:`RemediationContext` with the runner's behaviour, kept in memory."""

    def __init__(
        self,
        trigger: Trigger,
        gateway: RecordingGateway,
        tools: frozenset[str],
        budget: Budget | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self._trigger = trigger
        #: The remediator's params from the policy (what ``restart_worker`` runs).
        self.params: Mapping[str, Any] = dict(params or {})
        self.gateway = gateway
        self._tools = tools
        self._budget = budget or Budget()
        self.steps = 0
        self.tool_calls = 0
        self.tokens = 0
        self.calls: list[tuple[str, dict[str, Any], ToolResult]] = []
        self.step_results: list[Any] = []
        self.logs: list[str] = []
        #: What the waits return: set them to script the run's later spans and people.
        self.recovers = False
        self.answer: Mapping[str, Any] | None = None
        self.waited: list[tuple[str, float]] = []

    @property
    def trigger(self) -> Trigger:
        return self._trigger

    @property
    def remediation_id(self) -> str:
        return "rem_test"

    @property
    def budget(self) -> Budget:
        return self._budget

    @property
    def tools(self) -> frozenset[str]:
        return self._tools

    def _charge_step(self) -> None:
        if self.steps >= self._budget.steps:
            raise BudgetSpent(f"{self._budget.steps} steps")
        self.steps += 1

    async def call(self, tool: str, /, **arguments: Any) -> ToolResult:
        self._charge_step()
        if self.tool_calls >= self._budget.tool_calls:
            raise BudgetSpent(f"{self._budget.tool_calls} tool calls")
        self.tool_calls += 1
        if tool not in self._tools:
            result = ToolResult(False, error=f"{tool[:64]!r} is not in the allowlist", refused=True)
        else:
            reason = check_arguments(tool, arguments, self._trigger, self.gateway, self.params)
            if reason:
                result = ToolResult(False, error=reason, refused=True)
            else:
                result = execute(
                    tool,
                    arguments,
                    self._trigger,
                    self.gateway,
                    key=f"{self.remediation_id}/{self.steps}/{tool}",
                    remediation_id=self.remediation_id,
                    configured=self.params,
                )
        self.calls.append((tool, dict(arguments), result))
        return result

    async def step(self, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        self._charge_step()
        try:
            value = await fn()
        except Exception as exc:
            # A durable step records its exception and raises it again on replay.
            raise pickle.loads(pickle.dumps(exc)) from None  # noqa: S301 - our own bytes
        recorded: T = pickle.loads(pickle.dumps(value))  # noqa: S301 - a step result must pickle
        self.step_results.append(recorded)
        return recorded

    async def sleep(self, seconds: float) -> None:
        self._charge_step()
        self.waited.append(("sleep", seconds))

    async def wait_for_recovery(self, timeout_s: float) -> bool:
        self._charge_step()
        self.waited.append(("recovery", timeout_s))
        return self.recovers

    async def recovered(self) -> bool:
        return self.recovers

    async def wait_for_approval(
        self, approval_id: str, timeout_s: float
    ) -> Mapping[str, Any] | None:
        self._charge_step()
        self.waited.append(("approval", timeout_s))
        return self.answer

    async def restart_allowed(self) -> tuple[bool, str]:
        self._charge_step()  # a durable step in the runner
        return self.gateway.restart_allowed(self._trigger)

    def spend_tokens(self, tokens: int) -> None:
        self.tokens += max(0, int(tokens))
        if self.tokens > self._budget.tokens:
            raise BudgetSpent(f"{self._budget.tokens} tokens")

    def log(self, message: str) -> None:
        self.logs.append(message)
