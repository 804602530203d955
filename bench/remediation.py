"""Remediation dispatch: failing span received -> first tool call, and remediations per second.

Two measurements, each printed beside the command that made it.

**Dispatch latency, end to end** (a real sidecar). ``spanvisor run`` is
started with a policy that remediates ``timeout`` failures with a built-in
remediator (``--remediator``, default ``fallback_switch``) that has
``verify_window_s: 0`` and ``on_unresolved: none``, so each remediation ends
as soon as it acted, and with a settings file whose ``downstream`` is an
:class:`~supervisor.testing.otlp_recorder.OtlpRecorder` on loopback: the
sidecar's own spans (``spanvisor.decide``, the remediation's root
``spanvisor.remediate <name>`` and its ``spanvisor.tool <tool>`` children)
reach it through the sidecar's real OTLP exporter. Each OTLP/HTTP request is
one new agent trace holding one OpenInference LLM span that failed with
``APITimeoutError: Request timed out.`` (built-in rules: transient/timeout).

The figure is **received -> first tool call** = the first tool span's start
time minus the remediation root span's start time. Both are stamped by the
sidecar with one clock: the root starts at the remediation's
``dispatched_at``, which is the triggering request's receipt time
(``received_ns`` of the OTLP receiver), and a tool span starts when the tool
call begins, inside its durable step. Everything between is in it: receiver,
queue, decode, judge, decide, store the incident (SQLite), hand it to the
durable runner, DBOS workflow start (its rows written), the remediator's
code, the tool step's bookkeeping. The sender's own clock is only used for
the ``sent -> received`` check row (same machine, same wall clock): it shows
that receipt is within about a millisecond of the client's send on loopback.

Breakers are disabled in the bench policy: every LLM call fails, so with
breakers on, the fifth failure in a row would open ``openai:gpt-4o``'s breaker
and the governor would turn every later ``remediate`` into a fallback.

Phases: ``--warmup`` failures (the first remediate decision launches DBOS in
the sidecar, lazily; its latency is printed on its own), then ``--failures``
at a steady ``--rate`` per second, then ``--burst`` sent all at once from
``--threads`` threads. Goal: p99 < 100 ms at the steady rate.

**Remediations per second** (in process). ``DurableRunner`` with a
``RecordingGateway`` (no sidecar around it, as in
``tests/test_remediation_runner.py``) on SQLite and on Postgres, each in a
subprocess of its own (DBOS is one per process): ``--remediations`` requests
(default 500) of the built-in ``compact_context`` remediator (one tool call;
verification with a 0 s window, or ``--verify-window`` seconds that no
recovery ends; ``on_unresolved: none``) are dispatched as
fast as the runner takes them (never more than ``--max-active`` running, the
sidecar's own cap) and the batch ends when every one has an outcome.
Repeated ``--repeat`` times after a warm-up batch; medians are reported.
CPU is the worker process's (all its threads); on Postgres the server's
backends serving the bench database are measured from ``/proc`` too.

Postgres gets a database of its own, created for the run and dropped after
(``--postgres-url`` names the server, through any database on it).
The runner puts a SQLite database in WAL mode before DBOS opens it (DBOS
would leave it in rollback-journal mode); that gave 35-40% more
remediations per second here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

if __package__ in (None, ""):  # run as `python bench/remediation.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from bench.harness import (
    LOOPBACK,
    BenchError,
    Sidecar,
    add_sidecar_arguments,
    command_line,
    cpu_seconds,
    exit_cleanly_on_sigterm,
    percentile,
    sidecar_env,
    table,
)
from supervisor.testing.otlp_recorder import OtlpRecorder

GOAL_P99_MS = 100.0
REMEDIATORS = ("fallback_switch", "retry_step", "compact_context")
BACKENDS = ("sqlite", "postgres")
DEFAULT_BACKENDS = ("sqlite", "postgres")
_THROTTLED = (429, 503)
_MAX_SENDS = 200
_RESULT = "RESULT "
#: Runner counters that are not outcomes.
_NOT_OUTCOMES = frozenset({"active", "dispatched", "duplicates", "busy", "errors"})

POLICY_YAML = """\
version: 1
# Every LLM call of the bench fails: with breakers on, the fifth in a row would
# open openai:gpt-4o's breaker and turn every later remediate into a fallback.
breakers: {{enabled: false}}
remediators:
  bench:
    use: {use}
    verify_window_s: 0
    on_unresolved: none
{params}policies:
  - name: bench_remediate_timeouts
    match: {{kind: timeout}}
    action: remediate
    remediator: bench
  - name: bench_chain
    match: {{kind: never}}
    action: fallback
    chain: {{"openai:*": ["openai:gpt-4o", "anthropic:claude-3-5-sonnet"]}}
rules:
  - name: never
    match: {{span_name: "never-a-span-name"}}
    class: permanent
    kind: never
"""


def policy_yaml(use: str) -> str:
    params = "    params: {delay_s: 0}\n" if use == "retry_step" else ""
    return POLICY_YAML.format(use=use, params=params)


# -- the failing spans -------------------------------------------------------------


def _attr(span: Span, key: str, value: str) -> None:
    span.attributes.append(KeyValue(key=key, value=AnyValue(string_value=value)))


def failing_request(trace_id: bytes, span_id: bytes, now_ns: int) -> bytes:
    """One agent trace: an OpenInference LLM span that timed out (transient/timeout)."""
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="bench-agent"))
    )
    span = resource.scope_spans.add().spans.add()
    span.trace_id = trace_id
    span.span_id = span_id
    span.name = "ChatCompletion"
    span.kind = Span.SPAN_KIND_CLIENT
    span.start_time_unix_nano = now_ns - 30_000_000_000
    span.end_time_unix_nano = now_ns
    _attr(span, "openinference.span.kind", "LLM")
    _attr(span, "llm.provider", "openai")
    _attr(span, "llm.model_name", "gpt-4o")
    span.status.code = Status.STATUS_CODE_ERROR
    span.status.message = "APITimeoutError: Request timed out."
    return request.SerializeToString()


# -- what the recorder received ----------------------------------------------------


@dataclass
class Remediation:
    """The sidecar's spans about one triggering failure."""

    root_start_ns: int = 0
    root_end_ns: int = 0
    outcome: str = ""
    first_tool_ns: int = 0
    first_tool: str = ""
    decide_ns: int = 0


def _attributes(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


class SpanIndex:
    """Remediation spans by triggering trace id, read incrementally from the recorder."""

    def __init__(self, recorder: OtlpRecorder) -> None:
        self.recorder = recorder
        self.by_trigger: dict[str, Remediation] = {}
        self._trigger_of: dict[str, str] = {}  # remediation trace -> triggering trace
        self._tools: dict[str, list[tuple[int, int, str]]] = {}  # remediation trace -> tools
        self._seen = 0
        self.spans = 0

    def update(self) -> None:
        requests = self.recorder.requests
        for recorded in requests[self._seen :]:
            for span in recorded.spans():
                self.spans += 1
                self._add(span)
        self._seen = len(requests)

    def _add(self, span: Span) -> None:
        name = span.name
        if name.startswith("spanvisor.remediate "):
            attrs = _attributes(span)
            trigger = str(attrs.get("spanvisor.trigger.trace_id", ""))
            rem = self.by_trigger.setdefault(trigger, Remediation())
            rem.root_start_ns = span.start_time_unix_nano
            rem.root_end_ns = span.end_time_unix_nano
            rem.outcome = str(attrs.get("spanvisor.remediation.outcome", ""))
            trace = span.trace_id.hex()
            self._trigger_of[trace] = trigger
            for item in self._tools.pop(trace, []):
                self._tool(rem, *item)
        elif name.startswith("spanvisor.tool "):
            step = int(_attributes(span).get("spanvisor.tool.step") or 0)
            item = (step, span.start_time_unix_nano, name.removeprefix("spanvisor.tool "))
            trace = span.trace_id.hex()
            known = self._trigger_of.get(trace)
            if known is None:  # the root ends last: it is exported after its tools
                self._tools.setdefault(trace, []).append(item)
            else:
                self._tool(self.by_trigger[known], *item)
        elif name == "spanvisor.decide":
            rem = self.by_trigger.setdefault(span.trace_id.hex(), Remediation())
            rem.decide_ns = span.start_time_unix_nano

    @staticmethod
    def _tool(rem: Remediation, step: int, start_ns: int, tool: str) -> None:
        if not rem.first_tool_ns or start_ns < rem.first_tool_ns:
            rem.first_tool_ns, rem.first_tool = start_ns, tool

    def complete(self, trace_id: str) -> bool:
        rem = self.by_trigger.get(trace_id)
        return rem is not None and bool(rem.root_start_ns and rem.first_tool_ns)


# -- sending -------------------------------------------------------------------------


@dataclass
class Phase:
    """One batch of failures: when each left, and what the export calls did."""

    name: str
    sent_ns: dict[str, int] = field(default_factory=dict)
    round_trips_s: list[float] = field(default_factory=list)
    throttled: int = 0
    took_s: float = 0.0
    sidecar_cpu_s: float = 0.0


class Senders:
    """OTLP/HTTP exports from a pool of threads, one keep-alive client each."""

    def __init__(self, port: int, threads: int) -> None:
        self.url = f"http://{LOOPBACK}:{port}/v1/traces"
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="otlp")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list[httpx.Client] = []

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            # TCP_NODELAY: the request leaves in one go, as the OTel exporter's does.
            transport = httpx.HTTPTransport(
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            )
            client = httpx.Client(
                transport=transport,
                headers={"Content-Type": "application/x-protobuf"},
                timeout=10.0,
                trust_env=False,
            )
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _send(self, phase: Phase) -> None:
        trace_id, span_id = os.urandom(16), os.urandom(8)
        client = self._client()
        payload = failing_request(trace_id, span_id, time.time_ns())
        with self._lock:
            phase.sent_ns[trace_id.hex()] = time.time_ns()  # just before the first byte
        for attempt in range(_MAX_SENDS):
            started = time.perf_counter()
            try:
                response = client.post(self.url, content=payload)
            except httpx.HTTPError as exc:
                raise BenchError(f"POST /v1/traces failed: {exc!r}") from exc
            if response.status_code == 200:
                with self._lock:
                    phase.round_trips_s.append(time.perf_counter() - started)
                return
            if response.status_code not in _THROTTLED:
                raise BenchError(f"POST /v1/traces answered {response.status_code}")
            with self._lock:
                phase.throttled += 1
            time.sleep(min(0.005 * 2**attempt, 0.2))
        raise BenchError(f"still throttled after {_MAX_SENDS} attempts")

    def run(self, phase: Phase, count: int, rate: float | None, timeout_s: float) -> None:
        """``count`` exports, one every ``1/rate`` s (all at once when ``rate`` is None)."""
        futures: list[Future[None]] = []
        started = time.monotonic()
        for tick in range(count):
            if rate is not None:
                delay = started + tick / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            futures.append(self.pool.submit(self._send, phase))
        deadline = time.monotonic() + timeout_s
        for future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout as exc:
                raise BenchError(f"exports still running after {timeout_s:g} s") from exc
        phase.took_s = time.monotonic() - started

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients:
                client.close()


def wait_remediations(
    index: SpanIndex, phase: Phase, sidecar: Sidecar, timeout_s: float
) -> list[str]:
    """Poll the recorder until every failure of ``phase`` has its tool and root spans.

    Returns the trace ids still missing at the deadline (the caller reports them).
    """
    deadline = time.monotonic() + timeout_s
    pending = set(phase.sent_ns)
    while pending:
        index.update()
        pending = {t for t in pending if not index.complete(t)}
        if not pending or time.monotonic() > deadline:
            break
        if sidecar.process is not None and sidecar.process.poll() is not None:
            raise BenchError(f"the sidecar died:\n{sidecar.log_tail()}")
        time.sleep(0.05)
    return sorted(pending)


# -- part 1: the sidecar -------------------------------------------------------------


@dataclass
class LatencyResult:
    phases: list[Phase]
    missing: dict[str, int]
    first_ms: float | None
    stats: dict[str, Any]
    index: SpanIndex


def run_latency(args: argparse.Namespace) -> LatencyResult:
    with (
        OtlpRecorder(max_requests=1_000_000) as recorder,
        tempfile.TemporaryDirectory(prefix="spanvisor-bench-remediation-") as tmp,
    ):
        config = Path(tmp) / "spanvisor.yaml"
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(policy_yaml(args.remediator))
        settings: dict[str, Any] = {"downstream": {"endpoint": recorder.http_endpoint}}
        config.write_text(json.dumps(settings, indent=2))  # JSON is YAML
        env = {"SPANVISOR_POLICY": str(policy), **args.sidecar_env}
        command = (sys.executable, "-m", "supervisor.cli", "run", "--config", str(config))
        index = SpanIndex(recorder)
        missing: dict[str, int] = {}
        with Sidecar(extra_env=env, command=command) as sidecar:
            senders = Senders(sidecar.http_port, args.threads)
            try:
                warm = Phase("warm-up")
                # The first one alone: it launches DBOS in the sidecar.
                senders.run(warm, 1, None, args.timeout)
                wait_remediations(index, warm, sidecar, args.timeout)
                first = index.by_trigger.get(next(iter(warm.sent_ns)))
                first_ms = (
                    (first.first_tool_ns - first.root_start_ns) / 1e6
                    if first is not None and first.first_tool_ns
                    else None
                )
                if args.warmup > 1:
                    senders.run(warm, args.warmup - 1, args.rate, args.timeout)
                    wait_remediations(index, warm, sidecar, args.timeout)
                phases = []
                plan: list[tuple[str, int, float | None]] = [
                    (f"steady {args.rate:g}/s", args.failures, args.rate)
                ]
                if args.burst > 0:
                    plan.append((f"burst of {args.burst}", args.burst, None))
                for name, count, rate in plan:
                    phase = Phase(name)
                    cpu = cpu_seconds(sidecar.pid)
                    senders.run(phase, count, rate, args.timeout)
                    left = wait_remediations(index, phase, sidecar, args.timeout)
                    phase.sidecar_cpu_s = cpu_seconds(sidecar.pid) - cpu
                    missing[name] = len(left)
                    phases.append(phase)
                stats = sidecar.stats()
            finally:
                senders.close()
    return LatencyResult(phases, missing, first_ms, stats, index)


def _ms_stats(values: Sequence[float]) -> list[str]:
    if not values:
        return ["0", "-", "-", "-"]
    return [
        f"{len(values):,}",
        f"{percentile(values, 0.5):.2f}",
        f"{percentile(values, 0.99):.2f}",
        f"{max(values):.2f}",
    ]


def report_latency(args: argparse.Namespace, result: LatencyResult) -> float | None:
    """Print the latency table; the steady phase's p99 (ms) of the figure."""
    index = result.index
    rows: list[list[str]] = []
    outcomes: Counter[str] = Counter()
    tools: Counter[str] = Counter()
    steady_p99: float | None = None
    for number, phase in enumerate(result.phases):
        first, decided, to_tool, ended, received = [], [], [], [], []
        for trace_id, sent_ns in phase.sent_ns.items():
            rem = index.by_trigger.get(trace_id)
            if rem is None or not (rem.root_start_ns and rem.first_tool_ns):
                continue
            first.append((rem.first_tool_ns - rem.root_start_ns) / 1e6)
            received.append((rem.root_start_ns - sent_ns) / 1e6)
            ended.append((rem.root_end_ns - rem.root_start_ns) / 1e6)
            if rem.decide_ns:
                decided.append((rem.decide_ns - rem.root_start_ns) / 1e6)
                to_tool.append((rem.first_tool_ns - rem.decide_ns) / 1e6)
            outcomes[rem.outcome] += 1
            tools[rem.first_tool] += 1
        if number == 0 and first:
            steady_p99 = percentile(first, 0.99)
        took = f"{len(phase.sent_ns):,} failures sent in {phase.took_s:.2f} s"
        rows.append([f"{phase.name} ({took})", "", "", "", ""])
        rows.append(["  received -> first tool call", *_ms_stats(first)])
        rows.append(["    received -> decision span", *_ms_stats(decided)])
        rows.append(["    decision span -> first tool call", *_ms_stats(to_tool)])
        rows.append(["  received -> remediation ended", *_ms_stats(ended)])
        rows.append(["  sent (client) -> received", *_ms_stats(received)])
        rows.append(
            ["  OTLP export round trip", *_ms_stats([s * 1e3 for s in phase.round_trips_s])]
        )
    print()
    print(
        f"Dispatch latency through `spanvisor run` (remediator {args.remediator},"
        " verify_window_s 0, on_unresolved none; remediations on SQLite); ms"
    )
    print(table(["", "count", "p50", "p99", "max"], rows))
    print()
    stats = result.stats
    described: dict[str, Any] = stats.get("remediations") or {}
    missing = ", ".join(f"{name} {count}" for name, count in result.missing.items())
    print(
        f"outcomes: {', '.join(f'{k} {v:,}' for k, v in outcomes.most_common())};"
        f" first tool: {', '.join(f'{k} {v:,}' for k, v in tools.most_common())};"
        f" failures with no remediation spans within {args.timeout:g} s: {missing}"
    )
    counters = {
        k: v for k, v in described.items() if k not in ("database", "running", "state", "why")
    }
    print(f"sidecar remediations: {json.dumps(counters, sort_keys=True)}")
    decisions = stats.get("decisions") or {}
    judged = (stats.get("pipeline") or {}).get("failures", "?")
    print(
        f"sidecar: decisions {judged}, receipt -> decision latency"
        f" {decisions.get('latency_ms')} ms (its own window, warm-up included);"
        f" recorder received {index.spans:,} spans"
    )
    if result.first_ms is not None:
        print(
            f"first remediation after start: received -> first tool call {result.first_ms:,.0f} ms"
            " (the first remediate decision launches DBOS on the store writer's thread)"
        )
    cpu = ", ".join(
        f"{p.name} {p.sidecar_cpu_s:.2f} s ({p.sidecar_cpu_s / len(p.sent_ns) * 1e3:.1f} ms"
        " per failure)"
        for p in result.phases
        if p.sent_ns
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"sidecar CPU from the first send until every remediation's spans arrived: {cpu};"
        f" load average {load}"
    )
    return steady_p99


# -- part 2: the runner alone --------------------------------------------------------


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BackendCpu:
    """CPU of the Postgres backends serving one database (``/proc``; local server only)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._before: dict[int, float] = {}

    def _pids(self) -> list[int]:
        if self.url is None:
            return []
        import psycopg

        dbname = urlsplit(self.url).path.lstrip("/")
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (dbname,),
                ).fetchall()
        except psycopg.Error:
            return []
        return [int(row[0]) for row in rows]

    def start(self) -> None:
        self._before = {pid: _proc_cpu(pid) for pid in self._pids()}

    def stop(self) -> float | None:
        if self.url is None:
            return None
        pids = self._pids()
        if not pids or not Path(f"/proc/{pids[0]}").exists():
            return None  # not a server on this machine
        return sum(_proc_cpu(pid) - self._before.get(pid, 0.0) for pid in pids)


def _requests(count: int, tag: str, verify_window_s: float = 0.0) -> list[dict[str, Any]]:
    from remediators.base import Budget, Trigger
    from remediators.builtin import CompactContext
    from remediators.runner import build_request
    from supervisor.records import remediation_ids

    out = []
    for _ in range(count):
        trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
        remediation, trace = remediation_ids(trace_id, span_id, "bench_remediate_timeouts")
        trigger = Trigger(
            trace_id=trace_id,
            span_id=span_id,
            service="bench-agent",
            run_id=trace_id,
            failure_class="transient",
            kind="timeout",
            dependency="openai:gpt-4o",
            rule="bench_remediate_timeouts",
            message="APITimeoutError: Request timed out.",
            span_name="ChatCompletion",
            params={
                "remediator": "bench",
                "remediation_id": remediation,
                "remediation_trace_id": trace,
                "batch": tag,
            },
        )
        out.append(
            build_request(
                trigger,
                remediator="bench",
                use="compact_context",
                tools=CompactContext.tools,
                budget=Budget(),
                params={},
                verify_window_s=verify_window_s,
                on_unresolved="none",
                dispatched_at=0.0,  # set when dispatched
            )
        )
    return out


def _finished(counts: Mapping[str, int]) -> int:
    return sum(v for k, v in counts.items() if k not in _NOT_OUTCOMES)


def run_batch(runner: Any, requests: Sequence[dict[str, Any]], timeout_s: float) -> int:
    """Dispatch every request (at most ``max_active`` running) and wait for every outcome.

    Returns how many dispatches the runner refused as busy (they were retried).
    """
    limit = runner.settings.max_active
    base = _finished(runner.stats())
    deadline = time.monotonic() + timeout_s
    busy = 0
    for request in requests:
        while True:
            if time.monotonic() > deadline:
                raise BenchError(f"dispatching took more than {timeout_s:g} s")
            if runner.stats()["active"] >= limit:
                time.sleep(0.001)
                continue
            request["dispatched_at"] = time.time()
            if runner.dispatch(request) is not None:
                break
            busy += 1
            time.sleep(0.001)
    target = base + len(requests)
    while _finished(runner.stats()) < target:
        if time.monotonic() > deadline:
            stats = runner.stats()
            raise BenchError(f"{target - _finished(stats)} remediations unfinished: {stats}")
        time.sleep(0.005)
    return busy


def worker(args: argparse.Namespace) -> int:
    """One backend, in this process: launch the runner, warm up, time ``--repeat`` batches."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from remediators.gateway import RecordingGateway
    from remediators.runner import DurableRunner, RunnerSettings
    from remediators.tracing import PresetIdGenerator

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=PresetIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = RecordingGateway()
    runner = DurableRunner(
        gateway,
        RunnerSettings(database_url=args.database_url, max_active=args.max_active),
        tracer=provider.get_tracer("bench"),
    )
    pg = BackendCpu(args.database_url if args.worker == "postgres" else None)
    started = time.perf_counter()
    runner.start()
    batches: list[dict[str, Any]] = []
    try:
        launch_s = time.perf_counter() - started
        run_batch(runner, _requests(args.warmup_remediations, "warm-up"), args.timeout)
        for number in range(args.repeat):
            requests = _requests(args.remediations, f"batch-{number}", args.verify_window)
            exporter.clear()
            pg.start()
            cpu, wall = time.process_time(), time.perf_counter()
            busy = run_batch(runner, requests, args.timeout)
            took = time.perf_counter() - wall
            own_cpu = time.process_time() - cpu
            db_cpu = pg.stop()
            batches.append(
                {
                    "n": len(requests),
                    "wall_s": took,
                    "cpu_s": own_cpu,
                    "db_cpu_s": db_cpu,
                    "busy": busy,
                    "first_tool_ms": _first_tool_ms(exporter.get_finished_spans()),
                }
            )
        stats = runner.stats()
    finally:
        runner.close()
    commands = len(gateway.commands)
    result = {
        "backend": args.worker,
        "launch_s": launch_s,
        "batches": batches,
        "stats": stats,
        "commands": commands,
    }
    print(_RESULT + json.dumps(result), flush=True)
    return 0


def _first_tool_ms(spans: Sequence[Any]) -> list[float]:
    """Per remediation, first tool span start minus root start (= dispatched_at), in ms."""
    roots: dict[int, int] = {}
    tools: dict[int, int] = {}
    for span in spans:
        trace_id = span.context.trace_id
        if span.parent is None and span.name.startswith("spanvisor.remediate "):
            roots[trace_id] = span.start_time
        elif span.name.startswith("spanvisor.tool "):
            tools[trace_id] = min(tools.get(trace_id, span.start_time), span.start_time)
    return [(tools[t] - roots[t]) / 1e6 for t in roots if t in tools]


def _database_url(admin_url: str, name: str) -> str:
    parts = urlsplit(admin_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


@dataclass
class PostgresDatabase:
    """A database of the bench's own on the server of ``admin_url``, dropped at the end."""

    admin_url: str
    name: str = field(default_factory=lambda: f"spanvisor_bench_{os.getpid()}")

    @property
    def url(self) -> str:
        return _database_url(self.admin_url, self.name)

    def __enter__(self) -> PostgresDatabase:
        import psycopg

        try:
            with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE DATABASE "{self.name}"')
        except psycopg.Error as exc:
            raise BenchError(f"cannot create the bench database on Postgres: {exc}") from exc
        return self

    def __exit__(self, *_: object) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def run_worker(args: argparse.Namespace, backend: str, database_url: str) -> dict[str, Any]:
    """Re-invoke this script as a worker for one backend; its result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPANVISOR_"))}
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        backend,
        "--database-url",
        database_url,
        "--remediations",
        str(args.remediations),
        "--warmup-remediations",
        str(args.warmup_remediations),
        "--repeat",
        str(args.repeat),
        "--max-active",
        str(args.max_active),
        "--timeout",
        str(args.timeout),
        "--verify-window",
        str(args.verify_window),
    ]
    try:
        done = subprocess.run(  # this very script, with our own arguments
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout * (args.repeat + 2) + 60,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"the {backend} worker did not finish in time") from exc
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT):
            result: dict[str, Any] = json.loads(line.removeprefix(_RESULT))
            return result
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    raise BenchError(f"the {backend} worker failed ({done.returncode}):\n{tail}")


def run_throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for backend in args.backends:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory(prefix="spanvisor-bench-runner-") as tmp:
                path = Path(tmp) / "remediations.sqlite"
                results.append(run_worker(args, backend, f"sqlite:///{path}"))
        else:
            with PostgresDatabase(args.postgres_url) as database:
                results.append(run_worker(args, backend, database.url))
    return results


def _range(values: Sequence[float], fmt: str) -> str:
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def report_throughput(args: argparse.Namespace, results: Sequence[dict[str, Any]]) -> None:
    rows = []
    notes = []
    for result in results:
        batches = result["batches"]
        rates = [b["n"] / b["wall_s"] for b in batches]
        walls = [b["wall_s"] for b in batches]
        cpus = [b["cpu_s"] for b in batches]
        per = [b["cpu_s"] / b["n"] * 1e3 for b in batches]
        db = [b["db_cpu_s"] for b in batches if b["db_cpu_s"] is not None]
        first = [v for b in batches for v in b["first_tool_ms"]]
        rows.append(
            [
                result["backend"],
                f"{batches[0]['n']:,} x {len(batches)}",
                f"{statistics.median(walls):.2f}",
                f"{statistics.median(rates):,.0f}",
                _range(rates, ",.0f"),
                f"{statistics.median(cpus):.2f}",
                f"{statistics.median(per):.2f}",
                f"{statistics.median(db):.2f}" if db else "-",
                f"{percentile(first, 0.5):.0f}/{percentile(first, 0.99):.0f}" if first else "-",
                f"{result['launch_s']:.2f}",
            ]
        )
        stats = {k: v for k, v in result["stats"].items() if k != "active"}
        busy = sum(b["busy"] for b in batches)
        notes.append(
            f"{result['backend']}: runner counters {json.dumps(stats, sort_keys=True)};"
            f" busy refusals retried {busy}; commands recorded {result['commands']:,}"
        )
    print()
    print(
        "Remediations per second, DurableRunner in process (RecordingGateway; compact_context:"
        f" one tool call, verify {args.verify_window:g} s, on_unresolved none;"
        f" at most {args.max_active} running);"
        f" medians of {args.repeat} batches after {args.warmup_remediations} of warm-up"
    )
    header = [
        "backend",
        "remediations",
        "wall s",
        "rem/s",
        "rem/s min-max",
        "CPU s",
        "CPU ms/rem",
        "db CPU s",
        "dispatch->tool p50/p99 ms",
        "launch s",
    ]
    print(table(header, rows))
    print()
    for note in notes:
        print(note)
    print(
        "CPU s: the worker process (all threads: dispatcher, DBOS, SQLite); db CPU s: the"
        " Postgres backends serving the bench database (/proc), not the server's WAL writer;"
        " dispatch->tool: dispatched_at to the first tool span's start, under saturation"
        " (queueing included)"
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load}")


# -- command line --------------------------------------------------------------------


def _backends(value: str) -> list[str]:
    chosen = [b.strip() for b in value.split(",") if b.strip()]
    wrong = [b for b in chosen if b not in BACKENDS]
    if wrong or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(BACKENDS)}, comma separated")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Latency is measured on the sidecar's own clock: tool span start - root span start"
        " (the failure's receipt).",
    )
    part = parser.add_argument_group("dispatch latency (a real sidecar)")
    part.add_argument("--failures", type=int, default=200, help="steady-rate failures (200)")
    part.add_argument("--rate", type=float, default=20.0, help="failures per second (20)")
    part.add_argument("--burst", type=int, default=200, help="then this many at once (200; 0: no)")
    part.add_argument("--warmup", type=int, default=10, help="failures first, not counted (10)")
    part.add_argument("--threads", type=int, default=16, help="sending threads (16)")
    part.add_argument(
        "--remediator", choices=REMEDIATORS, default="fallback_switch", help="(fallback_switch)"
    )
    add_sidecar_arguments(parser)
    part = parser.add_argument_group("remediations per second (DurableRunner in process)")
    part.add_argument("--remediations", type=int, default=500, help="remediations per batch (500)")
    part.add_argument("--repeat", type=int, default=3, help="measured batches per backend (3)")
    part.add_argument(
        "--warmup-remediations", type=int, default=50, help="a batch first, not counted (50)"
    )
    part.add_argument(
        "--max-active", type=int, default=256, help="running at once, as the sidecar caps it (256)"
    )
    part.add_argument(
        "--verify-window",
        type=float,
        default=0.0,
        help="seconds each remediation waits for a recovery that does not come (0: none)",
    )
    part.add_argument(
        "--backends",
        type=_backends,
        default=list(DEFAULT_BACKENDS),
        help="comma separated, of sqlite and postgres (the default: both)",
    )
    part.add_argument(
        "--postgres-url",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="a database on the server to use; the bench creates and drops one of its own"
        " (postgresql://postgres@127.0.0.1:5432/test)",
    )
    parser.add_argument(
        "--only", choices=("latency", "throughput"), help="run one of the two parts"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds each phase or batch may take (120)"
    )
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--database-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    if args.failures < 1 or args.burst < 0 or args.warmup < 1 or args.threads < 1:
        parser.error("--failures, --warmup and --threads must be >= 1, --burst >= 0")
    if args.remediations < 1 or args.repeat < 1 or args.warmup_remediations < 0:
        parser.error("--remediations and --repeat must be >= 1, --warmup-remediations >= 0")
    if args.max_active < 1:
        parser.error("--max-active must be >= 1")
    if not 0 <= args.verify_window <= 60:
        parser.error("--verify-window must be in [0, 60] seconds")
    if not 0 < args.rate <= 10_000:
        parser.error("--rate must be in (0, 10000]")
    if not 0 < args.timeout <= 3600:
        parser.error("--timeout must be in (0, 3600] seconds")
    if args.worker and not args.database_url:
        parser.error("--worker needs --database-url")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    print(command_line(), flush=True)
    exit_cleanly_on_sigterm()
    verdict = ""
    try:
        if args.only in (None, "latency"):
            p99 = report_latency(args, run_latency(args))
            if p99 is not None:
                ok = "yes" if p99 < GOAL_P99_MS else "NO"
                verdict = f"goal p99 < {GOAL_P99_MS:g} ms at {args.rate:g}/s: {ok} ({p99:.2f} ms)"
        if args.only in (None, "throughput"):
            report_throughput(args, run_throughput(args))
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    if verdict:
        print()
        print(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
