"""Two source trees side by side: the same load sent to both at once, spans per CPU-second.

    python bench/compare.py BEFORE AFTER [--repeat 7] [--spans 50000] [--env KEY=VALUE]

BEFORE and AFTER are source trees of spanvisor (checkouts, ``git worktree``
copies); each sidecar runs ``spanvisor run`` with its tree first on
``PYTHONPATH``, on this virtualenv's dependencies. Each
repetition sends the same new spans (new runs) to both sidecars at once from
two sets of sending threads, so both are measured over the same seconds of a
machine whose speed drifts from one second to the next: the ratio is the
figure to trust, not either rate. Printed: each repetition, the ratio of the
medians and the median of the per-repetition ratios, and where each sidecar's
CPU went, thread by thread.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path
from statistics import median

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.detectors import measure_together
from bench.harness import (
    BenchError,
    add_sidecar_arguments,
    command_line,
    cpu_split,
    running_sidecar,
    sidecar_env,
    table,
)
from bench.ingest import Measurement, _Ids, measure, repetition_load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("before", type=Path, help="source tree of the first build")
    parser.add_argument("after", type=Path, help="source tree of the second build")
    parser.add_argument("--spans", type=int, default=50_000, help="per repetition (50000)")
    parser.add_argument("--spans-per-request", type=int, default=500, help="(500)")
    parser.add_argument("--repeat", type=int, default=7, help="repetitions (7)")
    parser.add_argument("--concurrency", type=int, default=4, help="sending threads each (4)")
    parser.add_argument("--transport", choices=("http", "grpc"), default="http", help="(http)")
    parser.add_argument("--pool", type=int, default=16, help="distinct generated requests (16)")
    parser.add_argument("--failure-rate", type=float, default=0.05, help="(0.05)")
    parser.add_argument(
        "--warmup-spans", type=int, default=20_000, help="sent to each before measuring (20000)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per repetition")
    add_sidecar_arguments(parser)
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    for tree in (args.before, args.after):
        if not (tree / "supervisor" / "__init__.py").is_file():
            parser.error(f"{tree} is not a spanvisor source tree (no supervisor/__init__.py)")
    if min(args.spans, args.spans_per_request, args.repeat, args.concurrency, args.pool) < 1:
        parser.error("--spans, --spans-per-request, --repeat, --concurrency, --pool must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    n_requests, spans, pool = repetition_load(args)
    ids = _Ids()
    names = ("before", "after")
    results: tuple[list[Measurement], list[Measurement]] = ([], [])
    try:
        with contextlib.ExitStack() as stack:
            sidecars = [
                stack.enter_context(
                    running_sidecar({**args.sidecar_env, "PYTHONPATH": str(tree.resolve())})
                )
                for tree in (args.before, args.after)
            ]
            warm_requests = max(1, math.ceil(args.warmup_spans / args.spans_per_request))
            for sidecar in sidecars:
                warm = ids.fresh(pool, warm_requests)
                measure(sidecar, args.transport, warm, warm_requests * args.spans_per_request, args)
            threads_before = [sidecar.threads() for sidecar in sidecars]
            for rep in range(args.repeat):
                pair = measure_together(sidecars, ids.fresh(pool, n_requests), spans, args)
                for measured, result in zip(results, pair, strict=True):
                    measured.append(result)
                print(
                    f"  rep {rep + 1}/{args.repeat}: before {pair[0].per_cpu_s:,.0f},"
                    f" after {pair[1].per_cpu_s:,.0f} spans/CPU-s"
                    f" (after/before {pair[1].per_cpu_s / pair[0].per_cpu_s:.3f})",
                    flush=True,
                )
            threads_after = [sidecar.threads() for sidecar in sidecars]
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rates = [median(m.per_cpu_s for m in measured) for measured in results]
    pairs = median(b.per_cpu_s / a.per_cpu_s for a, b in zip(*results, strict=True))
    print()
    print(
        f"{args.repeat} repetitions of {spans:,} spans over {args.transport} to both at once;"
        f" {args.failure_rate:.0%} failing spans"
    )
    rows = []
    for name, tree, measured, rate in zip(
        names, (args.before, args.after), results, rates, strict=True
    ):
        low, high = min(m.per_cpu_s for m in measured), max(m.per_cpu_s for m in measured)
        rows.append([name, str(tree), f"{rate:,.0f}", f"{low:,.0f}-{high:,.0f}"])
    print(table(["build", "tree", "spans/CPU-s (median)", "min-max"], rows))
    print(
        f"after/before: {rates[1] / rates[0]:.3f} (medians),"
        f" {pairs:.3f} (median of per-repetition ratios)"
    )
    for name, before, after in zip(names, threads_before, threads_after, strict=True):
        print(f"\nwhere the '{name}' sidecar's CPU went:")
        print(cpu_split(before, after, spans * args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
