"""The whole record of a span: identity, error evidence, output, attributes.

Made only for the spans that may be failures and the ones a verifier reads
(:meth:`.span.Span.record`). The adapters fill a :class:`~.attributes.Draft` in
order, most specific first, each only where a field is still empty;
:mod:`.evidence` reads what a failing span says. Never raises: a span that
cannot be read whole gets a minimal record, and the failure is counted
(:func:`failures`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Final, Protocol

from supervisor.normalize import genai, http_rpc, openinference, openllmetry
from supervisor.normalize.attributes import (
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    AttributeSource,
    Draft,
    args_digest,
    as_str,
    bounded,
)
from supervisor.normalize.evidence import (
    SCAN_CHARS,
    Swallowed,
    build_evidence,
    check_tool_calls,
    detect_swallowed,
    failing_finish,
    rejected_arguments,
    tool_message,
)
from supervisor.normalize.identity import dependency_and_tool, identify
from supervisor.normalize.ratelimits import RATE_LIMIT_KEYS, rate_limits_of
from supervisor.normalize.streaming import stream_began
from supervisor.normalize.wire import LazyConverted, RawAttributes
from supervisor.records import AttrValue, ErrorEvidence, Role, SpanRecord

__all__ = [
    "ANSWER_KEYS",
    "MAX_SPAN_NAME",
    "RESULT_KEYS",
    "SpanFields",
    "count_failure",
    "failures",
    "output_recorded",
    "record_of",
]

#: Span names are the agent's to choose: kept to this many characters.
MAX_SPAN_NAME: Final = 1024
_STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
#: Events scanned for an ``exception`` event: all of a short list, else the
#: first and last ``_EVENT_SCAN`` (streaming spans may carry one per chunk).
_EVENT_SCAN: Final = 16

#: Where each convention records an LLM's answer, and any other span's result:
#: a span with none of its role's keys has no output recorded.
ANSWER_KEYS: Final = frozenset(
    genai.ANSWER_KEYS + openinference.ANSWER_KEYS + openllmetry.ANSWER_KEYS
)
RESULT_KEYS: Final = frozenset(
    genai.RESULT_KEYS + openinference.RESULT_KEYS + openllmetry.RESULT_KEYS
)

_logger = logging.getLogger("supervisor.normalize")
_failures_lock = threading.Lock()
_failures = 0


class SpanFields(Protocol):
    """What a record is made from: a span view (:class:`.span.Span`)."""

    @property
    def message(self) -> Any: ...
    @property
    def attributes(self) -> RawAttributes: ...
    @property
    def present(self) -> frozenset[str]: ...
    @property
    def resource(self) -> Mapping[str, AttrValue]: ...
    @property
    def service(self) -> str: ...
    @property
    def kind(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def trace_hex(self) -> str: ...
    @property
    def start_ns(self) -> int: ...
    @property
    def end_ns(self) -> int: ...
    @property
    def has_events(self) -> bool: ...
    @property
    def dependency(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def credential(self) -> str: ...


def output_recorded(present: frozenset[str], role: Role) -> bool:
    """Whether a span of ``role`` with these keys carries its output (the one place it is said)."""
    return not (ANSWER_KEYS if role is Role.LLM else RESULT_KEYS).isdisjoint(present)


def failures() -> int:
    """How many spans could not be fully normalized since start (each got a minimal record)."""
    return _failures


def count_failure() -> None:
    global _failures  # noqa: PLW0603 - a process-wide counter, like the SDK's drop counts
    with _failures_lock:
        _failures += 1
        first = _failures == 1
    if first:
        _logger.exception("span normalization failed; emitting a minimal record (logged once)")


def record_of(span: SpanFields) -> SpanRecord:
    """The record of one span; never raises."""
    try:
        return _normalize(span)
    except Exception:  # boundary: a record with fewer fields beats a lost span
        count_failure()
        return minimal_record(span.message, span.resource, span.service)


def _normalize(span: SpanFields) -> SpanRecord:
    message = span.message
    attributes: AttributeSource = LazyConverted(span.attributes)
    attrs = attributes.values
    draft = Draft(attributes)
    keys = span.present
    kind = span.kind
    identify(draft, keys, kind)
    if openinference.MARKER in keys:
        openinference.extract(draft)
    if genai.applies(keys):
        genai.extract(draft)
    if openllmetry.applies(keys):
        openllmetry.extract(draft)
    http_rpc.extract(draft)
    draft.session_id = span.session_id
    role = draft.role or Role.OTHER

    status = message.status
    status_error = status.code == _STATUS_ERROR
    invalid = check_tool_calls(draft.tool_calls, draft.offered_tools) if draft.tool_calls else ()
    name = span.name
    tool_name = dependency_and_tool(draft, role, name)[0]
    output = draft.output_text
    if role is Role.TOOL and output[:1] == "{":
        returned = tool_message(output)  # a LangChain ToolMessage: its content is the output
        if returned is not None:
            draft.output_text = returned[0][: len(output)]
    http_status = draft.http_status
    error_type = attrs.get(http_rpc.ERROR_TYPE)
    server = kind == http_rpc.SPAN_KIND_SERVER
    failing = (
        status_error
        or bool(invalid)
        or error_type is not None
        or (http_status is not None and http_status >= (500 if server else 400))
        or (draft.grpc_code is not None and draft.grpc_code != 0)
        or (bool(draft.finish_reasons) and failing_finish(draft.finish_reasons))
    )
    exception = _exception_event(message.events) if span.has_events else None
    swallowed: Swallowed | None = None
    caught: Swallowed | None = None
    if role is Role.TOOL and output:
        if not failing and exception is None:
            swallowed = detect_swallowed(output)
        elif exception is None or not exception[0]:
            caught = detect_swallowed(output)  # what a failing tool's output says it raised
    error = None
    if failing or exception is not None or swallowed is not None:
        if role is Role.TOOL:
            exc_type, exc_message, stacktrace = exception or ("", "", "")
            said = caught or swallowed
            if said is not None and not exc_type:
                exc_type, exc_message = said.exception_type, said.message
            refused = rejected_arguments(
                tool_name,
                exc_type,
                exc_message or status.message[:SCAN_CHARS],
                draft.tool_args,
                stacktrace,
            )
            invalid = invalid + tuple(c for c in refused if c not in invalid)
        error = build_evidence(
            status_error=status_error,
            status_message=status.message[:SCAN_CHARS] if status_error else "",
            exception=exception[:2] if exception is not None else None,
            error_type=as_str(error_type),
            http_status=http_status,
            grpc_code=draft.grpc_code,
            finish_reasons=draft.finish_reasons,
            invalid_tool_calls=invalid,
            swallowed=swallowed,
            attrs=attrs,
            now_ns=span.end_ns,
            caught=caught,
            stream_began=role is Role.LLM
            and stream_began(
                attrs,
                draft.output_tokens,
                draft.output_text,
                draft.finish_reasons,
                message.events if span.has_events else (),
            ),
        )

    service = span.service
    return SpanRecord(
        trace_id=span.trace_hex,
        span_id=message.span_id.hex(),
        parent_span_id=message.parent_span_id.hex(),
        name=name,
        service=service if len(service) <= MAX_NAME_CHARS else service[:MAX_NAME_CHARS],
        kind=kind,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        role=role,
        conventions=tuple(draft.conventions),
        dependency=span.dependency,  # the view's: worked out once, for every stage
        provider=draft.provider,
        model=draft.response_model or draft.request_model,
        tool_name=tool_name,
        tool_args_digest=args_digest(draft.tool_args) if draft.tool_args is not None else "",
        input_tokens=draft.input_tokens,
        output_tokens=draft.output_tokens,
        output_text=draft.output_text,
        output_recorded=output_recorded(span.present, role),
        calls_tools=role is Role.LLM and bool(draft.tool_calls),
        session_id=draft.session_id,
        error=error,
        rate_limits=None
        if RATE_LIMIT_KEYS.isdisjoint(keys)
        else rate_limits_of(attrs, span.end_ns / 1e9),
        attributes=span.attributes,
        resource_attributes=span.resource,
        credential=span.credential,
    )


def _scanned(count: int) -> Any:
    """The indices of events looked at: all, or the first and last ``_EVENT_SCAN``."""
    if count <= 2 * _EVENT_SCAN:
        return range(count)
    return (*range(_EVENT_SCAN), *range(count - _EVENT_SCAN, count))


def _exception_event(events: Any) -> tuple[str, str, str] | None:
    """Type, message and (for a validation error) stack trace of the first ``exception`` event.

    The stack trace is kept only where it tells what was being validated
    (:func:`.evidence.rejected_arguments`): it can be long.
    """
    for i in _scanned(len(events)):
        event = events[i]
        if event.name != "exception":
            continue
        exc_type = message = ""
        traceback: Any = None  # read only without a type: a stack trace can be long
        for kv in event.attributes:
            key = kv.key
            if key == "exception.type":
                exc_type = kv.value.string_value
            elif key == "exception.message":
                message = kv.value.string_value
            elif key == "exception.stacktrace":
                traceback = kv
        stack = ""
        if traceback is not None:
            if not exc_type:
                exc_type = _last_traceback_type(traceback.value.string_value)
            if exc_type.endswith("ValidationError"):
                stack = traceback.value.string_value[-SCAN_CHARS:]
        return bounded(exc_type, MAX_NAME_CHARS), message[:SCAN_CHARS], stack
    return None


def _last_traceback_type(stacktrace: str) -> str:
    found = detect_swallowed(stacktrace[-SCAN_CHARS:]) if "Traceback" in stacktrace else None
    return found.exception_type if found is not None else ""


def minimal_record(span: Any, resource: Mapping[str, AttrValue], service: str) -> SpanRecord:
    """The fields that can still be read, for a span whose attributes could not be."""
    return SpanRecord(
        trace_id=_read(span, "trace_id", bytes.hex, ""),
        span_id=_read(span, "span_id", bytes.hex, ""),
        parent_span_id=_read(span, "parent_span_id", bytes.hex, ""),
        name=_read(span, "name", lambda n: bounded(str(n), MAX_SPAN_NAME), ""),
        service=bounded(str(service), MAX_NAME_CHARS),
        kind=_read(span, "kind", int, 0),
        start_ns=_read(span, "start_time_unix_nano", int, 0),
        end_ns=_read(span, "end_time_unix_nano", int, 0),
        role=Role.OTHER,
        output_recorded=False,
        resource_attributes=resource,
        error=_read(span, "status", _status_only, None),
    )


def _read(span: Any, name: str, convert: Any, default: Any) -> Any:
    """One field of a span, converted; ``default`` if it cannot be read."""
    try:
        return convert(getattr(span, name))
    except Exception:  # each field on its own: keep what can be read
        return default


def _status_only(status: Any) -> ErrorEvidence | None:
    if status.code != _STATUS_ERROR:
        return None
    return ErrorEvidence(
        status_error=True, status_message=bounded(status.message, MAX_MESSAGE_CHARS)
    )
