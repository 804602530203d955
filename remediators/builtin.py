"""The remediators that ship with spanvisor (all but ``llm``, in :mod:`remediators.llm`).

Each acts only through its context's tools; the runner verifies what it did
(the run's later spans) and escalates when nothing recovers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from remediators.base import Budget, RemediationContext, Remediator, Verdict
from remediators.gateway import WorkerRestart

__all__ = [
    "CompactContext",
    "Escalate",
    "FallbackSwitch",
    "LoopBreaker",
    "RestartWorker",
    "ResumeRun",
    "RetryStep",
    "Rewind",
]

_MAX_DELAY_S = 3600.0


def _number(params: Mapping[str, Any], name: str, default: float, problems: list[str]) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        problems.append(f"{name} must be a number >= 0, not {value!r}")
        return default
    return float(value)


class RetryStep(Remediator):
    """Durable backoff, then ``retry_step``; the runner then verifies the step succeeded.

    params: ``delay_s`` (default: the decision's delay, else 2), capped at an hour.
    """

    name = "retry_step"
    tools = frozenset({"retry_step", "recent_spans"})

    @classmethod
    def check_params(cls, params: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        _number(params, "delay_s", 2.0, problems)
        return problems

    async def run(self, ctx: RemediationContext) -> Verdict:
        decided = ctx.trigger.params.get("delay_s")
        default = float(decided) if isinstance(decided, (int, float)) else 2.0
        delay = min(_MAX_DELAY_S, float(self.params.get("delay_s", default)))
        await ctx.sleep(delay)
        result = await ctx.call("retry_step", delay_s=0, reason=f"remediation after {delay:g} s")
        return Verdict.ACTED if result.ok else Verdict.FAILED


class ResumeRun(Remediator):
    """For a stalled run: ask the agent to resume from its checkpoint, naming unverified work.

    The trigger carries ``unverified``: tool calls the last LLM response asked
    for that no tool span answered. The agent checks their effects before
    acting again (a payment sent twice is worse than a stall).
    """

    name = "resume_run"
    tools = frozenset({"resume_run", "recent_spans"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        found = ctx.trigger.params.get("unverified") or ()
        calls = found if isinstance(found, (list, tuple)) else ()
        unverified = [str(call)[:500] for call in calls][:64]
        result = await ctx.call(
            "resume_run",
            unverified=unverified,
            reason=f"the run stalled at {ctx.trigger.span_name or 'its last step'}",
        )
        return Verdict.ACTED if result.ok else Verdict.FAILED


class Reanchor(Remediator):
    """A long run, reminded of its objective: guidance carrying the run's task.

    Long runs drift from what they were asked; the objective, the first user
    message of the run's input (never the system prompt, which the agent
    keeps anyway), is sent back as guidance every few steps.
    """

    name = "reanchor"
    tools = frozenset({"inject_guidance"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        objective = str(ctx.trigger.params.get("objective") or "")[:1800]
        if not objective:
            return Verdict.FAILED
        result = await ctx.call(
            "inject_guidance",
            guidance=f"Reminder: this run's objective, as first given, is: {objective}",
        )
        return Verdict.SUCCEEDED if result.ok else Verdict.FAILED


class CompactContext(Remediator):
    """For a context overflow: ask the agent to compact its context, then verify.

    params: ``target_tokens`` (optional): what the compacted context should fit.
    """

    name = "compact_context"
    tools = frozenset({"compact_context", "recent_spans"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        arguments: dict[str, Any] = {"reason": f"{ctx.trigger.kind} on {ctx.trigger.dependency}"}
        target = self.params.get("target_tokens")
        if isinstance(target, int) and not isinstance(target, bool) and target > 0:
            arguments["target_tokens"] = target
        result = await ctx.call("compact_context", **arguments)
        return Verdict.ACTED if result.ok else Verdict.FAILED


class FallbackSwitch(Remediator):
    """Switch the run to the first alternative in its chain whose breaker is not open.

    The chain is the policy's (passed with the trigger); with none left, a
    person is asked.
    """

    name = "fallback_switch"
    tools = frozenset({"switch_fallback", "breaker_states", "request_approval"})

    async def run(self, ctx: RemediationContext) -> Verdict:
        trigger = ctx.trigger
        chain = trigger.params.get("chain") or ()
        states = await ctx.call("breaker_states")
        open_now = {
            b.get("dependency")
            for b in (states.value or [])
            if isinstance(b, Mapping) and b.get("state") == "open"
        }
        for target in _after(list(chain), trigger.dependency):
            if target in open_now:
                continue
            result = await ctx.call("switch_fallback", to=target, reason=f"{trigger.kind}")
            return Verdict.ACTED if result.ok else Verdict.FAILED
        await ctx.call(
            "request_approval",
            question=f"No fallback left for {trigger.dependency} ({trigger.kind}).",
            proposal="abort_run",
            on_deny="the run is left paused",
        )
        return Verdict.ESCALATED


def _after(chain: Sequence[Any], dependency: str) -> list[str]:
    names = [str(d) for d in chain]
    if dependency in names:
        names = names[names.index(dependency) + 1 :]
    return [n for n in names if n != dependency]


class LoopBreaker(Remediator):
    """For a reasoning loop: guidance, then a rewind, then an abort, as the loop goes on.

    The run tracker reports a loop again each time it goes on after a report
    (``occurrence`` 1, 2, 3), so each rung is a new remediation triggered by
    evidence that the previous one did not work, and a restarted sidecar
    takes the same rung:

    1. guidance naming the repeated call;
    2. ``rewind_run``: back to the checkpoint before the loop's first call,
       with a summary of the failed attempt, because going forward from
       inside the loop has not helped;
    3. ``abort_run``.
    """

    name = "loop_breaker"
    tools = frozenset({"inject_guidance", "rewind_run", "abort_run", "recent_spans"})
    budget: ClassVar[Budget] = Budget(steps=6, tool_calls=4)

    async def run(self, ctx: RemediationContext) -> Verdict:
        trigger = ctx.trigger
        repeated = str(trigger.params.get("repeated_call") or trigger.span_name or "the same call")
        count = trigger.params.get("repeats")
        times = f" {count} times" if isinstance(count, int) else " repeatedly"
        occurrence = trigger.params.get("occurrence")
        rung = occurrence if isinstance(occurrence, int) and occurrence > 0 else 1
        if rung == 1:
            guidance = (
                f"You have called {repeated[:200]}{times} with the same arguments and the same"
                " result. Do not call it again with these arguments: change the arguments, use"
                " another tool, or give your best final answer now."
            )
            sent = await ctx.call("inject_guidance", guidance=guidance)
            return Verdict.ACTED if sent.ok else Verdict.FAILED
        if rung == 2:
            arguments: dict[str, Any] = {
                "summary": (
                    f"A previous attempt from this point called {repeated[:200]}{times} with the"
                    " same arguments and kept getting the same result, and went on after being"
                    " told to stop. Take a different approach from here."
                ),
                "reason": f"reasoning loop on {repeated[:200]}",
            }
            if trigger.dependency.startswith("tool:"):
                arguments["tool"] = trigger.dependency[len("tool:") :][:200]
            elif isinstance(count, int) and 1 <= count <= 100:
                arguments["steps_back"] = count  # an LLM repeating itself: its last turns
            rewound = await ctx.call("rewind_run", **arguments)
            return Verdict.ACTED if rewound.ok else Verdict.FAILED
        ctx.log("the loop went on after guidance and a rewind; aborting the run")
        await ctx.call("abort_run", reason=f"reasoning loop on {repeated[:200]}")
        return Verdict.FAILED


class Rewind(Remediator):
    """For a semantic failure: rewind the run to before the failed step, with what was wrong.

    Going forward from a wrong answer tends to build on it; going back one
    step with a summary of why it failed verification gives the model a
    clean second try. Verification then watches the run's later spans, and
    a second failure goes to ``on_unresolved`` (a person, by default).

    params: ``steps_back`` (default 1).
    """

    name = "rewind"
    tools = frozenset({"rewind_run", "recent_spans"})
    budget: ClassVar[Budget] = Budget(steps=4, tool_calls=2)

    @classmethod
    def check_params(cls, params: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        steps = params.get("steps_back", 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
            problems.append("steps_back must be an integer between 1 and 100")
        return problems

    async def run(self, ctx: RemediationContext) -> Verdict:
        trigger = ctx.trigger
        what = (trigger.message or trigger.kind)[:600]
        result = await ctx.call(
            "rewind_run",
            summary=(
                f"A previous attempt at this step produced a result that failed"
                f" verification ({what}). Do it again and make sure the result passes."
            ),
            reason=f"{trigger.kind} at {trigger.span_name or 'the last step'}"[:400],
            steps_back=int(self.params.get("steps_back", 1)),
        )
        return Verdict.ACTED if result.ok else Verdict.FAILED


class Escalate(Remediator):
    """Ask a person, with the whole context; on timeout, do the configured default.

    params: ``timeout_s`` (default 3600); ``on_timeout``: ``abort_run``
    (default), ``retry_step`` or ``none``. The approval request carries what
    failed, where, what is proposed and what approve and deny will do; the
    sidecar also posts it to the notification webhook (Slack-compatible).
    The ``pause_run`` carries the same deadline, with ``on_timeout``
    ``resume`` for ``retry_step`` and ``abort`` otherwise: with ``none`` the
    remediation sends nothing when it passes, and the agent's own timer ends
    the pause.
    """

    name = "escalate"
    tools = frozenset({"pause_run", "request_approval", "abort_run", "retry_step"})
    _DEFAULTS = ("abort_run", "retry_step", "none")

    @classmethod
    def check_params(cls, params: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        _number(params, "timeout_s", 3600.0, problems)
        if params.get("on_timeout", "abort_run") not in cls._DEFAULTS:
            problems.append(f"on_timeout must be one of {', '.join(cls._DEFAULTS)}")
        return problems

    async def run(self, ctx: RemediationContext) -> Verdict:
        trigger = ctx.trigger
        on_timeout = str(self.params.get("on_timeout", "abort_run"))
        timeout = float(self.params.get("timeout_s", 3600.0))
        # The pause states its own deadline and outcome, so an agent that hears nothing
        # more (the sidecar down, on_timeout "none") does not wait forever.
        await ctx.call(
            "pause_run",
            reason=f"awaiting a person's decision on {trigger.kind}",
            timeout_s=max(timeout, 1.0),
            on_timeout="resume" if on_timeout == "retry_step" else "abort",
        )
        asked = await ctx.call(
            "request_approval",
            question=(
                f"{trigger.service} run {trigger.run_id}: {trigger.kind} ({trigger.failure_class})"
                f" on {trigger.dependency or trigger.span_name}. Retry the step?"
            ),
            proposal="retry_step",
            on_approve="the run gets approval_result(approved=true) and retries the step",
            on_deny="the run gets approval_result(approved=false) and should abort",
        )
        approval_id = str((asked.value or {}).get("approval_id", "")) if asked.ok else ""
        if not approval_id:
            return Verdict.FAILED
        answer = await ctx.wait_for_approval(approval_id, timeout)
        if answer is None:
            ctx.log(f"no answer within {timeout:g} s; default: {on_timeout}")
            if on_timeout != "none":
                await ctx.call(on_timeout, reason=f"approval {approval_id} timed out")
        return Verdict.ESCALATED


class RestartWorker(Remediator):
    """Restart the run's worker with the configured command, then verify the run recovers.

    params: ``argv`` (required; ``{run_id}``, ``{service}``... placeholders as
    whole arguments, no shell), ``timeout_s`` (default 60), ``env``
    (:class:`~remediators.gateway.WorkerRestart`). The sidecar runs it through
    the ``restart_worker`` tool, so a remediation replayed after a crash does
    not restart the worker again. Within the policy's restart intensity; past
    it, a person is asked.
    """

    name = "restart_worker"
    tools = frozenset({"restart_worker", "resume_run", "request_approval", "recent_spans"})

    @classmethod
    def check_params(cls, params: Mapping[str, Any]) -> list[str]:
        try:
            WorkerRestart.from_params(params)
        except ValueError as exc:
            return [str(exc)]
        return []

    async def run(self, ctx: RemediationContext) -> Verdict:
        trigger = ctx.trigger
        allowed, why = await ctx.restart_allowed()
        if not allowed:
            await ctx.call(
                "request_approval",
                question=f"Restart {trigger.service} run {trigger.run_id} again? ({why})",
                proposal="resume_run",
            )
            return Verdict.ESCALATED
        restarted = await ctx.call("restart_worker", reason=f"restart after {trigger.kind}"[:200])
        if not restarted.ok:
            ctx.log(f"restart command failed: {restarted.error}")
            return Verdict.FAILED
        return Verdict.ACTED
