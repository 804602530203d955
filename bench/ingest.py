"""Ingest throughput: spans the sidecar fully processes per CPU-second, per transport.

Starts ``spanvisor run``, sends the same realistic pre-encoded requests over
OTLP/HTTP protobuf and over OTLP/gRPC, and for each batch measures the
sidecar's CPU seconds (``/proc/<pid>/stat``) from the first byte sent until
``pipeline.processed_spans`` has caught up. CPU seconds, not wall time, is the
figure: on a shared two-core machine the sender steals wall time but not the
sidecar's CPU. For scale, the same payloads are decoded here with the raw
upb protobuf parser (``FromString`` plus a walk over every span): the ratio
says how close to "only decoding" the whole pipeline gets.

Goal: >= 50,000 spans per CPU-second.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/ingest.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from bench.harness import (
    BenchError,
    Sidecar,
    add_sidecar_arguments,
    command_line,
    cpu_seconds,
    cpu_split,
    make_sender,
    median,
    running_sidecar,
    send_all,
    sidecar_env,
    table,
)
from bench.spans import make_requests, span_count, with_fresh_ids

GOAL_SPANS_PER_CPU_S = 50_000


@dataclass(frozen=True)
class Measurement:
    """One batch over one transport."""

    transport: str
    spans: int
    wall_s: float
    cpu_s: float
    throttled: int

    @property
    def per_cpu_s(self) -> float:
        return self.spans / self.cpu_s if self.cpu_s > 0 else math.inf

    @property
    def per_wall_s(self) -> float:
        return self.spans / self.wall_s if self.wall_s > 0 else math.inf


class _Ids:
    """Hands out a new id suffix per payload copy, so no span is ever sent twice."""

    def __init__(self) -> None:
        self.next = 0

    def fresh(self, pool: list[bytes], count: int) -> list[bytes]:
        out = [with_fresh_ids(pool[i % len(pool)], self.next + i) for i in range(count)]
        self.next += count
        return out


def measure(
    sidecar: Sidecar, transport: str, payloads: list[bytes], spans: int, args: argparse.Namespace
) -> Measurement:
    """Send ``payloads`` and wait until the pipeline has processed all of them."""
    sender = make_sender(transport, sidecar)
    try:
        target = sidecar.processed() + spans
        cpu_before = cpu_seconds(sidecar.pid)
        started = time.monotonic()
        result = send_all(sender, payloads, args.concurrency)
        finished = sidecar.wait_processed(target, args.timeout)
        cpu_after = cpu_seconds(sidecar.pid)
    finally:
        sender.close()
    return Measurement(
        transport, spans, finished - started, cpu_after - cpu_before, result.throttled
    )


def raw_decode_per_cpu_s(payloads: list[bytes]) -> float:
    """Spans per CPU-second of parsing the payloads and walking every span, here."""
    started = time.thread_time()
    count = 0
    for payload in payloads:
        request = ExportTraceServiceRequest.FromString(payload)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for _span in scope_spans.spans:
                    count += 1
    elapsed = time.thread_time() - started
    return count / elapsed if elapsed > 0 else math.inf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--spans", type=int, default=50_000, help="spans per transport per repetition (50000)"
    )
    parser.add_argument("--spans-per-request", type=int, default=500, help="(500)")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions; medians reported (5)")
    parser.add_argument("--concurrency", type=int, default=4, help="sending threads (4)")
    parser.add_argument(
        "--transports", default="http,grpc", help="comma-separated: http, grpc (http,grpc)"
    )
    parser.add_argument("--pool", type=int, default=16, help="distinct generated requests (16)")
    parser.add_argument("--failure-rate", type=float, default=0.05, help="(0.05)")
    add_sidecar_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for processing (120)"
    )
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    if min(args.spans, args.spans_per_request, args.repeat, args.concurrency, args.pool) < 1:
        parser.error("--spans, --spans-per-request, --repeat, --concurrency, --pool must be >= 1")
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not args.transports or set(args.transports) - {"http", "grpc"}:
        parser.error("--transports takes http and/or grpc")
    return args


def repetition_load(args: argparse.Namespace) -> tuple[int, int, list[bytes]]:
    """(requests, spans, pool) of one repetition: ``--spans`` in whole requests of
    ``--spans-per-request``, sent as copies of ``--pool`` generated requests."""
    n_requests = math.ceil(args.spans / args.spans_per_request)
    pool = make_requests(
        min(args.pool, n_requests), args.spans_per_request, args.failure_rate, seed=11
    )
    return n_requests, n_requests * args.spans_per_request, pool


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    n_requests, spans, pool = repetition_load(args)
    payload_kib = sum(map(len, pool)) / len(pool) / 1024
    ids = _Ids()
    results: dict[str, list[Measurement]] = {t: [] for t in args.transports}
    raw: list[float] = []
    try:
        with running_sidecar(args.sidecar_env) as sidecar:
            for transport in args.transports:  # warm-up: imports, JIT-free caches, connections
                warm = ids.fresh(pool, min(20, n_requests))
                measure(sidecar, transport, warm, sum(map(span_count, warm)), args)
            before, threads_before = sidecar.stats(), sidecar.threads()
            for rep in range(args.repeat):
                for transport in args.transports:
                    payloads = ids.fresh(pool, n_requests)
                    m = measure(sidecar, transport, payloads, spans, args)
                    results[transport].append(m)
                    if transport == args.transports[0]:
                        raw.append(raw_decode_per_cpu_s(payloads))
                    print(
                        f"  rep {rep + 1}/{args.repeat} {transport:4}: {m.spans} spans, "
                        f"wall {m.wall_s:.2f} s, sidecar CPU {m.cpu_s:.2f} s, "
                        f"{m.per_cpu_s:,.0f} spans/CPU-s, throttled {m.throttled}",
                        flush=True,
                    )
            after, threads_after = sidecar.stats(), sidecar.threads()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    raw_rate = median(raw)
    rows = []
    for transport, ms in results.items():
        rates = [m.per_cpu_s for m in ms]
        rate = median(rates)
        rows.append(
            [
                transport,
                f"{spans:,}",
                f"{median([m.wall_s for m in ms]):.2f}",
                f"{median([m.cpu_s for m in ms]):.2f}",
                f"{rate:,.0f}",
                f"{min(rates):,.0f}-{max(rates):,.0f}",
                f"{median([m.per_wall_s for m in ms]):,.0f}",
                str(sum(m.throttled for m in ms)),
                f"{raw_rate:,.0f}",
                f"{rate / raw_rate:.3f}",
                "yes" if rate >= GOAL_SPANS_PER_CPU_S else "NO",
            ]
        )
    print()
    print(
        f"{args.repeat} repetitions, medians; {args.spans_per_request} spans/request "
        f"(~{payload_kib:.0f} KiB), {args.concurrency} sending threads, "
        f"{args.failure_rate:.0%} failing spans"
    )
    print(
        table(
            [
                "transport",
                "spans/rep",
                "wall s",
                "CPU s",
                "spans/CPU-s",
                "min-max",
                "spans/wall-s",
                "throttled",
                "raw decode/CPU-s",
                "sidecar/raw",
                f">= {GOAL_SPANS_PER_CPU_S:,}",
            ],
            rows,
        )
    )
    print(_counters(before, after))
    print(cpu_split(threads_before, threads_after, spans * args.repeat * len(args.transports)))
    return 0


def _counters(before: dict[str, object], after: dict[str, object]) -> str:
    """The sidecar's own view of the measured batches, as a sanity check."""

    def get(stats: dict[str, object], *path: str) -> int:
        node: object = stats
        for key in path:
            if not isinstance(node, dict):
                return 0
            node = node.get(key, 0)
        return int(node) if isinstance(node, int | float) else 0

    parts = []
    for label, path in (
        ("accepted", ("ingest", "accepted_spans")),
        ("throttled", ("ingest", "throttled_spans")),
        ("processed", ("pipeline", "processed_spans")),
        ("failures judged and decided", ("pipeline", "failures")),
        ("remediations started", ("remediations", "dispatched")),
        ("refused as too many running", ("remediations", "busy")),
    ):
        parts.append(f"{label} {get(after, *path) - get(before, *path):,}")
    return "sidecar counters over the measured batches: " + ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
