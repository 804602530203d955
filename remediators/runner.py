"""The durable runner: each remediation is a DBOS workflow, each tool call a step.

Why DBOS: a remediation may wait minutes for a backoff, an approval or a
verification window, and the sidecar may be killed meanwhile. The workflow's
id is the idempotency key of (triggering span, rule)
(:func:`supervisor.records.remediation_ids`), so dispatching it twice starts
it once; completed steps are recorded, so a restart replays their results and
does not repeat them; sleeps, approval waits and verification windows keep
their deadlines across a restart, and no thread is held while a remediation
waits.

Lifecycle: :meth:`DurableRunner.start` once (a thread with its own event loop
launches DBOS there; workflows left pending by a crash resume then);
:meth:`dispatch`, :meth:`notify_recovery`, :meth:`answer_approval` from any
thread; :meth:`list`, :meth:`show`, :meth:`cancel` from any thread but the
runner's (they wait for the answer); :meth:`close` once. DBOS is one per
process, so is the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import sqlite3
import threading
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from dbos import DBOS, DBOSConfig, SetWorkflowID
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from remediators.base import (
    Budget,
    BudgetSpent,
    Remediator,
    ToolResult,
    Trigger,
    Verdict,
)
from remediators.gateway import Gateway
from remediators.registry import resolve
from remediators.tools import check_arguments, execute
from remediators.tracing import preset_ids, root_span_id
from supervisor.errors import ConfigError

__all__ = ["DurableRunner", "RunnerSettings", "build_request", "redact_url"]

log = logging.getLogger("spanvisor.remediate")

T = TypeVar("T")

#: The workflow contract's version: recovery needs the same one, whatever else changed.
APP_VERSION: Final = "spanvisor-remediation-1"
_WORKFLOW: Final = "spanvisor.remediate"
_APPROVAL: Final = "approval"
#: Longest text recorded on a span or in a result (characters).
_MAX_TEXT: Final = 512


class _RecoveryWait:
    """One remediation's wait for its run's recovery, on the runner's loop."""

    __slots__ = ("event", "evidence")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.evidence: dict[str, Any] = {}


class _Active:
    """The process's one runner (DBOS is one per process): workflows find it here."""

    runner: DurableRunner | None = None


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """Where and how remediations run."""

    #: ``sqlite:///path`` (the default, next to the state) or ``postgresql://...``.
    database_url: str
    #: Unique per sidecar sharing one database: a sidecar recovers only its own.
    executor_id: str = "local"
    #: Remediations running at once; past it a dispatch is refused and counted.
    max_active: int = 256
    #: How often DBOS looks for the messages of a remediation waiting for an
    #: approval on SQLite: one query per waiting remediation each time (at
    #: 0.05 s, 256 remediations waiting for approvals kept a core busy). The
    #: sidecar sends every answer and wakes its waiter at once
    #: (:func:`_wake_waiters`); this is the safety net. Recoveries are not
    #: messages (see :meth:`DurableRunner.notify_recovery`), so few wait here.
    #: It also bounds :meth:`DurableRunner.close`: DBOS's shutdown waits for
    #: its poller to finish sleeping, up to 10 s (at 30 s, every stop took 10 s).
    poll_interval_s: float = 2.0
    start_timeout_s: float = 60.0
    #: DBOS's threads, which do its database work. A remediation's statements
    #: are short, and more threads than cores only take turns at the
    #: interpreter: 4 (with tools on threads of their own) spent less CPU per
    #: remediation, with fewer context switches, than 16 (``bench/remediation.py``
    #: compares two settings side by side).
    db_threads: int = 4
    #: Threads for tool calls and the runner's own actions (commands,
    #: approvals), apart from DBOS's: a slow tool must not hold up the
    #: database work of every other remediation.
    tool_threads: int = 8


def build_request(
    trigger: Trigger,
    *,
    remediator: str,
    use: str,
    tools: frozenset[str],
    budget: Budget,
    params: Mapping[str, Any],
    verify_window_s: float,
    on_unresolved: str,
    dispatched_at: float,
) -> dict[str, Any]:
    """The workflow's input: everything it needs, fixed at dispatch (a reload changes nothing)."""
    remediation_id = str(trigger.params["remediation_id"])
    return {
        "id": remediation_id,
        "trace_id": str(trigger.params["remediation_trace_id"]),
        "remediator": remediator,
        "use": use,
        "tools": sorted(tools),
        "budget": {
            "steps": budget.steps,
            "tool_calls": budget.tool_calls,
            "deadline_s": budget.deadline_s,
            "tokens": budget.tokens,
        },
        "params": dict(params),
        "verify_window_s": verify_window_s,
        "on_unresolved": on_unresolved,
        "trigger": trigger.to_json(),
        "dispatched_at": dispatched_at,
    }


@DBOS.workflow(name=_WORKFLOW, max_recovery_attempts=20)
async def _remediation_workflow(request: dict[str, Any]) -> dict[str, Any]:
    runner = _Active.runner
    if runner is None:  # a workflow resumed in a process whose runner was closed
        raise RuntimeError("no remediation runner in this process")
    return await runner.execute(request)


class _Context:
    """The :class:`~remediators.base.RemediationContext` of one workflow execution.

    Counters are rebuilt on every execution from the replayed steps, so a
    resumed remediation has spent exactly what it had spent. The deadline is
    read against durable times (each step records when it ran), never the
    clock directly: a replay takes the same branches as the first run.
    """

    def __init__(self, runner: DurableRunner, request: Mapping[str, Any], root: trace.Span):
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
                        result = ToolResult(False, error=f"{type(exc).__name__}: {exc}"[:_MAX_TEXT])
            runner.trace_tool(
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
                runner.trace_step(root, f"spanvisor.step {name}", seq, started, error)

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
        that had recorded its answer replays it without waiting. (DBOS's
        ``recv`` with a timeout, and a step for the span, took 15 statements
        and 7 commits a remediation; this is 4 and 2.)
        """
        if timeout_s <= 0:
            return False  # no window: nothing to wait for, nothing to record
        runner, root, trigger = self._runner, self._root, self._trigger
        rid = self.remediation_id
        deadline = self._last_at + float(timeout_s)

        async def wait() -> tuple[bool, float]:
            evidence = await runner.wait_for_recovery(trigger, rid, deadline)
            attributes: dict[str, Any] = {"spanvisor.wait.recovered": evidence is not None}
            span_id = (evidence or {}).get("span_id")
            if isinstance(span_id, str) and span_id:
                attributes["spanvisor.wait.recovered_by"] = span_id[:32]  # the agent's span
            runner.trace_event(root, "spanvisor.wait recovery", attributes)
            return evidence is not None, time.time()

        recovered, self._last_at = await self._durable("waited:recovery", wait)
        return recovered

    async def wait_for_approval(
        self, approval_id: str, timeout_s: float
    ) -> Mapping[str, Any] | None:
        self._charge_step()
        got = await DBOS.recv_async(_APPROVAL, timeout_seconds=max(0.0, float(timeout_s)))
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
            runner.trace_event(root, f"spanvisor.wait {what}", attributes)
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
        self._root.add_event("spanvisor.note", {"message": message[:_MAX_TEXT]})


class DurableRunner:
    """Runs remediations as DBOS workflows on a thread of its own; see the module."""

    def __init__(
        self,
        gateway: Gateway,
        settings: RunnerSettings,
        *,
        tracer: trace.Tracer | None = None,
        resolver: Callable[[str], type[Remediator]] = resolve,
    ) -> None:
        self.gateway = gateway
        self.settings = settings
        self._tracer = tracer or trace.NoOpTracer()
        self._resolve = resolver
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._active: set[str] = set()
        #: Remediations waiting for their run to recover, by id (the runner's loop only).
        self._recovery_waiters: dict[str, _RecoveryWait] = {}
        self._tool_pool = ThreadPoolExecutor(
            max_workers=settings.tool_threads, thread_name_prefix="spanvisor-remediate-tool"
        )
        #: Counters for ``stats``: dispatched, duplicates, busy (refused: too many active),
        #: errors, and outcomes by name.
        self.counts: Counter[str] = Counter()

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Launch DBOS on the runner's thread; pending remediations resume. Raises ConfigError."""
        if _Active.runner is not None and _Active.runner is not self:
            raise ConfigError("another remediation runner is active in this process")
        _Active.runner = self
        self._thread = threading.Thread(target=self._main, name="spanvisor-remediate", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.settings.start_timeout_s):
            raise ConfigError("the remediation runner did not start in time")
        if self._error is not None:
            _Active.runner = None
            raise ConfigError(
                f"cannot start remediations on {redact_url(self.settings.database_url)}:"
                f" {type(self._error).__name__}: {_first_line(self._error)}"
            ) from self._error

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._launch())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            with contextlib.suppress(Exception):
                DBOS.destroy()
            loop.close()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _launch(self) -> None:
        s = self.settings
        _use_wal(s.database_url)
        config: DBOSConfig = {
            "name": "spanvisor",
            "system_database_url": s.database_url,
            "application_version": APP_VERSION,
            "executor_id": s.executor_id,
            "log_level": "WARNING",
            "notification_listener_polling_interval_sec": s.poll_interval_s,
            "max_executor_threads": s.db_threads,
        }
        if s.database_url.startswith("sqlite:"):
            # DBOS pings every connection it takes from its pool (a SELECT 1), which
            # guards against a Postgres server that dropped it; a SQLite file's
            # connection cannot go stale, so the ping would only cost CPU.
            config["db_engine_kwargs"] = {"pool_pre_ping": False, "module": _SQLITE_NORMAL_SYNC}
        DBOS(config=config)
        DBOS.launch()  # on this loop: resumed async workflows run here

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: running remediations stay pending in the database and resume on the next start."""
        loop = self._loop
        if loop is not None and loop.is_running():

            async def stop() -> None:
                DBOS.destroy(workflow_completion_timeout_sec=0)
                # Remediations still waiting end here, after DBOS stopped writing: their
                # status stays PENDING, and the next start resumes them.
                waiting = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in waiting:
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)

            fut = asyncio.run_coroutine_threadsafe(stop(), loop)
            try:
                fut.result(timeout_s)
            except Exception:
                log.exception("remediation runner did not stop cleanly")
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout_s)
        # A tool call still blocked is abandoned, as the workflow that made it was.
        self._tool_pool.shutdown(wait=False, cancel_futures=True)
        if _Active.runner is self:
            _Active.runner = None

    # -- from the sidecar -----------------------------------------------------

    def dispatch(self, request: Mapping[str, Any]) -> Future[str] | None:
        """Start the remediation (once per id); None when it is refused as one too many."""
        rid = str(request["id"])
        with self._lock:
            if rid in self._active:
                self.counts["duplicates"] += 1
                return None
            if len(self._active) >= self.settings.max_active:
                self.counts["busy"] += 1
                log.warning(
                    "too many remediations running; not dispatched",
                    extra={"remediation": rid, "active": len(self._active)},
                )
                return None
            self._active.add(rid)
        return self._submit(self._start(dict(request)))

    async def _start(self, request: dict[str, Any]) -> str:
        rid = str(request["id"])
        try:
            # A workflow id starts its workflow once: DBOS records the start and the
            # id in one insert, and a second start finds the row and runs nothing.
            with SetWorkflowID(rid):
                handle = await DBOS.start_workflow_async(_remediation_workflow, request)
            if getattr(handle, "task", None) is not None:  # it runs here, from now on
                self.counts["dispatched"] += 1
                return handle.get_workflow_id()
            # Started before (a re-sent span, or a restart). Asked only now, not before
            # every start: that was one more transaction for every remediation.
            found = await DBOS.get_workflow_status_async(rid)
            if found is None or found.status not in ("PENDING", "ENQUEUED"):
                # A finished one is no longer active; a pending one is being resumed.
                with self._lock:
                    self._active.discard(rid)
            self.counts["duplicates"] += 1
            return rid
        except Exception:
            self.counts["errors"] += 1
            with self._lock:
                self._active.discard(str(request["id"]))
            log.exception("could not start a remediation", extra={"remediation": request["id"]})
            raise

    def notify_recovery(self, remediation_id: str, evidence: Mapping[str, Any]) -> None:
        """The run's later spans show the failed part succeeding (from the pipeline).

        Wakes the remediation's wait in memory: the wait records its answer as
        a durable step as soon as it wakes, so a message in the database would
        keep a recovery only for the milliseconds before that step commits.
        """
        loop = self._loop
        if loop is None or loop.is_closed():
            log.warning("remediation runner is not running; recovery of %s dropped", remediation_id)
            self.counts["errors"] += 1
            return
        loop.call_soon_threadsafe(self._recovered, remediation_id, dict(evidence))

    def _recovered(self, remediation_id: str, evidence: dict[str, Any]) -> None:
        waiter = self._recovery_waiters.get(remediation_id)
        if waiter is not None and not waiter.event.is_set():
            waiter.evidence = evidence
            waiter.event.set()

    async def wait_for_recovery(
        self, trigger: Trigger, remediation_id: str, deadline: float
    ) -> dict[str, Any] | None:
        """What showed the run recovering before ``deadline`` (unix s), or None.

        Woken by :meth:`notify_recovery`; the evidence is what it was given.
        """
        waiter = self._recovery_waiters[remediation_id] = _RecoveryWait()
        self.gateway.watch_recovery(trigger, remediation_id)
        try:
            remaining = deadline - time.time()
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.event.wait(), remaining)
            return waiter.evidence if waiter.event.is_set() else None
        finally:
            self.gateway.unwatch(remediation_id)
            if self._recovery_waiters.get(remediation_id) is waiter:
                del self._recovery_waiters[remediation_id]

    def answer_approval(self, remediation_id: str, answer: Mapping[str, Any]) -> None:
        """A person answered the approval a remediation waits for."""
        self._submit(self._send(remediation_id, dict(answer), _APPROVAL))

    async def _send(self, remediation_id: str, message: dict[str, Any], topic: str) -> None:
        try:
            await DBOS.send_async(remediation_id, message, topic)
        except Exception as exc:  # finished or unknown: nothing is waiting
            log.debug("message to %s not delivered: %s", remediation_id, exc)
            return
        _wake_waiters(remediation_id, topic)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T] | None:
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            log.warning("remediation runner is not running; message dropped")
            self.counts["errors"] += 1
            return None
        return asyncio.run_coroutine_threadsafe(coro, loop)

    async def in_tool_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the tool threads (as ``asyncio.to_thread``, context kept)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tool_pool, call)

    # -- operator views ------------------------------------------------------

    def _ask(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        fut = self._submit(coro)
        if fut is None:
            raise ConfigError("the remediation runner is not running")
        return fut.result(timeout_s)

    def list(self, limit: int = 50, status: str | None = None) -> list[dict[str, Any]]:
        async def query() -> list[dict[str, Any]]:
            found = await DBOS.list_workflows_async(
                name=_WORKFLOW, status=status, limit=limit, sort_desc=True, load_output=True
            )
            return [_summary(w) for w in found]

        return self._ask(query())

    def show(self, remediation_id: str) -> dict[str, Any] | None:
        async def query() -> dict[str, Any] | None:
            found = await DBOS.list_workflows_async(
                workflow_ids=[remediation_id], load_input=True, load_output=True
            )
            if not found:
                return None
            steps = await DBOS.list_workflow_steps_async(remediation_id)
            view = _summary(found[0])
            request = found[0].input
            if request is not None and request["args"]:
                view["request"] = request["args"][0]
            view["steps"] = [
                {
                    "n": s["function_id"],
                    "name": s["function_name"],
                    "output": s["output"],
                    "error": None if s["error"] is None else str(s["error"])[:_MAX_TEXT],
                }
                for s in steps
            ]
            return view

        return self._ask(query())

    def cancel(self, remediation_id: str) -> bool:
        async def act() -> bool:
            status = await DBOS.get_workflow_status_async(remediation_id)
            if status is None or status.status in ("SUCCESS", "ERROR", "CANCELLED"):
                return False
            await DBOS.cancel_workflow_async(remediation_id)
            return True

        cancelled = self._ask(act())
        if cancelled:
            with self._lock:
                self._active.discard(remediation_id)
            self.gateway.unwatch(remediation_id)
        return cancelled

    def stats(self) -> dict[str, Any]:
        with self._lock:
            active = len(self._active)
        return {"active": active, **dict(self.counts)}

    # -- the workflow body ----------------------------------------------------

    async def execute(self, request: dict[str, Any]) -> dict[str, Any]:
        rid = str(request["id"])
        with self._lock:
            self._active.add(rid)  # a resumed one counts too
        root = self._start_root(request)
        ctx = _Context(self, request, root)
        verdict = Verdict.FAILED
        reason = ""
        try:
            remediator = self._resolve(str(request["use"]))(request["params"])
            verdict = await remediator.run(ctx)
            if verdict is Verdict.ACTED:
                verdict, reason = await self._verify(ctx, request)
        except BudgetSpent as spent:
            reason = f"budget spent: {spent.what}"
            verdict = await self._escalate(ctx, reason)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:_MAX_TEXT]
            log.exception("remediation failed", extra={"remediation": rid})
            verdict = Verdict.FAILED
        if verdict is Verdict.FAILED and ctx.refused and not ctx.acted:
            verdict = Verdict.REFUSED
        outcome = verdict.value if verdict is not Verdict.ACTED else Verdict.FAILED.value
        self._end_root(root, outcome, reason, ctx)
        with self._lock:
            self._active.discard(rid)
        self.counts[outcome] += 1
        log.info(
            "remediation ended",
            extra={"remediation": rid, "outcome": outcome, "reason": reason, "steps": ctx.steps},
        )
        return {
            "outcome": outcome,
            "reason": reason,
            "steps": ctx.steps,
            "tool_calls": ctx.tool_calls,
            "refused": ctx.refused,
            "trace_id": request["trace_id"],
        }

    async def _verify(self, ctx: _Context, request: Mapping[str, Any]) -> tuple[Verdict, str]:
        window = float(request["verify_window_s"])
        if await ctx.recovered_within(window):
            return Verdict.SUCCEEDED, "the run recovered"
        reason = f"no recovery within {window:g} s"
        follow = str(request["on_unresolved"])
        if follow == "escalate":
            return await self._escalate(ctx, reason), reason
        if follow == "abort_run":
            await self._runner_command(ctx, "abort_run", {"reason": reason})
        return Verdict.FAILED, reason

    async def _escalate(self, ctx: _Context, reason: str) -> Verdict:
        """Hand the remediation to a person; outside the remediator's budget and allowlist."""
        trigger = ctx.trigger
        body = {
            "question": f"spanvisor could not fix {trigger.kind} on {trigger.dependency}: {reason}",
            "remediation_id": ctx.remediation_id,
            "remediator": ctx._request["remediator"],
            "on_approve": "the run gets approval_result(approved=true) and retries the step",
            "on_deny": "the run gets approval_result(approved=false) and should abort",
        }
        gateway, rid = self.gateway, ctx.remediation_id
        await self._runner_step(
            ctx,
            "escalate",
            lambda: gateway.open_approval(trigger, body, key=f"{rid}/escalate", remediation_id=rid),
        )
        return Verdict.ESCALATED

    async def _runner_command(self, ctx: _Context, command: str, params: dict[str, Any]) -> None:
        gateway, trigger, rid = self.gateway, ctx.trigger, ctx.remediation_id
        sent = {**params, "remediation_id": rid}
        await self._runner_step(
            ctx,
            command,
            lambda: gateway.send_command(trigger, command, sent, key=f"{rid}/{command}"),
        )

    async def _runner_step(
        self, ctx: _Context, name: str, act: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """A step of the runner's own (escalation, abort): durable and traced, never budgeted."""
        root = ctx.root

        async def run() -> dict[str, Any]:
            started = time.time_ns()
            error: BaseException | None = None
            try:
                return await self.in_tool_thread(act)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.trace_step(root, f"spanvisor.step {name}", 0, started, error)

        return await DBOS.run_step_async({"name": name}, run)

    # -- tracing ------------------------------------------------------------------

    def _start_root(self, request: Mapping[str, Any]) -> trace.Span:
        trigger = request["trigger"]
        link = Link(
            SpanContext(
                trace_id=int(trigger["trace_id"], 16),
                span_id=int(trigger["span_id"], 16),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            ),
            attributes={
                "spanvisor.link.type": "triggered_by",
                "spanvisor.failure.class": str(trigger.get("class", "")),
                "spanvisor.failure.kind": str(trigger.get("kind", "")),
            },
        )
        with preset_ids(str(request["trace_id"]), root_span_id(str(request["id"]))):
            return self._tracer.start_span(
                f"spanvisor.remediate {request['remediator']}",
                context=trace.set_span_in_context(trace.INVALID_SPAN),
                kind=SpanKind.INTERNAL,
                links=[link],
                start_time=int(float(request["dispatched_at"]) * 1e9),
                attributes={
                    "spanvisor.remediation.id": str(request["id"]),
                    "spanvisor.remediator": str(request["remediator"]),
                    "spanvisor.remediator_use": str(request["use"]),
                    "spanvisor.remediation.tools": list(request["tools"]),
                    "spanvisor.service": str(trigger.get("service", "")),
                    "spanvisor.run_id": str(trigger.get("run_id", "")),
                    "spanvisor.trigger.trace_id": str(trigger["trace_id"]),
                    "spanvisor.trigger.span_id": str(trigger["span_id"]),
                },
            )

    def _end_root(self, root: trace.Span, outcome: str, reason: str, ctx: _Context) -> None:
        root.set_attribute("spanvisor.remediation.outcome", outcome)
        root.set_attribute("spanvisor.remediation.steps", ctx.steps)
        root.set_attribute("spanvisor.remediation.tool_calls", ctx.tool_calls)
        root.set_attribute("spanvisor.remediation.refused_calls", ctx.refused)
        if reason:
            root.set_attribute("spanvisor.remediation.reason", reason[:_MAX_TEXT])
        if outcome in ("failed", "refused"):
            root.set_status(Status(StatusCode.ERROR, reason[:_MAX_TEXT] or outcome))
        root.end()

    def trace_tool(
        self,
        root: trace.Span,
        tool: str,
        arguments: Mapping[str, Any],
        result: ToolResult,
        *,
        seq: int,
        started_ns: int,
        allowed: bool,
    ) -> None:
        span = self._tracer.start_span(
            f"spanvisor.tool {tool[:64]}",
            context=trace.set_span_in_context(root),
            start_time=started_ns,
            attributes={
                "spanvisor.tool.name": tool[:128],
                "spanvisor.tool.step": seq,
                "spanvisor.tool.allowed": allowed,
                "spanvisor.tool.refused": result.refused,
                "spanvisor.tool.arguments": _clip(repr(dict(arguments))),
            },
        )
        if not result.ok:
            span.set_status(Status(StatusCode.ERROR, result.error[:_MAX_TEXT]))
            span.add_event(
                "exception",
                {
                    "exception.type": "ToolRefused" if result.refused else "ToolFailed",
                    "exception.message": result.error[:_MAX_TEXT],
                },
            )
        span.end()

    def trace_step(
        self, root: trace.Span, name: str, seq: int, started_ns: int, error: BaseException | None
    ) -> None:
        span = self._tracer.start_span(
            name[:128],
            context=trace.set_span_in_context(root),
            start_time=started_ns,
            attributes={"spanvisor.step": seq},
        )
        if error is not None:
            text = f"{type(error).__name__}: {error}"
            span.set_status(Status(StatusCode.ERROR, text[:_MAX_TEXT]))
        span.end()

    def trace_event(self, root: trace.Span, name: str, attributes: Mapping[str, Any]) -> None:
        span = self._tracer.start_span(
            name, context=trace.set_span_in_context(root), attributes=dict(attributes)
        )
        span.end()


def _wake_waiters(workflow_id: str, topic: str) -> None:
    """Wake a remediation waiting in ``recv`` for a message this process just committed.

    DBOS on SQLite has no notifications: a waiting ``recv`` is woken by a
    poller that queries the database for each waiter. The sidecar sends
    every message itself, so it wakes the waiter as Postgres's NOTIFY would.
    Best effort through DBOS's waiter map (not a public API): if that ever
    changes, the poller still delivers the message, within ``poll_interval_s``.
    """
    try:
        from dbos._dbos import _get_dbos_instance  # internal: imported here, guarded

        waiters = _get_dbos_instance()._sys_db.notifications_map.snapshot()
        for _key, components, signal in waiters:
            if components[0] == workflow_id and components[1] == topic:
                signal.set()  # the message is committed: recv reads it when it wakes
    except Exception:  # the poller is the fallback
        log.debug("could not wake %s's waiter; the poller will", workflow_id)


def _summary(status: Any) -> dict[str, Any]:
    output = status.output if isinstance(status.output, dict) else {}
    return {
        "id": status.workflow_id,
        "status": status.status,
        "outcome": output.get("outcome"),
        "reason": output.get("reason"),
        "trace_id": output.get("trace_id"),
        "created_at": (status.created_at or 0) / 1000,
        "updated_at": (status.updated_at or 0) / 1000,
        "recovery_attempts": status.recovery_attempts,
        "error": None if status.error is None else str(status.error)[:_MAX_TEXT],
    }


class _SqliteNormalSync(types.ModuleType):
    """``sqlite3`` whose connections commit without waiting for the disk (``synchronous=NORMAL``).

    Given to SQLAlchemy as the DBAPI module of DBOS's SQLite engine, so the
    URL is parsed, and DBOS's own connect hook runs, as with ``sqlite3``.
    SQLite's default (FULL) syncs the WAL at every commit, and a remediation
    commits several times: NORMAL cut its CPU by a fifth to a quarter
    (bench/remediation.py --only throughput --backends sqlite). In WAL mode a
    commit still survives the process being killed, which is what recovery
    is for; only a power loss can take back the last commits, and then a
    step runs again, as DBOS steps may (tool calls carry idempotency keys).
    The span store makes the same choice (:mod:`supervisor.act.store`).
    """

    def __init__(self) -> None:
        super().__init__("sqlite3")

    def __getattr__(self, name: str) -> Any:
        return getattr(sqlite3, name)

    @staticmethod
    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        db: sqlite3.Connection = sqlite3.connect(*args, **kwargs)
        db.execute("PRAGMA synchronous=NORMAL")
        return db


_SQLITE_NORMAL_SYNC: Final = _SqliteNormalSync()


def _use_wal(url: str) -> None:
    """Put a SQLite remediation database in WAL mode (it stays so) before DBOS opens it.

    DBOS leaves SQLite in rollback-journal mode, where every step's ownership
    check waits for the write lock; in WAL mode readers do not wait for the
    writer, and remediations per second rise accordingly (``bench/remediation.py
    --backends sqlite,sqlite-wal`` compares the two).
    """
    if not url.startswith("sqlite:///") or "mode=ro" in url:
        return
    path = url.removeprefix("sqlite:///").split("?", 1)[0].removeprefix("file:")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")


def _first_line(error: BaseException) -> str:
    """SQLAlchemy's messages go on with the SQL and a link; the first line says what failed."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"


def redact_url(url: str) -> str:
    """A database URL without its password, for messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        credentials, host = rest.rsplit("@", 1)
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
    return url
