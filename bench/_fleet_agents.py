"""The agents of ``bench/fleet.py``: runs that hop between sidecars, as real agents export them.

Every run is a session (``session.id``) of a few steps; each step is one trace
(an AGENT span and its OpenInference LLM span) sent, as an OpenTelemetry SDK
sends it, by a ``BatchSpanProcessor`` and an ``OTLPSpanExporter``. There is one
``TracerProvider`` per sidecar, and trace number ``n`` of a session goes to
sidecar ``(crc32(session) + n) % 3``: a session's traces hop between the
sidecars, as behind a load balancer that does not pin sessions. A sidecar
taken out (killed) is skipped for new traces, as a load balancer's health
check does; spans already queued for it are lost with it.

One step of each run fails, in one of three ways the fleet's policy treats
differently: an HTTP 503 (retried: twice in a row), a 401 (escalated for
approval) or a timeout (remediated: a durable ``retry_step`` some seconds
later). The agent waits for its command, then sends the step again, which
succeeds, and goes on; a run is done after its last step. A few more runs
loop: they make the same tool call in each of :data:`LOOP_CALLS` traces,
which hop, so no sidecar sees the call :data:`LOOP_CALLS` times (fewer, even
with one sidecar taken out): only a fleet-wide view of the run can call it a
loop.

Commands arrive by signed webhook (Standard Webhooks) at one loopback server,
on ``/hooks/<instance>``, so each delivery names the sidecar that sent it. The
agents act on each ``Idempotency-Key`` once and answer 200 after ``ack_delay_s``
(an agent persisting the command before acknowledging it), which keeps some
deliveries in flight at any moment. Everything is recorded for the figures:
which spans each exporter got acknowledged, every delivery with its arrival
and answer times.
"""

from __future__ import annotations

import heapq
import json
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.trace import Status, StatusCode, Tracer

from supervisor.act import signing
from supervisor.testing.loopback import LoopbackHTTPServer, LoopbackServer

SERVICE = "fleet-agent"
SECRET = "fleet-bench-webhook-secret-0123"
#: What each kind of run's failing step raises, as the ``openai`` SDK's instrumentation records it.
ERRORS: Mapping[str, tuple[str, str]] = {
    "transient": (
        "openai.InternalServerError",
        "Error code: 503 - {'error': {'message': 'The server is overloaded',"
        " 'type': 'server_error'}}",
    ),
    "escalate": (
        "openai.AuthenticationError",
        "Error code: 401 - {'error': {'message': 'Incorrect API key provided',"
        " 'type': 'invalid_request_error', 'code': 'invalid_api_key'}}",
    ),
    "remediate": ("openai.APITimeoutError", "Request timed out."),
}
KINDS: tuple[str, ...] = tuple(ERRORS)
#: A looping run's calls: the policy's loop detector needs as many repeats.
LOOP_CALLS = 3
LOOP_ARGUMENTS = '{"query": "the same thing, again"}'
#: Failures in a row of the failing step, per kind (a 503 is retried twice).
FAILURES_IN_A_ROW: Mapping[str, int] = {"transient": 2, "escalate": 1, "remediate": 1}


def hop(session: str, trace_number: int, sidecars: int) -> int:
    """The sidecar (index) that trace ``trace_number`` of ``session`` is sent to."""
    return (zlib.crc32(session.encode()) + trace_number) % sidecars


@dataclass
class Run:
    """One agent run: a session of ``steps`` steps, one of which fails first."""

    index: int
    session: str
    #: transient | escalate | remediate (how its failing step fails), or loop
    kind: str
    fail_step: int
    steps: int
    failures_left: int
    step: int = 0
    traces: int = 0
    #: running | waiting (for its command) | done | aborted
    state: str = "running"

    @property
    def finished(self) -> bool:
        return self.state in ("done", "aborted")


@dataclass(frozen=True)
class FailureSent:
    """A failing span a run exported: where to and when."""

    trace_id: str
    span_id: str
    run: int
    target: str
    at: float


@dataclass(frozen=True)
class Export:
    """One export of a batch of spans to a sidecar, as the exporter saw it end."""

    target: str
    ok: bool
    at: float


@dataclass
class Delivery:
    """One webhook request as the agents saw it."""

    key: str
    instance: str
    type: str
    run_id: str
    trigger_span: str
    arrived: float
    signed: bool
    #: When the 200 was written back; None when the sender was gone by then.
    answered: float | None = None


class Ledger:
    """Which spans each exporter got acknowledged (thread-safe; bounded by the spans sent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exports: dict[str, list[Export]] = {}

    def exported(self, target: str, spans: Sequence[ReadableSpan], ok: bool) -> None:
        done = Export(target, ok, time.time())
        with self._lock:
            for span in spans:
                span_id = format(span.context.span_id, "016x") if span.context else ""
                self._exports.setdefault(span_id, []).append(done)

    def acknowledged_by(self, span_id: str) -> str | None:
        """The sidecar that answered an export of the span with success, if one did."""
        found = self.acknowledgement(span_id)
        return None if found is None else found.target

    def acknowledgement(self, span_id: str) -> Export | None:
        """The export of the span that a sidecar answered with success, if one did."""
        with self._lock:
            return next((e for e in self._exports.get(span_id, ()) if e.ok), None)


class RecordingExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP exporter, recording which spans each export got acknowledged."""

    def __init__(self, target: str, endpoint: str, ledger: Ledger) -> None:
        super().__init__(endpoint=f"{endpoint}/v1/traces", timeout=2)
        self.target = target
        self.ledger = ledger

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        self.ledger.exported(self.target, spans, result is SpanExportResult.SUCCESS)
        return result


class Exporters:
    """One TracerProvider per sidecar, each with a batch processor and its own exporter."""

    def __init__(self, endpoints: Mapping[str, str], ledger: Ledger) -> None:
        resource = Resource.create({"service.name": SERVICE})
        self.providers: dict[str, TracerProvider] = {}
        for target, endpoint in endpoints.items():
            provider = TracerProvider(resource=resource)
            provider.add_span_processor(
                BatchSpanProcessor(
                    RecordingExporter(target, endpoint, ledger),
                    schedule_delay_millis=100,
                    max_export_batch_size=256,
                    export_timeout_millis=3000,
                )
            )
            self.providers[target] = provider

    def tracer(self, target: str) -> Tracer:
        return self.providers[target].get_tracer("fleet-agents")

    def close(self) -> None:
        for provider in self.providers.values():
            provider.shutdown()


class Agents:
    """The runs, driven from one thread by a heap of due steps; commands move them on."""

    def __init__(
        self,
        sessions: Sequence[Run],
        targets: Sequence[str],
        *,
        spacing_s: float,
        step_pause_s: float,
    ) -> None:
        self.runs = list(sessions)
        self.targets = list(targets)
        self.exporters: Exporters | None = None
        self.spacing_s = spacing_s
        self.step_pause_s = step_pause_s
        #: Sidecars taken out of the load balancer (killed).
        self.dead: set[str] = set()
        self.failures: list[FailureSent] = []
        self.deliveries: list[Delivery] = []
        self._by_session = {run.session: run for run in self.runs}
        self._by_span: dict[str, Run] = {}
        self._acted: set[str] = set()
        self._due: list[tuple[float, int]] = []
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._drive, name="fleet-agents", daemon=True)

    # -- the driver ----------------------------------------------------------------------

    def start(self, exporters: Exporters) -> None:
        """Begin the runs, one every ``spacing_s``, exporting through ``exporters``."""
        with self._changed:
            self.exporters = exporters
            begin = time.monotonic()
            for run in self.runs:
                heapq.heappush(self._due, (begin + run.index * self.spacing_s, run.index))
        self._thread.start()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._thread.join(10)

    def finished(self) -> bool:
        with self._changed:
            return all(run.finished for run in self.runs)

    def snapshot(self) -> tuple[list[Run], list[FailureSent], list[Delivery]]:
        """Copies of what happened so far (runs, failures sent, deliveries)."""
        with self._changed:
            runs = [Run(**vars(run)) for run in self.runs]
            return runs, list(self.failures), list(self.deliveries)

    def _schedule(self, run: Run, at: float) -> None:  # under the condition
        heapq.heappush(self._due, (at, run.index))
        self._changed.notify_all()

    def _drive(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and (not self._due or self._due[0][0] > time.monotonic()):
                    wait = self._due[0][0] - time.monotonic() if self._due else 1.0
                    self._changed.wait(max(0.001, min(wait, 1.0)))
                if self._stopped:
                    return
                _, index = heapq.heappop(self._due)
                run = self.runs[index]
                if run.state == "running":
                    self._emit(run)

    def _route(self, run: Run) -> str:  # under the condition
        first = hop(run.session, run.traces, len(self.targets))
        for offset in range(len(self.targets)):
            target = self.targets[(first + offset) % len(self.targets)]
            if target not in self.dead:
                return target
        raise RuntimeError("no sidecar left")

    def _emit(self, run: Run) -> None:  # under the condition
        assert self.exporters is not None, "started with its exporters"
        target = self._route(run)
        run.traces += 1
        failing = run.step == run.fail_step and run.failures_left > 0
        tracer = self.exporters.tracer(target)
        session = {"session.id": run.session}
        if run.kind == "loop":  # the same tool call each time
            name = "search"
            attributes = {
                "openinference.span.kind": "TOOL",
                "tool.name": "search",
                "input.value": LOOP_ARGUMENTS,
            }
        else:
            name = "ChatCompletion"
            attributes = {
                "openinference.span.kind": "LLM",
                "llm.provider": "openai",
                "llm.model_name": "gpt-4o",
            }
        with (
            tracer.start_as_current_span(
                f"agent.step.{run.step}", attributes={"openinference.span.kind": "AGENT", **session}
            ),
            tracer.start_as_current_span(name, attributes={**attributes, **session}) as span,
        ):
            if failing:
                kind, message = ERRORS[run.kind]
                span.add_event("exception", {"exception.type": kind, "exception.message": message})
                span.set_status(Status(StatusCode.ERROR, f"{kind}: {message}"))
            context = span.get_span_context()
        if failing:
            run.failures_left -= 1
            run.state = "waiting"
            sent = FailureSent(
                format(context.trace_id, "032x"),
                format(context.span_id, "016x"),
                run.index,
                target,
                time.time(),
            )
            self.failures.append(sent)
            self._by_span[sent.span_id] = run
            return
        run.step += 1
        if run.step == run.steps:
            run.state = "done"
        else:
            self._schedule(run, time.monotonic() + self.step_pause_s)

    # -- commands ------------------------------------------------------------------------

    def received(self, delivery: Delivery, command: Mapping[str, Any]) -> None:
        """A webhook request arrived: record it; act on its key the first time only."""
        with self._changed:
            self.deliveries.append(delivery)
            if not delivery.signed or delivery.key in self._acted:
                return
            self._acted.add(delivery.key)
            run = self._by_session.get(delivery.run_id) or self._by_span.get(delivery.trigger_span)
            if run is None or run.finished:
                return
            params = command.get("params") or {}
            if delivery.type == "retry_step" or (
                delivery.type == "approval_result" and params.get("approved") is True
            ):
                if run.state == "waiting":
                    run.state = "running"
                    self._schedule(run, time.monotonic())
            elif delivery.type in ("abort_run", "approval_result"):
                run.state = "aborted"  # denied, or told to give up

    def answered(self, delivery: Delivery) -> None:
        with self._changed:
            delivery.answered = time.time()


def plan_runs(count: int, steps: int, targets: int, victim: int, loops: int = 0) -> list[Run]:
    """``count`` runs, the kinds in turn, then ``loops`` looping runs.

    Half the remediated runs fail on the ``victim`` (each run's first failure
    is its trace number ``fail_step``; with 4 steps or more, one of steps 1 to 3
    goes there), so the sidecar that is killed judges timeouts and holds their
    remediations.
    """
    runs: list[Run] = []
    for index in range(count):
        kind = KINDS[index % len(KINDS)]
        session = f"fleet-run-{index:03d}"
        fail_step = 1 + index % max(1, steps - 1)
        if kind == "remediate" and (index // len(KINDS)) % 2 == 0:
            fail_step = next(
                (s for s in range(1, steps) if hop(session, s, targets) == victim), fail_step
            )
        runs.append(Run(index, session, kind, fail_step, steps, FAILURES_IN_A_ROW[kind]))
    for index in range(count, count + loops):
        runs.append(Run(index, f"fleet-loop-{index:03d}", "loop", -1, LOOP_CALLS, 0))
    return runs


class _Hook(BaseHTTPRequestHandler):
    server: LoopbackHTTPServer[AgentWebhooks]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        hooks = self.server.context
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            signing.verify(SECRET, headers, body)
            signed = True
        except signing.SignatureError:
            signed = False
        command: dict[str, Any] = json.loads(body) if body else {}
        trigger = command.get("trigger") or {}
        delivery = Delivery(
            key=headers.get("idempotency-key", ""),
            instance=self.path.rsplit("/", 1)[-1],
            type=str(command.get("type", "")),
            run_id=str(command.get("run_id", "")),
            trigger_span=str(trigger.get("span_id", "")),
            arrived=time.time(),
            signed=signed,
        )
        hooks.agents.received(delivery, command)
        hooks.release.wait(hooks.ack_delay_s)
        try:
            self.send_response(200 if signed else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.wfile.flush()
        except OSError:
            return  # the sidecar is gone (kill -9)
        if signed:
            hooks.agents.answered(delivery)


class AgentWebhooks(LoopbackServer["AgentWebhooks"]):
    """The agents' webhook endpoint: ``/hooks/<instance>``, one path per sidecar."""

    def __init__(self, agents: Agents, ack_delay_s: float) -> None:
        super().__init__(_Hook, self, name="fleet-webhooks", poll_interval_s=0.01)
        self.agents = agents
        self.ack_delay_s = ack_delay_s
        self.release = threading.Event()  # ends every wait at once (teardown)

    def url_for(self, instance: str) -> str:
        return f"{self.url}/hooks/{instance}"

    def stop(self, timeout: float = 5.0) -> None:
        self.release.set()
        super().stop(timeout)
