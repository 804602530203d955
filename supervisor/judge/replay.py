"""Recorded traces in, one verdict per failure out: how users test a policy.

Input, detected from the first byte:

* OTLP/JSON lines, one ``ExportTraceServiceRequest`` per line, as the
  OpenTelemetry Collector's file exporter writes them;
* OTLP protobuf requests, each preceded by its length as 4 bytes big-endian
  (the file exporter's ``format: proto``).

The same file and policy give the same output, byte for byte: requests are
judged in file order and nothing depends on the clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from policies import Policy
from supervisor.act.failure_log import outcome_json
from supervisor.errors import IngestError
from supervisor.ingest.codec import decode_request, validate_spans
from supervisor.judge.pipeline import Outcome, Pipeline, detected_failure
from supervisor.runs import RunTracker

#: Far above any real request; a corrupt length prefix fails clearly instead.
MAX_RECORD_BYTES = 256 * 1024 * 1024
_JSON = "application/json"
_PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record of the input that could not be decoded (it is skipped)."""

    where: str
    message: str


def read_requests(path: Path) -> Iterator[ExportTraceServiceRequest | BadRecord]:
    """Yield the file's requests in order, and a :class:`BadRecord` for each bad one."""
    with path.open("rb") as fh:
        head = fh.read(1)
        while head in (b" ", b"\n", b"\r", b"\t"):
            head = fh.read(1)
        fh.seek(0)
        if head in (b"{", b"["):
            yield from _json_lines(fh)
        elif head:
            yield from _length_prefixed(fh)


def _json_lines(fh: IO[bytes]) -> Iterator[ExportTraceServiceRequest | BadRecord]:
    for number, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            request = decode_request(
                line, content_type=_JSON, content_encoding="", max_bytes=MAX_RECORD_BYTES
            )
        except IngestError as exc:
            yield BadRecord(f"line {number}", str(exc))
            continue
        yield from _validated(request, f"line {number}")


def _length_prefixed(fh: IO[bytes]) -> Iterator[ExportTraceServiceRequest | BadRecord]:
    index = 0
    while True:
        prefix = fh.read(4)
        if not prefix:
            return
        index += 1
        where = f"record {index} (byte {fh.tell() - len(prefix)})"
        if len(prefix) < 4:
            yield BadRecord(where, "truncated length prefix at end of file")
            return
        size = int.from_bytes(prefix, "big")
        if size > MAX_RECORD_BYTES:
            yield BadRecord(
                where,
                f"length prefix {size} is over {MAX_RECORD_BYTES}: not length-prefixed OTLP?",
            )
            return
        body = fh.read(size)
        if len(body) < size:
            yield BadRecord(where, f"truncated: {len(body)} of {size} bytes")
            return
        try:
            request = decode_request(
                body, content_type=_PROTOBUF, content_encoding="", max_bytes=MAX_RECORD_BYTES
            )
        except IngestError as exc:
            yield BadRecord(where, str(exc))
            continue
        yield from _validated(request, where)


def _validated(
    request: ExportTraceServiceRequest, where: str
) -> Iterator[ExportTraceServiceRequest | BadRecord]:
    result = validate_spans(request)
    if result.rejected:
        yield BadRecord(where, f"{result.rejected} span(s) skipped: {result.message}")
    yield request


def replay(
    path: Path,
    policy: Policy,
    on_request: Callable[[ExportTraceServiceRequest], None] | None = None,
) -> Iterator[Outcome | BadRecord]:
    """Judge every request of the file in order, as the running sidecar would.

    ``on_request`` sees each decoded request before it is judged (progress,
    looking for a span).

    The run detectors see the recording's own clock: a request counts as
    received when its last span ended, and a run is stalled when the
    recording shows no span of it for its ``idle_seconds`` (checked after
    each request, and at the end of the file). Same file, same output.
    """
    clock_ns = 0
    runs = RunTracker(
        settings=policy.detectors.for_service,
        models=policy.detectors.models,
        slo=policy.detectors.slo,
        clock=lambda: clock_ns / 1e9,
    )
    pipeline = Pipeline(policy, runs=runs)
    for item in read_requests(path):
        if isinstance(item, BadRecord):
            yield item
            continue
        if on_request is not None:
            on_request(item)
        clock_ns = max(clock_ns, _last_end_ns(item))
        yield from pipeline.process(item, received_ns=clock_ns)
        yield from _stalls(pipeline, runs, clock_ns)
    yield from _stalls(pipeline, runs, clock_ns)


def span_count(request: ExportTraceServiceRequest) -> int:
    return sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)


def _last_end_ns(request: ExportTraceServiceRequest) -> int:
    return max(
        (
            span.end_time_unix_nano
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ),
        default=0,
    )


def _stalls(pipeline: Pipeline, runs: RunTracker, clock_ns: int) -> list[Outcome]:
    found = runs.stalled(now=clock_ns / 1e9)
    return pipeline.judge_detected([detected_failure(s, clock_ns) for s in found]) if found else []


# -- output ---------------------------------------------------------------------

TABLE_COLUMNS: tuple[tuple[str, int], ...] = (
    ("trace_id", 32),
    ("span_id", 16),
    ("service", 16),
    ("span_name", 28),
    ("class", 9),
    ("kind", 18),
    ("dependency", 28),
    ("rule", 34),
    ("action", 9),
)


def jsonl_line(outcome: Outcome) -> str:
    entry: dict[str, Any] = outcome_json(outcome)
    return json.dumps(entry, sort_keys=True, ensure_ascii=False)


def table_header() -> str:
    return "  ".join(name.upper().ljust(width) for name, width in TABLE_COLUMNS).rstrip()


def table_row(outcome: Outcome) -> str:
    entry = outcome_json(outcome)
    cells = []
    for name, width in TABLE_COLUMNS:
        text = _printable(str(entry[name]))
        cells.append(text if len(text) <= width else text[: width - 1] + "…")
        cells[-1] = cells[-1].ljust(width)
    return "  ".join(cells).rstrip()


def _printable(text: str) -> str:
    """Span content is untrusted: no control characters reach the terminal."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)
