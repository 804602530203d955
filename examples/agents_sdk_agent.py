"""An OpenAI Agents SDK agent that spanvisor supervises over the pull channel.

The agent half is an ordinary Agents SDK agent: an ``Agent`` with two function
tools (``lookup_rota``, read-only, and ``send_email``, which has a side
effect), run with ``Runner.run``. The model is the SDK's
``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client with its own
retries off (``max_retries=0``: the sidecar decides what happens after a
failure, not the SDK), at ``OPENAI_BASE_URL``. Chat completions, not the SDK's
default Responses API, because every OpenAI-compatible server (local models,
gateways, spanvisor's fake provider) serves ``/v1/chat/completions``.

Tracing: ``openinference-instrumentation-openai-agents`` turns the SDK's own
traces into OpenTelemetry spans (AGENT, LLM ``generation``, TOOL spans...),
exported over OTLP/HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the sidecar) under
the service ``OTEL_SERVICE_NAME``. The SDK's default trace processor, which
would upload traces to OpenAI's tracing backend, is removed first, so nothing
leaves for api.openai.com; ``set_tracing_disabled(True)`` is *not* used: it
would silence the instrumentor too, which is fed by the SDK's tracing.
``trace_include_sensitive_data`` stays on: without it the SDK writes
"Error details are redacted." on a failed model call's span, and the sidecar
can no longer tell a 429 from a 401. (To keep messages off the spans, give
the instrumentor an OpenInference ``TraceConfig(hide_inputs=True,
hide_outputs=True)`` instead: error texts survive that.)

Runs and run ids: one run of this agent (one task for the model) may take
several ``Runner.run`` calls, one per attempt, and each call is a new SDK
trace and so a new OpenTelemetry trace. The sidecar's run id is a span's
``session.id`` when there is one, else its trace id; every span of a run
carries ``session.id`` = the run id chosen here (OpenInference's
``using_session``), so attempts stay one run for the sidecar (its retry
counts, its run view) and its commands name that run id. Each attempt is
wrapped in a span of the agent's own, so the agent knows the attempt's trace
id too: a command whose trigger is in an older attempt's trace is about a
failure already dealt with ("stale"), and the run map also answers by trace
id, for commands about spans that carry no session.

Commands: a thread long-polls the sidecar (``CommandPuller.poll``) and hands
each command to the event loop, which drops redeliveries
(``SeenCommands`` by idempotency key) and puts it in its run's inbox. A
command is acknowledged once acted on; one for no current run is
acknowledged at once (received; a redelivery would not help). When a run
fails (the SDK raises ``openai.RateLimitError``, ``InternalServerError``...)
the agent does not retry on its own: it waits, bounded, for the sidecar's
command about that failure and acts on it:

==================  ===========================================================
retry_step          run again from the failed point (the conversation so far
                    is in the run's SDK session), or from the start with
                    ``--retry-from start``
resume_run          the same as retry_step
rewind_run          run again from the start: the tools run again, and the
                    ledger below makes their effects happen once
switch_fallback     ``params.to`` is ``provider:model``: the model for the rest
                    of the run, then as retry_step
pause_run           wait (``--pause-timeout-s``) for resume_run or
                    approval_result
approval_result     approved: as retry_step; denied: the run ends aborted
abort_run           the run ends aborted
inject_guidance     ``params.guidance`` goes into the conversation as a
                    developer message marked as the supervisor's, not the
                    user's; the run keeps waiting for what to do
==================  ===========================================================

Between model calls (the SDK's ``call_model_input_filter``) the run also
looks at its inbox: guidance goes into the next call, ``abort_run`` ends the
run, ``pause_run`` holds it until resumed; other commands about a run that is
not failing are acknowledged and ignored.

Side effects: ``send_email`` records each e-mail in ``--effects`` (JSON lines,
the agent's outbox) under an idempotency key made of the run id and the tool
call. The call is identified by what it asks for (tool name and arguments),
not by the id the model gave it: a replayed turn gets a new call id from the
model for the same e-mail. A second attempt at the same effect finds the key
and returns the first result, and is counted. At the end ``--summary`` gets a
JSON report: per run its status, attempts, failures, models used and every
command, with its arrival time relative to the failure it answers.

Run it next to a sidecar whose settings give this service a pull channel
(``agents: {agents-sdk-agent: {pull: {visibility_s: 30}}}``) and whose API
token is in ``SPANVISOR_API_TOKEN`` (or ``~/.spanvisor/api-token``):

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=sk-fake \\
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_SERVICE_NAME=agents-sdk-agent \\
    SPANVISOR_API_TOKEN=<token> \\
    python examples/agents_sdk_agent.py --runs 2 --summary summary.json --effects effects.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import openai
from agents import (
    Agent,
    AgentsException,
    FunctionTool,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    RunResult,
    SQLiteSession,
    TResponseInputItem,
    UserError,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_trace_processors,
)
from agents.run_config import CallModelData, ModelInputData
from agents.tool_context import ToolContext
from openinference.instrumentation import using_session
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import format_trace_id

from supervisor.client import SeenCommands, SupervisorClientError
from supervisor.client.pull import Command, CommandPuller

#: Marks guidance from the sidecar in the conversation: the model must not take it for the user.
GUIDANCE_MARK = "[spanvisor guidance: from this agent's supervisor, not from the user]"
#: Longest guidance kept (it comes from a policy or a remediator, over the network).
MAX_GUIDANCE_CHARS = 2000
#: Longest final answer kept in the summary.
MAX_OUTPUT_CHARS = 2000
#: Commands for no current run kept in the summary (all are counted).
MAX_UNMATCHED_KEPT = 100
#: Commands kept in one run's report, and guidance texts held for its next model call.
MAX_COMMANDS_KEPT = 500
MAX_GUIDANCE_HELD = 8
#: Commands whose trigger names the failure they answer: checked against the run's last failure.
TRIGGERED = frozenset(
    {
        "retry_step",
        "resume_run",
        "rewind_run",
        "switch_fallback",
        "pause_run",
        "approval_result",
    }
)
RECIPIENT = "oncall@example.com"

log = logging.getLogger("agents_sdk_agent")


def _say(message: str) -> None:
    """One human-readable line on stderr: what the agent does and why."""
    log.info(message)


def _clean(value: object, limit: int = 200) -> str:
    """A value from a command, fit for one log line: bounded, no control characters."""
    text = str(value)[:limit]
    return "".join(c if c.isprintable() else "?" for c in text)


# -- side effects, once each ----------------------------------------------------------


class EffectLog:
    """Side effects recorded by idempotency key in a JSON-lines file (the agent's outbox).

    The record is the effect here (a fake outbox), so writing it is sending;
    a real tool would pass the key to the service it calls (mail and payment
    APIs take an ``Idempotency-Key``). Read at start, so a restarted agent
    does not repeat an effect either. Used from the event loop's thread only.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.sent = 0
        self.deduplicated = 0
        self._done: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                try:
                    record = json.loads(line)
                    self._done[str(record["key"])] = record
                except (ValueError, KeyError, TypeError):
                    log.warning("%s:%d: not an effect record; skipped", path, number)

    def perform(self, key: str, effect: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Do ``effect`` unless ``key`` was done already; (its record, whether done now)."""
        found = self._done.get(key)
        if found is not None:
            self.deduplicated += 1
            return found, False
        record = {"key": key, **effect, "at": time.time()}
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record, sort_keys=True) + "\n")
                out.flush()
                os.fsync(out.fileno())
        self._done[key] = record
        self.sent += 1
        return record, True


def effect_key(run_id: str, tool: str, arguments: dict[str, Any]) -> str:
    """The idempotency key of one tool call of a run: what it asks for, not its call id."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{run_id}/{tool}/{digest}"


# -- runs and the commands routed to them ----------------------------------------------


class RunEnded(Exception):
    """The run cannot go on: aborted by a command, denied, or no command came in time."""


class AbortRequested(BaseException):
    """Ends a run from inside the SDK (its model-input filter).

    A BaseException on purpose: the SDK's ``except Exception`` handlers would
    record an ordinary exception as an error on the run's span, which the
    sidecar would then report as a new failure of its own.
    """


@dataclass(frozen=True, slots=True)
class Arrival:
    """A command as the poller received it."""

    command: Command
    at: float  # time.monotonic()
    wall: float


@dataclass
class RunReport:
    """One run, as the summary shows it."""

    name: str
    run_id: str
    status: str = "running"  # running | completed | aborted
    reason: str = ""
    duration_s: float = 0.0
    output: str = ""
    models_used: list[str] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    effects: list[dict[str, Any]] = field(default_factory=list)

    def use(self, model: str) -> None:
        if model not in self.models_used:
            self.models_used.append(model)


@dataclass
class Run:
    """One run in progress; also the SDK's run context, so the tools can reach it."""

    report: RunReport
    inbox: asyncio.Queue[Arrival]
    deadline: float
    model: str
    original_input: list[TResponseInputItem]
    session: SQLiteSession
    #: Trace ids of the run's attempts, oldest first (aliases of the run id).
    traces: list[str] = field(default_factory=list)
    #: Trace id of the attempt that failed last ("" while none did).
    failed_trace: str = ""
    #: Guidance received and not yet given to the model.
    guidance: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.report.run_id

    @property
    def name(self) -> str:
        return self.report.name


def _brief(arrival: Arrival, failed_at: float | None) -> dict[str, Any]:
    """What the summary keeps of a command (its params are data, kept by name only)."""
    command = arrival.command
    failure, params = command.failure, command.params
    kept = ("to", "approved", "delay_s", "retry_after_s", "attempt", "awaiting", "breaker")
    return {
        "type": command.type,
        "id": command.id,
        "trigger_trace_id": command.trigger_trace_id,
        "failure_class": failure.get("class"),
        "failure_kind": failure.get("kind"),
        "failure_dependency": failure.get("dependency"),
        "params": {k: params[k] for k in kept if k in params},
        "received_wall": round(arrival.wall, 3),
        "after_failure_s": None if failed_at is None else round(arrival.at - failed_at, 3),
    }


class Router:
    """Routes commands to the runs they name; lives on the event loop (not thread-safe).

    The poller thread hands every command over with ``call_soon_threadsafe``,
    so all routing happens on the loop and a run's inbox is never written
    after the run closed it.
    """

    def __init__(self, puller: CommandPuller) -> None:
        self.puller = puller
        self.seen = SeenCommands()
        self.received = 0
        self.duplicates = 0
        self.unmatched = 0
        self.acked = 0
        self.ack_refused = 0
        self.unmatched_kept: list[dict[str, Any]] = []
        self._runs: dict[str, Run] = {}
        self._aliases: dict[str, str] = {}  # attempt trace id -> run id
        self._pending: set[str] = set()  # command ids routed to a run, not yet acknowledged
        self._acks: set[asyncio.Task[None]] = set()

    def open(self, run: Run) -> None:
        self._runs[run.run_id] = run

    def alias(self, trace_id: str, run: Run) -> None:
        """Commands naming the trace of one of the run's attempts reach the run too."""
        self._aliases[trace_id] = run.run_id

    def close(self, run: Run) -> list[Arrival]:
        """Forget the run; return what was left in its inbox (to acknowledge as late)."""
        self._runs.pop(run.run_id, None)
        for trace_id in run.traces:
            self._aliases.pop(trace_id, None)
        late: list[Arrival] = []
        while not run.inbox.empty():
            late.append(run.inbox.get_nowait())
        return late

    def arrive(self, command: Command, at: float, wall: float) -> None:
        """One leased command (on the loop)."""
        self.received += 1
        if not self.seen.first_time(command.idempotency_key):
            self.duplicates += 1
            _say(f"{_clean(command.type)} {_clean(command.id)} came again; dropped")
            if command.id not in self._pending:
                self._ack_soon(command)  # acted on before: the first ack did not land
            return
        run = self._runs.get(command.run_id) or self._runs.get(
            self._aliases.get(command.run_id, "")
        )
        if run is None:
            self.unmatched += 1
            if len(self.unmatched_kept) < MAX_UNMATCHED_KEPT:
                self.unmatched_kept.append(_brief(Arrival(command, at, wall), None))
            self._ack_soon(command)
            return
        self._pending.add(command.id)
        run.inbox.put_nowait(Arrival(command, at, wall))

    async def ack(self, command: Command) -> None:
        """Acknowledge a command acted on (the puller blocks: on a worker thread)."""
        try:
            taken = await asyncio.to_thread(self.puller.ack, command)
        except SupervisorClientError as exc:
            self.ack_refused += 1
            log.error("cannot acknowledge %s: %s", command.id, exc)
            return
        finally:
            self._pending.discard(command.id)
        if taken:
            self.acked += 1

    def _ack_soon(self, command: Command) -> None:
        task = asyncio.get_running_loop().create_task(self.ack(command))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def settle(self, timeout_s: float) -> None:
        """Let acknowledgements in flight finish (bounded)."""
        if self._acks:
            await asyncio.wait(set(self._acks), timeout=timeout_s)


class Poller:
    """Long-polls the sidecar on a thread of its own and hands commands to the loop."""

    def __init__(
        self,
        puller: CommandPuller,
        router: Router,
        loop: asyncio.AbstractEventLoop,
        wait_s: float,
    ) -> None:
        self.puller = puller
        self.router = router
        self.loop = loop
        self.wait_s = wait_s
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spanvisor-pull", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop after the poll in flight; whether the thread ended within ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                commands = self.puller.poll(wait_s=self.wait_s)
            except SupervisorClientError as exc:
                # Waiting does not fix a refused token: stop polling; runs that wait time out.
                self.error = str(exc)
                log.error("stopped pulling commands: %s", exc)
                return
            at, wall = time.monotonic(), time.time()
            for command in commands:
                try:
                    self.loop.call_soon_threadsafe(self.router.arrive, command, at, wall)
                except RuntimeError:  # the loop is closed: the agent is stopping
                    return
            if not commands and time.monotonic() - started < 0.5:
                # An empty answer at once: the sidecar is down or refuses this service
                # (the puller logged why), or the wait asked is tiny. Do not spin.
                self._stop.wait(0.5)


# -- the agent ------------------------------------------------------------------------


def build_tools(effects: EffectLog) -> list[FunctionTool]:
    """The agent's tools: one to read, one with an effect that must happen once."""

    @function_tool
    async def lookup_rota(team: str) -> str:
        """Who is on call for a team, and at which address."""
        return json.dumps({"team": team[:64], "on_call": "Sam", "email": RECIPIENT})

    @function_tool
    async def send_email(ctx: ToolContext[Run], to: str, subject: str) -> str:
        """Send an e-mail. It cannot be unsent: send each message once."""
        run = ctx.context
        arguments = {"to": to, "subject": subject}
        key = effect_key(run.run_id, ctx.tool_name, arguments)
        record, first = effects.perform(
            key,
            {
                "effect": ctx.tool_name,
                "run": run.name,
                "run_id": run.run_id,
                "tool_call_id": ctx.tool_call_id,
                "arguments": {k: v[:500] for k, v in arguments.items()},  # model output: bounded
            },
        )
        run.report.effects.append(
            {"key": key, "first_time": first, "tool_call_id": ctx.tool_call_id}
        )
        if not first:
            _say(f"run {run.name}: {ctx.tool_name} {key} already done; not repeated")
        return json.dumps(
            {"status": "sent" if first else "already_sent", "key": key, "at": record["at"]}
        )

    return [lookup_rota, send_email]


@dataclass
class Settings:
    service: str
    model: str
    runs: int
    run_prefix: str
    run_gap_s: float
    retry_from: Literal["failed_point", "start"]
    command_timeout_s: float
    pause_timeout_s: float
    run_timeout_s: float
    max_turns: int


@dataclass(frozen=True, slots=True)
class Step:
    """What one command says to do."""

    kind: Literal["go", "pause", "abort", "noted", "ignored", "stale"]
    model: str = ""
    from_start: bool = False
    reason: str = ""


class SdkAgent:
    """Runs the Agents SDK agent; on a failure, waits for the sidecar's command (see the module)."""

    def __init__(
        self,
        settings: Settings,
        client: openai.AsyncOpenAI,
        tracer: trace.Tracer,
        router: Router,
        effects: EffectLog,
    ) -> None:
        self.settings = settings
        self.client = client
        self.tracer = tracer
        self.router = router
        self.effects = effects
        self.reports: list[RunReport] = []
        self.agent: Agent[Run] = Agent[Run](
            name="oncall-notifier",
            instructions="You are an operations assistant. Look up who is on call when you"
            " need to, and tell them what the user asks, by e-mail.",
            tools=list(build_tools(effects)),
        )
        self._models: dict[str, OpenAIChatCompletionsModel] = {}

    def _model(self, name: str) -> OpenAIChatCompletionsModel:
        found = self._models.get(name)
        if found is None:
            if len(self._models) >= 32:  # bounded: fallbacks come from the sidecar
                self._models.clear()
            found = self._models[name] = OpenAIChatCompletionsModel(
                model=name, openai_client=self.client
            )
        return found

    # -- one run --------------------------------------------------------------------

    async def run(self, number: int) -> RunReport:
        name = f"{self.settings.run_prefix}-{number}"
        run_id = f"{name}-{os.urandom(4).hex()}"  # unique across restarts of the agent
        started = time.monotonic()
        report = RunReport(name, run_id)
        self.reports.append(report)
        ask: TResponseInputItem = {
            "role": "user",
            "content": f"Run {name}: tell the on-call team about incident {number}:"
            " the nightly backup did not finish.",
        }
        run = Run(
            report=report,
            inbox=asyncio.Queue(),
            deadline=started + self.settings.run_timeout_s,
            model=self.settings.model,  # each run starts on the primary model
            original_input=[ask],
            session=SQLiteSession(run_id),  # in memory: the conversation so far, per turn
        )
        self.router.open(run)
        _say(f"run {name} ({run_id}) starts on {run.model}")
        try:
            # Every span of every attempt names the run: the sidecar's run id.
            with using_session(run_id):
                await self._until_done(run)
            report.status = "completed"
        except RunEnded as ended:
            report.status, report.reason = "aborted", str(ended)
        finally:
            for late in self.router.close(run):
                if len(report.commands) < MAX_COMMANDS_KEPT:
                    report.commands.append({**_brief(late, None), "acted": "late"})
                await self.router.ack(late.command)
            run.session.close()
            report.duration_s = round(time.monotonic() - started, 3)
        _say(f"run {name}: {report.status} in {report.duration_s}s {report.reason}".rstrip())
        return report

    async def _until_done(self, run: Run) -> None:
        """Attempt the run until it completes, as the sidecar's commands direct."""
        input_items, from_start = list(run.original_input), True
        while True:
            try:
                result = await self._attempt(run, input_items, from_start)
            except AbortRequested as abort:
                raise RunEnded(str(abort)) from None
            except UserError:
                raise  # a mistake in this program: no command from the sidecar fixes it
            except (openai.APIError, AgentsException) as exc:
                failed_at = time.monotonic()
                status = getattr(exc, "status_code", None)
                run.report.failures.append(
                    {
                        "attempt": len(run.report.attempts),
                        "model": run.model,
                        "trace_id": run.failed_trace,
                        "error": type(exc).__name__,
                        "status_code": status,
                        "wall": round(time.time(), 3),
                    }
                )
                _say(
                    f"run {run.name}: {type(exc).__name__}{f' ({status})' if status else ''}"
                    f" from {run.model}; waiting for the sidecar"
                )
                step = await self._await_go(run, failed_at=failed_at, paused=False)
                if step.kind == "abort":
                    raise RunEnded(step.reason) from None
                if step.model:
                    run.model = step.model  # a fallback lasts for the rest of the run
                from_start = step.from_start
                guidance = self._take_guidance(run)
                if from_start:
                    # A fresh conversation: the run's tools will run again, and the
                    # effect ledger is what keeps their effects from happening twice.
                    run.session.close()
                    run.session = SQLiteSession(f"{run.run_id}/{len(run.report.attempts) + 1}")
                    input_items = [*run.original_input, *guidance]
                else:
                    input_items = guidance  # the session holds the conversation so far
                continue
            run.report.output = str(result.final_output)[:MAX_OUTPUT_CHARS]
            return

    async def _attempt(
        self, run: Run, input_items: list[TResponseInputItem], from_start: bool
    ) -> RunResult:
        """One ``Runner.run``, in a span of the agent's own that names the attempt."""
        number = len(run.report.attempts) + 1
        entry: dict[str, Any] = {
            "attempt": number,
            "model": run.model,
            "from": "start" if from_start else "failed_point",
        }
        run.report.attempts.append(entry)
        run.report.use(run.model)
        started = time.monotonic()
        with self.tracer.start_as_current_span(
            f"agent_run {run.name}",
            attributes={
                "openinference.span.kind": "CHAIN",
                "session.id": run.run_id,
                "agent.run.name": run.name,
                "agent.run.attempt": number,
                "agent.run.model": run.model,
            },
            # OK whatever happens: the SDK's spans below carry the failure, and an
            # ERROR here would be one more incident about the same thing.
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            trace_id = format_trace_id(span.get_span_context().trace_id)
            entry["trace_id"] = trace_id
            run.traces.append(trace_id)
            self.router.alias(trace_id, run)
            try:
                result = await Runner.run(
                    self.agent,
                    input_items,
                    context=run,
                    session=run.session,
                    max_turns=self.settings.max_turns,
                    run_config=RunConfig(
                        model=self._model(run.model),
                        workflow_name=self.settings.service,
                        group_id=run.run_id,
                        trace_include_sensitive_data=True,
                        call_model_input_filter=self._between_calls,
                    ),
                )
            except BaseException as exc:
                run.failed_trace = trace_id
                entry["outcome"] = (
                    "aborted"
                    if isinstance(exc, AbortRequested)
                    else "cancelled"
                    if isinstance(exc, asyncio.CancelledError)
                    else "failed"
                )
                entry["error"] = type(exc).__name__
                raise
            finally:
                entry["duration_s"] = round(time.monotonic() - started, 3)
            entry["outcome"] = "completed"
            span.set_attribute("agent.run.outcome", "completed")
            return result

    # -- commands ---------------------------------------------------------------------

    async def _between_calls(self, data: CallModelData[Run]) -> ModelInputData:
        """Before each model call: commands that came while the run was going well."""
        run, model_data = data.context, data.model_data
        if run is None:
            return model_data
        while not run.inbox.empty():
            arrival = run.inbox.get_nowait()
            step = self._act(run, arrival, failed_at=None, paused=False)
            await self.router.ack(arrival.command)
            if step.kind == "pause":
                try:
                    step = await self._await_go(run, failed_at=None, paused=True)
                except RunEnded as ended:
                    raise AbortRequested(str(ended)) from None
            if step.kind == "abort":
                raise AbortRequested(step.reason)
        model_data.input.extend(self._take_guidance(run))
        return model_data

    def _take_guidance(self, run: Run) -> list[TResponseInputItem]:
        items: list[TResponseInputItem] = [
            {"role": "developer", "content": f"{GUIDANCE_MARK} {text}"} for text in run.guidance
        ]
        run.guidance.clear()
        return items

    async def _await_go(self, run: Run, *, failed_at: float | None, paused: bool) -> Step:
        """Wait, bounded, for the command that says go on (or stop); return it."""
        limit = self.settings.pause_timeout_s if paused else self.settings.command_timeout_s
        until = min(time.monotonic() + limit, run.deadline)
        while True:
            left = until - time.monotonic()
            if left <= 0:
                what = "resume_run or approval_result" if paused else "command"
                why = "the run's deadline" if until >= run.deadline else f"{limit:g}s"
                _say(
                    f"run {run.name}: no {what} from the sidecar within {why}; giving up"
                    " (is the sidecar running, with a pull channel for this service?)"
                )
                raise RunEnded(f"no {what} from the sidecar within {why}")
            try:
                arrival = await asyncio.wait_for(run.inbox.get(), timeout=left)
            except asyncio.TimeoutError:
                continue
            step = self._act(run, arrival, failed_at=failed_at, paused=paused)
            await self.router.ack(arrival.command)
            if step.kind in ("go", "abort"):
                return step
            if step.kind == "pause" and not paused:
                paused = True
                until = min(time.monotonic() + self.settings.pause_timeout_s, run.deadline)

    def _act(self, run: Run, arrival: Arrival, *, failed_at: float | None, paused: bool) -> Step:
        """What one command means for the run now (see the module's table); recorded."""
        brief = _brief(arrival, failed_at)
        if len(run.report.commands) < MAX_COMMANDS_KEPT:
            run.report.commands.append(brief)
        step = self._meaning(run, arrival.command, waiting=failed_at is not None or paused)
        brief["acted"] = {"go": "retried", "abort": "aborted"}.get(step.kind, step.kind)
        if step.kind == "go" and step.model:
            brief["acted"] = "switched"
        if step.kind == "go" and failed_at is None:
            brief["acted"] = "resumed"
        after = brief["after_failure_s"]
        _say(
            f"run {run.name}: {_clean(arrival.command.type)} {_clean(arrival.command.id)}"
            f"{f' {after}s after the failure' if after is not None else ''}: {brief['acted']}"
            f"{f' ({step.reason})' if step.reason else ''}"
        )
        return step

    def _meaning(self, run: Run, command: Command, *, waiting: bool) -> Step:
        kind, params = command.type, command.params
        if kind == "abort_run":
            why = _clean(params.get("reason", ""))
            return Step("abort", reason=f"abort_run: {why}".rstrip(": "))
        if kind == "inject_guidance":
            text = params.get("guidance")
            if not isinstance(text, str) or not text.strip():
                return Step("ignored", reason="no guidance in it")
            if len(run.guidance) >= MAX_GUIDANCE_HELD:
                run.guidance.pop(0)  # the newest guidance matters most
            run.guidance.append(text.strip()[:MAX_GUIDANCE_CHARS])
            return Step("noted")
        if kind in TRIGGERED and waiting and run.traces:
            # After a failure the latest attempt is the one that failed; while paused
            # mid-attempt it is the one that was paused.
            trigger = command.trigger_trace_id
            if trigger and trigger != run.traces[-1]:
                return Step("stale", reason="about an earlier attempt")
        if kind == "pause_run":
            return Step("pause", reason=_clean(params.get("awaiting", "")))
        if not waiting:
            return Step("ignored", reason="the run is not failing")
        from_start = self.settings.retry_from == "start"
        if kind in ("retry_step", "resume_run"):
            return Step("go", from_start=from_start)
        if kind == "rewind_run":
            return Step("go", from_start=True)
        if kind == "switch_fallback":
            target = _clean(params.get("to", ""), 256)
            provider, _, fallback = target.rpartition(":")
            if provider not in ("", "openai") or not fallback:
                return Step(
                    "abort", reason=f"cannot switch to {target!r}: this agent speaks openai"
                )
            return Step("go", model=fallback, from_start=from_start)
        if kind == "approval_result":
            by = _clean(params.get("answered_by", "?"))
            if params.get("approved") is True:
                return Step("go", from_start=from_start, reason=f"approved by {by}")
            return Step("abort", reason=f"approval denied by {by}")
        return Step("ignored", reason="not something this agent does")


# -- wiring ---------------------------------------------------------------------------


def _tracer_provider(service: str, delay_ms: int) -> TracerProvider:
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


@contextlib.contextmanager
def _instrumented(provider: TracerProvider) -> Iterator[None]:
    # The SDK's default processor uploads traces to OpenAI: drop it before the
    # instrumentor registers its own, so that uninstrumenting cannot bring it back.
    set_trace_processors([])
    instrumentor = OpenAIAgentsInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield
    finally:
        instrumentor.uninstrument()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="An OpenAI Agents SDK agent, instrumented with OpenInference, that takes"
        " spanvisor's commands over the pull channel. The model is reached at OPENAI_BASE_URL"
        " with OPENAI_API_KEY; spans go to OTEL_EXPORTER_OTLP_ENDPOINT (OTLP/HTTP).",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--service",
        default=os.environ.get("OTEL_SERVICE_NAME") or "agents-sdk-agent",
        help="service.name of the spans, and the service whose commands are pulled"
        " (default: OTEL_SERVICE_NAME, else agents-sdk-agent)",
    )
    parser.add_argument("--model", default="gpt-4o", help="the primary model (default gpt-4o)")
    parser.add_argument("--runs", type=int, default=1, help="runs to make, one after the other")
    parser.add_argument("--run-prefix", default="run", help="runs are named PREFIX-1, PREFIX-2...")
    parser.add_argument("--run-gap-s", type=float, default=0.0, help="pause between runs (0)")
    parser.add_argument(
        "--retry-from",
        choices=["failed_point", "start"],
        default="failed_point",
        help="where retry_step / resume_run / switch_fallback take a run up again (failed_point)",
    )
    parser.add_argument(
        "--spanvisor-url",
        default=None,
        help="the sidecar's control API (default: found as the spanvisor CLI finds it:"
        " SPANVISOR_API_URL, SPANVISOR_API_PORT, SPANVISOR_CONFIG...); its token comes from"
        " SPANVISOR_API_TOKEN, else the sidecar's token file (~/.spanvisor/api-token)",
    )
    parser.add_argument(
        "--poll-wait-s",
        type=float,
        default=5.0,
        help="how long one long poll waits for a command (5, at most 30); stopping the agent"
        " waits for the poll in flight",
    )
    parser.add_argument("--effects", type=Path, help="JSON-lines file of side effects (outbox)")
    parser.add_argument("--summary", type=Path, help="write the JSON summary here at the end")
    parser.add_argument(
        "--command-timeout-s",
        type=float,
        default=30.0,
        help="how long a failed run waits for the sidecar's command (30)",
    )
    parser.add_argument(
        "--pause-timeout-s",
        type=float,
        default=120.0,
        help="how long a paused run waits for resume_run or approval_result (120)",
    )
    parser.add_argument(
        "--run-timeout-s", type=float, default=300.0, help="a run's deadline, waits included"
    )
    parser.add_argument("--max-turns", type=int, default=10, help="the SDK's max_turns (10)")
    parser.add_argument(
        "--llm-timeout-s", type=float, default=10.0, help="timeout of each model call (10)"
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


async def _serve(args: argparse.Namespace, settings: Settings) -> list[RunReport]:
    """Run the runs with the poller going; write the summary however it ends."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    if main_task is not None:  # SIGTERM: unwind through the finally blocks (summary, flush)
        loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    effects = EffectLog(args.effects)
    puller = CommandPuller(settings.service, args.spanvisor_url)
    router = Router(puller)
    poller = Poller(puller, router, loop, min(max(args.poll_wait_s, 0.0), 30.0))
    provider = _tracer_provider(settings.service, args.export_delay_ms)
    client = openai.AsyncOpenAI(max_retries=0, timeout=args.llm_timeout_s)
    # Anything that would use the SDK's default client gets ours (no SDK retries), and
    # it is never used to upload traces.
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("chat_completions")
    agent = SdkAgent(settings, client, provider.get_tracer("agents_sdk_agent"), router, effects)
    _say(
        f"{settings.service}: pulling commands from {puller.base_url},"
        f" {settings.runs} run(s) on {settings.model}"
    )
    started = time.time()
    poller.start()
    try:
        with _instrumented(provider):
            for number in range(1, settings.runs + 1):
                if number > 1 and settings.run_gap_s > 0:
                    await asyncio.sleep(settings.run_gap_s)
                await agent.run(number)
    except asyncio.CancelledError:
        _say("stopping: SIGTERM")
    finally:
        # The poll in flight may bring commands about runs that just ended (a failure
        # can lead to several): let it end, then acknowledge what it brought, so the
        # sidecar does not hand them out again. Bounded by the poll's own timeouts.
        stopped = await asyncio.to_thread(poller.stop, poller.wait_s + puller.timeout_s + 1)
        await asyncio.sleep(0)  # what the poller handed over runs on the loop now
        await router.settle(5.0)
        if stopped:
            puller.close()  # else the sidecar hangs; the daemon thread dies with us
        provider.shutdown()  # flushes the last spans
        await client.close()
        if args.summary is not None:
            for report in agent.reports:
                if report.status == "running":  # cut short (SIGTERM, a crash)
                    report.status, report.reason = "aborted", "the agent stopped mid-run"
            _write_summary(
                args.summary,
                {
                    "service": settings.service,
                    "primary_model": settings.model,
                    "started_wall": round(started, 3),
                    "runs": [asdict(r) for r in agent.reports],
                    "pull": {
                        "received": router.received,
                        "duplicates": router.duplicates,
                        "malformed": puller.malformed,
                        "acked": router.acked,
                        "ack_refused": router.ack_refused,
                        "unmatched": router.unmatched,
                        "unmatched_kept": router.unmatched_kept,
                        "error": poller.error,
                    },
                    "effects": {
                        "path": str(args.effects) if args.effects else None,
                        "sent": effects.sent,
                        "deduplicated": effects.deduplicated,
                    },
                },
            )
    return agent.reports


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="agents-sdk-agent: %(message)s")
    log.setLevel(logging.INFO)  # our own lines; the libraries' only from warnings up
    if not os.environ.get("OPENAI_API_KEY"):
        print(
            "agents_sdk_agent: set OPENAI_API_KEY (any value for a fake provider)", file=sys.stderr
        )
        return 2
    if args.runs < 1 or args.max_turns < 1:
        print("agents_sdk_agent: --runs and --max-turns must be at least 1", file=sys.stderr)
        return 2
    settings = Settings(
        service=args.service,
        model=args.model,
        runs=args.runs,
        run_prefix=args.run_prefix,
        run_gap_s=args.run_gap_s,
        retry_from=args.retry_from,
        command_timeout_s=args.command_timeout_s,
        pause_timeout_s=args.pause_timeout_s,
        run_timeout_s=args.run_timeout_s,
        max_turns=args.max_turns,
    )
    reports = asyncio.run(_serve(args, settings))
    completed = sum(r.status == "completed" for r in reports)
    _say(f"{completed} of {settings.runs} run(s) completed")
    return 0 if completed == settings.runs else 1


if __name__ == "__main__":
    sys.exit(main())
