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
thread; :meth:`list`, :meth:`show`, :meth:`cancel`, :meth:`resume_executor` from
any thread but the runner's (they wait for the answer); :meth:`close` once. DBOS is one per
process, so is the runner.

What a remediator calls is :mod:`remediators.durable_context`; the spans a
remediation makes, :mod:`remediators.remediation_spans`; how DBOS's database
is set up, :mod:`remediators.dbos_database`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from dbos import DBOS, DBOSClient, DBOSConfig, SetWorkflowID
from opentelemetry import trace

from remediators.base import Budget, BudgetSpent, Remediator, Trigger, Verdict
from remediators.dbos_database import (
    SQLITE_NORMAL_SYNC,
    redact_url,
    search_path_schema,
    use_wal,
    wake_waiters,
)
from remediators.durable_context import APPROVAL_TOPIC, DurableContext
from remediators.gateway import Gateway
from remediators.registry import resolve
from remediators.remediation_spans import MAX_TEXT, RemediationSpans
from supervisor.errors import ConfigError
from supervisor.records import RUN_ENDED_OK

__all__ = [
    "DurableRunner",
    "RunnerSettings",
    "build_request",
    "redact_url",
    "send_approval_answer",
]

log = logging.getLogger("spanvisor.remediate")

T = TypeVar("T")

#: The workflow contract's version: recovery needs the same one, whatever else changed.
APP_VERSION: Final = "spanvisor-remediation-1"
_WORKFLOW: Final = "spanvisor.remediate"
#: Another executor's pending remediations are resumed this many at a time, at most
#: this many times (a sidecar runs at most ``max_active`` at once).
_RESUME_BATCH: Final = 500
_RESUME_ROUNDS: Final = 200


class _RecoveryWait:
    """One remediation's watch for its run's recovery, on the runner's loop.

    Made when the remediation starts, before it sends anything: a run that
    recovers while the remediator is still at work (a model writing its
    summary) has recovered all the same, and the verification finds it here.
    """

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
    #: (:func:`~remediators.dbos_database.wake_waiters`); this is the safety net. Recoveries are not
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
        self.spans = RemediationSpans(tracer or trace.NoOpTracer())
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
        use_wal(s.database_url)
        config: DBOSConfig = {
            "name": "spanvisor",
            "system_database_url": s.database_url,
            "application_version": APP_VERSION,
            "executor_id": s.executor_id,
            "log_level": "WARNING",
            "notification_listener_polling_interval_sec": s.poll_interval_s,
            "max_executor_threads": s.db_threads,
        }
        if schema := search_path_schema(s.database_url):
            config["dbos_system_schema"] = schema
        if s.database_url.startswith("sqlite:"):
            # DBOS pings every connection it takes from its pool (a SELECT 1), which
            # guards against a Postgres server that dropped it; a SQLite file's
            # connection cannot go stale, so the ping would only cost CPU.
            config["db_engine_kwargs"] = {"pool_pre_ping": False, "module": SQLITE_NORMAL_SYNC}
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
            if not _runs_here(found, self.settings.executor_id):
                # A finished one is no longer active, and one another sidecar of the
                # fleet runs (the same span judged there too) is not this one's to
                # count: its end is never seen here. One pending here is being resumed
                # (its execute counts it again, so a discard could only undercount).
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
        if _running_loop() is loop:  # from the watch itself: a recovery seen before it began
            self._recovered(remediation_id, dict(evidence))
        else:
            loop.call_soon_threadsafe(self._recovered, remediation_id, dict(evidence))

    def _recovered(self, remediation_id: str, evidence: dict[str, Any]) -> None:
        waiter = self._recovery_waiters.get(remediation_id)
        if waiter is not None and not waiter.event.is_set():
            waiter.evidence = {**evidence, "seen_at": time.time()}
            waiter.event.set()

    def _watch(self, trigger: Trigger, remediation_id: str) -> _RecoveryWait:
        """Watch the run for its recovery, on the runner's loop (see :class:`_RecoveryWait`)."""
        waiter = self._recovery_waiters[remediation_id] = _RecoveryWait()
        # After the waiter exists: the gateway may find the run recovered already.
        try:
            self.gateway.watch_recovery(trigger, remediation_id)
        except Exception:  # the remediation goes on; its verification may wait in vain
            self.counts["errors"] += 1
            log.exception("could not watch a run's recovery", extra={"remediation": remediation_id})
        return waiter

    def _unwatch(self, remediation_id: str, waiter: _RecoveryWait) -> None:
        self.gateway.unwatch(remediation_id)
        if self._recovery_waiters.get(remediation_id) is waiter:
            del self._recovery_waiters[remediation_id]

    async def wait_for_recovery(
        self, trigger: Trigger, remediation_id: str, deadline: float
    ) -> dict[str, Any] | None:
        """What showed the run recovering before ``deadline`` (unix s), or None.

        Woken by :meth:`notify_recovery`; the evidence is what it was given,
        with ``seen_at``. A recovery seen since the remediation started
        answers at once: the watch began before its first command.
        """
        waiter = self._recovery_waiters.get(remediation_id)
        own = waiter is None  # not inside execute(): watch for this wait only
        if waiter is None:
            waiter = self._watch(trigger, remediation_id)
        try:
            remaining = deadline - time.time()
            if remaining > 0 and not waiter.event.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.event.wait(), remaining)
            return waiter.evidence if waiter.event.is_set() else None
        finally:
            if own:
                self._unwatch(remediation_id, waiter)

    def answer_approval(self, remediation_id: str, answer: Mapping[str, Any]) -> None:
        """A person answered the approval a remediation waits for."""
        self._submit(self._send(remediation_id, dict(answer), APPROVAL_TOPIC))

    async def _send(self, remediation_id: str, message: dict[str, Any], topic: str) -> None:
        try:
            await DBOS.send_async(remediation_id, message, topic)
        except Exception as exc:  # finished or unknown: nothing is waiting
            log.debug("message to %s not delivered: %s", remediation_id, exc)
            return
        wake_waiters(remediation_id, topic)

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

    def list(
        self, limit: int = 50, status: str | None = None, created_before: float | None = None
    ) -> list[dict[str, Any]]:
        """Newest first; ``created_before`` (Unix seconds, inclusive): those created by then."""
        end_time = None
        if created_before is not None:
            # DBOS keeps milliseconds and truncates the bound to one: half a millisecond
            # more keeps the bound's own millisecond in, and no later one.
            utc = datetime.timezone.utc
            end = datetime.datetime.fromtimestamp(created_before + 0.0005, tz=utc)
            end_time = end.isoformat()

        async def query() -> list[dict[str, Any]]:
            found = await DBOS.list_workflows_async(
                name=_WORKFLOW,
                status=status,
                limit=limit,
                sort_desc=True,
                load_output=True,
                end_time=end_time,
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
                    "error": None if s["error"] is None else str(s["error"])[:MAX_TEXT],
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

    def resume_executor(self, executor_id: str, timeout_s: float = 30.0) -> int:
        """Resume another executor's pending remediations (a dead sidecar's); how many.

        DBOS's public resume: each becomes ENQUEUED on DBOS's internal queue,
        and one live executor dequeues it (taking it as its own) and runs it
        from its last completed step; a durable sleep keeps its recorded
        wake-up time. Once dequeued it is no longer the dead executor's, so
        that executor, started again, does not recover it a second time.
        """

        async def act() -> int:
            resumed = 0
            for _ in range(_RESUME_ROUNDS):
                found = await DBOS.list_workflows_async(
                    name=_WORKFLOW,
                    status="PENDING",
                    executor_id=executor_id,
                    limit=_RESUME_BATCH,
                    load_input=False,
                    load_output=False,
                )
                if not found:
                    break
                await DBOS.resume_workflows_async([w.workflow_id for w in found])
                resumed += len(found)
                if len(found) < _RESUME_BATCH:
                    break
            return resumed

        return self._ask(act(), timeout_s)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            active = len(self._active)
        return {"active": active, **dict(self.counts)}

    # -- the workflow body ----------------------------------------------------

    async def execute(self, request: dict[str, Any]) -> dict[str, Any]:
        rid = str(request["id"])
        with self._lock:
            self._active.add(rid)  # a resumed one counts too
        root = self.spans.start_root(request)
        ctx = DurableContext(self, request, root)
        verdict = Verdict.FAILED
        reason = ""
        # Watched from before the first command: the verification window covers
        # everything the remediation did, not only what follows its last step.
        watching = self._watch(ctx.trigger, rid)
        try:
            remediator = self._resolve(str(request["use"]))(request["params"])
            verdict = await remediator.run(ctx)
            if verdict is Verdict.ACTED:
                verdict, reason = await self._verify(ctx, request)
            elif verdict is Verdict.SUCCEEDED and ctx.recovery:
                reason = _recovered_reason(ctx)  # it saw the recovery itself
        except BudgetSpent as spent:
            reason = f"budget spent: {spent.what}"
            if await ctx.recovered():  # nothing left for a person to fix
                verdict, reason = Verdict.SUCCEEDED, f"{_recovered_reason(ctx)} ({reason})"
            else:
                verdict = await self._escalate(ctx, reason)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:MAX_TEXT]
            log.exception("remediation failed", extra={"remediation": rid})
            verdict = Verdict.FAILED
        finally:
            self._unwatch(rid, watching)
        if verdict is Verdict.FAILED and ctx.refused and not ctx.acted:
            verdict = Verdict.REFUSED
        outcome = verdict.value if verdict is not Verdict.ACTED else Verdict.FAILED.value
        self.spans.end_root(
            root, outcome, reason, steps=ctx.steps, tool_calls=ctx.tool_calls, refused=ctx.refused
        )
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

    async def _verify(self, ctx: DurableContext, request: Mapping[str, Any]) -> tuple[Verdict, str]:
        window = float(request["verify_window_s"])
        follow = str(request["on_unresolved"])
        # No window still counts a recovery seen while the remediator worked. It is
        # recorded (a durable step) only where the branch leads to more steps.
        if window > 0:
            recovered = await ctx.recovered_within(window)
        elif follow == "none":
            recovered = await ctx.recovered_now()
        else:
            recovered = await ctx.recovered()
        if recovered:
            return Verdict.SUCCEEDED, _recovered_reason(ctx)
        reason = f"no recovery within {window:g} s"
        if follow == "escalate":
            return await self._escalate(ctx, reason), reason
        if follow == "abort_run":
            await self._runner_command(ctx, "abort_run", {"reason": reason})
        return Verdict.FAILED, reason

    async def _escalate(self, ctx: DurableContext, reason: str) -> Verdict:
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

    async def _runner_command(
        self, ctx: DurableContext, command: str, params: dict[str, Any]
    ) -> None:
        gateway, trigger, rid = self.gateway, ctx.trigger, ctx.remediation_id
        sent = {**params, "remediation_id": rid}
        await self._runner_step(
            ctx,
            command,
            lambda: gateway.send_command(trigger, command, sent, key=f"{rid}/{command}"),
        )

    async def _runner_step(
        self, ctx: DurableContext, name: str, act: Callable[[], dict[str, Any]]
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
                self.spans.step(root, f"spanvisor.step {name}", 0, started, error)

        return await DBOS.run_step_async({"name": name}, run)


def send_approval_answer(database_url: str, remediation_id: str, answer: Mapping[str, Any]) -> None:
    """Send an approval's answer to its remediation without a runner in this process (blocks).

    A fleet's remediations wait in their own sidecar's runner, and an answer may
    come through any sidecar's API: one whose runner is still starting, or
    could not start, sends it through DBOS's client on the shared database
    instead, where the waiting sidecar reads it (on PostgreSQL it is notified).
    Raises what the database raises; the message is kept once this returns.
    """
    client = DBOSClient(
        system_database_url=database_url,
        dbos_system_schema=search_path_schema(database_url) or "dbos",
        lazy=True,
        retry_connection_errors=False,  # an unreachable database is an error, not a wait
    )
    try:
        client.send(remediation_id, dict(answer), APPROVAL_TOPIC)
    finally:
        client.destroy()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _runs_here(status: Any, executor_id: str) -> bool:
    """Whether a workflow already started is unfinished and this executor's to run."""
    if status is None or status.status not in ("PENDING", "ENQUEUED"):
        return False
    return bool(status.executor_id == executor_id)


def _recovered_reason(ctx: DurableContext) -> str:
    if ctx.recovery == RUN_ENDED_OK:
        return "the run ended OK"
    return "the run recovered"


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
        # Which sidecar runs it: its executor id (the instance, in a fleet).
        "executor_id": status.executor_id,
        "error": None if status.error is None else str(status.error)[:MAX_TEXT],
    }


def _first_line(error: BaseException) -> str:
    """SQLAlchemy's messages go on with the SQL and a link; the first line says what failed."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
