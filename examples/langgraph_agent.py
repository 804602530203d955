"""A LangGraph agent supervised by spanvisor: checkpoints in SQLite, commands by pull.

The agent is an ordinary LangGraph tool-using agent: a ``StateGraph`` whose
model node calls ``langchain_openai.ChatOpenAI`` (its own retries off,
``max_retries=0``: the sidecar decides what follows a failure) and whose tool
node runs ``send_email`` (a side effect: it cannot be unsent) and
``issue_refund`` (a risky one: above ``--approval-over`` it asks a person,
with LangGraph's ``interrupt()``). Each thread is a run of ``--steps`` user
turns; the threads are named ``PREFIX-1``, ``PREFIX-2``... A ``SqliteSaver``
keeps every checkpoint in ``--checkpoints``. OpenInference's LangChain
instrumentation exports the spans over OTLP/HTTP to
``OTEL_EXPORTER_OTLP_ENDPOINT`` (the sidecar), with the thread id as
``session.id``, so the sidecar's run id is the thread id.

Commands come by the pull channel (``supervisor.client.pull.CommandPuller``,
service ``OTEL_SERVICE_NAME``) and are mapped onto the graph by
``supervisor.client.langgraph.LangGraphAdapter``: a failed thread continues
from its last checkpoint (``retry_step``, ``resume_run``, an approved
escalation), switches model (``switch_fallback``), gets guidance, is rewound
to before a loop (``rewind_run``), waits (``pause_run``) or stops
(``abort_run``); a thread waiting in ``interrupt()`` gets the person's answer
(``approval_result`` becomes ``Command(resume={"approved": ..., "note":
...})``). The agent never retries on its own: when a step fails it waits,
bounded (``--command-timeout-s``), for the sidecar's command for that thread.

Side effects happen once. Each is recorded in ``--effects`` (JSON lines,
fsynced) under an idempotency key made of the thread, the step and the tool
(``t-1/step-2/send_email``): a tool that runs again (a thread continued from
a checkpoint taken before its result) finds its key and answers with the
first result instead of acting again.

After a crash. ``--crash-after-effects N`` (fault injection, for the demo and
the tests) exports the finished spans and kills the process with SIGKILL
right after its N-th side effect, inside the tool: the tool's span never
ends, and the checkpoint still says the tool is to run. Started again with
``--resume``, the agent does not decide on its own which threads to go on
with: a thread left mid-step waits for the sidecar, whose stall detector
sees the run gone silent and sends ``resume_run`` naming the tool calls it
never saw answered (``params.unverified``); the thread continues from its
checkpoint, its tool checks the ledger for the unverified effect and does
not repeat it, and the thread's remaining steps follow. Threads that had not
started are then run as usual.

Approvals. The refund's ``interrupt()`` shows on its tool span as a
``GraphInterrupt`` exception event; two policy entries make it a request for
a person (the approval's answer resumes the interrupt)::

    rules:
      - {name: langgraph.interrupt, match: {exception_type: GraphInterrupt},
         class: semantic, kind: approval_required}
    policies:
      - {name: approvals, match: {kind: approval_required}, action: escalate}

Without them the built-in policy reads it as a tool error and sends
``retry_step``, which the adapter answers with ``wait``: a thread in an
interrupt waits for its answer, not for a retry.

Run it next to a sidecar whose settings name this service's pull channel
(``agents: {langgraph-agent: {pull: {visibility_s: 30}}}``)::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=sk-fake \\
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_SERVICE_NAME=langgraph-agent \\
    SPANVISOR_API_TOKEN=<the sidecar's api_token> \\
    python examples/langgraph_agent.py --runs 2 --steps 3 --checkpoints lg.sqlite \\
        --effects effects.jsonl --summary summary.json

The pieces are importable (``build_graph``, ``EffectLedger``, ``Agent``,
``Settings``) for the demo and the recovery benchmark.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

from langchain_core.messages import AnyMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import InjectedState, ToolNode, tools_condition
from langgraph.types import interrupt
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from typing_extensions import TypedDict

from supervisor.client import SupervisorClientError
from supervisor.client.langgraph import Directive, LangGraphAdapter, supervision
from supervisor.client.pull import CommandPuller

log = logging.getLogger("langgraph_agent")

SYSTEM = SystemMessage(
    "You are an operations assistant. Use the tools to do what each step asks: each step"
    " sends at most one e-mail, and a refund above the approval limit waits for a person."
)
#: Inbox of one thread: directives waiting for the runner (more is a flood: dropped, counted).
MAX_INBOX = 64


def _say(message: str) -> None:
    """One human-readable line on stderr: what the agent does and why."""
    log.info(message)


# -- side effects, once each ----------------------------------------------------------------


class EffectLedger:
    """Side effects by idempotency key, in a JSON-lines file (the agent's outbox).

    Writing the record is the effect here (a fake outbox); a real tool would
    pass the key to the service it calls or write it in the same transaction.
    The file is read at start, so a restarted agent does not repeat an effect.
    Thread-safe: a tool node runs parallel tool calls in threads.
    ``on_effect`` is called after each effect performed (not after a repeat).
    """

    def __init__(self, path: Path | None, on_effect: Callable[[int], None] | None = None) -> None:
        self.path = path
        self.on_effect = on_effect
        self.performed = 0
        self.deduplicated = 0
        self._done: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        if path is not None and path.exists():
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                try:
                    record = json.loads(line)
                    self._done[str(record["key"])] = record
                except (ValueError, KeyError, TypeError):
                    log.warning("%s:%d: not an effect record; skipped", path, number)

    def find(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self._done.get(key)

    def perform(self, key: str, effect: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Do ``effect`` unless ``key`` was done already: (its record, whether done now)."""
        with self._lock:
            found = self._done.get(key)
            if found is not None:
                self.deduplicated += 1
                return found, False
            record = {"key": key, **effect, "at": round(time.time(), 3)}
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(json.dumps(record, sort_keys=True) + "\n")
                    out.flush()
                    os.fsync(out.fileno())
            self._done[key] = record
            self.performed += 1
            count = self.performed
        if self.on_effect is not None:
            self.on_effect(count)
        return record, True


# -- the graph --------------------------------------------------------------------------------


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def step_message(thread_id: str, step: int, text: str) -> HumanMessage:
    """A step's user turn; its id says which step it is (the tools' keys, ``--resume``)."""
    return HumanMessage(f"Step {step} of {thread_id}: {text}", id=f"{thread_id}/step-{step}")


def current_step(messages: list[BaseMessage], thread_id: str) -> int:
    """The step the thread is in: that of its last step message (-1 before any)."""
    prefix = f"{thread_id}/step-"
    for message in reversed(messages):
        if message.id and message.id.startswith(prefix):
            try:
                return int(message.id[len(prefix) :])
            except ValueError:
                break
    return -1


def build_graph(
    *,
    ledger: EffectLedger,
    checkpointer: SqliteSaver,
    model: str = "gpt-4o",
    base_url: str | None = None,
    api_key: str | None = None,
    approval_over: float = 100.0,
    llm_timeout_s: float = 10.0,
) -> Any:
    """The agent's graph: model -> tools -> model ..., compiled with ``checkpointer``.

    The model node follows the adapter's conventions (the fallback model, the
    supervisor's notes, halting); the tools record their effects in
    ``ledger`` under ``thread/step-N/tool``.
    """
    llms: dict[str, Any] = {}

    def effect_key(config: RunnableConfig, state: dict[str, Any], name: str) -> str:
        thread_id = supervision(config).thread_id or str(
            config.get("configurable", {}).get("thread_id", "")
        )
        step = current_step(state.get("messages", []), thread_id)
        return f"{thread_id}/step-{step}/{name}"

    def checked(config: RunnableConfig, name: str, key: str) -> None:
        if supervision(config).is_unverified(name):
            done = ledger.find(key) is not None
            _say(
                f"{key}: unverified after a restart; the ledger says it was"
                f" {'done: not repeated' if done else 'not done: doing it now'}"
            )

    @tool
    def send_email(
        to: str,
        subject: str,
        config: RunnableConfig,
        state: Annotated[dict[str, Any], InjectedState],
        tool_call_id: Annotated[str, InjectedToolCallId],
    ) -> str:
        """Send an e-mail. It cannot be unsent: each step sends at most one."""
        key = effect_key(config, state, "send_email")
        checked(config, "send_email", key)
        record, first = ledger.perform(
            key,
            {"effect": "send_email", "to": to, "subject": subject[:200], "call": tool_call_id},
        )
        if not first:
            _say(f"{key}: already sent; not sent again")
        status = "sent" if first else "already_sent"
        return json.dumps({"status": status, "key": key, "at": record["at"]})

    @tool
    def issue_refund(
        order: str,
        amount: float,
        config: RunnableConfig,
        state: Annotated[dict[str, Any], InjectedState],
        tool_call_id: Annotated[str, InjectedToolCallId],
    ) -> str:
        """Refund an order to the customer. Above the approval limit, a person decides."""
        key = effect_key(config, state, "issue_refund")
        checked(config, "issue_refund", key)
        if ledger.find(key) is None and amount > approval_over:
            # The thread waits here, checkpointed; the answer comes back as the
            # value of interrupt() when the approval_result resumes it.
            answer = interrupt(
                {
                    "action": "issue_refund",
                    "order": order,
                    "amount": amount,
                    "question": f"Refund {amount:g} on order {order}?",
                }
            )
            if not (isinstance(answer, dict) and answer.get("approved") is True):
                note = answer.get("note", "") if isinstance(answer, dict) else ""
                return json.dumps({"status": "denied", "key": key, "note": note})
        _, first = ledger.perform(
            key, {"effect": "issue_refund", "order": order, "amount": amount, "call": tool_call_id}
        )
        return json.dumps({"status": "refunded" if first else "already_refunded", "key": key})

    tools = [send_email, issue_refund]

    def llm_for(name: str) -> Any:
        found = llms.get(name)
        if found is None:
            found = llms[name] = ChatOpenAI(
                model=name,
                base_url=base_url,
                api_key=api_key,  # type: ignore[arg-type]
                max_retries=0,  # the sidecar decides what follows a failure
                timeout=llm_timeout_s,
            ).bind_tools(tools)
        return found

    def call_model(state: State, config: RunnableConfig) -> dict[str, Any]:
        sv = supervision(config)
        if sv.halted:  # aborted, or about to be rewound: end this invocation now
            return {}
        notes = sv.notes(state["messages"])
        reply = llm_for(sv.model(model)).invoke([SYSTEM, *state["messages"], *notes])
        return {"messages": [*notes, reply]}

    graph = StateGraph(State)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=checkpointer)


# -- directives, routed to threads ----------------------------------------------------------------


class Inboxes:
    """Hands each directive to the thread it names; thread-safe and bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue[tuple[Directive, float]]] = {}
        self.received = 0
        self.dropped = 0
        self.unmatched: list[dict[str, Any]] = []

    def open(self, thread_id: str) -> queue.Queue[tuple[Directive, float]]:
        with self._lock:
            return self._queues.setdefault(thread_id, queue.Queue(MAX_INBOX))

    def close(self, thread_id: str) -> None:
        with self._lock:
            self._queues.pop(thread_id, None)

    def deliver(self, directive: Directive) -> None:
        with self._lock:
            self.received += 1
            inbox = self._queues.get(directive.thread_id)
            if inbox is None:
                if len(self.unmatched) < 100:
                    self.unmatched.append(_brief(directive, time.monotonic(), None))
                return
        try:
            inbox.put_nowait((directive, time.monotonic()))
        except queue.Full:
            with self._lock:
                self.dropped += 1


def _brief(directive: Directive, at: float, failed_at: float | None) -> dict[str, Any]:
    """What the summary keeps of a directive."""
    return {
        "type": directive.command_type,
        "id": directive.command_id,
        "action": directive.action,
        "reason": directive.reason,
        "deferred": directive.deferred,
        "received_wall": round(time.time() - (time.monotonic() - at), 3),
        "after_failure_s": None if failed_at is None else round(at - failed_at, 3),
    }


# -- the agent --------------------------------------------------------------------------------


class RunEnded(Exception):
    """The thread cannot go on: aborted, denied, or no command came in time."""


@dataclass
class Settings:
    service: str = "langgraph-agent"
    model: str = "gpt-4o"
    runs: int = 1
    steps: int = 3
    run_prefix: str = "thread"
    run_gap_s: float = 0.0
    command_timeout_s: float = 30.0
    pause_timeout_s: float = 120.0
    run_timeout_s: float = 300.0
    refund_step: int = -1
    refund_amount: float = 250.0


@dataclass
class ThreadReport:
    """One thread, as the summary shows it."""

    thread_id: str
    status: str = "running"
    reason: str = ""
    adopted: bool = False
    duration_s: float = 0.0
    models_used: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)


class Agent:
    """Runs threads through the adapter; on a failure, waits for the sidecar (see the module)."""

    def __init__(self, settings: Settings, adapter: LangGraphAdapter, inboxes: Inboxes) -> None:
        self.settings = settings
        self.adapter = adapter
        self.inboxes = inboxes
        self.reports: list[ThreadReport] = []

    def thread_ids(self) -> list[str]:
        return [f"{self.settings.run_prefix}-{n}" for n in range(1, self.settings.runs + 1)]

    def task(self, thread_id: str, step: int) -> HumanMessage:
        if step == self.settings.refund_step:
            text = (
                f"refund order {thread_id}-{step} ({self.settings.refund_amount:g} EUR)"
                " to the customer."
            )
        else:
            text = f"tell the on-call team about item {step} by e-mail."
        return step_message(thread_id, step, text)

    def progress(self, thread_id: str) -> tuple[int, bool]:
        """(the step the thread is in, whether that step is unfinished); (-1, False): new."""
        state = self.adapter.graph.get_state({"configurable": {"thread_id": thread_id}})
        values = state.values if isinstance(state.values, dict) else {}
        step = current_step(values.get("messages", []), thread_id)
        return step, bool(state.next) or bool(state.interrupts)

    def run(self, *, resume: bool) -> None:
        for number, thread_id in enumerate(self.thread_ids(), 1):
            if number > 1 and self.settings.run_gap_s > 0:
                time.sleep(self.settings.run_gap_s)
            step, unfinished = self.progress(thread_id) if resume else (-1, False)
            if step + 1 >= self.settings.steps and not unfinished:
                _say(f"thread {thread_id}: already complete")
                self.reports.append(ThreadReport(thread_id, status="completed", reason="before"))
                continue
            self.run_thread(thread_id, first_step=step + 1, adopt=unfinished)

    def run_thread(
        self, thread_id: str, *, first_step: int = 0, adopt: bool = False
    ) -> ThreadReport:
        """Run the thread's steps from ``first_step``; ``adopt``: first finish the one in flight."""
        settings = self.settings
        report = ThreadReport(thread_id, adopted=adopt)
        self.reports.append(report)
        inbox = self.inboxes.open(thread_id)
        started = time.monotonic()
        deadline = started + settings.run_timeout_s
        try:
            if adopt:
                # Restarted mid-step: the sidecar says how to go on (resume_run).
                _say(f"thread {thread_id}: left mid-step; waiting for the sidecar's command")
                directive = self._await(report, inbox, deadline, time.monotonic())
                view = self.adapter.view(thread_id)
                report.unverified = list(view.unverified) if view is not None else []
                self._drive(report, inbox, deadline, first_step - 1, directive.input)
            for step in range(first_step, settings.steps):
                self._between(report, inbox)
                self._drive(
                    report, inbox, deadline, step, {"messages": [self.task(thread_id, step)]}
                )
            report.status = "completed"
        except RunEnded as ended:
            report.status, report.reason = "aborted", str(ended)
        finally:
            self.inboxes.close(thread_id)
            report.duration_s = round(time.monotonic() - started, 3)
        _say(
            f"thread {thread_id}: {report.status} in {report.duration_s}s {report.reason}".rstrip()
        )
        return report

    def _drive(
        self,
        report: ThreadReport,
        inbox: queue.Queue[tuple[Directive, float]],
        deadline: float,
        step: int,
        payload: Any,
    ) -> None:
        """Take one step to its end, following the sidecar's commands after each failure."""
        entry: dict[str, Any] = {"step": step, "attempts": 0, "models": [], "interrupts": 0}
        report.steps.append(entry)
        while True:
            entry["attempts"] += 1
            model = self._model(report.thread_id)
            if model not in entry["models"]:
                entry["models"].append(model)
            if model not in report.models_used:
                report.models_used.append(model)
            try:
                out = self.adapter.invoke(report.thread_id, payload)
            except Exception as exc:  # the sidecar decides what follows, not this agent
                failed_at = time.monotonic()
                status = getattr(exc, "status_code", None)
                report.failures.append(
                    {
                        "step": step,
                        "attempt": entry["attempts"],
                        "model": model,
                        "error": type(exc).__name__,
                        "status_code": status,
                        "wall": round(time.time(), 3),
                    }
                )
                _say(
                    f"thread {report.thread_id} step {step}: {type(exc).__name__}"
                    f"{f' ({status})' if status else ''} on {model}; waiting for the sidecar"
                )
                payload = self._await(report, inbox, deadline, failed_at).input
                continue
            self._between(report, inbox)  # what was deferred while the invocation ran
            view = self.adapter.view(report.thread_id)
            if view is not None and view.stopped:
                raise RunEnded("aborted while running")
            if isinstance(out, dict) and out.get("__interrupt__"):
                entry["interrupts"] += 1
                _say(f"thread {report.thread_id} step {step}: waiting for a person's approval")
                payload = self._await(report, inbox, deadline, time.monotonic(), paused=True).input
                continue
            entry["model"] = self._model(report.thread_id)
            return

    def _model(self, thread_id: str) -> str:
        view = self.adapter.view(thread_id)
        return (view.model if view is not None else None) or self.settings.model

    def _record(
        self,
        report: ThreadReport,
        directive: Directive,
        at: float,
        failed_at: float | None,
        *,
        late: bool = False,
    ) -> Directive | None:
        """Keep a directive; for a deferred one, also what the adapter made of it since.

        A command that came while the thread's invocation ran is answered
        "none" and applied by the adapter when that invocation ends (it then
        goes on by itself after a ``continue``). That application never comes
        through the inbox, so it is looked up here and returned.
        """
        entry = _brief(directive, at, failed_at)
        if late:
            entry["late"] = True
        report.commands.append(entry)
        if not directive.deferred:
            return None
        view = self.adapter.view(report.thread_id)
        for applied in view.directives if view is not None else ():
            if applied.command_id == directive.command_id and not applied.deferred:
                report.commands.append(
                    {**_brief(applied, time.monotonic(), None), "on_return": True}
                )
                return applied
        return None

    def _between(self, report: ThreadReport, inbox: queue.Queue[tuple[Directive, float]]) -> None:
        """Directives that came while no step waited for one: kept, and obeyed if they stop."""
        while True:
            try:
                directive, at = inbox.get_nowait()
            except queue.Empty:
                return
            applied = self._record(report, directive, at, None, late=True)
            if directive.action == "stop" or (applied is not None and applied.action == "stop"):
                raise RunEnded(directive.reason)

    def _await(
        self,
        report: ThreadReport,
        inbox: queue.Queue[tuple[Directive, float]],
        deadline: float,
        failed_at: float,
        *,
        paused: bool = False,
    ) -> Directive:
        """Wait, bounded, for a ``continue`` directive for the thread; RunEnded otherwise."""
        settings = self.settings
        limit = settings.pause_timeout_s if paused else settings.command_timeout_s
        until = min(time.monotonic() + limit, deadline)
        while True:
            left = until - time.monotonic()
            if left <= 0:
                why = "the thread's deadline" if until >= deadline else f"{limit:g}s"
                raise RunEnded(f"no command from the sidecar within {why}")
            try:
                directive, at = inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            applied = self._record(report, directive, at, failed_at)
            if applied is not None and applied.action == "stop":
                raise RunEnded(f"{directive.command_type}: {applied.reason}")
            if applied is not None and applied.action == "wait" and not paused:
                # The adapter paused the thread when the failed invocation ended.
                paused, limit = True, settings.pause_timeout_s
                until = min(time.monotonic() + limit, deadline)
            _say(
                f"thread {report.thread_id}: {directive.command_type} ->"
                f" {directive.action} ({directive.reason})"
            )
            if directive.action == "continue":
                return directive
            if directive.action == "stop":
                raise RunEnded(f"{directive.command_type}: {directive.reason}")
            if directive.action == "wait" and not paused:
                paused, limit = True, settings.pause_timeout_s
                until = min(time.monotonic() + limit, deadline)


# -- wiring -----------------------------------------------------------------------------------


def tracer_provider(service: str, delay_ms: int) -> TracerProvider:
    """OTLP/HTTP to the sidecar, in small batches sent within ``delay_ms``."""
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not traces:
        base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
        traces = f"{base.rstrip('/')}/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=traces, timeout=5), schedule_delay_millis=delay_ms
        )
    )
    return provider


@contextmanager
def instrumented(provider: TracerProvider) -> Iterator[None]:
    from openinference.instrumentation.langchain import LangChainInstrumentor

    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield
    finally:
        instrumentor.uninstrument()


def crash_hook(provider: TracerProvider, after: int) -> Callable[[int], None] | None:
    """``--crash-after-effects``: after the N-th effect, export what ended, then SIGKILL."""
    if after <= 0:
        return None

    def on_effect(count: int) -> None:
        if count == after:
            _say(f"fault injection: killed (SIGKILL) right after side effect #{count}")
            provider.force_flush(2000)  # the spans that ended, as a batch export would
            os.kill(os.getpid(), signal.SIGKILL)

    return on_effect


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="A LangGraph agent (SQLite checkpoints, OpenInference spans) that takes"
        " spanvisor's commands by pull. The model is reached at OPENAI_BASE_URL with"
        " OPENAI_API_KEY; spans go to OTEL_EXPORTER_OTLP_ENDPOINT (OTLP/HTTP).",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--service",
        default=os.environ.get("OTEL_SERVICE_NAME") or "langgraph-agent",
        help="service.name of the spans, and the pull channel's service"
        " (default: OTEL_SERVICE_NAME, else langgraph-agent)",
    )
    parser.add_argument("--model", default="gpt-4o", help="the primary model (default gpt-4o)")
    parser.add_argument("--runs", type=int, default=1, help="threads to run, one after the other")
    parser.add_argument("--steps", type=int, default=3, help="steps (user turns) per thread")
    parser.add_argument("--run-prefix", default="thread", help="threads are PREFIX-1, PREFIX-2...")
    parser.add_argument("--run-gap-s", type=float, default=0.0, help="pause between threads")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=Path("langgraph-checkpoints.sqlite"),
        help="SQLite file of the threads' checkpoints (default langgraph-checkpoints.sqlite)",
    )
    parser.add_argument("--effects", type=Path, help="JSON-lines ledger of side effects")
    parser.add_argument("--summary", type=Path, help="write the JSON summary here at the end")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="after a crash: threads left mid-step wait for the sidecar's command, then go on",
    )
    parser.add_argument(
        "--api",
        default=None,
        help="the sidecar's control API (default: found as the spanvisor CLI finds it:"
        " SPANVISOR_API_URL, SPANVISOR_API_PORT, SPANVISOR_CONFIG...; token:"
        " SPANVISOR_API_TOKEN, else the sidecar's token file)",
    )
    parser.add_argument(
        "--refund-step", type=int, default=-1, help="this step asks for a refund (default none)"
    )
    parser.add_argument("--refund-amount", type=float, default=250.0, help="its amount (250)")
    parser.add_argument(
        "--approval-over", type=float, default=100.0, help="refunds above this need approval"
    )
    parser.add_argument(
        "--crash-after-effects",
        type=int,
        default=0,
        help="fault injection: SIGKILL this process right after its N-th side effect",
    )
    parser.add_argument(
        "--command-timeout-s",
        type=float,
        default=30.0,
        help="how long a failed step waits for the sidecar's command (30)",
    )
    parser.add_argument(
        "--pause-timeout-s",
        type=float,
        default=120.0,
        help="how long a paused thread waits for resume_run or approval_result (120)",
    )
    parser.add_argument(
        "--run-timeout-s", type=float, default=300.0, help="a thread's deadline, waits included"
    )
    parser.add_argument("--llm-timeout-s", type=float, default=10.0, help="per model call (10)")
    parser.add_argument(
        "--poll-wait-s", type=float, default=2.0, help="long poll of the pull channel (2)"
    )
    parser.add_argument(
        "--export-delay-ms",
        type=int,
        default=100,
        help="most a finished span waits before it is exported (100)",
    )
    return parser


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a summary."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: summary, flush


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="langgraph-agent: %(message)s")
    log.setLevel(logging.INFO)
    logging.getLogger("spanvisor.client.langgraph").setLevel(logging.INFO)
    if not os.environ.get("OPENAI_API_KEY"):
        print("langgraph_agent: set OPENAI_API_KEY (any value for a fake)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    settings = Settings(
        service=args.service,
        model=args.model,
        runs=args.runs,
        steps=args.steps,
        run_prefix=args.run_prefix,
        run_gap_s=args.run_gap_s,
        command_timeout_s=args.command_timeout_s,
        pause_timeout_s=args.pause_timeout_s,
        run_timeout_s=args.run_timeout_s,
        refund_step=args.refund_step,
        refund_amount=args.refund_amount,
    )
    provider = tracer_provider(settings.service, args.export_delay_ms)
    ledger = EffectLedger(args.effects, crash_hook(provider, args.crash_after_effects))
    connection = sqlite3.connect(args.checkpoints, check_same_thread=False)
    graph = build_graph(
        ledger=ledger,
        checkpointer=SqliteSaver(connection),
        model=settings.model,
        base_url=os.environ.get("OPENAI_BASE_URL"),
        api_key=os.environ.get("OPENAI_API_KEY"),
        approval_over=args.approval_over,
        llm_timeout_s=args.llm_timeout_s,
    )
    adapter = LangGraphAdapter(graph)
    inboxes = Inboxes()
    agent = Agent(settings, adapter, inboxes)
    puller = CommandPuller(settings.service, args.api)
    stop = threading.Event()

    def pull() -> None:
        try:
            adapter.serve(puller, inboxes.deliver, stop=stop, wait_s=args.poll_wait_s)
        except SupervisorClientError as exc:  # a refused token: waiting will not help
            log.error("no commands from spanvisor: %s", exc)

    poller = threading.Thread(target=pull, name="spanvisor-pull", daemon=True)
    _say(
        f"{settings.service}: {settings.runs} thread(s) of {settings.steps} step(s) on"
        f" {settings.model}, checkpoints in {args.checkpoints}, commands from {puller.base_url}"
        f"{' (resuming)' if args.resume else ''}"
    )
    if not args.resume:
        taken = [t for t in agent.thread_ids() if agent.progress(t)[0] >= 0]
        if taken:
            print(
                f"langgraph_agent: {', '.join(taken[:5])} already in"
                f" {args.checkpoints}: pass --resume to go on with them, or"
                " another --run-prefix or --checkpoints file",
                file=sys.stderr,
            )
            connection.close()
            return 2
    for thread_id in agent.thread_ids():
        inboxes.open(thread_id)  # before the first poll: a resume_run may be waiting already
    started = time.time()
    try:
        with instrumented(provider):
            poller.start()
            agent.run(resume=args.resume)
    finally:
        stop.set()
        poller.join(args.poll_wait_s + 5)
        puller.close()
        provider.shutdown()  # flushes the last spans
        connection.close()
        if args.summary is not None:
            for report in agent.reports:
                if report.status == "running":  # cut short (SIGTERM)
                    report.status, report.reason = "aborted", "the agent stopped mid-run"
            _write_summary(
                args.summary,
                {
                    "service": settings.service,
                    "primary_model": settings.model,
                    "resumed": args.resume,
                    "started_wall": round(started, 3),
                    "threads": [asdict(r) for r in agent.reports],
                    "commands": {
                        "received": inboxes.received,
                        "dropped": inboxes.dropped,
                        "unmatched": inboxes.unmatched,
                    },
                    "adapter": asdict(adapter.stats),
                    "effects": {
                        "path": str(args.effects) if args.effects else None,
                        "performed": ledger.performed,
                        "deduplicated": ledger.deduplicated,
                    },
                },
            )
    completed = sum(r.status == "completed" for r in agent.reports)
    _say(f"{completed} of {settings.runs} thread(s) completed")
    return 0 if completed == settings.runs else 1


if __name__ == "__main__":
    sys.exit(main())
