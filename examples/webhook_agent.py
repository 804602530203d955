"""An ordinary tool-using agent, plus a webhook on which spanvisor tells it what to do.

The agent half is what any agent looks like: the real ``openai`` client with its
own retries off (``max_retries=0``: the sidecar decides what happens after a
failure, not the SDK), instrumented with OpenTelemetry's GenAI instrumentation
(``opentelemetry-instrumentation-openai-v2``, with ``opentelemetry-util-genai>=1.1b0,<1.2``
beside it: its 2.4b0 imports ``opentelemetry.util.genai.instruments``, which 1.2
removed; the ``test`` extra pins it so), exporting spans over OTLP/HTTP to
``OTEL_EXPORTER_OTLP_ENDPOINT`` (the sidecar) under the service name
``--service`` (default ``OTEL_SERVICE_NAME``). Each run is a root span
(``invoke_agent``), so its trace id is the run id the sidecar writes in the
commands it sends about that run. A step asks the model (offering the tool
``send_email``), runs the tool the model calls and asks the model again with
the tool's result.

The webhook half: a small HTTP server on ``127.0.0.1:--webhook-port``.
``POST /commands`` takes spanvisor's commands: the Standard Webhooks signature
is checked with the shared secret (``supervisor.client.verify_webhook``),
redeliveries are dropped by idempotency key (``SeenCommands``) and each command
goes to the run it names. ``GET /status`` says what each run is doing.

The agent never retries on its own. When a step fails it waits, bounded, for
the sidecar's command and acts on it:

==================  ===========================================================
retry_step          retry the failed step now (the sidecar already waited)
switch_fallback     use ``params.to`` as the model for the rest of the run,
                    and retry the step
pause_run           wait (``--pause-timeout-s``) for resume_run or
                    approval_result
resume_run          retry the failed step
approval_result     approved: retry the step; denied: the run ends aborted
abort_run           the run ends aborted
==================  ===========================================================

A fallback lasts for the rest of the run; each new run starts on the primary
model again. That is how the agent returns to it after an outage: during one,
a new run pays one failed call and the sidecar, whose breaker is open, answers
it at once with ``switch_fallback``; once the provider is back, the new runs'
calls are the successes that half-open and close the sidecar's breaker.

A retried step is replayed from its start (the conversation is rewound to it),
so its tool runs again. The tool's side effect is recorded in ``--effects``
(JSON lines) under an idempotency key made of the run id and the step; a second
attempt at the same effect finds the key and returns the first result instead
of sending again. At the end, ``--summary`` gets a JSON report: per run its
status, steps, failures, the models used and every command received, with its
arrival time relative to the failure it answers.

Run it next to a sidecar (commands reach it only if the sidecar's settings name
its webhook: ``agents: {webhook-agent: {webhook: {url:
http://127.0.0.1:8787/commands, secret: ...}}}``):

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=sk-fake \\
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 AGENT_WEBHOOK_SECRET=<16+ chars> \\
    python examples/webhook_agent.py --runs 2 --steps 3 --summary summary.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

import openai
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import format_trace_id

from supervisor.client import SeenCommands, SignatureError, verify_webhook

SECRET_ENV = "AGENT_WEBHOOK_SECRET"
#: Largest command body the webhook reads (a command is well under 4 KiB).
MAX_COMMAND_BYTES = 64 * 1024
TOOL_NAME = "send_email"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Send an e-mail. It cannot be unsent: each step sends at most one.",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
                "required": ["to", "subject"],
            },
        },
    }
]

log = logging.getLogger("webhook_agent")


def _say(message: str) -> None:
    """One human-readable line on stderr: what the agent does and why."""
    log.info(message)


# -- side effects, once each ----------------------------------------------------------


class EffectLog:
    """Side effects recorded by idempotency key in a JSON-lines file (the agent's outbox).

    The record is the effect here (a fake outbox), so writing it is sending.
    A real tool would pass the key to the service it calls (most payment and
    mail APIs take an ``Idempotency-Key``) or record it in the same transaction.
    The file is read at start, so a restarted agent does not repeat an effect
    either. Used from the agent's main thread only.
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


# -- commands, routed to runs -----------------------------------------------------------


@dataclass
class Arrival:
    """A command as the webhook received it."""

    command: dict[str, Any]
    at: float  # time.monotonic()
    wall: float


@dataclass
class RunView:
    """What ``GET /status`` shows of a run."""

    name: str
    run_id: str
    state: str = "running"  # running | waiting | paused | completed | aborted
    step: int = 0


class Router:
    """Hands each verified command to the run it names; thread-safe.

    A command for no current run (the run ended, or it is not this agent's) is
    answered 200 all the same: it was received, and a redelivery would not
    help. It is kept, bounded, for the summary.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.Queue[Arrival]] = {}
        self._views: dict[str, RunView] = {}
        self.seen = SeenCommands()
        self.received = 0
        self.duplicates = 0
        self.rejected = 0
        self.unmatched: list[dict[str, Any]] = []

    def open(self, view: RunView) -> queue.Queue[Arrival]:
        inbox: queue.Queue[Arrival] = queue.Queue()
        with self._lock:
            self._inboxes[view.run_id] = inbox
            self._views[view.run_id] = view
        return inbox

    def close(self, run_id: str) -> None:
        with self._lock:
            self._inboxes.pop(run_id, None)

    def deliver(self, command: dict[str, Any]) -> str:
        arrival = Arrival(command, time.monotonic(), time.time())
        with self._lock:
            self.received += 1
            inbox = self._inboxes.get(str(command.get("run_id", "")))
            if inbox is None:
                if len(self.unmatched) < 100:
                    self.unmatched.append(_brief(arrival, None))
                return "unmatched"
            inbox.put(arrival)
            return "queued"

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(view) for view in self._views.values()]


def _brief(arrival: Arrival, failed_at: float | None) -> dict[str, Any]:
    """What the summary keeps of a command."""
    command = arrival.command
    failure = command.get("failure")
    params = command.get("params")
    kept = ("to", "approved", "delay_s", "retry_after_s", "breaker", "awaiting", "attempt")
    return {
        "type": command.get("type"),
        "id": command.get("id"),
        "failure_kind": failure.get("kind") if isinstance(failure, dict) else None,
        "failure_dependency": failure.get("dependency") if isinstance(failure, dict) else None,
        "params": {k: params[k] for k in kept if isinstance(params, dict) and k in params},
        "not_before": command.get("not_before"),
        "received_wall": round(arrival.wall, 3),
        "after_failure_s": None if failed_at is None else round(arrival.at - failed_at, 3),
    }


class _WebhookServer(ThreadingHTTPServer):
    daemon_threads = True
    secret: str
    router: Router


class _WebhookHandler(BaseHTTPRequestHandler):
    """``POST /commands`` (signed commands) and ``GET /status``."""

    server: _WebhookServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return  # the agent logs what it does with each command instead

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/status":
            self._json(404, {"error": "GET /status or POST /commands"})
            return
        self._json(200, {"runs": self.server.router.status()})

    def do_POST(self) -> None:
        router = self.server.router
        if self.path.split("?", 1)[0] != "/commands":
            self._json(404, {"error": "commands go to POST /commands"})
            return
        try:
            length = int(self.headers.get("content-length", ""))
        except ValueError:
            self.close_connection = True
            self._json(411, {"error": "content-length required"})
            return
        if not 0 <= length <= MAX_COMMAND_BYTES:
            self.close_connection = True
            self._json(413, {"error": f"a command is at most {MAX_COMMAND_BYTES} bytes"})
            return
        body = self.rfile.read(length)
        try:
            command = verify_webhook(self.server.secret, dict(self.headers.items()), body)
        except SignatureError as exc:
            router.rejected += 1
            _say(f"webhook: refused a command whose signature does not hold ({exc})")
            self._json(401, {"error": f"bad signature: {exc}"})
            return
        except ValueError as exc:
            router.rejected += 1
            self._json(400, {"error": str(exc)})
            return
        key = command.get("idempotency_key") or self.headers.get("idempotency-key")
        if not isinstance(key, str) or not key:
            self._json(400, {"error": "the command has no idempotency_key"})
            return
        if not router.seen.first_time(key):
            router.duplicates += 1
            _say(f"webhook: {command.get('type')} {command.get('id')} again; dropped")
            self._json(200, {"status": "duplicate"})
            return
        self._json(200, {"status": router.deliver(command)})

    def _json(self, status: int, payload: Mapping[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def start_webhook(port: int, secret: str, router: Router) -> _WebhookServer:
    """Serve the webhook on 127.0.0.1:``port`` in a daemon thread."""
    server = _WebhookServer(("127.0.0.1", port), _WebhookHandler)
    server.secret = secret
    server.router = router
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="webhook", daemon=True
    )
    thread.start()
    return server


# -- the agent ------------------------------------------------------------------------


class RunEnded(Exception):
    """The run cannot go on: aborted by a command, denied, or no command came in time."""


@dataclass
class Settings:
    service: str
    model: str
    runs: int
    steps: int
    run_prefix: str
    run_gap_s: float
    command_timeout_s: float
    pause_timeout_s: float
    run_timeout_s: float


@dataclass
class RunReport:
    """One run, as the summary shows it."""

    name: str
    run_id: str
    status: str = "running"
    reason: str = ""
    duration_s: float = 0.0
    models_used: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)

    def use(self, model: str) -> None:
        if model not in self.models_used:
            self.models_used.append(model)


@dataclass
class Run:
    """One run in progress: its report, its inbox, its conversation and its deadline."""

    report: RunReport
    view: RunView
    inbox: queue.Queue[Arrival]
    deadline: float
    messages: list[Any] = field(default_factory=list)


@dataclass
class Next:
    """What a command says to do after a failure: retry (with this model), or wait on."""

    retry: bool
    model: str = ""


class Agent:
    """Runs the steps; on a failure, waits for the sidecar's command (see the module)."""

    def __init__(
        self,
        settings: Settings,
        client: openai.OpenAI,
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

    def run(self, number: int) -> RunReport:
        name = f"{self.settings.run_prefix}-{number}"
        started = time.monotonic()
        with self.tracer.start_as_current_span(
            f"invoke_agent {self.settings.service}",
            record_exception=False,
            set_status_on_exception=False,
        ) as root:
            # The run's trace id is its run id: the sidecar names it in every command.
            run_id = format_trace_id(root.get_span_context().trace_id)
            root.set_attribute("gen_ai.operation.name", "invoke_agent")
            root.set_attribute("gen_ai.agent.name", self.settings.service)
            root.set_attribute("agent.run.name", name)
            report = RunReport(name, run_id)
            self.reports.append(report)
            view = RunView(name, run_id)
            run = Run(report, view, self.router.open(view), started + self.settings.run_timeout_s)
            run.messages.append({"role": "system", "content": "You are an operations assistant."})
            _say(f"run {name} ({run_id}) starts on {self.settings.model}")
            model = self.settings.model  # each run starts on the primary model
            try:
                for step in range(self.settings.steps):
                    view.step = step
                    self._between_steps(run)
                    model = self._step(run, step, model)
                report.status = "completed"
            except RunEnded as ended:
                report.status, report.reason = "aborted", str(ended)
            finally:
                self.router.close(run_id)
                while not run.inbox.empty():  # came too late to matter; kept for the record
                    late = _brief(run.inbox.get_nowait(), None)
                    report.commands.append({**late, "acted": "late"})
                view.state = report.status
                report.duration_s = round(time.monotonic() - started, 3)
                root.set_attribute("agent.run.status", report.status)
                # The root span stays OK even when the run was aborted: the sidecar
                # already has the failure that caused it; an ERROR here would be a
                # second incident about the same thing.
        _say(f"run {name}: {report.status} in {report.duration_s}s {report.reason}".rstrip())
        return report

    def _between_steps(self, run: Run) -> None:
        """Commands that came while no step was failing: an operator's pause or abort."""
        while True:
            try:
                arrival = run.inbox.get_nowait()
            except queue.Empty:
                return
            brief = _brief(arrival, None)
            run.report.commands.append(brief)
            kind = arrival.command.get("type")
            if kind == "abort_run":
                brief["acted"] = "aborted"
                raise RunEnded("abort_run received between steps")
            if kind == "pause_run":
                brief["acted"] = "paused"
                self._wait(run, time.monotonic(), "", paused=True)
            else:
                brief["acted"] = "ignored"
                _say(f"run {run.report.name}: {kind} while no step is failing; ignored")

    def _step(self, run: Run, step: int, model: str) -> str:
        """Do one step until it succeeds (as the sidecar directs); return the model in use."""
        report = run.report
        start = len(run.messages)
        entry: dict[str, Any] = {"step": step, "attempts": 0, "models": [], "effects": []}
        report.steps.append(entry)
        while True:
            entry["attempts"] += 1
            if model not in entry["models"]:
                entry["models"].append(model)
            report.use(model)
            del run.messages[start:]  # a retry replays the step from its start
            try:
                self._attempt(run, entry, step, model)
            except openai.APIError as exc:
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
                    f"run {report.name} step {step}: {type(exc).__name__}"
                    f"{f' ({status})' if status else ''} from {model}; waiting for the sidecar"
                )
                model = self._wait(run, failed_at, model)
                continue
            entry["model"] = model
            run.view.state = "running"
            return model

    def _attempt(self, run: Run, entry: dict[str, Any], step: int, model: str) -> None:
        """One try at a step: ask the model, run the tool it calls, ask again. Raises APIError."""
        messages = run.messages
        with self.tracer.start_as_current_span(
            f"step {step}", record_exception=False, set_status_on_exception=False
        ) as span:
            # No error status or exception event here: the LLM span that failed
            # is the failure; a failing parent would only repeat it.
            span.set_attribute("agent.step", step)
            span.set_attribute("agent.step.attempt", entry["attempts"])
            span.set_attribute("agent.step.outcome", "failed")
            messages.append(
                {
                    "role": "user",
                    "content": f"Step {step} of run {run.report.name}: tell the on-call team"
                    f" about item {step}.",
                }
            )
            reply = self.client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            calls = [c for c in message.tool_calls or [] if getattr(c, "function", None)]
            if calls:
                for call in calls:
                    output = self._tool(run.report, entry, step, call)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
                reply = self.client.chat.completions.create(
                    model=model, messages=messages, tools=TOOLS
                )
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            span.set_attribute("agent.step.outcome", "done")

    def _tool(self, report: RunReport, entry: dict[str, Any], step: int, call: Any) -> str:
        name = call.function.name
        with self.tracer.start_as_current_span(f"execute_tool {name}") as span:
            span.set_attribute("gen_ai.operation.name", "execute_tool")
            span.set_attribute("gen_ai.tool.name", name)
            span.set_attribute("gen_ai.tool.call.id", call.id)
            if name != TOOL_NAME:
                output = json.dumps({"status": "unknown_tool", "tools": [TOOL_NAME]})
            else:
                try:
                    args = json.loads(call.function.arguments or "{}")
                except ValueError:
                    args = {}
                args = args if isinstance(args, dict) else {}
                # The key names the effect, not the attempt: the step's e-mail, whatever
                # the model wrote in it this time.
                key = f"{report.run_id}/step-{step}/{name}"
                record, first = self.effects.perform(
                    key,
                    {
                        "effect": name,
                        "run": report.name,
                        "run_id": report.run_id,
                        "step": step,
                        "arguments": args,
                    },
                )
                entry["effects"].append({"key": key, "first_time": first})
                span.set_attribute("agent.effect.key", key)
                span.set_attribute("agent.effect.first_time", first)
                if not first:
                    _say(f"run {report.name} step {step}: {name} already done; not repeated")
                output = json.dumps(
                    {"status": "sent" if first else "already_sent", "key": key, "at": record["at"]}
                )
            span.set_attribute("gen_ai.tool.call.result", output)
            return output

    def _wait(self, run: Run, failed_at: float, model: str, *, paused: bool = False) -> str:
        """Wait, bounded, for the command that says what to do; return the model to retry with."""
        report = run.report
        limit = self.settings.pause_timeout_s if paused else self.settings.command_timeout_s
        until = min(time.monotonic() + limit, run.deadline)
        run.view.state = "paused" if paused else "waiting"
        while True:
            left = until - time.monotonic()
            if left <= 0:
                what = "resume_run or approval_result" if paused else "command"
                why = "the run's deadline" if until >= run.deadline else f"{limit:g}s"
                _say(
                    f"run {report.name}: no {what} from the sidecar within {why}; giving up"
                    " (is the sidecar running, and is this agent's webhook in its settings?)"
                )
                raise RunEnded(f"no {what} from the sidecar within {why}")
            try:
                arrival = run.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            brief = _brief(arrival, failed_at)
            report.commands.append(brief)
            decided = self._act(run, arrival.command, brief, model)
            if decided.retry:
                return decided.model
            if brief["acted"] == "paused" and not paused:
                paused = True
                limit = self.settings.pause_timeout_s
                until = min(time.monotonic() + limit, run.deadline)

    def _act(self, run: Run, command: dict[str, Any], brief: dict[str, Any], model: str) -> Next:
        """Carry out one command received after a failure (see the module's table)."""
        name = run.report.name
        kind = command.get("type")
        params = command.get("params")
        params = params if isinstance(params, dict) else {}
        after = brief["after_failure_s"]
        if kind in ("retry_step", "resume_run"):
            brief["acted"] = "retried"
            _say(f"run {name}: {kind} {after}s after the failure; retrying")
            return Next(retry=True, model=model)
        if kind == "switch_fallback":
            target = str(params.get("to", ""))
            provider, _, fallback = target.rpartition(":")
            if provider not in ("", "openai") or not fallback:
                brief["acted"] = "aborted"
                raise RunEnded(f"cannot switch to {target!r}: this agent only speaks openai")
            brief["acted"] = "switched"
            _say(f"run {name}: switch_fallback to {fallback} {after}s after the failure")
            return Next(retry=True, model=fallback)
        if kind == "pause_run":
            brief["acted"] = "paused"
            run.view.state = "paused"
            _say(f"run {name}: paused, awaiting {params.get('awaiting', 'resume_run')}")
            return Next(retry=False)
        if kind == "approval_result":
            by = params.get("answered_by", "?")
            if params.get("approved") is True:
                brief["acted"] = "retried"
                _say(f"run {name}: approved by {by}; retrying")
                return Next(retry=True, model=model)
            brief["acted"] = "aborted"
            raise RunEnded(f"approval denied by {by}")
        if kind == "abort_run":
            brief["acted"] = "aborted"
            raise RunEnded(f"abort_run: {params.get('reason', '')}".rstrip(": "))
        brief["acted"] = "ignored"
        _say(f"run {name}: {kind} is not something this agent can do; ignored")
        return Next(retry=False)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="An instrumented tool-using agent that takes spanvisor's commands on a"
        " webhook. The model is reached at OPENAI_BASE_URL with OPENAI_API_KEY; spans go to"
        " OTEL_EXPORTER_OTLP_ENDPOINT (OTLP/HTTP).",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--service",
        default=os.environ.get("OTEL_SERVICE_NAME") or "webhook-agent",
        help="service.name of the spans; the sidecar's settings route commands by it"
        " (default: OTEL_SERVICE_NAME, else webhook-agent)",
    )
    parser.add_argument("--model", default="gpt-4o", help="the primary model (default gpt-4o)")
    parser.add_argument("--runs", type=int, default=1, help="runs to make, one after the other")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (default 3)")
    parser.add_argument("--run-prefix", default="run", help="runs are named PREFIX-1, PREFIX-2...")
    parser.add_argument(
        "--run-gap-s", type=float, default=0.0, help="pause between runs (default 0)"
    )
    parser.add_argument(
        "--webhook-port", type=int, default=8787, help="port of the webhook on 127.0.0.1 (8787)"
    )
    parser.add_argument(
        "--webhook-secret",
        default=os.environ.get(SECRET_ENV),
        help=f"the webhook's signing secret, 16+ characters (default: ${SECRET_ENV})",
    )
    parser.add_argument("--effects", type=Path, help="JSON-lines file of side effects (outbox)")
    parser.add_argument("--summary", type=Path, help="write the JSON summary here at the end")
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
        help="how long a paused run waits for resume_run or approval_result (120)",
    )
    parser.add_argument(
        "--run-timeout-s", type=float, default=300.0, help="a run's deadline, waits included"
    )
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


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: summary, flush


@contextlib.contextmanager
def _instrumented(provider: TracerProvider) -> Iterator[None]:
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield
    finally:
        instrumentor.uninstrument()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="webhook-agent: %(message)s")
    log.setLevel(logging.INFO)  # our own lines; the libraries' only from warnings up
    # openai-v2 2.4b0 sets error.type to the exception class itself; the SDK
    # converts it to a string and warns on every failed call.
    logging.getLogger("opentelemetry.attributes").setLevel(logging.ERROR)
    if not args.webhook_secret or len(args.webhook_secret) < 16:
        print(
            f"webhook_agent: a webhook secret of 16+ characters is required"
            f" (--webhook-secret or ${SECRET_ENV}); it must match the sidecar's",
            file=sys.stderr,
        )
        return 2
    if not os.environ.get("OPENAI_API_KEY"):
        print("webhook_agent: set OPENAI_API_KEY (any value for a fake provider)", file=sys.stderr)
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
    )
    router = Router()
    effects = EffectLog(args.effects)
    try:
        webhook = start_webhook(args.webhook_port, args.webhook_secret, router)
    except OSError as exc:
        print(
            f"webhook_agent: cannot listen on 127.0.0.1:{args.webhook_port}: {exc}", file=sys.stderr
        )
        return 2
    provider = _tracer_provider(settings.service, args.export_delay_ms)
    tracer = provider.get_tracer("webhook_agent")
    agent = Agent(
        settings,
        openai.OpenAI(max_retries=0, timeout=args.llm_timeout_s),
        tracer,
        router,
        effects,
    )
    _say(
        f"{settings.service}: webhook on http://127.0.0.1:{args.webhook_port}/commands,"
        f" {settings.runs} run(s) of {settings.steps} step(s) on {settings.model}"
    )
    started = time.time()
    try:
        with _instrumented(provider):
            for number in range(1, settings.runs + 1):
                if number > 1 and settings.run_gap_s > 0:
                    time.sleep(settings.run_gap_s)
                agent.run(number)
    finally:
        provider.shutdown()  # flushes the last spans
        webhook.shutdown()
        webhook.server_close()
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
                    "webhook": {
                        "received": router.received,
                        "duplicates": router.duplicates,
                        "rejected": router.rejected,
                        "unmatched": router.unmatched,
                    },
                    "effects": {
                        "path": str(args.effects) if args.effects else None,
                        "sent": effects.sent,
                        "deduplicated": effects.deduplicated,
                    },
                },
            )
    completed = sum(r.status == "completed" for r in agent.reports)
    _say(f"{completed} of {settings.runs} run(s) completed")
    return 0 if completed == settings.runs else 1


if __name__ == "__main__":
    sys.exit(main())
