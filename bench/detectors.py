"""Run detectors' cost: spans per CPU-second with the run tracker off and on, side by side.

    python bench/detectors.py [--repeat 7] [--spans 50000] [--transport http]

Two sidecars run at once on the same machine, one with ``track_runs`` off
and one with it on (run progress, loops and stalls; the built-in policy's
detectors). Each repetition sends the same kind of load to one, then the
other, alternating which goes first, so a drifting machine affects both
alike. The figure is the ratio of the medians (goal: the tracker costs at
most 10%, i.e. on/off >= 0.90), and the median of the per-repetition ratios.
Before the first repetition each sidecar gets ``--warmup-spans``, enough to
fill the 'on' sidecar's run table: every repetition then measures a table
that churns (a run created and one evicted every few spans), not one filling.

With ``--together``, each repetition sends the same spans to both sidecars at
once, from two sets of sending threads, so that both are measured over the
same seconds of a machine whose speed drifts from one second to the next.
Sent as fast as they take them, the two still differ in load: whichever falls
behind reads more requests per turn of its event loop, which costs less per
span, and the per-repetition ratios spread by +-15%. ``--rate`` paces the
load instead (spans per second to each, below what either can take): every
request goes to both sidecars at the same moment, so both see the same
arrivals and do the same work per request, and the ratio measures the
tracker rather than who fell behind.

What is measured is detection, not what the policy then does: the bench's
spans do contain loops (a generated run may call ``web_search`` three times
with the same query), and the built-in policy would send each one a
remediation (a DBOS workflow, ~10 ms of CPU). Both sidecars get a policy
whose decision for ``reasoning_loop`` and ``stall`` is ``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import threading
from pathlib import Path
from statistics import median
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

from bench.harness import (
    BenchError,
    SendResult,
    Sidecar,
    command_line,
    cpu_seconds,
    cpu_split,
    make_sender,
    running_sidecar,
    table,
)
from bench.ingest import Measurement, _Ids, measure, repetition_load

GOAL_RATIO = 0.90
#: Detections are decided but not acted on (see the module docstring).
POLICY = """\
version: 1
policies:
  - name: bench.detections
    match: {kind: [reasoning_loop, stall]}
    action: none
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=50_000, help="per sidecar per repetition")
    parser.add_argument("--spans-per-request", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--transport", choices=("http", "grpc"), default="http")
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--failure-rate", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument(
        "--warmup-spans",
        type=int,
        default=100_000,
        help="sent to each sidecar before measuring (100000: enough to fill the 'on'"
        " sidecar's table of 10,000 runs, so that every repetition creates and evicts runs)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="send each repetition to both sidecars at once (default: one, then the other)",
    )
    parser.add_argument(
        "--rate",
        type=int,
        default=0,
        help="with --together: spans per second to each sidecar, each request sent to both"
        " at the same moment (0: as fast as they take them); keep it below what either"
        " takes (e.g. 8000)",
    )
    args = parser.parse_args(argv)
    if args.rate < 0 or (args.rate and not args.together):
        parser.error("--rate must be >= 0 and needs --together")
    return args


def measure_together(
    sidecars: list[Sidecar], payloads: list[bytes], spans: int, args: argparse.Namespace
) -> list[Measurement]:
    """The same payloads sent to every sidecar at once; each one's CPU over that time."""
    results: list[Measurement | BaseException | None] = [None] * len(sidecars)

    def run(index: int, sidecar: Sidecar) -> None:
        try:
            results[index] = measure(sidecar, args.transport, payloads, spans, args)
        except BaseException as exc:  # handed to the caller below
            results[index] = exc

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(sidecars)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=args.timeout + 60)
    measured: list[Measurement] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        if result is None:
            raise BenchError("a sender did not finish in time")
        measured.append(result)
    return measured


def measure_paced(
    sidecars: list[Sidecar], payloads: list[bytes], spans: int, args: argparse.Namespace
) -> list[Measurement]:
    """Each payload sent to every sidecar at the same tick, ``args.rate`` spans a second."""
    interval = args.spans_per_request / args.rate
    senders = [make_sender(args.transport, sidecar) for sidecar in sidecars]
    results = [SendResult() for _ in sidecars]
    pools = [ThreadPoolExecutor(max_workers=args.concurrency) for _ in sidecars]
    try:
        targets = [sidecar.processed() + spans for sidecar in sidecars]
        cpu_before = [cpu_seconds(sidecar.pid) for sidecar in sidecars]
        started = time.monotonic()
        sent: list[Future[None]] = []
        for tick, payload in enumerate(payloads):
            delay = started + tick * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing, not synchronisation
            order = range(len(sidecars)) if tick % 2 == 0 else reversed(range(len(sidecars)))
            for k in order:  # neither is always first
                sent.append(pools[k].submit(senders[k].send, payload, results[k]))
        for future in sent:
            future.result(timeout=args.timeout)  # re-raises a sending error
        behind = time.monotonic() - started - len(payloads) * interval
        if behind > 0.2 * len(payloads) * interval:
            print(f"  (sending fell {behind:.1f} s behind the schedule: lower --rate)", flush=True)
        finished = [
            sidecar.wait_processed(target, args.timeout)
            for sidecar, target in zip(sidecars, targets, strict=True)
        ]
        cpu_after = [cpu_seconds(sidecar.pid) for sidecar in sidecars]
    finally:
        for pool in pools:
            pool.shutdown(wait=True)
        for sender in senders:
            sender.close()
    return [
        Measurement(args.transport, spans, end - started, after - before, result.throttled)
        for end, before, after, result in zip(finished, cpu_before, cpu_after, results, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    n_requests, spans, pool = repetition_load(args)
    ids = _Ids()
    off: list[Measurement] = []
    on: list[Measurement] = []
    try:
        with contextlib.ExitStack() as stack:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            policy = folder / "policy.yaml"
            policy.write_text(POLICY)
            env = {"SPANVISOR_POLICY": str(policy)}
            sidecar_off = stack.enter_context(
                running_sidecar({**env, "SPANVISOR_TRACK_RUNS": "false"})
            )
            sidecar_on = stack.enter_context(
                running_sidecar({**env, "SPANVISOR_TRACK_RUNS": "true"})
            )
            warm_requests = max(1, math.ceil(args.warmup_spans / args.spans_per_request))
            for sidecar in (sidecar_off, sidecar_on):  # warm-up: the 'on' table fills
                warm = ids.fresh(pool, warm_requests)
                measure(sidecar, args.transport, warm, warm_requests * args.spans_per_request, args)
            threads_before = [sidecar_off.threads(), sidecar_on.threads()]
            gc_before = [sidecar_off.stats().get("gc", {}), sidecar_on.stats().get("gc", {})]
            for rep in range(args.repeat):
                if args.together:
                    payloads = ids.fresh(pool, n_requests)
                    measure_both = measure_paced if args.rate else measure_together
                    pair = measure_both([sidecar_off, sidecar_on], payloads, spans, args)
                    off.append(pair[0])
                    on.append(pair[1])
                else:
                    order = [(sidecar_off, off), (sidecar_on, on)]
                    if rep % 2:
                        order.reverse()
                    for sidecar, results in order:
                        payloads = ids.fresh(pool, n_requests)
                        results.append(measure(sidecar, args.transport, payloads, spans, args))
                print(
                    f"  rep {rep + 1}/{args.repeat}: off {off[-1].per_cpu_s:,.0f},"
                    f" on {on[-1].per_cpu_s:,.0f} spans/CPU-s"
                    f" (on/off {on[-1].per_cpu_s / off[-1].per_cpu_s:.3f})",
                    flush=True,
                )
            threads_after = [sidecar_off.threads(), sidecar_on.threads()]
            gc_after = [sidecar_off.stats().get("gc", {}), sidecar_on.stats().get("gc", {})]
            on_stats = sidecar_on.stats()
            tracked = on_stats.get("runs", {})
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rate_off = median(m.per_cpu_s for m in off)
    rate_on = median(m.per_cpu_s for m in on)
    pairs = median(b.per_cpu_s / a.per_cpu_s for a, b in zip(off, on, strict=True))
    print()
    print(
        f"{args.repeat} repetitions of {spans:,} spans over {args.transport},"
        f" {'to both at once' if args.together else 'alternating'}"
        f"{f', paced at {args.rate:,} spans/s' if args.rate else ''};"
        f" {args.failure_rate:.0%} failing spans"
    )
    print(
        table(
            ["run tracker", "spans/CPU-s (median)", "min-max"],
            [
                ["off", f"{rate_off:,.0f}", _range(off)],
                ["on", f"{rate_on:,.0f}", _range(on)],
            ],
        )
    )
    ratio = rate_on / rate_off
    print(f"on/off: {ratio:.3f} (medians), {pairs:.3f} (median of per-repetition ratios)")
    for name, before, after in zip(("off", "on"), threads_before, threads_after, strict=True):
        print(f"\nwhere the '{name}' sidecar's CPU went:")
        print(cpu_split(before, after, spans * args.repeat))
    for name, before, after in zip(("off", "on"), gc_before, gc_after, strict=True):
        print(f"'{name}' sidecar, {_collections(before, after, spans * args.repeat)}")
    print(f"runs tracked by the 'on' sidecar at the end: {tracked}")
    print(f"its remediations: {on_stats.get('remediations', {})}")
    print(f"goal on/off >= {GOAL_RATIO}: {'yes' if ratio >= GOAL_RATIO else 'NO'}")
    return 0


def _collections(before: dict[str, Any], after: dict[str, Any], spans: int) -> str:
    """Garbage collection's share over the measured spans (``/v1/stats`` ``gc``)."""
    if not after.get("managed"):
        return "garbage collection: left to CPython (not measured)"
    parts = []
    for kind in ("young", "full"):
        count = after[kind] - before.get(kind, 0)
        ms = after[f"{kind}_total_ms"] - before.get(f"{kind}_total_ms", 0.0)
        parts.append(f"{count} {kind} collections, {ms:,.0f} ms ({ms * 1e3 / spans:.2f} us/span)")
    return "garbage collection: " + "; ".join(parts)


def _range(ms: list[Measurement]) -> str:
    rates = [m.per_cpu_s for m in ms]
    return f"{min(rates):,.0f}-{max(rates):,.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
