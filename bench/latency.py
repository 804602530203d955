"""Decision latency under a steady load: span receipt to ``spanvisor.decide`` emitted.

Sends realistic requests at a fixed rate (default 10,000 spans/s as 20
requests/s of 500 spans, paced by the monotonic clock) for a number of
seconds, waits until the pipeline has processed everything, then reads the
sidecar's own latency percentiles from ``/v1/stats`` (``decisions.latency_ms``:
the last 10,000 decisions, measured inside the sidecar from the moment a
request was received to the moment its decision was emitted). The client's
own round trip per request and the sidecar's CPU use are reported beside it.

Goal: p99 < 20 ms.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/latency.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    BenchError,
    Sender,
    SendResult,
    add_sidecar_arguments,
    command_line,
    cpu_seconds,
    make_sender,
    percentile,
    running_sidecar,
    sidecar_env,
    table,
)
from bench.spans import make_requests, with_fresh_ids

GOAL_P99_MS = 20.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rate", type=int, default=10_000, help="spans per second (10000)")
    parser.add_argument("--spans-per-request", type=int, default=500, help="(500)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (20)")
    parser.add_argument("--transport", choices=["http", "grpc"], default="http", help="(http)")
    parser.add_argument("--concurrency", type=int, default=8, help="sending threads (8)")
    parser.add_argument("--pool", type=int, default=16, help="distinct generated requests (16)")
    parser.add_argument("--failure-rate", type=float, default=0.05, help="(0.05)")
    add_sidecar_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for processing (120)"
    )
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    if min(args.rate, args.spans_per_request, args.concurrency, args.pool) < 1:
        parser.error("--rate, --spans-per-request, --concurrency, --pool must be >= 1")
    if not 0 < args.duration <= 3600:
        parser.error("--duration must be in (0, 3600] seconds")
    return args


class _Paced:
    """Sends one request per tick on worker threads; never more than a bounded backlog."""

    def __init__(self, sender: Sender, pool: list[bytes], concurrency: int) -> None:
        self.sender = sender
        self.pool = pool
        self.executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="send")
        self.max_in_flight = 4 * concurrency
        self.in_flight: set[Future[SendResult]] = set()
        self.done: list[Future[SendResult]] = []
        self.missed = 0
        self.index = 0
        self._lock = threading.Lock()

    def _send(self, index: int) -> SendResult:
        payload = with_fresh_ids(self.pool[index % len(self.pool)], index)
        result = SendResult()
        self.sender.send(payload, result)
        return result

    def _finished(self, future: Future[SendResult]) -> None:
        with self._lock:
            self.in_flight.discard(future)
            self.done.append(future)

    def tick(self) -> None:
        with self._lock:
            if len(self.in_flight) >= self.max_in_flight:
                self.missed += 1
                return
            future = self.executor.submit(self._send, self.index)
            self.in_flight.add(future)
        self.index += 1
        future.add_done_callback(self._finished)

    def run(self, interval_s: float, duration_s: float) -> float:
        """Tick every ``interval_s`` for ``duration_s``; returns the seconds the load lasted.

        That is the whole schedule (ticks x interval) or longer if sending fell behind.
        """
        started = time.monotonic()
        ticks = max(1, round(duration_s / interval_s))
        for tick in range(ticks):
            delay = started + tick * interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing, not synchronisation
            self.tick()
        self.executor.shutdown(wait=True)
        return max(time.monotonic() - started, ticks * interval_s)

    def result(self) -> SendResult:
        total = SendResult()
        for future in self.done:
            part = future.result()  # re-raises a sending error
            total.requests += part.requests
            total.throttled += part.throttled
            total.latencies_s.extend(part.latencies_s)
        return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    spr = args.spans_per_request
    interval = spr / args.rate
    pool = make_requests(args.pool, spr, args.failure_rate, seed=23)
    try:
        with running_sidecar(args.sidecar_env) as sidecar:
            sender = make_sender(args.transport, sidecar)
            try:
                warm = _Paced(sender, pool, args.concurrency)
                warm.index = 2**30  # ids apart from the measured ones
                warm.run(interval, min(1.0, args.duration))
                warm.result()
                before = sidecar.stats()
                cpu_before = cpu_seconds(sidecar.pid)
                paced = _Paced(sender, pool, args.concurrency)
                took = paced.run(interval, args.duration)
                sent = paced.result()
                target = before["pipeline"]["processed_spans"] + sent.requests * spr
                sidecar.wait_processed(target, args.timeout)
                cpu = cpu_seconds(sidecar.pid) - cpu_before
                after = sidecar.stats()
            finally:
                sender.close()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    latency = after["decisions"]["latency_ms"]
    decisions = after["pipeline"]["failures"] - before["pipeline"]["failures"]
    remediations = _started(after) - _started(before)
    throttled_spans = after["ingest"]["throttled_spans"] - before["ingest"]["throttled_spans"]
    p99 = latency["p99"]
    ok = p99 is not None and p99 < GOAL_P99_MS
    achieved = sent.requests * spr / took
    print()
    print(
        f"{args.transport}, {spr} spans/request every {interval * 1000:.1f} ms for "
        f"{args.duration:g} s, {args.failure_rate:.0%} failing spans"
    )
    print(
        table(
            ["figure", "value"],
            [
                ["target rate (spans/s)", f"{args.rate:,}"],
                ["achieved rate (spans/s)", f"{achieved:,.0f}"],
                ["requests sent", f"{sent.requests:,}"],
                ["ticks skipped (backlog full)", f"{paced.missed:,}"],
                ["throttled requests (client)", f"{sent.throttled:,}"],
                ["throttled spans (sidecar)", f"{throttled_spans:,}"],
                ["decisions in this run", f"{decisions:,}"],
                ["remediations started", f"{remediations:,}"],
                ["decision latency p50 (ms)", _ms(latency["p50"])],
                ["decision latency p99 (ms)", _ms(p99)],
                ["latency samples (window)", f"{min(latency['count'], 10_000):,}"],
                ["client round trip p50 (ms)", f"{percentile(sent.latencies_s, 0.5) * 1000:.1f}"],
                ["client round trip p99 (ms)", f"{percentile(sent.latencies_s, 0.99) * 1000:.1f}"],
                ["sidecar CPU (% of one core)", f"{cpu / took * 100:.0f}"],
                [f"p99 < {GOAL_P99_MS:g} ms", "yes" if ok else "NO"],
            ],
        )
    )
    return 0


def _started(stats: dict[str, Any]) -> int:
    """Remediations the runner started; 0 before the first one launched it."""
    return int(stats.get("remediations", {}).get("dispatched", 0))


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
