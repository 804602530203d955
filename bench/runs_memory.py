"""Open runs and memory: is the run table's resident memory bounded by ``tracked_runs``?

Starts a real sidecar (``SPANVISOR_TRACKED_RUNS``, default 10,000) and sends
the spans of ever more distinct *open* runs: every span has a parent and no
root span is ever sent, so no run ends its turn. Each run is one agent trace
(a fresh trace id) naming its own session (``gen_ai.conversation.id`` or
``session.id``, fresh too), with the spans :mod:`bench.spans` generates
below the root: LLM calls with token usage and output text (GenAI or
OpenInference), tool calls with their arguments and results, HTTP client
spans under some tools. Phases send ``--phases`` times ``tracked_runs`` runs
in all (default 1x, 2x, 5x); after each, the script waits until the pipeline
has judged everything sent, then samples ``VmRSS`` (``/proc/<pid>/status``)
and the ``runs`` counters of ``/v1/stats`` (tracked, evicted, expired).

The same load goes, afterwards, to a second sidecar with
``SPANVISOR_TRACK_RUNS=false`` (no run tracking, same everything else): the
difference in RSS is what the run table costs, and divided by the runs
tracked, an estimate of the memory per open run.

The load judges to no failure unless ``--failure-rate`` asks for some (the
generator's truncated LLM calls end normally here, and no run repeats an answer
or a tool call three times, a loop): failures fill state of their own (stored
incidents and SQLite's page cache, seen-failure ids, remediations) that would
blur the run table's figure.

Run entries: the tracker keys a run by its session when a span names one, else
by its trace id. A trace's spans that arrive before any span naming its
session (HTTP client spans, exported first as they end first) make an entry of
their own, so with sessions the table holds more entries than runs were sent;
the script says so. ``--no-sessions`` sends no session attributes: one entry
a run.

Verdict: once the table is full (tracked == tracked_runs) RSS stops growing:
the last two phases' RSS with tracking on lie within ``--flat-tolerance``
(default 5 %) of each other.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

if __package__ in (None, ""):  # run as `python bench/runs_memory.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    BenchError,
    Sidecar,
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
#: Where a run's session name is rewritten per copy, as the ids are: 12 ASCII bytes
#: (never in the generated text) replaced by 12 hex digits of the copy's index.
RUN_MARK = b"@@run-mark@@"
#: The attributes the generator names a trace's session with.
SESSION_ATTRIBUTES = ("gen_ai.conversation.id", "session.id")
#: Every attribute that names a session, for the sidecar (removed with --no-sessions).
SESSION_KEYS = (
    *SESSION_ATTRIBUTES,
    "traceloop.association.properties.session_id",
    "traceloop.association.properties.conversation_id",
)
#: What the loop detector compares, made distinct per call: the generator draws
#: answers and arguments from a few canned ones, so ~1 % of its runs repeat one
#: three times, a reasoning loop (a detection, a remediation) that is not the
#: run table's memory.
TOOL_ARGUMENTS = ("gen_ai.tool.call.arguments",)
LLM_TEXT = ("llm.output_messages.0.message.content",)
LLM_MESSAGES = ("gen_ai.output.messages",)
#: The generator ends 2 % of LLM calls at their token limit, failures the sidecar
#: reports (output_truncated) whatever --failure-rate says; they end normally here.
#: Failures fill caches of their own (incidents in SQLite and its page cache,
#: seen-failure ids) whose growth is not the run table's.
UNTRUNCATED = {"length": "stop", "max_tokens": "end_turn"}
#: Requests built and sent at a time.
CHUNK = 256


@dataclass(frozen=True)
class Template:
    """A request of ``runs`` open runs; copies get fresh trace, span and session ids."""

    payload: bytes
    runs: int
    spans: int


@dataclass
class Sample:
    """One phase's end, for one sidecar."""

    runs: int
    spans: int
    rss: int
    tracked: int
    evicted: int
    expired: int
    seconds: float
    cpu: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--tracked-runs",
        type=int,
        default=10_000,
        help="sets SPANVISOR_TRACKED_RUNS, the run table's bound (10000)",
    )
    parser.add_argument(
        "--phases",
        default="1,2,5",
        help="runs sent by the end of each phase, in multiples of --tracked-runs (1,2,5)",
    )
    parser.add_argument("--runs-per-request", type=int, default=10, help="(10)")
    parser.add_argument("--pool", type=int, default=32, help="distinct generated requests (32)")
    parser.add_argument(
        "--failure-rate",
        type=float,
        default=0.0,
        help="originating failures among the spans (0: the failure caches stay empty)",
    )
    parser.add_argument("--transport", choices=["http", "grpc"], default="grpc", help="(grpc)")
    parser.add_argument("--concurrency", type=int, default=2, help="sending threads (2)")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds to wait before each sample (1.0)"
    )
    parser.add_argument(
        "--flat-tolerance", type=float, default=0.05, help="spread allowed in the last 2 (0.05)"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the track_runs=false sidecar"
    )
    parser.add_argument(
        "--no-sessions",
        action="store_true",
        help="send no session attributes: each run is its trace (default: a session per run)",
    )
    add_sidecar_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait per phase (300)"
    )
    args = parser.parse_args(argv)
    args.sidecar_env = sidecar_env(parser, args)
    try:
        args.phase_list = [float(p) for p in args.phases.split(",")]
    except ValueError:
        parser.error(f"--phases takes numbers separated by commas, got {args.phases!r}")
    if not args.phase_list or any(p <= 0 for p in args.phase_list):
        parser.error("--phases must be positive")
    if args.phase_list != sorted(args.phase_list):
        parser.error("--phases must increase")
    if min(args.tracked_runs, args.runs_per_request, args.pool, args.concurrency) < 1:
        parser.error("sizes and counts must be >= 1")
    if not 0.0 <= args.failure_rate <= 1.0:
        parser.error("--failure-rate must be between 0 and 1")
    for key in ("SPANVISOR_TRACKED_RUNS", "SPANVISOR_TRACK_RUNS"):
        if key in args.sidecar_env:
            parser.error(f"{key} is set by the script; use --tracked-runs")
    return args


def make_templates(
    pool: int,
    runs_per_request: int,
    failure_rate: float = 0.0,
    *,
    sessions: bool = True,
    seed: int = 47,
) -> list[Template]:
    """``pool`` requests of ``runs_per_request`` open runs each, from :mod:`bench.spans`.

    Generated whole traces lose their root span (so every span has a parent
    and the run stays open); each trace's session attributes get a name of
    their own with :data:`RUN_MARK` in it, for :func:`fresh_copy` (or, with
    ``sessions`` false, are removed: each trace is then a run by its id).
    Tool arguments and LLM answers are made distinct per call (see
    :data:`TOOL_ARGUMENTS`).
    """
    # About 7 spans a trace with its root: generate enough for every template at once.
    per_source = runs_per_request * 9 + 16
    templates: list[Template] = []
    seed_offset = 0
    while len(templates) < pool:
        sources = make_requests(
            pool, per_source, failure_rate, seed=seed + seed_offset, start_ns=None
        )
        seed_offset += 1
        for source in sources:
            request = ExportTraceServiceRequest.FromString(source)
            traces: list[bytes] = []
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        if span.parent_span_id and span.trace_id not in traces:
                            traces.append(span.trace_id)
            for first in range(0, len(traces) - runs_per_request + 1, runs_per_request):
                chosen = traces[first : first + runs_per_request]
                templates.append(_template(request, chosen, len(templates), sessions))
                if len(templates) == pool:
                    return templates
    return templates


def _template(
    source: ExportTraceServiceRequest, traces: list[bytes], number: int, sessions: bool
) -> Template:
    slot = {trace: i for i, trace in enumerate(traces)}
    out = ExportTraceServiceRequest()
    spans = 0
    for rs in source.resource_spans:
        new_rs = None
        for ss in rs.scope_spans:
            kept = [s for s in ss.spans if s.parent_span_id and s.trace_id in slot]
            if not kept:
                continue
            if new_rs is None:
                new_rs = out.resource_spans.add()
                new_rs.resource.CopyFrom(rs.resource)
                new_rs.schema_url = rs.schema_url
            new_ss = new_rs.scope_spans.add()
            new_ss.scope.CopyFrom(ss.scope)
            for span in kept:
                copy = new_ss.spans.add()
                copy.CopyFrom(span)
                if not sessions:
                    kept_attributes = [
                        KeyValue(key=kv.key, value=kv.value)
                        for kv in copy.attributes
                        if kv.key not in SESSION_KEYS
                    ]
                    del copy.attributes[:]
                    copy.attributes.extend(kept_attributes)
                oi_tool = any(
                    kv.key == "openinference.span.kind" and kv.value.string_value == "TOOL"
                    for kv in copy.attributes
                )
                for kv in copy.attributes:
                    if kv.key in SESSION_ATTRIBUTES:
                        name = f"sess-{number:04d}-{slot[span.trace_id]:04d}-"
                        kv.value.string_value = name + RUN_MARK.decode()
                    elif kv.key in TOOL_ARGUMENTS or (oi_tool and kv.key == "input.value"):
                        arguments = json.loads(kv.value.string_value)
                        arguments["request_id"] = f"req-{spans}"
                        kv.value.string_value = json.dumps(arguments)
                    elif kv.key in LLM_TEXT:
                        kv.value.string_value += f" (ref {spans})"
                    elif kv.key == "gen_ai.response.finish_reasons":
                        for value in kv.value.array_value.values:
                            value.string_value = UNTRUNCATED.get(
                                value.string_value, value.string_value
                            )
                    elif kv.key in LLM_MESSAGES:
                        messages = json.loads(kv.value.string_value)
                        for message in messages:
                            reason = message.get("finish_reason")
                            message["finish_reason"] = UNTRUNCATED.get(reason, reason)
                            for part in message.get("parts", ()):
                                if part.get("type") == "text":
                                    part["content"] += f" (ref {spans})"
                        kv.value.string_value = json.dumps(messages)
                spans += 1
    return Template(out.SerializeToString(), len(traces), spans)


def fresh_copy(template: Template, index: int) -> bytes:
    """The template with fresh trace and span ids and session names for copy ``index``."""
    return with_fresh_ids(template.payload, index).replace(RUN_MARK, f"{index:012x}".encode())


def measure(
    args: argparse.Namespace, templates: list[Template], track: bool
) -> tuple[list[Sample], dict[str, object]]:
    """One sidecar through every phase; a sample at the start and after each phase."""
    env = dict(args.sidecar_env)
    env["SPANVISOR_TRACKED_RUNS"] = str(args.tracked_runs)
    env["SPANVISOR_TRACK_RUNS"] = "true" if track else "false"
    label = "on " if track else "off"
    samples: list[Sample] = []
    with running_sidecar(env) as sidecar:
        sender = make_sender(args.transport, sidecar)
        try:
            started = time.monotonic()
            processed0 = sidecar.processed()
            samples.append(_sample(sidecar, 0, 0, started))
            runs = spans = index = 0
            for multiple in args.phase_list:
                target = round(multiple * args.tracked_runs)
                while runs < target:  # in chunks: a phase's copies would take 100s of MiB
                    batch: list[bytes] = []
                    while runs < target and len(batch) < CHUNK:
                        template = templates[index % len(templates)]
                        batch.append(fresh_copy(template, index))
                        runs += template.runs
                        spans += template.spans
                        index += 1
                    send_all(sender, batch, args.concurrency)
                sidecar.wait_processed(processed0 + spans, args.timeout)
                time.sleep(args.settle)
                samples.append(_sample(sidecar, runs, spans, started))
                last = samples[-1]
                print(
                    f"  tracking {label}: {runs:>9,} runs sent  tracked {last.tracked:>9,}"
                    f"  evicted {last.evicted:>9,}  RSS {last.rss / MIB:8.1f} MiB",
                    flush=True,
                )
            final = sidecar.stats()
        finally:
            sender.close()
    return samples, final


def _sample(sidecar: Sidecar, runs: int, spans: int, started: float) -> Sample:
    counters = sidecar.stats().get("runs") or {}
    return Sample(
        runs=runs,
        spans=spans,
        rss=rss_bytes(sidecar.pid),
        tracked=int(counters.get("tracked", 0)),
        evicted=int(counters.get("evicted", 0)),
        expired=int(counters.get("expired", 0)),
        seconds=time.monotonic() - started,
        cpu=cpu_seconds(sidecar.pid),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(command_line(), flush=True)
    generated = time.monotonic()
    templates = make_templates(
        args.pool, args.runs_per_request, args.failure_rate, sessions=not args.no_sessions
    )
    runs_in_pool = sum(t.runs for t in templates)
    spans_in_pool = sum(t.spans for t in templates)
    bytes_in_pool = sum(len(t.payload) for t in templates)
    print(
        f"load: {len(templates)} generated requests of {args.runs_per_request} open runs, "
        f"{spans_in_pool / runs_in_pool:.1f} spans and {bytes_in_pool / runs_in_pool / 1024:.1f}"
        f" KiB (OTLP protobuf) a run on average, no root spans; "
        f"generated in {time.monotonic() - generated:.1f} s",
        flush=True,
    )
    try:
        on, final_on = measure(args, templates, track=True)
        off: list[Sample] | None = None
        final_off: dict[str, object] | None = None
        if not args.no_baseline:
            off, final_off = measure(args, templates, track=False)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rows = []
    for i, sample in enumerate(on):
        base = off[i] if off is not None else None
        per_run = (
            f"{(sample.rss - base.rss) / sample.tracked / 1024:.2f}"
            if base is not None and sample.tracked
            else "-"
        )
        rows.append(
            [
                f"{sample.runs:,}",
                f"{sample.spans:,}",
                f"{sample.tracked:,}",
                f"{sample.evicted:,}",
                f"{sample.rss / MIB:.1f}",
                f"{base.rss / MIB:.1f}" if base is not None else "-",
                f"{(sample.rss - base.rss) / MIB:+.1f}" if base is not None else "-",
                per_run,
            ]
        )
    print()
    print(
        f"tracked_runs={args.tracked_runs:,}, {args.transport}, "
        f"{args.runs_per_request} runs/request, {args.failure_rate:.0%} failing spans"
    )
    print(
        table(
            [
                "runs sent",
                "spans sent",
                "runs tracked",
                "evicted",
                "RSS MiB (on)",
                "RSS MiB (off)",
                "on-off MiB",
                "KiB/run",
            ],
            rows,
        )
    )
    print(
        "(first row: the idle sidecar before any span; KiB/run = (RSS on - RSS off) / runs"
        " tracked, per entry of the run table)"
    )
    last_on = on[-1]
    if last_on.expired:
        print(f"note: {last_on.expired:,} run(s) expired (idle past max_idle_s) during the run")
    made = last_on.tracked + last_on.evicted + last_on.expired
    if made != last_on.runs:
        print(
            f"note: the tracker made {made:,} run entries (tracked + evicted + expired) for "
            f"{last_on.runs:,} runs sent, {made / last_on.runs:.2f} a run"
            + (
                ": a trace's spans that arrive before any span naming its session start a"
                " run of their own, keyed by the trace id (--no-sessions: one entry a run)"
                if made > last_on.runs and not args.no_sessions
                else ""
            )
        )
    if last_on.tracked > args.tracked_runs:
        print(f"BOUND BROKEN: {last_on.tracked:,} runs tracked > tracked_runs")
    full = [s for s in on[1:] if s.tracked == args.tracked_runs]
    last_two = [s.rss for s in on[-2:]]
    spread = (max(last_two) - min(last_two)) / max(last_two)
    flat = len(full) >= 2 and on[-2] in full and spread <= args.flat_tolerance
    print(
        f"last 2 phases spread {spread:.1%} with tracking on (tolerance "
        f"{args.flat_tolerance:.0%}), table full in {len(full)} of {len(on) - 1} phases: "
        + ("PASS, RSS stopped growing" if flat else "FAIL, RSS still growing or table not full")
    )
    if off is not None:
        growth = (off[-1].rss - off[-2].rss) / max(off[-1].rss, off[-2].rss)
        print(f"baseline (tracking off) over the last 2 phases: {growth:+.1%}")
    print(
        f"sidecar CPU: {on[-1].cpu:.1f} s tracking on"
        + (f", {off[-1].cpu:.1f} s off" if off is not None else "")
    )
    print("sidecar stats at the end (on): " + json.dumps(final_on, separators=(",", ":")))
    if final_off is not None:
        print("sidecar stats at the end (off): " + json.dumps(final_off, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
