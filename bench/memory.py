"""Memory under a long stream: does the sidecar's RSS stop growing once its state is full?

Sends 1,000,000 realistic spans (every trace and span id distinct: a pool of
generated requests whose ids are patched per copy) and, every 100,000 spans,
waits until the pipeline has caught up (so the ingest queue is empty and what
remains is retained state: runs, recent failures, seen-failure ids) and reads
``VmRSS`` from ``/proc/<pid>/status``. Bounded state shows as a series that
climbs while the run table and caches fill, then goes flat.

Verdict: the last three samples lie within ``--flat-tolerance`` (default 5 %)
of each other.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/memory.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    BenchError,
    add_sidecar_arguments,
    command_line,
    cpu_seconds,
    make_sender,
    rss_bytes,
    running_sidecar,
    send_all,
    sidecar_env,
    table,
)
from bench.spans import make_requests, with_fresh_ids

MIB = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--spans", type=int, default=1_000_000, help="spans in all (1000000)")
    parser.add_argument(
        "--sample-every", type=int, default=100_000, help="spans between RSS samples (100000)"
    )
    parser.add_argument("--spans-per-request", type=int, default=500, help="(500)")
    parser.add_argument("--transport", choices=["http", "grpc"], default="grpc", help="(grpc)")
    parser.add_argument("--concurrency", type=int, default=4, help="sending threads (4)")
    parser.add_argument("--pool", type=int, default=32, help="distinct generated requests (32)")
    parser.add_argument("--failure-rate", type=float, default=0.05, help="(0.05)")
    parser.add_argument(
        "--flat-tolerance", type=float, default=0.05, help="spread allowed in the last 3 (0.05)"
    )
    add_sidecar_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait per sample (300)"
    )
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    if min(args.spans, args.sample_every, args.spans_per_request, args.concurrency, args.pool) < 1:
        parser.error("sizes and counts must be >= 1")
    if args.sample_every < args.spans_per_request:
        parser.error("--sample-every must be at least --spans-per-request")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    spr = args.spans_per_request
    per_sample = math.ceil(args.sample_every / spr)
    samples_wanted = math.ceil(args.spans / (per_sample * spr))
    pool = make_requests(args.pool, spr, args.failure_rate, seed=31)
    series: list[tuple[int, int, float, float]] = []  # spans, rss, seconds, cpu
    index = 0
    try:
        with running_sidecar(args.sidecar_env) as sidecar:
            sender = make_sender(args.transport, sidecar)
            try:
                started = time.monotonic()
                series.append((0, rss_bytes(sidecar.pid), 0.0, cpu_seconds(sidecar.pid)))
                processed0 = sidecar.processed()
                sent = 0
                for _ in range(samples_wanted):
                    batch = [
                        with_fresh_ids(pool[(index + i) % len(pool)], index + i)
                        for i in range(per_sample)
                    ]
                    index += per_sample
                    send_all(sender, batch, args.concurrency)
                    sent += per_sample * spr
                    sidecar.wait_processed(processed0 + sent, args.timeout)
                    series.append(
                        (
                            sent,
                            rss_bytes(sidecar.pid),
                            time.monotonic() - started,
                            cpu_seconds(sidecar.pid),
                        )
                    )
                    print(f"  {sent:>10,} spans  RSS {series[-1][1] / MIB:8.1f} MiB", flush=True)
                final = sidecar.stats()
            finally:
                sender.close()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rows = []
    for i, (spans, rss, seconds, cpu) in enumerate(series):
        delta = "" if i == 0 else f"{(rss - series[i - 1][1]) / MIB:+.1f}"
        rows.append([f"{spans:,}", f"{rss / MIB:.1f}", delta, f"{seconds:.1f}", f"{cpu:.1f}"])
    print()
    print(f"{args.transport}, {spr} spans/request, {args.failure_rate:.0%} failing spans")
    print(table(["spans sent", "RSS MiB", "delta MiB", "wall s", "sidecar CPU s"], rows))
    if len(series) >= 5:
        half = len(series) // 2
        early, late = _slope(series[: half + 1]), _slope(series[half:])
        print(
            f"RSS growth per 100,000 spans: {early:+.1f} MiB over the first half, "
            f"{late:+.1f} MiB over the second half (least squares)"
        )
    last = [rss for _, rss, _, _ in series[-3:]]
    spread = (max(last) - min(last)) / max(last)
    flat = len(series) >= 4 and spread <= args.flat_tolerance
    print(
        f"last 3 samples spread {spread:.1%} (tolerance {args.flat_tolerance:.0%}): "
        + ("RSS stopped growing" if flat else "RSS STILL GROWING (or too few samples)")
    )
    print("sidecar stats at the end: " + json.dumps(final, separators=(",", ":")))
    return 0


def _slope(points: list[tuple[int, int, float, float]]) -> float:
    """Least-squares RSS growth in MiB per 100,000 spans."""
    xs = [spans / 100_000 for spans, _, _, _ in points]
    ys = [rss / MIB for _, rss, _, _ in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


if __name__ == "__main__":
    sys.exit(main())
