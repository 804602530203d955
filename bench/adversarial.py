"""Adversarial load: how long ``/healthz`` waits while hostile or huge requests arrive.

Starts ``spanvisor run`` and, for each named attack in :data:`ATTACKS`, runs
the attack for ``--seconds`` while another thread polls ``GET /healthz`` on the
control API (the same event loop that serves ingest) every 10 ms, until the
attack stopped and what it got accepted is judged. It prints,
per attack, the poll latency's p50, p99 and max, the sidecar's RSS after it,
and what the attack's requests were answered. The max is the loop's longest stall seen: a stall
holds exactly one poll, so the p99 understates a rare long one.

Goal (issue: no single request makes any other wait): ``/healthz`` p99 <= 100 ms
under every attack.

To add an attack, write a function ``(sidecar, stop) -> str`` that sends until
``stop`` is set (or its work is done) and returns a one-line summary, and add an
:class:`Attack` to :data:`ATTACKS`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gzip
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/adversarial.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.harness import (
    LOOPBACK,
    Sidecar,
    add_sidecar_arguments,
    command_line,
    percentile,
    rss_bytes,
    running_sidecar,
    sidecar_env,
    table,
)

GOAL_P99_MS = 100.0
_POLL_EVERY_S = 0.01

Attack_fn = Callable[[Sidecar, threading.Event], str]


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    run: Attack_fn


# ------------------------------------------------------------------ payloads


def many_spans(n: int, failing_every: int = 100) -> bytes:
    """One request of ``n`` small spans, one in ``failing_every`` with an ERROR status."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attr = resource_spans.resource.attributes.add(key="service.name")
    attr.value.string_value = "adversary"
    scope = resource_spans.scope_spans.add()
    trace_id = os.urandom(16)
    for i in range(n):
        if i % 100 == 0:
            trace_id = os.urandom(16)
        span = scope.spans.add(
            trace_id=trace_id,
            span_id=os.urandom(8),
            name=f"tool call {i % 50}",
            start_time_unix_nano=1_700_000_000_000_000_000 + i,
            end_time_unix_nano=1_700_000_000_000_100_000 + i,
        )
        span.attributes.add(key="input.value").value.string_value = "x" * 60
        if i % failing_every == 0:
            span.status.code = 2
            span.status.message = "upstream timed out"
    return request.SerializeToString()


def as_otlp_json(payload: bytes) -> bytes:
    document = MessageToDict(ExportTraceServiceRequest.FromString(payload))
    for rs in document.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(document, separators=(",", ":")).encode()


# ------------------------------------------------------------------- attacks


def _post_repeatedly(
    sidecar: Sidecar,
    stop: threading.Event,
    body: bytes,
    headers: dict[str, str],
    threads: int = 1,
) -> str:
    url = f"http://{LOOPBACK}:{sidecar.http_port}/v1/traces"
    answers: Counter[str] = Counter()
    took: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(timeout=300.0) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    status = str(client.post(url, content=body, headers=headers).status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with lock:
                    answers[status] += 1
                    took.append(time.perf_counter() - started)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    slowest = max(took) if took else 0.0
    shown = ", ".join(f"{k} x{v}" for k, v in sorted(answers.items()))
    return f"{len(body):,} B; answers {shown}; slowest answer {slowest:.2f} s"


def gzip_members(sidecar: Sidecar, stop: threading.Event) -> str:
    body = gzip.compress(b"") * 200_000
    return _post_repeatedly(
        sidecar,
        stop,
        body,
        {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
    )


def gzip_bomb(sidecar: Sidecar, stop: threading.Event) -> str:
    body = gzip.compress(bytes(1024**3))  # 1 GiB of zeros, about 1 MB compressed
    return _post_repeatedly(
        sidecar,
        stop,
        body,
        {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
    )


_SPANS_100K: dict[str, bytes] = {}


def _spans_100k() -> bytes:
    if "pb" not in _SPANS_100K:
        _SPANS_100K["pb"] = many_spans(100_000)
    return _SPANS_100K["pb"]


def protobuf_100k(sidecar: Sidecar, stop: threading.Event) -> str:
    return _post_repeatedly(
        sidecar, stop, _spans_100k(), {"Content-Type": "application/x-protobuf"}
    )


def json_100k(sidecar: Sidecar, stop: threading.Event) -> str:
    if "json" not in _SPANS_100K:
        _SPANS_100K["json"] = as_otlp_json(_spans_100k())
    return _post_repeatedly(
        sidecar, stop, _SPANS_100K["json"], {"Content-Type": "application/json"}
    )


def _trickle(
    sidecar: Sidecar, stop: threading.Event, count: int, head: bytes, byte: bytes
) -> tuple[int, int]:
    """``count`` connections that send ``head``, then ``byte`` every 0.2 s; (count, still open)."""
    socks: list[socket.socket] = []
    for _ in range(count):
        sock = socket.create_connection((LOOPBACK, sidecar.http_port), timeout=5)
        sock.sendall(head)
        sock.setblocking(False)
        socks.append(sock)
    while not stop.wait(0.2):
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(byte)
    open_at_end = 0
    for sock in socks:
        try:
            sock.recv(4096)  # an answer (408) or the end: not held any more
        except BlockingIOError:
            open_at_end += 1  # nothing said, not closed: still held
        except OSError:
            pass
        sock.close()
    return count, open_at_end


def slow_clients(sidecar: Sidecar, stop: threading.Event) -> str:
    head = (
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    count, still_open = _trickle(sidecar, stop, 50, head, b"\x0a")
    return f"{count} connections trickling a body; {still_open} still open at the end"


def slow_headers(sidecar: Sidecar, stop: threading.Event) -> str:
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Slow: "
    count, still_open = _trickle(sidecar, stop, 50, head, b"a")
    return f"{count} connections trickling headers; {still_open} still open at the end"


ATTACKS: list[Attack] = [
    Attack("gzip-members", "200,000 empty gzip members (4 MB), back to back", gzip_members),
    Attack("gzip-bomb", "1 GiB of zeros gzipped (1 MB), back to back", gzip_bomb),
    Attack("protobuf-100k", "100,000 spans in one OTLP/HTTP protobuf request", protobuf_100k),
    Attack("json-100k", "the same 100,000 spans as OTLP/JSON", json_100k),
    Attack("slow-clients", "50 connections trickling a body, a byte per 0.2 s", slow_clients),
    Attack("slow-headers", "50 connections trickling headers, a byte per 0.2 s", slow_headers),
]


# ------------------------------------------------------------------- measure


def poll_healthz(sidecar: Sidecar, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=f"http://{LOOPBACK}:{sidecar.api_port}", timeout=600) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz")
            out.append(time.perf_counter() - started)
            time.sleep(_POLL_EVERY_S)


def measure(sidecar: Sidecar, attack: Attack, seconds: float) -> tuple[list[float], str]:
    stop = threading.Event()
    latencies: list[float] = []
    summary: list[str] = []
    runner = threading.Thread(target=lambda: summary.append(attack.run(sidecar, stop)), daemon=True)
    done = threading.Event()
    poller = threading.Thread(target=poll_healthz, args=(sidecar, done, latencies), daemon=True)
    poller.start()
    runner.start()
    runner.join(seconds)
    stop.set()
    runner.join(600)
    # Keep polling until what was accepted is judged: that is when a big batch stalls.
    deadline = time.monotonic() + 120
    while sidecar.stats()["ingest"]["queued_spans"] and time.monotonic() < deadline:
        time.sleep(0.05)
    done.set()
    poller.join(600)
    return latencies, summary[0] if summary else "(the attack did not finish)"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per attack (default 10)")
    parser.add_argument(
        "--only", action="append", default=[], help="run only this attack (repeatable)"
    )
    add_sidecar_arguments(parser)
    args = parser.parse_args(argv)
    known = {a.name for a in ATTACKS}
    for name in args.only:
        if name not in known:
            parser.error(f"unknown attack {name!r}; known: {', '.join(sorted(known))}")
    return args, sidecar_env(parser, args)


def main(argv: list[str] | None = None) -> int:
    args, env = parse_args(argv)
    print(command_line())
    attacks = [a for a in ATTACKS if not args.only or a.name in args.only]
    rows: list[list[str]] = []
    worst = 0.0
    with running_sidecar(env) as sidecar:
        for attack in attacks:
            latencies, summary = measure(sidecar, attack, args.seconds)
            p50 = percentile(latencies, 0.5) * 1000
            p99 = percentile(latencies, 0.99) * 1000
            top = max(latencies) * 1000
            worst = max(worst, p99)
            rss = rss_bytes(sidecar.pid) / 2**20
            rows.append(
                [
                    attack.name,
                    str(len(latencies)),
                    f"{p50:.1f}",
                    f"{p99:.1f}",
                    f"{top:.0f}",
                    f"{rss:.0f}",
                ]
            )
            print(f"{attack.name}: {attack.what}\n    {summary}", flush=True)
        ingest = sidecar.stats()["ingest"]
    print()
    print(table(["attack", "polls", "p50 ms", "p99 ms", "max ms", "RSS MiB after"], rows))
    print(f"ingest counters: {json.dumps(ingest)}")
    verdict = "met" if worst <= GOAL_P99_MS else "NOT met"
    print(f"goal /healthz p99 <= {GOAL_P99_MS:.0f} ms under every attack: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
