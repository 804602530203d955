"""Instructions per span of the span path, run tracker off and on: a figure free of noise.

    python bench/instructions.py [--batches 40] [--warmup 60] [--tracked-runs 1000]

CPU time on a shared two-core machine drifts by a fifth from one minute to the
next, more than the effects worth measuring. Instructions do not: this runs
what ``Sidecar.handle`` does for a batch (both passes of the pipeline, the
reports with their ``spanvisor.decide`` spans, made but not exported as there
is no downstream, and the store's transaction for the batch's failures) in
process, under ``valgrind --tool=cachegrind``, and counts instructions. Each
configuration runs twice, with ``--warmup`` batches and with ``--warmup`` +
``--batches``; the difference, per span, is the cost
of a warm span path, start-up and imports excluded. The batches are
``bench/ingest.py``'s (500 spans, 5% failing, fresh ids) with the policy of
``bench/detectors.py``; ``--tracked-runs`` is small so that the warm-up
fills the run table and the measured batches create and evict runs, as a busy
sidecar's do. The same code counts within about 0.2% from run to run: breakers
and the store read the clock, which valgrind slows down.

Not in the figure: the receivers (decoding, HTTP or gRPC), the threads, and
what memory costs beyond instructions. The tracker touches cold memory (a run
created and one evicted every few spans); CPU time pays for those misses and
instructions do not, so its share of CPU time is higher than its share here.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/instructions.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import command_line, table
from bench.inprocess import SPANS_PER_REQUEST

_I_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
_LL_MISSES = re.compile(r"LL misses:\s+([\d,]+)")


def parse_i_refs(report: str) -> int:
    """The instruction count in cachegrind's summary (``==pid== I refs: 1,234``)."""
    found = _I_REFS.search(report)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{report[-2000:]}")
    return int(found.group(1).replace(",", ""))


def parse_ll_misses(report: str) -> int | None:
    """Last-level cache misses in cachegrind's summary; None without ``--cache-sim=yes``."""
    found = _LL_MISSES.search(report)
    return None if found is None else int(found.group(1).replace(",", ""))


def _child(args: argparse.Namespace) -> None:
    """The measured work: ``args.warmup + args.batches`` batches, judged and stored."""
    import logging

    from bench.inprocess import handle, make_sidecar
    from bench.spans import make_requests, with_fresh_ids

    logging.disable(logging.WARNING)  # "no delivery channel": the commands are dead letters
    folder = Path(tempfile.mkdtemp(prefix="spanvisor-instructions-"))
    try:
        sidecar = make_sidecar(folder, track=args.track, tracked_runs=args.tracked_runs)
        sidecar.collector.take_over()  # as `spanvisor run` does
        pool = make_requests(16, SPANS_PER_REQUEST, 0.05, seed=11)
        # The same payloads for both run lengths: only how many are judged differs.
        payloads = [
            with_fresh_ids(pool[i % len(pool)], i + 1)
            for i in range(args.warmup + args.max_batches)
        ]
        start_ns = 1_790_000_000_000_000_000  # fixed: the same decisions every run
        judged = 0
        for i, payload in enumerate(payloads[: args.warmup + args.batches]):
            judged += handle(sidecar, payload, start_ns + i * 10_000_000)[3]
        stats = sidecar.pipeline.stats()
        print(f"{stats.processed_spans} spans, {judged} failures judged and stored")
        sidecar.store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _count(args: argparse.Namespace, *, track: bool, batches: int) -> tuple[int, int | None]:
    """Instructions and last-level misses (None unless simulated) of one child run."""
    cache = ["--cache-sim=yes", f"--LL={args.cache_sim},16,64"] if args.cache_sim else []
    command = [
        "valgrind",
        "--tool=cachegrind",
        *(cache or ["--cache-sim=no"]),
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--track" if track else "--no-track",
        f"--batches={batches}",
        f"--max-batches={args.batches}",
        f"--warmup={args.warmup}",
        f"--tracked-runs={args.tracked_runs}",
    ]
    done = subprocess.run(  # our own script, fixed arguments
        command, capture_output=True, text=True, timeout=args.timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return parse_i_refs(done.stderr), parse_ll_misses(done.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batches", type=int, default=40, help="measured batches of 500 spans")
    parser.add_argument("--warmup", type=int, default=60, help="batches before (both runs)")
    parser.add_argument(
        "--tracked-runs", type=int, default=1000, help="the run table's bound (default: 1000)"
    )
    parser.add_argument(
        "--cache-sim",
        type=int,
        default=0,
        metavar="BYTES",
        help="also count misses of a simulated last-level cache of BYTES (16-way, 64-byte"
        " lines; e.g. 2097152, a core's L2 here); slower",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per valgrind run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--track", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
    parser.add_argument("--max-batches", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.child and (args.batches < 1 or args.warmup < 0 or args.tracked_runs < 1):
        parser.error("--batches and --tracked-runs must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        _child(args)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 1
    print(command_line(), flush=True)
    print("4 runs under valgrind, two at a time", flush=True)
    started = time.monotonic()
    runs = [(track, n) for track in (False, True) for n in (0, args.batches)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(
            zip(runs, pool.map(lambda r: _count(args, track=r[0], batches=r[1]), runs), strict=True)
        )
    spans = args.batches * SPANS_PER_REQUEST

    def per_span(track: bool, what: int) -> float:
        measured, warm = counts[(track, args.batches)][what], counts[(track, 0)][what]
        return (measured - warm) / spans if measured is not None and warm is not None else 0.0

    off, on = per_span(False, 0), per_span(True, 0)
    print()
    print(
        f"{args.batches} batches of {SPANS_PER_REQUEST} spans after {args.warmup} of warm-up,"
        f" {args.tracked_runs:,} tracked runs at most,"
        f" {time.monotonic() - started:.0f} s"
    )
    print(
        table(
            ["run tracker", "instructions/span", "LL misses/span", "warm-up run", "measured run"],
            [
                [
                    "off" if not track else "on",
                    f"{per_span(track, 0):,.0f}",
                    f"{per_span(track, 1):,.1f}" if args.cache_sim else "-",
                    f"{counts[(track, 0)][0]:,}",
                    f"{counts[(track, args.batches)][0]:,}",
                ]
                for track in (False, True)
            ],
        )
    )
    print(f"tracker: +{on - off:,.0f} instructions/span; on/off {off / on:.3f} (instructions)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")  # children inherit: the same hashes each run
    sys.exit(main())
