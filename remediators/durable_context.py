"""What a remediator works with: the budgeted, durable context of one workflow execution.

Every call a remediator makes through it (a tool, a step, a sleep, a wait)
is charged to the remediation's budget and recorded as a DBOS step, so a
remediation resumed after a crash replays what it had done and has spent
exactly what it had spent.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol, TypeVar

from dbos import DBOS
from opentelemetry import trace

from remediators.base import Budget, BudgetSpent, ToolResult, Trigger
from remediators.gateway import Gateway
from remediators.remediation_spans import MAX_TEXT, RemediationSpans
from remediators.tools import check_arguments, execute

T = TypeVar("T")

#: The DBOS topic of the answers to a remediation's approval requests.
APPROVAL_TOPIC: Final = "approval"


class RunnerServices(Protocol):
    """What a context asks of the runner that made it (``remediators.runner.DurableRunner``)."""

    @property
    def gateway(self) -> Gateway: ...

    @property
    def spans(self) -> RemediationSpans: ...

    async def in_tool_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...

    async def wait_for_recovery(
        self, trigger: Trigger, remediation_id: str, deadline: float
    ) -> dict[str, Any] | None: ...


class DurableContext:
    """The :class:`~remediators.base.RemediationContext` of one workflow execution.

    Counters are rebuilt on every execution from the replayed steps, so a
    resumed remediation has spent exactly what it had spent. The deadline is
    read against durable times (each step records when it ran), never the
    clock directly: a replay takes the same branches as the first run.
    """

    def __init__(self, runner: RunnerServices, request: Mapping[str, Any], root: trace.Span):
        self._runner = runner
        self._request = request
        self._root = root
        self._trigger = Trigger.from_json(request["trigger"])
        b = request["budget"]
        self._budget = Budget(
            steps=int(b["steps"]),
            tool_calls=int(b["tool_calls"]),
            deadline_s=float(b["deadline_s"]),
            tokens=int(b["tokens"]),
        )
        self._tools = frozenset(request["tools"])
        self.steps = 0
        self.tool_calls = 0
        self.tokens = 0
        self.refused = 0
        self.acted = 0
        #: What showed the run recovering (the dependency, or that the run ended
        #: OK), as the last wait saw it; ``""`` when none did, or on a replay.
        self.recovery = ""
        self._last_at = float(request["dispatched_at"])

    @property
    def trigger(self) -> Trigger:
        return self._trigger

    @property
    def root(self) -> trace.Span:
        return self._root

    @property
    def remediation_id(self) -> str:
        return str(self._request["id"])

    @property
    def budget(self) -> Budget:
        return self._budget

    @property
    def tools(self) -> frozenset[str]:
        return self._tools

    def _charge_step(self) -> None:
        if self.steps >= self._budget.steps:
            raise BudgetSpent(f"{self._budget.steps} steps")
        if self._last_at - float(self._request["dispatched_at"]) > self._budget.deadline_s:
            raise BudgetSpent(f"the {self._budget.deadline_s:g} s deadline")
        self.steps += 1

    async def _durable(self, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        async def once() -> T:
            return await fn()

        return await DBOS.run_step_async({"name": name}, once)

    async def call(self, tool: str, /, **arguments: Any) -> ToolResult:
        self._charge_step()
        if self.tool_calls >= self._budget.tool_calls:
            raise BudgetSpent(f"{self._budget.tool_calls} tool calls")
        self.tool_calls += 1
        seq = self.steps
        runner, trigger, rid = self._runner, self._trigger, self.remediation_id
        configured: Mapping[str, Any] = self._request["params"]
        allowed = tool in self._tools

        async def run() -> dict[str, Any]:
            started = time.time_ns()
            if not allowed:
                result = ToolResult(
                    False,
                    error=f"{tool[:64]!r} is not in this remediator's allowlist",
                    refused=True,
                )
            else:
                reason = check_arguments(tool, arguments, trigger, runner.gateway, configured)
                if reason:
                    result = ToolResult(False, error=reason, refused=True)
                else:
                    key = f"{rid}/{seq}/{tool}"
                    try:
                        result = await runner.in_tool_thread(
                            execute,
                            tool,
                            arguments,
                            trigger,
                            runner.gateway,
                            key=key,
                            remediation_id=rid,
                            configured=configured,
                        )
                    except Exception as exc:  # a failed tool is a result, not a crash
                        result = ToolResult(False, error=f"{type(exc).__name__}: {exc}"[:MAX_TEXT])
            runner.spans.tool(
                self._root, tool, arguments, result, seq=seq, started_ns=started, allowed=allowed
            )
            return {**result.to_json(), "at": time.time()}

        recorded = await self._durable(f"tool:{tool}", run)
        self._last_at = float(recorded.get("at", self._last_at))
        result = ToolResult.from_json(recorded)
        if result.refused:
            self.refused += 1
        elif result.ok and tool not in ("recent_spans", "incident_history", "breaker_states"):
            self.acted += 1
        return result

    async def step(self, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        self._charge_step()
        runner, root, seq = self._runner, self._root, self.steps

        async def run() -> tuple[T, float]:
            started = time.time_ns()
            error: BaseException | None = None
            try:
                return await fn(), time.time()
            except BaseException as exc:
                error = exc
                raise
            finally:
                runner.spans.step(root, f"spanvisor.step {name}", seq, started, error)

        value, at = await self._durable(f"step:{name}", run)
        self._last_at = at
        return value

    async def sleep(self, seconds: float) -> None:
        self._charge_step()
        await DBOS.sleep_async(max(0.0, float(seconds)))
        await self._waited("sleep", {"spanvisor.wait.seconds": float(seconds)})

    async def wait_for_recovery(self, timeout_s: float) -> bool:
        self._charge_step()
        return await self.recovered_within(timeout_s)

    async def recovered_within(self, timeout_s: float) -> bool:
        """The wait itself; the runner's verification uses it without charging a step.

        One durable step that waits in memory and records what it saw, with the
        wait's span. Its deadline counts from the last recorded step, so a
        remediation resumed after a crash waits out the same window, and one
        that had recorded its answer replays it without waiting. What it waits
        for was watched since the remediation started (the runner's
        ``execute``), so a run that recovered while the remediator was still at
        work answers at once. (DBOS's ``recv`` with a timeout, and a step for
        the span, took 15 statements and 7 commits a remediation; this is 4 and 2.)
        """
        if timeout_s <= 0:
            return False  # no window: nothing to wait for, nothing to record
        return await self._recovery(self._last_at + float(timeout_s))

    async def recovered(self) -> bool:
        """Whether the run recovered since the remediation started, at once (recorded).

        Like a wait's answer, a durable step: a replay takes the same branch.
        Only a recovery is noted on the trace; a miss is not.
        """
        return await self._recovery(0.0, note_miss=False)

    async def recovered_now(self) -> bool:
        """:meth:`recovered`, not recorded: for a last branch, after which nothing is done.

        A step costs a remediation a third more CPU; a replay that took the
        other branch here would record nothing different.
        """
        evidence = await self._runner.wait_for_recovery(self._trigger, self.remediation_id, 0.0)
        if evidence is None:
            return False
        what = evidence.get("dependency")
        if isinstance(what, str) and what:
            self.recovery = what
        return True

    async def _recovery(self, deadline: float, *, note_miss: bool = True) -> bool:
        runner, root, trigger = self._runner, self._root, self._trigger
        rid = self.remediation_id

        async def wait() -> tuple[bool, float]:
            waited_from = time.time()
            evidence = await runner.wait_for_recovery(trigger, rid, deadline)
            attributes: dict[str, Any] = {"spanvisor.wait.recovered": evidence is not None}
            if evidence is not None:
                span_id = evidence.get("span_id")
                if isinstance(span_id, str) and span_id:
                    attributes["spanvisor.wait.recovered_by"] = span_id[:32]  # the agent's span
                what = evidence.get("dependency")
                if isinstance(what, str) and what:
                    attributes["spanvisor.wait.recovery"] = what[:MAX_TEXT]
                    self.recovery = what
                seen = evidence.get("seen_at")
                if isinstance(seen, (int, float)):
                    # Seen while the remediator was still at work, before this wait.
                    attributes["spanvisor.wait.recovered_before_s"] = round(
                        max(0.0, waited_from - float(seen)), 3
                    )
            if evidence is not None or note_miss:
                runner.spans.event(root, "spanvisor.wait recovery", attributes)
            return evidence is not None, time.time()

        recovered, self._last_at = await self._durable("waited:recovery", wait)
        return recovered

    async def wait_for_approval(
        self, approval_id: str, timeout_s: float
    ) -> Mapping[str, Any] | None:
        self._charge_step()
        got = await DBOS.recv_async(APPROVAL_TOPIC, timeout_seconds=max(0.0, float(timeout_s)))
        answer = got if isinstance(got, dict) else None
        await self._waited(
            "approval",
            {
                "spanvisor.approval.id": approval_id,
                "spanvisor.approval.answered": answer is not None,
            },
        )
        return answer

    async def _waited(self, what: str, attributes: Mapping[str, Any]) -> None:
        """Record a finished wait as a span, once (a step: a replay does not record it again)."""
        runner, root = self._runner, self._root

        async def record() -> float:
            runner.spans.event(root, f"spanvisor.wait {what}", attributes)
            return time.time()

        self._last_at = await self._durable(f"waited:{what}", record)

    async def restart_allowed(self) -> tuple[bool, str]:
        runner, trigger = self._runner, self._trigger
        gateway = runner.gateway

        async def ask() -> tuple[bool, str]:
            return await runner.in_tool_thread(gateway.restart_allowed, trigger)

        return await self.step("restart_allowed", ask)

    def spend_tokens(self, tokens: int) -> None:
        self.tokens += max(0, int(tokens))
        if self.tokens > self._budget.tokens:
            raise BudgetSpent(f"{self._budget.tokens} tokens")

    def log(self, message: str) -> None:
        self._root.add_event("spanvisor.note", {"message": message[:MAX_TEXT]})
