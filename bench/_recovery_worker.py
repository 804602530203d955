"""One agent worker process of the recovery benchmark (``python -m bench._recovery_worker``).

The agent is the same in every arm: a LangGraph graph with an LLM node
(``langchain_openai.ChatOpenAI(max_retries=0)`` against the fake provider) and
a tool node whose ``do_step`` tool has a side effect, recorded in a ledger
under the key ``run/step``. A step is one model call and one tool call; a
whole run is one graph invocation (the model -> tools -> model loop), on a
SqliteSaver checkpointer of the worker's own, with ``durability="sync"`` (a
checkpoint written before the next step starts). The nodes follow the
conventions of :mod:`supervisor.client.langgraph` (the model a fallback
chose, the supervisor's notes, ``halted``, unverified calls), which are inert
outside its adapter. Each worker drives its share of the fleet, one thread per
run. What differs is what happens after a failure:

``a``   nothing: the first failed step ends the run (failed).
``b``   every model call wrapped in tenacity, retrying every error:
        ``stop_after_attempt(5)``, ``wait_exponential(multiplier=1, max=30)``.
``c``   LangGraph's own ``RetryPolicy()`` (its defaults) on both nodes.
``c+``  as ``c``, and a restarted worker resumes, from its checkpointer, the
        runs its job table says were running when it died.
``d``   spanvisor: the worker exports OpenInference spans (``session.id`` =
        the thread id = the run id) to a ``spanvisor run`` sidecar, runs its
        threads through :class:`~supervisor.client.langgraph.LangGraphAdapter`
        and never retries on its own: a failed run waits for the sidecar's
        command (pull channel), which the adapter turns into a directive
        (continue from the checkpoint, on the fallback model, with guidance;
        wait; stop). A restarted worker does nothing until the sidecar names a
        run (``resume_run`` after a stall, a pending ``retry_step``...); the
        ``do_step`` tool checks the ledger when its call is among the
        unverified ones a ``resume_run`` lists, and does not act twice.

The tool does not check the ledger otherwise, in any arm: it is a service
call with a side effect, as most are.

Files, in the arm's directory, per worker index (shared by a worker and the
processes that replace it): ``ckpt-wN.sqlite`` (checkpoints), ``ledger-wN.jsonl``
(the side effects: the "external service", written before the tool answers),
``events-wN.jsonl`` (the job table: run started, done, failed, aborted;
commands received). A SIGKILL loses nothing written with ``write()``.
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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, TypedDict

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy
from tenacity import Retrying, stop_after_attempt, wait_exponential

from bench._recovery_scenario import (
    HEADER,
    LOOP_TOOL,
    STEP_TOOL,
    TASK_PREFIX,
    Scenario,
    read_lines,
)
from supervisor.client.langgraph import Directive, LangGraphAdapter, supervision

log = logging.getLogger("recovery-worker")

#: Loop iterations a run may make beyond its steps before LangGraph's recursion limit.
LOOP_ALLOWANCE = 25
#: How long a failed run waits for the sidecar's command (arm d); a pause restarts it.
COMMAND_WAIT_S = 120.0
#: How long a started worker waits for the benchmark's go (every worker is ready).
GO_WAIT_S = 180.0
#: A directive a failed run acts on must come from a command created after the
#: failure (less this clock skew): an older one answered an earlier failure.
_SKEW_S = 0.05


# -- files ----------------------------------------------------------------------------


class JsonLines:
    """Append-only JSON lines, one ``write()`` each (whole lines survive a SIGKILL)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def read(self) -> list[dict[str, Any]]:
        return read_lines(self.path)


class Ledger(JsonLines):
    """The side effects, keyed ``run/step``: the external service's own record."""

    def record(self, run: str, step: int, arm: str) -> None:
        self.write(
            {
                "key": f"{run}/{step}",
                "run": run,
                "step": step,
                "t": time.time(),
                "pid": os.getpid(),
                "arm": arm,
            }
        )

    def done(self, run: str, step: int) -> bool:
        """Whether the effect of ``run``'s step is recorded (read from the file: any process)."""
        key = f"{run}/{step}"
        return any(r.get("key") == key for r in self.read())


# -- the agent ------------------------------------------------------------------------


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@dataclass
class Agent:
    """The graph, its checkpointer and what its nodes need."""

    arm: str
    scenario: Scenario
    provider_url: str
    ledger: Ledger
    checkpoint_path: Path
    events: JsonLines
    worker: int
    #: run -> when its last model call failed (Unix s): commands older than that are stale
    failed_at: dict[str, float] = field(default_factory=dict)
    _models: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        connection = sqlite3.connect(self.checkpoint_path, check_same_thread=False)
        self.checkpointer = SqliteSaver(connection)
        self.graph = self._build()

    def _model(self, name: str) -> Any:
        with self._lock:
            found = self._models.get(name)
            if found is None:
                chat = ChatOpenAI(
                    model=name,
                    base_url=self.provider_url,
                    api_key="sk-fake",  # type: ignore[arg-type]
                    max_retries=0,  # the SDK never retries: each arm decides
                    timeout=10.0,
                )
                found = self._models[name] = chat.bind_tools([do_step, check_status])
            return found

    def llm(self, state: State, config: RunnableConfig) -> dict[str, Any]:
        """The model node: a trimmed context (the task, notes, the last exchange)."""
        sv = supervision(config)
        if sv.halted:  # aborted by the sidecar: end this invocation
            return {}
        configurable = config.get("configurable") or {}
        run = str(configurable["thread_id"])
        model = sv.model(str(configurable.get("model") or self.scenario.primary))
        messages = state["messages"]
        notes = sv.notes(messages)
        turn = sum(isinstance(m, AIMessage) for m in messages)
        earlier_notes = [m for m in messages[1:] if isinstance(m, HumanMessage)]
        context: list[BaseMessage] = [
            SystemMessage(HEADER.format(run=run, turn=turn, steps=self.scenario.steps)),
            messages[0],
            *earlier_notes,
            *notes,
            *_last_exchange(messages),
        ]
        chat = self._model(model)
        try:
            if self.arm == "b":
                retrying = Retrying(
                    stop=stop_after_attempt(5),
                    wait=wait_exponential(multiplier=1, max=30),
                    reraise=True,  # every error is retried: that is the naive arm
                )
                reply = retrying(chat.invoke, context)
            else:
                reply = chat.invoke(context)
        except Exception:
            self.failed_at[run] = time.time()  # about when the failing span ended
            raise
        return {"messages": [*notes, reply]}

    def _build(self) -> Any:
        retry = RetryPolicy() if self.arm in ("c", "c+") else None
        builder = StateGraph(State)
        builder.add_node("llm", self.llm, retry_policy=retry)
        builder.add_node("tools", ToolNode([do_step, check_status]), retry_policy=retry)
        builder.add_edge(START, "llm")
        builder.add_conditional_edges("llm", _route, {"tools": "tools", END: END})
        builder.add_edge("tools", "llm")
        return builder.compile(checkpointer=self.checkpointer)

    @property
    def recursion_limit(self) -> int:
        return 2 * self.scenario.steps + 2 * LOOP_ALLOWANCE + 4

    def config(self, run: str) -> RunnableConfig:
        return {
            "configurable": {"thread_id": run, "model": self.scenario.primary},
            "recursion_limit": self.recursion_limit,
        }

    def first_input(self, run: str) -> dict[str, Any]:
        task = (
            f"{TASK_PREFIX}{run}: carry out steps 0 to {self.scenario.steps - 1} in order, one"
            f" {STEP_TOOL} call each, then say that you are done."
        )
        return {"messages": [HumanMessage(task)]}

    def finished(self, run: str) -> bool:
        """Whether the run's checkpointed state ends with the final answer."""
        snapshot = self.graph.get_state({"configurable": {"thread_id": run}})
        messages = snapshot.values.get("messages") or []
        last = messages[-1] if messages else None
        return not snapshot.next and isinstance(last, AIMessage) and not last.tool_calls


def _route(state: State) -> str:
    last = state["messages"][-1]
    return "tools" if isinstance(last, AIMessage) and last.tool_calls else END


def _last_exchange(messages: list[AnyMessage]) -> list[AnyMessage]:
    """The last model answer and the tool results that followed it (the trimmed context)."""
    for index in range(len(messages) - 1, 0, -1):
        if isinstance(messages[index], AIMessage):
            return [m for m in messages[index:] if not isinstance(m, HumanMessage)]
    return []


#: Set in main(): the tools are module-level and need the ledger and the pace.
_AGENT: list[Agent] = []


def _agent() -> Agent:
    if not _AGENT:
        raise RuntimeError("the worker's agent is not built")
    return _AGENT[0]


@tool(STEP_TOOL)
def do_step(step: int, config: RunnableConfig) -> str:
    """Carry out one step of the run. It has a side effect: each step must happen once."""
    agent = _agent()
    run = str((config.get("configurable") or {})["thread_id"])
    listed = [c for c in supervision(config).unverified if _step_of(c) == step]
    if listed and agent.ledger.done(run, step):
        # The sidecar said this call was in flight when the worker died: the
        # service's record says it happened, so it is not done again.
        agent.events.write(
            {"t": time.time(), "ev": "effect_verified", "run": run, "step": step, "w": agent.worker}
        )
        return f"step {step} done"
    pace = agent.scenario.tool_s
    after = pace * agent.scenario.after_effect
    time.sleep(pace - after)  # preparing the request
    agent.ledger.record(run, step, agent.arm)  # the service did it
    time.sleep(after)  # waiting for its answer: a crash here leaves an unverified effect
    return f"step {step} done"


@tool(LOOP_TOOL)
def check_status(item: str) -> str:
    """Look up the status of an order (read-only)."""
    time.sleep(_agent().scenario.tool_s)
    number = item.rsplit("-", 1)[-1]
    return f"status of order-{number}: still pending"


def _step_of(call: str) -> int:
    """The step of ``do_step({"step": 12})`` as the sidecar lists it; -1 if not one."""
    if not call.startswith(f"{STEP_TOOL}("):
        return -1
    try:
        args = json.loads(call.split("(", 1)[1].rsplit(")", 1)[0])
    except (ValueError, IndexError):
        return -1
    step = args.get("step", -1) if isinstance(args, dict) else -1
    return int(step) if isinstance(step, int) else -1


# -- the worker -----------------------------------------------------------------------


class Worker:
    """One process's share of the fleet; see the module."""

    def __init__(self, args: argparse.Namespace, scenario: Scenario) -> None:
        self.args = args
        self.scenario = scenario
        self.arm: str = args.arm
        self.index: int = args.worker
        folder = Path(args.dir)
        self.events = JsonLines(folder / f"events-w{self.index}.jsonl")
        self.ledger = Ledger(folder / f"ledger-w{self.index}.jsonl")
        self.stop = threading.Event()
        self.agent = Agent(
            self.arm,
            scenario,
            args.provider_url,
            self.ledger,
            folder / f"ckpt-w{self.index}.sqlite",
            self.events,
            self.index,
        )
        _AGENT[:] = [self.agent]
        self.tracer_provider: Any = None
        self.adapter: LangGraphAdapter | None = None
        self.puller: Any = None
        self.inboxes: dict[str, queue.Queue[Directive]] = {}
        self.active: set[str] = set()
        self.seen_keys: set[str] = set()
        #: command id -> created_at (Unix s), to tell an answer from an older one
        self.created: dict[str, float] = {}
        self._lock = threading.Lock()
        #: The arm's start (Unix time), from the benchmark's go file.
        self.t0 = 0.0

    def event(self, ev: str, run: str = "", **more: Any) -> None:
        self.events.write(
            {"t": time.time(), "ev": ev, "run": run, "w": self.index, "pid": os.getpid(), **more}
        )

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        self.event("worker_start", incarnation=self.args.incarnation)
        if self.args.incarnation == 0:
            for run in self.scenario.runs_of(self.index):
                self._spawn(run, at=self.t0 + self.scenario.start_offset(run))
        elif self.arm == "c+":
            for run in self._running_in_job_table():
                self._spawn(run, resume=True)
        if self.arm == "d":
            threading.Thread(target=self._pull, name="pull", daemon=True).start()

    def _running_in_job_table(self) -> list[str]:
        state: dict[str, str] = {}
        for record in self.events.read():
            if record.get("run") and record.get("ev") in ("start", "done", "failed", "aborted"):
                state[str(record["run"])] = str(record["ev"])
        return [run for run, ev in state.items() if ev == "start"]

    def terminal_runs(self) -> set[str]:
        ended = ("done", "failed", "aborted")
        return {str(r["run"]) for r in self.events.read() if r.get("ev") in ended}

    def instrument(self) -> None:
        """Arm d: spans to the sidecar (OTLP/HTTP), the adapter, the pull channel."""
        from openinference.instrumentation.langchain import LangChainInstrumentor
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from supervisor.client.pull import CommandPuller

        provider = TracerProvider(resource=Resource.create({"service.name": self.args.service}))
        # A sidecar restart takes seconds: the exporter retries a batch for up to 30 s,
        # and the queue holds what is made meanwhile.
        exporter = OTLPSpanExporter(endpoint=f"{self.args.otlp_endpoint}/v1/traces", timeout=30)
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=self.args.export_delay_ms,
                max_queue_size=65536,
            )
        )
        LangChainInstrumentor().instrument(tracer_provider=provider)
        self.tracer_provider = provider
        self.adapter = LangGraphAdapter(
            self.agent.graph,
            config={"recursion_limit": self.agent.recursion_limit},
            durability="sync",
            max_threads=4096,
        )
        self.puller = CommandPuller(
            self.args.service, base_url=self.args.api_url, token=self.args.api_token, limit=50
        )

    def shutdown(self) -> None:
        self.stop.set()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes the last spans

    # -- runs ---------------------------------------------------------------------

    def _spawn(
        self,
        run: str,
        *,
        at: float = 0.0,
        resume: bool = False,
        directive: Directive | None = None,
    ) -> None:
        with self._lock:
            if run in self.active:
                return
            self.active.add(run)
            self.inboxes.setdefault(run, queue.Queue())
        thread = threading.Thread(
            target=self._drive, args=(run, at, resume, directive), name=run, daemon=True
        )
        thread.start()

    def _drive(self, run: str, at: float, resume: bool, directive: Directive | None) -> None:
        try:
            if at and self.stop.wait(max(0.0, at - time.time())):
                return
            if self.arm == "d":
                self._drive_supervised(run, directive)
            else:
                self._drive_alone(run, resume)
        except Exception as exc:  # a bug in the benchmark: say so rather than hang the arm
            self.event("failed", run, reason=f"worker error {_why(exc)}")
        finally:
            with self._lock:
                self.active.discard(run)

    def _drive_alone(self, run: str, resume: bool) -> None:
        """Arms a, b, c, c+: one invocation; whatever it raises ends the run."""
        self.event("resumed" if resume else "start", run)
        try:
            self.agent.graph.invoke(
                None if resume else self.agent.first_input(run),
                self.agent.config(run),
                durability="sync",
            )
        except GraphRecursionError:
            self.event("failed", run, reason="recursion limit (a reasoning loop)")
            return
        except Exception as exc:
            self.event("failed", run, reason=_why(exc))
            return
        self._finish(run)

    def _finish(self, run: str) -> None:
        if self.agent.finished(run):
            self.event("done", run)
        else:
            self.event("failed", run, reason="the graph ended without the final answer")

    # -- arm d: the sidecar decides ---------------------------------------------------

    def _drive_supervised(self, run: str, directive: Directive | None) -> None:
        """Invoke through the adapter; after each failure, do what the sidecar says."""
        adapter = self.adapter
        if adapter is None:
            raise RuntimeError("arm d without its adapter")
        inbox = self.inboxes[run]
        if directive is None:
            self.event("start", run)
        else:
            self.event("resumed", run, by=directive.command_type)
        while not self.stop.is_set():
            try:
                if directive is None:
                    adapter.invoke(run, self.agent.first_input(run))
                else:
                    adapter.proceed(directive)
            except Exception as exc:  # the sidecar decides what follows, not this worker
                failed_at = self.agent.failed_at.get(run, time.time())
                view = adapter.view(run)
                self.event("step_failed", run, reason=_why(exc), model=view and view.model)
            else:
                view = adapter.view(run)
                if view is not None and view.stopped:
                    self.event("aborted", run, reason="abort_run while running")
                else:
                    self._finish(run)
                return
            directive = self._await(run, inbox, failed_at)
            if directive is None:
                return

    def _await(self, run: str, inbox: queue.Queue[Directive], failed_at: float) -> Directive | None:
        """The directive that answers this failure: ``continue``; None when the run ends."""
        deadline = time.monotonic() + COMMAND_WAIT_S
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self.event("failed", run, reason=f"no command within {COMMAND_WAIT_S:g} s")
                return None
            try:
                directive = inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            created = self.created.get(directive.command_id, 0.0)
            if created and created < failed_at - _SKEW_S and directive.action != "stop":
                self.event("stale", run, type=directive.command_type, action=directive.action)
                continue
            if directive.action == "continue":
                return directive
            if directive.action == "stop":
                self.event("aborted", run, reason=f"{directive.command_type}: {directive.reason}")
                return None
            if directive.action == "wait":
                deadline = time.monotonic() + COMMAND_WAIT_S  # paused: wait for resume_run
        return None

    def _pull(self) -> None:
        """The pull channel: lease this service's commands, apply them, route the directives."""
        adapter, puller = self.adapter, self.puller
        if adapter is None or puller is None:
            return
        while not self.stop.is_set():
            try:
                commands = puller.poll(wait_s=1.0)
                for command in commands:
                    self._note(command)
                for directive in adapter.handle(commands, puller.ack):
                    self.event(
                        "directive",
                        directive.thread_id,
                        type=directive.command_type,
                        id=directive.command_id,
                        action=directive.action,
                        reason=directive.reason[:120],
                    )
                    self._route(directive)
            except Exception as exc:  # keep pulling: one bad answer must not stop the worker
                log.warning("pull loop: %s", _why(exc))
                self.stop.wait(0.5)

    def _note(self, command: Any) -> None:
        with self._lock:
            duplicate = command.idempotency_key in self.seen_keys
            self.seen_keys.add(command.idempotency_key)
            self.created[command.id] = float(command.created_at or 0.0)
        self.event(
            "command",
            command.run_id,
            type=command.type,
            id=command.id,
            key=command.idempotency_key,
            duplicate=duplicate,
            created_at=command.created_at,
            kind=(command.failure or {}).get("kind"),
            unverified=list((command.params or {}).get("unverified") or ()),
        )

    def _route(self, directive: Directive) -> None:
        run = directive.thread_id
        with self._lock:
            inbox = self.inboxes.get(run) if run in self.active else None
        if inbox is not None:
            inbox.put(directive)
            return
        # A run this process does not drive: a restarted worker hears of it from the sidecar.
        if self.scenario.worker_of(run) != self.index or run in self.terminal_runs():
            return
        if directive.action == "continue":
            self._spawn(run, directive=directive)
        elif directive.action == "stop":
            self.event("aborted", run, reason=f"{directive.command_type} for a run not driven")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


@contextmanager
def _stopping() -> Iterator[threading.Event]:
    """SIGTERM and SIGINT set the event (the main thread then flushes and exits)."""
    stopping = threading.Event()

    def handler(signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    yield stopping


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--arm", required=True, choices=["a", "b", "c", "c+", "d"])
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--scenario", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--provider-url", required=True)
    parser.add_argument("--service", default="recovery-agent")
    parser.add_argument("--otlp-endpoint", default="")
    parser.add_argument("--api-url", default="")
    parser.add_argument("--api-token", default="")
    parser.add_argument(
        "--export-delay-ms", type=int, default=100, help="BatchSpanProcessor schedule delay"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"worker {args.worker}: %(message)s")
    for noisy in ("opentelemetry", "openinference", "httpx", "openai", "langchain", "langgraph"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    scenario = Scenario.from_json(json.loads(args.scenario.read_text(encoding="utf-8")))
    with _stopping() as stopping:
        worker = Worker(args, scenario)
        if args.arm == "d":
            worker.instrument()
        worker.event("worker_ready", incarnation=args.incarnation)
        go = args.dir / "go.json"
        deadline = time.monotonic() + GO_WAIT_S
        while not go.exists() and time.monotonic() < deadline and not stopping.wait(0.02):
            pass
        if not go.exists():
            os._exit(3)  # the benchmark never said go (it stopped, or it is broken)
        worker.t0 = float(json.loads(go.read_text(encoding="utf-8"))["t0"])
        worker.start()
        while not stopping.wait(0.5):
            pass
        worker.shutdown()
    os._exit(0)  # run threads may sit in a tool's sleep: do not wait for them


if __name__ == "__main__":
    sys.exit(main())
