"""Where the span path's CPU time goes: each stage, per span, in process.

    python bench/stages.py [--batches 32] [--repeat 7] [--failure-rate 0.05]

``bench/ingest.py`` says how fast the whole sidecar is and
``bench/instructions.py`` counts instructions without noise; neither says
which stage the time goes to. This runs the stages of ``Sidecar.handle`` one
at a time over the same batches (``bench/ingest.py``'s: 500 spans, fresh
ids) and times each with this thread's CPU clock, ``--repeat`` times,
alternating; it prints medians with their range:

* ingest's check of each span's ids (:func:`supervisor.ingest.codec.validate_spans`),
  on requests already decoded;
* the stages every span passes: the views of its spans
  (:func:`supervisor.normalize.read_spans`, which decodes the request: its
  parse alone is the ``decode`` row, for reference), the two screens, the
  dependency, the run tracker (on a table already full of
  ``--tracked-runs`` runs, so that new runs evict old ones);
* the whole span path (both passes, the reports, the store's transaction)
  with the tracker off and on, on batches without failures and on batches
  with ``--failure-rate`` of them;
* what one failure costs: batches without injected failures and batches
  with half their spans failing, one after the other, tracker off; their
  difference in each repetition, divided by the failures judged (medians
  of the repetitions), split into judging (normalization, classification,
  decision), reporting (the ``spanvisor.decide`` span, the failure list)
  and storing (the incident and its commands in SQLite, which the sidecar
  does on a thread of its own).

Not measured: the receivers, the threads' hand-offs, remediations.
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/stages.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import command_line, table
from bench.inprocess import SPANS_PER_REQUEST, handle, make_sidecar
from bench.spans import make_requests, with_fresh_ids

#: The failure rate of the load that prices one failure: failures must dominate its
#: cost, or the machine's noise does (at 5% a failure's cost is a quarter of the whole).
COST_RATE = 0.5


@dataclass
class Timings:
    """CPU microseconds per unit of each measured thing, one entry per repetition."""

    values: dict[str, list[float]]

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def span(self, name: str, digits: int = 2) -> str:
        found = self.values[name]
        return f"{min(found):.{digits}f}-{max(found):.{digits}f}"


def _cpu_us(work: Callable[[], object]) -> float:
    started = time.thread_time()
    work()
    return (time.thread_time() - started) * 1e6


class _Bench:
    """Two in-process sidecars (tracker off and on) and the batches they judge."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.off = make_sidecar(folder, track=False, tracked_runs=args.tracked_runs)
        self.on = make_sidecar(folder, track=True, tracked_runs=args.tracked_runs)
        self.pools = {
            0.0: make_requests(16, SPANS_PER_REQUEST, 0.0, seed=11),
            args.failure_rate: make_requests(16, SPANS_PER_REQUEST, args.failure_rate, seed=11),
            COST_RATE: make_requests(16, SPANS_PER_REQUEST, COST_RATE, seed=11),
        }
        self.batches = args.batches
        self._next_id = 0

    def fresh(self, rate: float) -> list[bytes]:
        """``batches`` requests never sent before (new trace and span ids: new runs)."""
        pool = self.pools[rate]
        out = [
            with_fresh_ids(pool[i % len(pool)], self._next_id + i + 1) for i in range(self.batches)
        ]
        self._next_id += self.batches
        return out

    def handle_all(
        self, sidecar: Any, payloads: Sequence[bytes]
    ) -> tuple[float, float, float, int]:
        """Each request as ``Sidecar.handle`` runs it: (judge, report, store) CPU µs, failures."""
        judge = report = store = 0.0
        failures = 0
        for payload in payloads:
            parts = handle(sidecar, payload, time.time_ns(), time.thread_time)
            judge, report, store = judge + parts[0], report + parts[1], store + parts[2]
            failures += parts[3]
        return judge * 1e6, report * 1e6, store * 1e6, failures

    def close(self) -> None:
        for sidecar in (self.off, self.on):
            sidecar.store.close()


def _time_stages(bench: _Bench, tracker: Any, timings: Timings, spans: int) -> None:
    """One repetition of the stages every span passes, each over the same new batches."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from supervisor.ingest.codec import validate_spans
    from supervisor.normalize import read_spans
    from supervisor.normalize.screen import may_fail_quietly, shows_failure_signal
    from supervisor.normalize.wire import LiteRequest

    ok = bench.fresh(0.0)
    items: list[Any] = []
    timings.add("decode", _cpu_us(lambda: [LiteRequest.FromString(p) for p in ok]) / spans)
    decoded = [ExportTraceServiceRequest.FromString(p) for p in ok]
    timings.add("id check", _cpu_us(lambda: [validate_spans(r) for r in decoded]) / spans)
    timings.add("read_spans", _cpu_us(lambda: items.extend(map(read_spans, ok))) / spans)
    flat = [item for batch in items for item in batch]
    signal = _cpu_us(lambda: [shows_failure_signal(i) for i in flat])
    timings.add("shows_failure_signal", signal / spans)
    timings.add("may_fail_quietly", _cpu_us(lambda: [may_fail_quietly(i) for i in flat]) / spans)
    timings.add("dependency", _cpu_us(lambda: [i.dependency for i in flat]) / spans)

    def observe() -> None:
        for batch in items:
            tracker.observe_all(batch, time.time(), [])
            tracker.settle()

    timings.add("run tracker", _cpu_us(observe) / spans)


def measure(args: argparse.Namespace) -> tuple[Timings, dict[str, float]]:
    """Every stage ``args.repeat`` times; also the failures per span of each load."""
    logging.disable(logging.WARNING)  # "no delivery channel": the commands are dead letters
    folder = Path(tempfile.mkdtemp(prefix="spanvisor-stages-"))
    bench = _Bench(args, folder)
    timings = Timings({})
    per_span: dict[str, float] = {}
    spans = args.batches * SPANS_PER_REQUEST
    try:
        for sidecar in (bench.off, bench.on):  # as `spanvisor run` does: between batches
            sidecar.collector.take_over()
        rate = args.failure_rate
        # Warm-up: imports, memos, and the 'on' table full, so new runs evict old ones.
        warm = max(1, -(-args.tracked_runs * 8 // SPANS_PER_REQUEST))
        for _ in range(-(-warm // args.batches)):
            bench.handle_all(bench.on, bench.fresh(rate))
        bench.handle_all(bench.off, bench.fresh(rate))
        for _ in range(args.repeat):
            _time_stages(bench, bench.on.pipeline.runs, timings, spans)
            gc.collect(0)
            parts: dict[float, tuple[float, float, float, int]] = {}
            for name, sidecar in (("off", bench.off), ("on", bench.on)):
                for load in (0.0, rate):
                    parts[load] = bench.handle_all(sidecar, bench.fresh(load))
                    judge, report, store, failures = parts[load]
                    total = judge + report + store
                    timings.add(f"tracker {name}, {load:.0%} injected", total / spans)
                    per_span[f"{load:.0%}"] = failures / spans
            # What failures add, against batches without them that ran just before.
            parts[0.0] = bench.handle_all(bench.off, bench.fresh(0.0))
            parts[COST_RATE] = bench.handle_all(bench.off, bench.fresh(COST_RATE))
            extra = parts[COST_RATE][3] - parts[0.0][3]
            per_span[f"{COST_RATE:.0%}"] = parts[COST_RATE][3] / spans
            for i, part in enumerate(("judge", "report", "store")):
                timings.add(part, (parts[COST_RATE][i] - parts[0.0][i]) / max(1, extra))
    finally:
        bench.close()
        shutil.rmtree(folder, ignore_errors=True)
    return timings, per_span


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batches", type=int, default=32, help="requests of 500 spans per stage")
    parser.add_argument("--repeat", type=int, default=7, help="repetitions; medians reported")
    parser.add_argument("--failure-rate", type=float, default=0.05, help="(0.05)")
    parser.add_argument(
        "--tracked-runs", type=int, default=10_000, help="the run table's bound (10000)"
    )
    args = parser.parse_args(argv)
    if args.batches < 1 or args.repeat < 1 or args.tracked_runs < 1:
        parser.error("--batches, --repeat and --tracked-runs must be at least 1")
    if not 0 < args.failure_rate < 1:
        parser.error("--failure-rate must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    started = time.monotonic()
    timings, failures = measure(args)
    rate = f"{args.failure_rate:.0%}"
    whole_off = timings.median(f"tracker off, {rate} injected")
    print()
    print(
        f"{args.repeat} repetitions of {args.batches} batches of {SPANS_PER_REQUEST} spans,"
        f" {time.monotonic() - started:.0f} s; CPU µs per span, medians"
    )
    stages = ["decode", "id check", "read_spans", "shows_failure_signal", "may_fail_quietly"]
    stages += ["dependency", "run tracker"]
    wholes = [f"tracker {name}, {load} injected" for name in ("off", "on") for load in ("0%", rate)]
    rows = [
        [
            name if name in stages else f"whole path, {name}",
            f"{timings.median(name):.2f}",
            timings.span(name),
            f"{timings.median(name) / whole_off:.0%}",
        ]
        for name in stages + wholes
    ]
    print(
        table(
            ["stage (decode, id check runtime: for reference)", "µs/span", "min-max", "of whole"],
            rows,
        )
    )
    print()
    print(
        f"one failure (tracker off; {failures[f'{COST_RATE:.0%}']:.3f} failures per span at"
        f" {COST_RATE:.0%} injected, {failures['0%']:.3f} at 0%): what the failing batches"
        " cost more than those without, per failure judged; CPU µs, medians"
    )
    parts = ["judge", "report", "store"]
    rows = [[part, f"{timings.median(part):.0f}", timings.span(part, 0)] for part in parts]
    total = sum(timings.median(part) for part in parts)
    rows.append(["all", f"{total:.0f}", ""])
    print(table(["part", "µs/failure", "min-max"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
