"""LangGraph under spanvisor: the sidecar's commands, mapped onto a checkpointed graph.

A LangGraph agent with a checkpointer already has what recovery needs: every
super-step of a thread is a checkpoint, a failed thread continues from its
last one (``graph.invoke(None, config)``), an ``interrupt()`` waits for an
answer (``Command(resume=...)``) and ``update_state`` forks a thread from any
earlier checkpoint. :class:`LangGraphAdapter` turns each spanvisor command
into one of those moves. It imports LangGraph, so only agents installed with
the ``langgraph`` extra import it (``pip install 'spanvisor[langgraph]'``);
``supervisor.client`` itself never does.

**The run is the thread.** The sidecar names a run by the spans' ``session.id``
when they carry one (else by trace id), and this adapter reads the command's
``run_id`` as a LangGraph ``thread_id``. :meth:`LangGraphAdapter.invoke` runs
the graph inside OpenInference's ``using_session(thread_id)``, so every span
of the thread carries it; invoke threads through the adapter (or wrap your
own calls in ``using_session``) or the commands name runs the adapter cannot
find.

**What the graph reads.** Commands change how the thread goes on, so the
graph's nodes read them, through the config every node and tool is given:

* ``config["configurable"]["model"]`` (the adapter's ``model_key``): the model
  a ``switch_fallback`` moved the thread to (``params.model``, the name the
  SDK knows, e.g. ``gpt-4o-mini``); absent while the thread is on its
  primary model.
* :func:`supervision` ``(config)``: the thread's live :class:`Supervision`
  handle: ``.model(default)`` (the same, read when the node runs),
  ``.notes(messages)`` (the supervisor's messages the model has not seen yet:
  guidance, unverified effects, a rewind's summary), ``.unverified`` (tool
  calls in flight when the agent stopped, for tools to check before acting
  again) and ``.halted`` (the thread is aborted or about to be rewound: a
  model node should return ``{}`` and let the invocation end).

A model node that follows the convention::

    def call_model(state, config):
        sv = supervision(config)
        if sv.halted:
            return {}
        notes = sv.notes(state["messages"])
        reply = llm_for(sv.model("gpt-4o")).invoke([*state["messages"], *notes])
        return {"messages": [*notes, reply]}   # the notes join the checkpoint

Notes are ``HumanMessage`` s named ``spanvisor`` whose content wraps the
command's text (untrusted: it came from span content) in delimiters, says
where it came from and that it is data, not an instruction. Their ids derive
from the command's idempotency key, so a redelivered command cannot add one
twice. They reach the model through its node rather than ``update_state``
because a message appended after a model turn whose tool calls have not run
yet would split the calls from their results (providers refuse that, and
``tools_condition`` would route to the end); at the next model call a note
is always in a valid place, and a thread that is running gets it too.

**Lifecycle.**

1. Build the graph with a checkpointer, then ``adapter = LangGraphAdapter(graph)``.
2. Run threads with ``adapter.invoke(thread_id, input)``. When one fails, the
   agent does not retry on its own: it waits for the sidecar's command.
3. Commands arrive by the pull channel: ``adapter.serve(puller, on_directive,
   stop=event)`` in a thread, or ``adapter.handle(puller.poll(), puller.ack)``
   in your own loop. ``CommandPuller(service)`` finds the sidecar and its token
   as the CLI does (``SPANVISOR_API_URL``, ``SPANVISOR_API_PORT``,
   ``SPANVISOR_CONFIG``...: :mod:`supervisor.api_access`). Each command is
   applied once per idempotency key and acknowledged once applied.
   :meth:`LangGraphAdapter.apply` returns a :class:`Directive`: ``continue``
   (call :meth:`LangGraphAdapter.proceed`), ``wait`` (paused, or waiting in
   an ``interrupt()``), ``stop`` (aborted or denied) or ``none`` (nothing to
   do now; the reason says why).
4. Commands that edit the checkpoints (``rewind_run``, ``compact_context``)
   for a thread that is running are deferred: the adapter applies them when
   that invocation ends, and continues the thread itself when they say so.

=================  ==========================================================
retry_step         continue the thread from its last checkpoint
resume_run         the same, carrying ``params.unverified`` to the model (a
                   note) and to the tools (``Supervision.unverified``)
approval_result    a thread waiting in ``interrupt()`` gets ``Command(resume=
                   {"approved", "note", "answered_by", "approval_id"})``;
                   otherwise approved continues, denied stops the thread
switch_fallback    the thread's model becomes ``params.model`` (the name the
                   SDK knows; from ``params.to`` when absent), then continue
inject_guidance    a note carrying ``params.guidance``, then continue (a
                   running thread gets it at its next model call)
compact_context    older messages removed (``params.keep_last`` or
                   ``params.target_tokens``), then continue
rewind_run         fork from the checkpoint before the loop (``params.tool``)
                   or ``params.steps_back`` checkpoints back, with a note
                   carrying ``params.summary``; continue from the fork
pause_run          the thread waits for resume_run or approval_result, at
                   most ``params.timeout_s``: then ``params.on_timeout``
                   (``resume``: continue; ``abort``: stop) happens here
                   (:meth:`LangGraphAdapter.expire_pauses`, which ``serve``
                   calls after every poll), and the sidecar's own outcome of
                   that pause (``params.after_pause``) is dropped when it comes
abort_run          the thread is stopped; later commands do not restart it
=================  ==========================================================

Bounded: at most ``max_threads`` threads are remembered (the least recently
used is evicted, never one that is running, and evictions are counted), each
with at most ``max_notes`` pending notes of ``max_note_chars`` characters.
The adapter is thread-safe: the poller thread may apply commands while the
agent's own thread runs the graph.

This module holds one idea, each command mapped onto a move of its thread
(the handlers, and the deferral and invocation they rely on), and is long
for its documentation; what the mapping stands on lives beside it:
``_langgraph_threads`` (per-thread state, :class:`Supervision`, the records),
``_langgraph_notes``, ``_langgraph_checkpoints`` (reading, rewinding and
compacting a thread's checkpoints) and ``_command_loop`` (once-per-key
delivery, the poll loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

try:
    from langchain_core.messages import HumanMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.runnables.config import merge_configs
    from langgraph.pregel import Pregel
    from langgraph.types import Command as GraphCommand
    from langgraph.types import Durability, Interrupt, StateSnapshot
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "supervisor.client.langgraph needs LangGraph: pip install 'spanvisor[langgraph]'"
    ) from exc

from supervisor.client._command_loop import CommandLoop
from supervisor.client._langgraph_checkpoints import (
    ThreadCheckpoints,
    canonical_call,
    checkpoint_id,
    unanswered_calls,
)
from supervisor.client._langgraph_notes import NOTE_NAME, as_data, supervisor_note
from supervisor.client._langgraph_threads import (
    HANDLE_KEY,
    MODEL_KEY,
    Action,
    AdapterStats,
    Directive,
    Supervision,
    ThreadState,
    ThreadView,
    supervision,
)
from supervisor.client._webhooks import SeenCommands
from supervisor.client.pull import Command, CommandPuller
from supervisor.records import split_model_dependency

__all__ = [
    "HANDLE_KEY",
    "MODEL_KEY",
    "NOTE_NAME",
    "AdapterStats",
    "Directive",
    "LangGraphAdapter",
    "Supervision",
    "ThreadView",
    "supervision",
]

log = logging.getLogger("spanvisor.client.langgraph")

#: Deferred commands applied in a row after one invocation (a rewind that loops again...).
_MAX_REDIRECTS = 4
#: Unverified calls kept per thread, and characters of each.
_MAX_UNVERIFIED = 64
_MAX_CALL_CHARS = 500


def _session_factory() -> Callable[[str], AbstractContextManager[Any]] | None:
    try:
        from openinference.instrumentation import using_session
    except ImportError:  # pragma: no cover - the langgraph extra installs it
        return None
    return using_session


_USING_SESSION = _session_factory()


def _session(thread_id: str) -> AbstractContextManager[Any]:
    """Spans made inside carry ``session.id`` = the thread id: the sidecar's run id."""
    return _USING_SESSION(thread_id) if _USING_SESSION is not None else nullcontext()


def _fallback_model(params: Any) -> str:
    """The model a ``switch_fallback`` names, as the agent's SDK calls it.

    ``params.model`` (the sidecar sends it); from a sidecar that sends only
    ``params.to``, the model part of that ``provider:model`` key.
    """
    model = params.get("model")
    if isinstance(model, str) and model.strip():
        return model.strip()[:200]
    target = params.get("to")
    if not isinstance(target, str) or not target.strip():
        return ""
    split = split_model_dependency(target.strip())
    return (split[1] if split is not None and split[1] else target.strip())[:200]


# -- the adapter -------------------------------------------------------------------------------

#: Commands that edit the thread's checkpoints before it goes on.
_EDITING = frozenset({"rewind_run", "compact_context"})


class LangGraphAdapter:
    """Maps spanvisor's commands onto a compiled LangGraph graph with a checkpointer.

    See the module for the lifecycle and the conventions the graph follows.
    ``durability`` is passed to every invocation; ``"sync"`` (the default)
    writes each checkpoint before the next step starts, so a tool's side
    effect never runs ahead of the checkpoint that says why it runs (with
    ``"async"``, a process killed mid-step may lose the checkpoint of the
    model turn that asked for the effect, and the resumed thread asks again).
    ``clock`` stamps directives (injectable for tests).
    """

    def __init__(
        self,
        graph: Pregel[Any, Any, Any, Any],
        *,
        model_key: str = MODEL_KEY,
        messages_key: str = "messages",
        config: RunnableConfig | None = None,
        durability: Durability | None = "sync",
        max_threads: int = 1024,
        max_notes: int = 8,
        max_note_chars: int = 2000,
        history_limit: int = 200,
        seen: SeenCommands | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not graph.checkpointer:
            raise ValueError(
                "the graph has no checkpointer: compile it with one (e.g. SqliteSaver), or no"
                " command can continue, resume or rewind its threads"
            )
        if max_threads < 1 or max_notes < 1 or max_note_chars < 100 or history_limit < 2:
            raise ValueError(
                "max_threads and max_notes must be >= 1, max_note_chars >= 100, history_limit >= 2"
            )
        if _USING_SESSION is None:  # pragma: no cover - the langgraph extra installs it
            log.warning(
                "openinference-instrumentation is not installed: spans will not carry the"
                " thread id as session.id, and the sidecar's commands will name traces instead"
            )
        self.graph = graph
        self.model_key = model_key
        self.messages_key = messages_key
        self.durability = durability
        self.max_threads = max_threads
        self.max_notes = max_notes
        self.max_note_chars = max_note_chars
        self.history_limit = history_limit
        self._base: RunnableConfig = config or {}
        self._checkpoints = ThreadCheckpoints(
            graph,
            messages_key=messages_key,
            config=self._base,
            history_limit=history_limit,
            max_note_chars=max_note_chars,
        )
        self._loop = CommandLoop(
            self.apply,
            seen=seen if seen is not None else SeenCommands(),
            max_failed=max_threads,
            log=log,
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._threads: OrderedDict[str, ThreadState] = OrderedDict()
        self._counts = {
            "applied": 0,
            "unknown": 0,
            "deferred": 0,
            "evicted": 0,
            "notes_dropped": 0,
        }
        self._handlers: dict[str, Callable[[Command, ThreadState], Directive]] = {
            "retry_step": self._retry,
            "resume_run": self._resume,
            "approval_result": self._approval,
            "switch_fallback": self._fallback,
            "inject_guidance": self._guidance,
            "compact_context": self._compact,
            "rewind_run": self._rewind,
            "pause_run": self._pause,
            "abort_run": self._abort,
        }

    # -- running threads -------------------------------------------------------------

    def config(self, thread_id: str) -> RunnableConfig:
        """The config to invoke ``thread_id`` with: thread id, fallback model, live handle."""
        return self._config_for(self._touch(thread_id))

    def supervision(self, thread_id: str) -> Supervision:
        """The thread's live handle (what :func:`supervision` finds in its config)."""
        return Supervision(self._touch(thread_id), self._lock)

    def invoke(self, thread_id: str, input: Any, **kwargs: Any) -> Any:
        """Run the graph on ``thread_id`` with ``input``, its spans in the thread's session.

        ``input`` is a new input (a new turn: clears a pause or an abort),
        ``None`` (continue from the last checkpoint) or a LangGraph
        ``Command``. ``kwargs`` go to ``graph.invoke``. Exceptions propagate,
        except when a command deferred while the thread ran (a rewind) takes
        the thread elsewhere: then the adapter applies it and continues.
        """
        return self._invoke(thread_id, input, kwargs, depth=0)

    def proceed(self, directive: Directive, **kwargs: Any) -> Any:
        """Carry out a ``continue`` directive (invoke with its input); others: ``None``."""
        if directive.action != "continue":
            return None
        return self._invoke(directive.thread_id, directive.input, kwargs, depth=0)

    def interrupts(self, thread_id: str) -> tuple[Interrupt, ...]:
        """The interrupts ``thread_id`` waits on (an ``interrupt()`` awaiting its answer)."""
        snapshot = self._snapshot(thread_id)
        return tuple(snapshot.interrupts) if snapshot is not None else ()

    def _invoke(self, thread_id: str, input: Any, kwargs: dict[str, Any], depth: int) -> Any:
        fresh = input is not None and not isinstance(input, GraphCommand)
        with self._lock:
            thread = self._thread_locked(thread_id)
            thread.running += 1
            if fresh:
                thread.paused = thread.stopped = False
        if self.durability is not None:
            kwargs.setdefault("durability", self.durability)
        error: Exception | None = None
        output: Any = None
        try:
            with _session(thread_id):
                output = self.graph.invoke(input, self._config_for(thread), **kwargs)
        except Exception as exc:  # judged below: a deferred rewind may supersede it
            error = exc
        finally:
            with self._lock:
                thread.running -= 1
                deferred = None
                if thread.running == 0:
                    deferred, thread.deferred = thread.deferred, None
                    if error is None:
                        thread.unverified = ()  # the thread went past them
        self._settle_notes(thread)
        if deferred is not None and depth < _MAX_REDIRECTS:
            directive = self.apply(deferred)
            if directive.action == "continue":
                return self._invoke(thread_id, directive.input, kwargs, depth + 1)
        if error is not None:
            raise error
        return output

    # -- commands --------------------------------------------------------------------

    def apply(self, command: Command) -> Directive:
        """Apply one command to the thread it names (``run_id``); say what to do next.

        Never raises for what the command says (an unknown type, a thread
        that is not there, a missing parameter: a ``none`` directive with the
        reason, and a log line); raises only when the graph or its
        checkpointer fails, so that the command is not acknowledged and comes
        again.
        """
        thread_id = command.run_id
        handler = self._handlers.get(command.type)
        if handler is None:
            with self._lock:
                self._counts["unknown"] += 1
            log.warning(
                "spanvisor command %s of type %r (thread %s) is not one this adapter knows"
                " (%s): ignored",
                command.id,
                command.type,
                thread_id or "?",
                ", ".join(sorted(self._handlers)),
            )
            return self._directive(None, command, "none", f"unknown command type {command.type!r}")
        if not thread_id:
            log.warning("spanvisor command %s (%s) names no run: ignored", command.id, command.type)
            return self._directive(None, command, "none", "the command names no run (thread)")
        thread = self._touch(thread_id)
        after = command.params.get("after_pause")
        if isinstance(after, str) and after and self._ended_here(thread, after):
            return self._directive(
                thread,
                command,
                "none",
                f"pause {after} already timed out here; its outcome was applied then",
            )
        directive = handler(command, thread)
        with self._lock:
            self._counts["applied"] += 1
        log.info(
            "spanvisor %s for thread %s: %s (%s)",
            command.type,
            thread_id,
            directive.action,
            directive.reason,
        )
        return directive

    def handle(
        self, commands: Iterable[Command], ack: Callable[[Command], object] | None = None
    ) -> list[Directive]:
        """Apply each new command (by ``idempotency_key``) and ``ack`` it; the directives.

        A redelivered command (the same key) is acknowledged again and not
        applied. A command whose application raised is not acknowledged, so
        the sidecar hands it out again after its lease, and it is applied then.
        """
        return self._loop.handle(commands, ack)

    def serve(
        self,
        puller: CommandPuller,
        on_directive: Callable[[Directive], object],
        *,
        stop: threading.Event,
        wait_s: float = 5.0,
    ) -> None:
        """Poll, apply, acknowledge and hand each directive to ``on_directive`` until ``stop``.

        Run it in a thread of its own. ``wait_s`` bounds each long poll, and so
        how long ``stop`` takes to be noticed. A poll that comes back empty long
        before ``wait_s`` (the sidecar is down: a refused connection fails at
        once) is followed by a pause, doubling from 0.25 s up to ``wait_s``, so
        the loop never spins. Raises what :meth:`CommandPuller.poll` raises (a
        refused token); an ``on_directive`` that raises is logged.
        """
        self._loop.serve(puller, on_directive, stop=stop, wait_s=wait_s, tick=self.expire_pauses)

    def expire_pauses(self, now: float | None = None) -> list[Directive]:
        """End the pauses whose ``timeout_s`` passed (adapter clock): their ``on_timeout``.

        ``resume``: a ``continue`` directive from the last checkpoint (as a
        ``resume_run`` would); ``abort``: the thread is stopped (``stop``). A
        paused thread so waits at most its pause's ``timeout_s`` for the
        sidecar, even when the sidecar is gone. :meth:`serve` calls this after
        every poll; an agent with its own loop calls it now and then.
        """
        at = self._clock() if now is None else now
        due: list[tuple[ThreadState, Command]] = []
        with self._lock:
            for thread in self._threads.values():
                until, pause = thread.pause_until, thread.pause
                if thread.paused and until is not None and until <= at and pause is not None:
                    thread.paused = False
                    thread.pause_until = None
                    thread.ended_pauses.append(pause.id)
                    due.append((thread, pause))
        directives: list[Directive] = []
        for thread, pause in due:
            timeout = pause.pause
            seconds = f"{timeout.timeout_s:g} s" if timeout is not None else "its timeout"
            if timeout is not None and timeout.on_timeout == "resume":
                directive = self._onward(pause, thread, why=f"pause timed out after {seconds}")
            else:
                with self._lock:
                    thread.stopped = True
                directive = self._directive(
                    thread, pause, "stop", f"pause timed out after {seconds}: aborted"
                )
            log.warning(
                "spanvisor pause %s of thread %s timed out: %s (%s)",
                pause.id,
                thread.thread_id,
                directive.action,
                directive.reason,
            )
            directives.append(directive)
        return directives

    # -- what the adapter holds -------------------------------------------------------

    def view(self, thread_id: str) -> ThreadView | None:
        """What the adapter holds for ``thread_id``, or ``None`` when nothing."""
        with self._lock:
            thread = self._threads.get(thread_id)
            if thread is None:
                return None
            return ThreadView(
                thread_id=thread_id,
                model=thread.model,
                pending_notes=len(thread.notes),
                unverified=thread.unverified,
                paused=thread.paused,
                stopped=thread.stopped,
                running=thread.running > 0,
                deferred=thread.deferred.type if thread.deferred is not None else None,
                directives=tuple(thread.directives),
            )

    def forget(self, thread_id: str) -> None:
        """Drop what the adapter holds for a thread (its checkpoints stay)."""
        with self._lock:
            self._threads.pop(thread_id, None)

    @property
    def stats(self) -> AdapterStats:
        with self._lock:
            return AdapterStats(
                threads=len(self._threads), duplicates=self._loop.duplicates, **self._counts
            )

    # -- command handlers (each returns the directive) -----------------------------------

    def _retry(self, command: Command, thread: ThreadState) -> Directive:
        self._unpause(thread)
        return self._onward(command, thread)

    def _resume(self, command: Command, thread: ThreadState) -> Directive:
        found = command.params.get("unverified")
        calls = list(found) if isinstance(found, (list, tuple)) else []
        # The sidecar lists what no tool span answered; a tool span can be exported
        # before the checkpoint records its result, so the checkpoint's own unanswered
        # calls are unverified too.
        snapshot = self._snapshot(thread.thread_id)
        if snapshot is not None:
            known = {canonical_call(str(c)) for c in calls}
            calls += [
                c for c in unanswered_calls(self._checkpoints.messages(snapshot)) if c not in known
            ]
        unverified = tuple(str(call)[:_MAX_CALL_CHARS] for call in calls[:_MAX_UNVERIFIED])
        with self._lock:
            thread.unverified = unverified
            thread.paused = False
            thread.pause_until = None
        if unverified:
            listed = "\n".join(f"- {as_data(call, _MAX_CALL_CHARS)}" for call in unverified)
            self._add_note(
                thread,
                supervisor_note(
                    "unverified",
                    command.idempotency_key,
                    "The agent stopped while these tool calls were in flight, so whether their"
                    " effects happened is not known. Before calling any of them again, check"
                    " whether its effect already happened, and do not repeat one that did.",
                    as_data(listed, self.max_note_chars),
                ),
            )
        return self._onward(command, thread)

    def _approval(self, command: Command, thread: ThreadState) -> Directive:
        params = command.params
        approved = params.get("approved") is True
        answer = {
            "approved": approved,
            "note": as_data(params.get("note") or "", self.max_note_chars),
            "answered_by": as_data(params.get("answered_by") or "", 200),
            "approval_id": str(params.get("approval_id") or "")[:200],
        }
        who = answer["answered_by"] or "a person"
        if self._stopped(thread):
            return self._directive(thread, command, "stop", "the thread was aborted")
        if self._defer(command, thread):
            return self._deferred(command, thread)  # answered when the invocation ends
        snapshot = self._snapshot(thread.thread_id)
        if snapshot is None:
            return self._directive(thread, command, "none", "no checkpoint for this thread")
        if snapshot.interrupts:
            self._unpause(thread)
            interrupts = snapshot.interrupts
            resume: Any = answer if len(interrupts) == 1 else {i.id: answer for i in interrupts}
            verdict = "approved" if approved else "denied"
            return self._directive(
                thread,
                command,
                "continue",
                f"{verdict} by {who}: answering the thread's interrupt",
                input=GraphCommand(resume=resume),
                checkpoint_id=checkpoint_id(snapshot),
            )
        if not approved:
            with self._lock:
                thread.stopped = True
            return self._directive(thread, command, "stop", f"denied by {who}")
        self._unpause(thread)
        return self._onward(command, thread, snapshot, why=f"approved by {who}")

    def _fallback(self, command: Command, thread: ThreadState) -> Directive:
        model = _fallback_model(command.params)
        if not model:
            return self._directive(
                thread, command, "none", "switch_fallback without params.model or params.to"
            )
        with self._lock:
            thread.model = model
            thread.paused = False
            thread.pause_until = None
        return self._onward(command, thread, why=f"now on {model}")

    def _guidance(self, command: Command, thread: ThreadState) -> Directive:
        guidance = command.params.get("guidance")
        if not isinstance(guidance, str) or not guidance.strip():
            return self._directive(thread, command, "none", "inject_guidance without guidance")
        self._add_note(
            thread,
            supervisor_note(
                "guidance",
                command.idempotency_key,
                "Guidance about this run from the reliability supervisor:",
                as_data(guidance.strip(), self.max_note_chars),
            ),
        )
        return self._onward(command, thread, why="guidance added")

    def _compact(self, command: Command, thread: ThreadState) -> Directive:
        if self._defer(command, thread):
            return self._deferred(command, thread)
        removed = self._checkpoints.compact(
            thread.thread_id, self._snapshot(thread.thread_id), command
        )
        return self._onward(command, thread, why=f"{removed} older message(s) removed")

    def _rewind(self, command: Command, thread: ThreadState) -> Directive:
        if self._stopped(thread):
            return self._directive(thread, command, "stop", "the thread was aborted")
        if self._defer(command, thread):
            return self._deferred(command, thread)
        params = command.params
        tool = params.get("tool")
        steps = params.get("steps_back")
        fork, made = self._checkpoints.fork(
            thread.thread_id,
            summary=str(params.get("summary") or ""),
            reason=str(params.get("reason") or ""),
            tool=tool if isinstance(tool, str) and tool else None,
            steps_back=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
            key=command.idempotency_key,
        )
        if fork is None:
            return self._onward(command, thread, why="nothing to rewind")
        if not made:  # a redelivery: the thread may have gone on from the fork since
            return self._onward(command, thread, why="rewound already")
        self._unpause(thread)
        return self._directive(
            thread,
            command,
            "continue",
            "rewound: continuing from the fork",
            checkpoint_id=str(fork.get("configurable", {}).get("checkpoint_id") or "") or None,
        )

    def _pause(self, command: Command, thread: ThreadState) -> Directive:
        timeout = command.pause
        with self._lock:
            thread.paused = True
            thread.pause = command
            thread.pause_until = None if timeout is None else self._clock() + timeout.timeout_s
        awaiting = command.params.get("awaiting")
        what = awaiting if isinstance(awaiting, str) and awaiting else "resume_run"
        until = (
            f", at most {timeout.timeout_s:g} s, then {timeout.on_timeout}"
            if timeout is not None
            else ""
        )
        return self._directive(thread, command, "wait", f"paused, awaiting {what}{until}")

    def _abort(self, command: Command, thread: ThreadState) -> Directive:
        with self._lock:
            thread.stopped = True
        reason = command.params.get("reason")
        return self._directive(
            thread, command, "stop", f"aborted: {reason}" if reason else "aborted"
        )

    # -- helpers for the handlers ------------------------------------------------------

    def _onward(
        self,
        command: Command,
        thread: ThreadState,
        snapshot: StateSnapshot | None = None,
        *,
        why: str = "",
    ) -> Directive:
        """Continue from the last checkpoint, unless the thread is stopped, busy or done."""
        prefix = f"{why}; " if why else ""
        if self._stopped(thread):
            return self._directive(thread, command, "stop", f"{prefix}the thread was aborted")
        if self._defer(command, thread):
            # The failed step may still be unwinding when its command arrives: the
            # command's continuation runs when that invocation ends, not never.
            return self._deferred(command, thread)
        if snapshot is None:
            snapshot = self._snapshot(thread.thread_id)
        if snapshot is None:
            return self._directive(
                thread, command, "none", f"{prefix}no checkpoint for this thread"
            )
        if snapshot.interrupts:
            return self._directive(
                thread,
                command,
                "wait",
                f"{prefix}the thread waits in an interrupt for approval_result",
            )
        if not snapshot.next and not snapshot.tasks:
            return self._directive(
                thread, command, "none", f"{prefix}the thread has finished: nothing to continue"
            )
        return self._directive(
            thread,
            command,
            "continue",
            f"{prefix}continuing from the last checkpoint",
            checkpoint_id=checkpoint_id(snapshot),
        )

    def _directive(
        self,
        thread: ThreadState | None,
        command: Command,
        action: Action,
        reason: str,
        *,
        input: Any = None,
        checkpoint_id: str | None = None,
        deferred: bool = False,
    ) -> Directive:
        directive = Directive(
            thread_id=command.run_id,
            action=action,
            command_type=command.type,
            command_id=command.id,
            reason=reason,
            input=input,
            checkpoint_id=checkpoint_id,
            deferred=deferred,
            at=self._clock(),
        )
        if thread is not None:
            with self._lock:
                thread.directives.append(directive)
        return directive

    def _defer(self, command: Command, thread: ThreadState) -> bool:
        """Keep a command for when the running invocation ends; False when none runs.

        One command is kept per thread. The latest wins (it knows the most),
        except that a plain continuation never replaces a command that edits
        the checkpoints (a rewind, a compaction): that one continues the
        thread too once it has edited it, and the continuation's own effect
        (a model switch, a note) is already applied.
        """
        with self._lock:
            if thread.running == 0:
                return False
            kept = thread.deferred
            if kept is None or command.type in _EDITING or kept.type not in _EDITING:
                thread.deferred = command
            self._counts["deferred"] += 1
            return True

    def _deferred(self, command: Command, thread: ThreadState) -> Directive:
        return self._directive(
            thread,
            command,
            "none",
            "the thread is running: applied when its invocation ends",
            deferred=True,
        )

    def _unpause(self, thread: ThreadState) -> None:
        with self._lock:
            thread.paused = False
            thread.pause_until = None

    def _ended_here(self, thread: ThreadState, pause_id: str) -> bool:
        with self._lock:
            return pause_id in thread.ended_pauses

    def _stopped(self, thread: ThreadState) -> bool:
        with self._lock:
            return thread.stopped

    def _running(self, thread: ThreadState) -> bool:
        with self._lock:
            return thread.running > 0

    def _add_note(self, thread: ThreadState, note: HumanMessage) -> None:
        note_id = note.id or ""
        with self._lock:
            if note_id in thread.notes:
                return
            thread.notes[note_id] = note
            while len(thread.notes) > self.max_notes:
                thread.notes.popitem(last=False)
                self._counts["notes_dropped"] += 1

    def _settle_notes(self, thread: ThreadState) -> None:
        """Forget the notes the thread's checkpoint now holds (the model saw them)."""
        with self._lock:
            if not thread.notes:
                return
        snapshot = self._snapshot(thread.thread_id)
        if snapshot is None:
            return
        present = {m.id for m in self._checkpoints.messages(snapshot) if m.id}
        with self._lock:
            for note_id in [n for n in thread.notes if n in present]:
                del thread.notes[note_id]

    # -- threads, configs, snapshots ------------------------------------------------------

    def _touch(self, thread_id: str) -> ThreadState:
        with self._lock:
            return self._thread_locked(thread_id)

    def _thread_locked(self, thread_id: str) -> ThreadState:
        threads = self._threads
        thread = threads.get(thread_id)
        if thread is not None:
            threads.move_to_end(thread_id)
            return thread
        if len(threads) >= self.max_threads:
            # The least recently used thread that is not running; a running one is
            # needed by its invocation (its handle, its deferred command).
            victim = next((t for t, s in threads.items() if s.running == 0), None)
            if victim is not None:
                del threads[victim]
                self._counts["evicted"] += 1
        thread = threads[thread_id] = ThreadState(thread_id)
        return thread

    def _config_for(self, thread: ThreadState) -> RunnableConfig:
        configurable: dict[str, Any] = {
            "thread_id": thread.thread_id,
            HANDLE_KEY: Supervision(thread, self._lock),
        }
        with self._lock:
            if thread.model:
                configurable[self.model_key] = thread.model
        return merge_configs(self._base, {"configurable": configurable})

    def _snapshot(self, thread_id: str) -> StateSnapshot | None:
        """The thread's latest checkpoint, or ``None`` when it has none."""
        snapshot = self._checkpoints.latest(thread_id)
        if snapshot is None:
            return None
        with self._lock:
            thread = self._threads.get(thread_id)
            if thread is not None and not thread.restored:
                # A fallback outlives a restart: its model is in the checkpoint's metadata
                # (LangGraph copies string configurables there).
                thread.restored = True
                model = (snapshot.metadata or {}).get(self.model_key)
                if thread.model is None and isinstance(model, str) and model:
                    thread.model = model
        return snapshot

    # -- rewind ---------------------------------------------------------------------------

    def rewind(
        self,
        thread_id: str,
        *,
        summary: str,
        reason: str = "",
        tool: str | None = None,
        steps_back: int | None = None,
        key: str = "",
    ) -> RunnableConfig | None:
        """Fork ``thread_id`` from an earlier checkpoint with a note; the fork's config.

        The checkpoint is, on the thread's current branch: with ``tool``, the
        latest one before the first model turn of the trailing run of turns
        calling ``tool`` (with the same arguments as the last such call, when
        at least two did; else with any); else ``steps_back`` checkpoints back;
        else the one before the last model turn. It is moved further back to a
        checkpoint from which the model speaks next (never between a tool call
        and its result). The note carries ``summary`` (what was tried, why it
        failed) and the tool calls the discarded turns made: their effects
        stay, and the model must not assume otherwise. ``None``: nothing to
        rewind. With ``key`` (the command's idempotency key) a second call
        finds the first fork and returns it instead of forking again.
        """
        fork, _ = self._checkpoints.fork(
            thread_id, summary=summary, reason=reason, tool=tool, steps_back=steps_back, key=key
        )
        return fork
