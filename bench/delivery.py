"""Delivery latency: a failing span sent to the sidecar until its signed webhook arrives.

What an agent waits for between exporting the span of a call that failed and
being told to retry it. This starts ``spanvisor run`` with a settings file
(``--config``) whose ``agents: {"*": {webhook: ...}}`` points at a receiver
this script runs on loopback, and a policy file (``SPANVISOR_POLICY``) that
retries tool connection errors with a fixed wait of 0 s, so the policy's own
backoff is excluded from the figure by construction (no clock arithmetic
across processes). Then it sends ``--failures`` OTLP/HTTP protobuf requests
(default 2,000), each holding one agent trace's completed tool spans: one
``execute_tool get_order`` failing with ``ConnectionRefusedError`` (an
exception event, ERROR status, ``error.type``) after ``--successes``
successful calls of the same tool (default 9). The successes are there because
a real agent's traffic has them: without them every call of the tool fails,
the breaker opens after five and the decisions become ``fail_fast``.

Requests are paced at ``--rate`` per second (default 200) from a pool of
sending threads, each with a keep-alive httpx client, so the figure is latency,
not queueing. The receiver verifies every signature with
:func:`supervisor.act.signing.verify`, answers 200, and notes the arrival time;
the trace id in the command's ``trigger`` matches it to the request.

Figures (p50, p99, max over the measured failures):

* **sent → webhook arrived**: monotonic clock of this process, from just
  before the request's first byte is written to when the receiver has read
  the webhook's body. Everything the sidecar does is in it: OTLP receipt,
  queue, decode, judge, decide, store (SQLite), dispatch, sign, POST.
* command created → arrived: from the command's ``created_at`` (the sidecar's
  wall clock, millisecond precision) to arrival (this process's wall clock):
  the store-and-dispatch part alone.

Goal: p99 < 50 ms.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/delivery.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
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
from supervisor.act.signing import SignatureError, verify
from supervisor.testing.loopback import LoopbackHTTPServer, LoopbackServer

GOAL_P99_MS = 50.0
SERVICE = "research-agent"
TOOL = "get_order"
_THROTTLED = (429, 503)
_MAX_SENDS = 50

#: Layered on the built-in policy: tool connection errors retried at once,
#: so that what is measured is the sidecar, not the backoff it prescribes.
POLICY_YAML = """\
version: 1
policies:
  - name: bench_retry_now
    description: delivery benchmark - retry a tool's connection errors with no wait
    match: {kind: connection, role: tool}
    action: retry
    max_attempts: 4
    wait: {type: fixed, seconds: 0}
    honour_retry_after: false
    on_exhausted: escalate
"""

_STACK = (
    "Traceback (most recent call last):\n"
    '  File "/app/agent/tools.py", line 57, in get_order\n'
    "    response = client.get(url)\n"
    '  File "/usr/lib/python3.11/socket.py", line 851, in create_connection\n'
    "    raise exceptions[0]\n"
    "ConnectionRefusedError: [Errno 111] Connection refused\n"
)


def _attr(span: Span | Any, key: str, value: str | int | bool) -> None:
    kv = span.attributes.add()
    kv.key = key
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.string_value = value


def failing_request(index: int, salt: bytes, successes: int) -> tuple[bytes, str]:
    """One export of an agent trace's finished tool spans, the last one failing.

    Returns the encoded request and its trace id (hex). The agent's root span
    is still open (the run is waiting to retry), so it is not in the export.
    """
    trace_id = salt + index.to_bytes(8, "big")
    root_id = b"\x0a" + index.to_bytes(7, "big")
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in (
        ("service.name", SERVICE),
        ("service.version", "1.4.2"),
        ("deployment.environment.name", "production"),
        ("telemetry.sdk.name", "opentelemetry"),
        ("telemetry.sdk.language", "python"),
        ("telemetry.sdk.version", "1.27.0"),
    ):
        _attr(rs.resource, key, value)
    ss = rs.scope_spans.add()
    ss.scope.name = "research_agent"
    ss.scope.version = "1.4.2"
    now = time.time_ns()
    for step in range(successes + 1):
        failed = step == successes
        span = ss.spans.add()
        span.trace_id = trace_id
        span.span_id = bytes([0x0B, step % 256]) + index.to_bytes(6, "big")
        span.parent_span_id = root_id
        span.name = f"execute_tool {TOOL}"
        span.kind = Span.SpanKind.SPAN_KIND_INTERNAL
        span.start_time_unix_nano = now - (successes + 1 - step) * 40_000_000
        span.end_time_unix_nano = span.start_time_unix_nano + (3_000_000 if failed else 30_000_000)
        span.flags = 0x101
        _attr(span, "gen_ai.operation.name", "execute_tool")
        _attr(span, "gen_ai.tool.name", TOOL)
        _attr(span, "gen_ai.tool.type", "function")
        _attr(span, "gen_ai.tool.description", "Fetch an order by id, with its items and state.")
        _attr(span, "gen_ai.tool.call.id", f"call_{index:08x}{step:04x}")
        _attr(span, "gen_ai.tool.call.arguments", json.dumps({"order_id": f"A-{48000 + step}"}))
        _attr(span, "code.function.name", f"tools.{TOOL}")
        if not failed:
            _attr(span, "gen_ai.tool.call.result", '{"status": "shipped", "items": 2}')
            span.status.code = Status.StatusCode.STATUS_CODE_UNSET
            continue
        _attr(span, "error.type", "ConnectionRefusedError")
        span.status.code = Status.StatusCode.STATUS_CODE_ERROR
        span.status.message = "ConnectionRefusedError: [Errno 111] Connection refused"
        event = span.events.add()
        event.name = "exception"
        event.time_unix_nano = span.end_time_unix_nano - 1000
        _attr(event, "exception.type", "ConnectionRefusedError")
        _attr(event, "exception.message", "[Errno 111] Connection refused")
        _attr(event, "exception.stacktrace", _STACK)
        _attr(event, "exception.escaped", "False")
    return request.SerializeToString(), trace_id.hex()


def _unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


@dataclass
class Arrival:
    """One webhook the receiver accepted."""

    at: float  # this process's monotonic clock
    wall: float
    type: str
    created_at: float
    not_before: float


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: LoopbackHTTPServer[Receiver]
    protocol_version = "HTTP/1.1"  # keep-alive, as the sidecar's client expects

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        at, wall = time.monotonic(), time.time()
        status = self.server.context.accept(dict(self.headers.items()), body, at, wall)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per webhook would swamp the figures."""


@dataclass
class Receiver:
    """An agent's webhook endpoint on loopback: verifies, records, answers 200."""

    secret: str
    arrivals: dict[str, Arrival] = field(default_factory=dict)
    types: Counter[str] = field(default_factory=Counter)
    bad_signatures: int = 0
    duplicates: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _http: LoopbackServer[Receiver] | None = None
    _ids: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self._http is not None
        return f"{self._http.url}/hooks/spanvisor"

    def start(self) -> None:
        self._http = LoopbackServer(_ReceiverHandler, self, host=LOOPBACK, name="receiver").start()

    def accept(self, headers: dict[str, str], body: bytes, at: float, wall: float) -> int:
        try:
            message_id = verify(self.secret, headers, body, now=wall)
        except SignatureError:
            with self._lock:
                self.bad_signatures += 1
            return 401
        command = json.loads(body)
        trace_id = command["trigger"]["trace_id"]
        with self._lock:
            self.types[command["type"]] += 1
            if message_id in self._ids:
                self.duplicates += 1
                return 200
            self._ids.add(message_id)
            if command["type"] == "retry_step" and trace_id not in self.arrivals:
                self.arrivals[trace_id] = Arrival(
                    at,
                    wall,
                    command["type"],
                    _unix(command["created_at"]),
                    _unix(command["not_before"]),
                )
        return 200

    def count(self) -> int:
        with self._lock:
            return len(self.arrivals)

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop()


@dataclass
class Sent:
    """What the senders did: when each trace left, and how the export calls went."""

    at: dict[str, float] = field(default_factory=dict)
    round_trips_s: list[float] = field(default_factory=list)
    throttled: int = 0
    skipped: int = 0
    sidecar_cpu_s: float = 0.0
    own_cpu_s: float = 0.0


class Senders:
    """Paced OTLP/HTTP exports from a pool of threads, one keep-alive client each."""

    def __init__(self, port: int, threads: int, salt: bytes, successes: int) -> None:
        self.url = f"http://{LOOPBACK}:{port}/v1/traces"
        self.salt = salt
        self.successes = successes
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="otlp")
        self.max_in_flight = 4 * threads
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list[httpx.Client] = []
        self.in_flight: set[Future[None]] = set()
        self.futures: list[Future[None]] = []

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            # TCP_NODELAY: the request leaves in one go, as http.client's single
            # write (the OTel exporter's requests session) makes it leave.
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

    def _send(self, index: int, sent: Sent) -> None:
        payload, trace_id = failing_request(index, self.salt, self.successes)
        client = self._client()
        first = time.monotonic()
        with self._lock:
            sent.at[trace_id] = first
        for attempt in range(_MAX_SENDS):
            started = time.perf_counter()
            try:
                response = client.post(self.url, content=payload)
            except httpx.HTTPError as exc:
                raise BenchError(f"POST /v1/traces failed: {exc!r}") from exc
            if response.status_code == 200:
                with self._lock:
                    sent.round_trips_s.append(time.perf_counter() - started)
                return
            if response.status_code not in _THROTTLED:
                raise BenchError(f"POST /v1/traces answered {response.status_code}")
            with self._lock:
                sent.throttled += 1
            time.sleep(min(0.005 * 2**attempt, 0.2))
        raise BenchError(f"still throttled after {_MAX_SENDS} attempts")

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self.in_flight.discard(future)

    def run(self, first: int, count: int, rate: float, sent: Sent) -> None:
        """Submit ``count`` exports, one every ``1/rate`` s; a full backlog skips a tick."""
        interval = 1.0 / rate
        started = time.monotonic()
        for tick in range(count):
            delay = started + tick * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing
            with self._lock:
                if len(self.in_flight) >= self.max_in_flight:
                    sent.skipped += 1
                    continue
                future = self.pool.submit(self._send, first + tick, sent)
                self.in_flight.add(future)
                self.futures.append(future)
            future.add_done_callback(self._done)

    def finish(self, timeout_s: float) -> None:
        """Wait for every export; re-raise the first error."""
        deadline = time.monotonic() + timeout_s
        for future in list(self.futures):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout as exc:
                raise BenchError(f"exports still running after {timeout_s:g} s") from exc

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients:
                client.close()


def wait_arrivals(receiver: Receiver, target: int, timeout_s: float) -> None:
    """Poll until ``target`` webhooks arrived or ``timeout_s`` passed (then just return)."""
    deadline = time.monotonic() + timeout_s
    while receiver.count() < target and time.monotonic() < deadline:
        time.sleep(0.01)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="The policy's delay is excluded by a policy file whose retry waits a fixed 0 s.",
    )
    parser.add_argument("--failures", type=int, default=2_000, help="measured failures (2000)")
    parser.add_argument("--warmup", type=int, default=200, help="failures first, not counted (200)")
    parser.add_argument("--rate", type=float, default=200.0, help="failing requests per s (200)")
    parser.add_argument(
        "--successes", type=int, default=9, help="successful tool spans per request (9)"
    )
    parser.add_argument("--threads", type=int, default=16, help="sending threads (16)")
    add_sidecar_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the last webhooks (30)"
    )
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    if args.failures < 1 or args.warmup < 0 or args.successes < 0 or args.threads < 1:
        parser.error("--failures and --threads must be >= 1, --warmup and --successes >= 0")
    if not 0 < args.rate <= 10_000:
        parser.error("--rate must be in (0, 10000]")
    if args.failures / args.rate > 3600:
        parser.error("--failures / --rate must stay under an hour")
    return args


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    exit_cleanly_on_sigterm()
    salt = os.urandom(8)
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    receiver = Receiver(secret)
    receiver.start()
    warm, measured = Sent(), Sent()
    try:
        with tempfile.TemporaryDirectory(prefix="spanvisor-bench-delivery-") as tmp:
            config = Path(tmp) / "spanvisor.yaml"
            policy = Path(tmp) / "policy.yaml"
            policy.write_text(POLICY_YAML)
            settings = {
                "agents": {"*": {"webhook": {"url": receiver.url, "secret": secret}}},
                "state_path": str(Path(tmp) / "state.db"),
            }
            config.write_text(json.dumps(settings, indent=2))  # JSON is YAML
            env = {"SPANVISOR_POLICY": str(policy), **args.sidecar_env}
            command = (sys.executable, "-m", "supervisor.cli", "run", "--config", str(config))
            with Sidecar(extra_env=env, command=command) as sidecar:
                senders = Senders(sidecar.http_port, args.threads, salt, args.successes)
                try:
                    senders.run(0, args.warmup, args.rate, warm)
                    senders.finish(args.timeout)
                    wait_arrivals(receiver, len(warm.at), args.timeout)
                    before = sidecar.stats()
                    cpu = cpu_seconds(sidecar.pid), time.process_time()
                    started = time.monotonic()
                    senders.run(args.warmup, args.failures, args.rate, measured)
                    took = time.monotonic() - started
                    senders.finish(args.timeout)
                    wait_arrivals(receiver, len(warm.at) + len(measured.at), args.timeout)
                    after = sidecar.stats()
                    measured.sidecar_cpu_s = cpu_seconds(sidecar.pid) - cpu[0]
                    measured.own_cpu_s = time.process_time() - cpu[1]
                finally:
                    senders.close()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        receiver.stop()
    return report(args, receiver, measured, took, before, after)


def report(
    args: argparse.Namespace,
    receiver: Receiver,
    sent: Sent,
    took: float,
    before: dict[str, Any],
    after: dict[str, Any],
) -> int:
    latencies, dispatch, delays = [], [], []
    for trace_id, at in sent.at.items():
        arrival = receiver.arrivals.get(trace_id)
        if arrival is None:
            continue
        latencies.append(arrival.at - at)
        dispatch.append(arrival.wall - arrival.created_at)
        delays.append(arrival.not_before - arrival.created_at)
    missing = len(sent.at) - len(latencies)
    delivery = after["delivery"]
    decisions = after["pipeline"]["failures"] - before["pipeline"]["failures"]
    print()
    print(
        f"{len(sent.at):,} failing spans (1 per request, with {args.successes} successful"
        f" calls), paced at {args.rate:g}/s over {took:.1f} s, {args.threads} sending threads"
    )
    rows = [
        ["sent -> webhook arrived", *_stats(latencies)],
        ["  command created -> arrived", *_stats(dispatch)],
        ["  OTLP export round trip", *_stats(sent.round_trips_s)],
    ]
    print(table(["ms", "count", "p50", "p99", "max"], rows))
    print()
    print(
        f"webhooks: {sum(receiver.types.values()):,} received"
        f" ({', '.join(f'{k} {v:,}' for k, v in receiver.types.most_common())}),"
        f" signatures verified, {receiver.bad_signatures} bad, {receiver.duplicates} repeated;"
        f" {missing} measured failure(s) got no retry_step within {args.timeout:g} s"
    )
    largest = max(delays, default=0.0)
    print(
        f"policy delay (not_before - created_at): max {largest * 1000:.0f} ms;"
        f" ticks skipped: {sent.skipped}; throttled exports: {sent.throttled}"
    )
    print(
        f"sidecar: {decisions:,} decisions in the measured part; its own latencies:"
        f" receipt -> decision p50/p99 {after['decisions']['latency_ms']['p50']}"
        f"/{after['decisions']['latency_ms']['p99']} ms,"
        f" due -> delivered {delivery['latency_ms']};"
        f" delivered {delivery['commands']['delivered']:,},"
        f" failed attempts {delivery['push']['failed_attempts']},"
        f" dead-lettered {delivery['commands']['dead']}"
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"CPU over the measured part: sidecar {sent.sidecar_cpu_s / took:.0%} of one core,"
        f" this script (senders + receiver) {sent.own_cpu_s / took:.0%};"
        f" {os.cpu_count()} CPUs, load average {load}"
    )
    if not latencies:
        print("no webhook arrived for the measured failures: nothing to report", file=sys.stderr)
        return 1
    p99 = percentile(latencies, 0.99) * 1000
    verdict = "yes" if p99 < GOAL_P99_MS and missing == 0 else "NO"
    print(f"goal p99 < {GOAL_P99_MS:g} ms, every failure delivered: {verdict} ({p99:.2f} ms)")
    return 0


def _stats(values: list[float]) -> list[str]:
    if not values:
        return ["0", "-", "-", "-"]
    return [
        f"{len(values):,}",
        _ms(percentile(values, 0.5)),
        _ms(percentile(values, 0.99)),
        _ms(max(values)),
    ]


if __name__ == "__main__":
    sys.exit(main())
