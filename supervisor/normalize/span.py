"""The one span model after ingest: a typed, lazy view of a span's encoding.

Every stage after ingest (the screens, the run tracker, the judging, the
breakers' success feed, budgets) reads a :class:`Span`, and nothing else of
the span. What comes straight from the OTLP message (ids, name, times,
status) is read from the decoded message. What the conventions say (the
span's dependency, its session and so its run, token counts, what a tool was
called with, what an LLM answered) is worked out by the adapters
(:mod:`.genai`, :mod:`.openinference`, :mod:`.openllmetry`, :mod:`.http_rpc`)
the first time a stage asks, and kept on the view: computed once per span,
in this package, whoever asks. The full record (:class:`SpanRecord`, with the
error evidence) is made by :meth:`Span.record`, only for the spans that may be
failures or that a verifier reads; most spans succeed and never pay for it.

Attribute values stay encoded until read (:mod:`.wire`), and the keys each
convention uses are the adapters' own constants: this module only says in
which order the conventions are asked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from supervisor.normalize import genai, http_rpc, openinference, openllmetry
from supervisor.normalize.attributes import AttributeSource, as_int
from supervisor.normalize.credential import CREDENTIAL_KEY, credential_of
from supervisor.normalize.identity import RUN_ORDER, SESSION_KEYS, dependency_of, session_of
from supervisor.normalize.ratelimits import RATE_LIMIT_KEYS, rate_limits_of
from supervisor.normalize.record import ANSWER_KEYS, MAX_SPAN_NAME, RESULT_KEYS, record_of
from supervisor.normalize.wire import (
    LazyConverted,
    RawAttributes,
    raw_value,
    read_varint,
    value_of,
)
from supervisor.records import AttrValue, RateLimitHeaders, SpanRecord, breaker_key

__all__ = [
    "SESSION_KEYS",
    "WATCHED_RUN_KEYS",
    "Span",
    "requested_calls",
    "session_of",
]

_STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
#: The tag of ``AnyValue.int_value`` (field 3, varint).
_INT_VALUE: Final = b"\x18"

_INPUT_TOKEN_KEYS: Final = genai.INPUT_TOKEN_KEYS + openinference.INPUT_TOKEN_KEYS
_OUTPUT_TOKEN_KEYS: Final = genai.OUTPUT_TOKEN_KEYS + openinference.OUTPUT_TOKEN_KEYS
_TOOL_ARGUMENT_KEYS: Final = tuple(k for a in RUN_ORDER for k in a.TOOL_ARGUMENT_KEYS)
#: An answer's own text where a convention keeps it apart from the message list
#: (cheaper to compare than the whole list, which is the fallback).
_LLM_TEXT_KEYS: Final = openinference.LLM_TEXT_KEYS + openllmetry.LLM_TEXT_KEYS
#: Where each convention keeps a span's input, with its reader of the run's task:
#: the first key present (in the conventions' order) names the reader.
_TASK_READERS: Final[Mapping[str, Callable[[AttributeSource], str | None]]] = {
    key: adapter.input_task for adapter in RUN_ORDER for key in adapter.OBJECTIVE_KEYS
}
_OBJECTIVE_KEYS: Final = tuple(_TASK_READERS)
#: An LLM span whose response may ask for tool calls.
_REQUEST_MARKERS: Final = frozenset({openinference.FIRST_TOOL_CALL, genai.OUTPUT_MESSAGES})
#: Every key a run reads from a span: the reader notes which of them each span carries.
WATCHED_RUN_KEYS: Final = (
    frozenset(
        SESSION_KEYS
        + _INPUT_TOKEN_KEYS
        + _OUTPUT_TOKEN_KEYS
        + _TOOL_ARGUMENT_KEYS
        + _LLM_TEXT_KEYS
        + _OBJECTIVE_KEYS
    )
    | _REQUEST_MARKERS
    | ANSWER_KEYS
    | RESULT_KEYS
    | RATE_LIMIT_KEYS
    | {CREDENTIAL_KEY}
)
#: Longest encoded text read for blankness (:attr:`Span.may_say_nothing`): longer is not blank.
_SHORT_OUTPUT: Final = 256
#: The tag of ``AnyValue.string_value`` (field 1, length-delimited).
_STRING_VALUE: Final = b"\x0a"
#: In a GenAI message list: a text part with a character that is not blank, or a tool call.
_SAYS_SOMETHING: Final = re.compile(
    rb'"content"\s*:\s*"(?:\s|\\[nrt])*[^"\s\\]|"type"\s*:\s*"tool_call"'
)
#: A span's result, in the order tried when it has no answer's text or message list.
_RESULT_KEYS: Final = tuple(sorted(RESULT_KEYS))

#: Raw values longer than this are not kept past their batch (requested calls).
_MAX_KEPT_BYTES: Final = 16 * 1024
#: Longest objective kept (characters): a first input can be a whole document.
_MAX_OBJECTIVE: Final = 2000


class _Shape:
    """Which of the run's keys a span carries, worked out once per set of present keys.

    Spans of one kind carry the same keys; the reader gives them equal
    ``present`` sets, so this is a dict lookup per span instead of a dozen
    key tests.
    """

    __slots__ = (
        "answer_role",
        "input_tokens_key",
        "llm_text_key",
        "messages",
        "objective_key",
        "output_tokens_key",
        "rate_limited",
        "requests",
        "result_keys",
        "session_keys",
        "tool_arguments_key",
    )

    def __init__(self, present: frozenset[str]) -> None:
        self.session_keys = tuple(k for k in SESSION_KEYS if k in present)
        self.input_tokens_key = _first(present, _INPUT_TOKEN_KEYS)
        self.output_tokens_key = _first(present, _OUTPUT_TOKEN_KEYS)
        self.tool_arguments_key = _first(present, _TOOL_ARGUMENT_KEYS)
        self.llm_text_key = _first(present, _LLM_TEXT_KEYS)
        self.messages = genai.OUTPUT_MESSAGES in present
        self.answer_role = openinference.OUTPUT_ROLE in present
        self.result_keys = tuple(k for k in _RESULT_KEYS if k in present)
        self.objective_key = _first(present, _OBJECTIVE_KEYS)
        self.requests = not _REQUEST_MARKERS.isdisjoint(present)
        self.rate_limited = not RATE_LIMIT_KEYS.isdisjoint(present)


def _first(present: frozenset[str], keys: tuple[str, ...]) -> str | None:
    return next((key for key in keys if key in present), None)


#: Shapes by present set; bounded (cleared when full, rebuilt from the next spans).
_SHAPES: Final[dict[frozenset[str], _Shape]] = {}
_MAX_SHAPES: Final = 4096


def _shape(present: frozenset[str]) -> _Shape:
    found = _SHAPES.get(present)
    if found is None:
        if len(_SHAPES) >= _MAX_SHAPES:
            _SHAPES.clear()
        found = _SHAPES[present] = _Shape(present)
    return found


class Span:
    """One span of a request, as every stage after ingest reads it.

    Immutable from the outside: what a property works out is kept on the
    view, so asking twice costs a slot read. A view shares its request's
    memory; keep a record or plain values, not the view, past the batch.
    Never raises: a value that cannot be read reads as absent.
    """

    __slots__ = (
        "_credential",
        "_dependency",
        "_record",
        "_session",
        "_shape",
        "_trace_hex",
        "attributes",
        "encoded",
        "has_events",
        "kind",
        "message",
        "name",
        "present",
        "resource",
        "service",
        "span_id",
        "status_error",
        "trace_id",
    )

    def __init__(
        self,
        message: Any,
        resource: Mapping[str, AttrValue],
        service: str,
        present: frozenset[str],
        encoded: Any = None,
    ) -> None:
        """``encoded``: ``message.attributes`` when the caller read it already.

        What every span is asked for is read here, once: each read of a field
        of a decoded message makes a new Python object, and the stages ask the
        view, not the message.
        """
        #: The decoded OTLP ``Span`` (the lite schema: attributes left encoded).
        self.message = message
        #: The resource's attributes, converted once per resource.
        self.resource = resource
        self.service = service
        #: Which of the keys the screens and runs watch the span carries.
        self.present = present
        #: Its attribute map as decoded: key to the encoded value.
        self.encoded: Any = message.attributes if encoded is None else encoded
        #: Its attributes, each value decoded when read.
        self.attributes = RawAttributes(self.encoded)
        self.trace_id: bytes = message.trace_id
        self.span_id: bytes = message.span_id
        name: str = message.name
        #: Span names are the agent's to choose: bounded.
        self.name = name if len(name) <= MAX_SPAN_NAME else name[:MAX_SPAN_NAME]
        self.kind: int = message.kind
        #: The status is ERROR; the span has events (``exception`` ones, or others).
        self.status_error: bool = message.status.code == _STATUS_ERROR
        self.has_events: bool = len(message.events) > 0
        shape = _SHAPES.get(present)
        self._shape: _Shape = shape if shape is not None else _shape(present)
        self._dependency: str | None = None
        self._credential: str | None = None
        self._session: str | None = None
        self._trace_hex: str | None = None
        self._record: SpanRecord | None = None

    # -- what the message says -------------------------------------------------

    @property
    def trace_hex(self) -> str:
        found = self._trace_hex
        if found is None:
            found = self._trace_hex = self.trace_id.hex()
        return found

    @property
    def is_root(self) -> bool:
        return not self.message.parent_span_id

    @property
    def start_ns(self) -> int:
        return int(self.message.start_time_unix_nano)

    @property
    def end_ns(self) -> int:
        return int(self.message.end_time_unix_nano)

    @property
    def failed(self) -> bool:
        """Failed for sure: an ERROR status, an ``error.type`` or an exception event.

        A span with only harmless events (a streamed answer's first token) has not.
        """
        return (
            self.status_error
            or http_rpc.ERROR_TYPE in self.present
            or (self.has_events and any(e.name == "exception" for e in self.message.events))
        )

    # -- what the conventions say ----------------------------------------------

    @property
    def dependency(self) -> str:
        """What the span called: ``provider:model``, ``tool:<name>``, ``http:<host>`` or ``""``."""
        found = self._dependency
        if found is None:
            found = self._dependency = dependency_of(
                self.encoded, self.present, self.kind, self.name
            )
        return found

    @property
    def credential(self) -> str:
        """The credential's name the span gives (``spanvisor.credential``), or ``""``."""
        found = self._credential
        if found is None:
            found = self._credential = (
                credential_of(self.attributes.get(CREDENTIAL_KEY))
                if CREDENTIAL_KEY in self.present
                else ""
            )
        return found

    @property
    def breaker_key(self) -> str:
        """The breaker a call of the span counts for: its dependency, and credential if named."""
        return breaker_key(self.dependency, self.credential)

    @property
    def session_id(self) -> str:
        """The session the span names (the first of :data:`SESSION_KEYS` with one), or ``""``."""
        found = self._session
        if found is None:
            keys = self._shape.session_keys
            found = self._session = session_of(self.attributes, keys) if keys else ""
        return found

    @property
    def names_session(self) -> bool:
        """Whether the span carries one of the session keys (a value may still be empty)."""
        return bool(self._shape.session_keys)

    @property
    def input_tokens(self) -> int:
        return _count(self.encoded, self._shape.input_tokens_key)

    @property
    def output_tokens(self) -> int:
        return _count(self.encoded, self._shape.output_tokens_key)

    @property
    def has_rate_limits(self) -> bool:
        """Whether the span carries a provider's rate-limit header (a slot read)."""
        return self._shape.rate_limited

    def rate_limits(self) -> RateLimitHeaders | None:
        """What its rate-limit headers say (:mod:`.ratelimits`); None without any."""
        if not self._shape.rate_limited:
            return None
        return rate_limits_of(self.attributes, self.end_ns / 1e9)

    @property
    def tool_arguments(self) -> bytes | None:
        """A tool call's arguments as encoded: compared by the loop detector, never decoded."""
        return self._raw(self._shape.tool_arguments_key)

    @property
    def output_messages(self) -> bytes | None:
        """The GenAI message list of the response, as encoded."""
        return self._raw(genai.OUTPUT_MESSAGES) if self._shape.messages else None

    @property
    def answer(self) -> bytes | None:
        """An LLM's answer as encoded: its text where kept apart, else the message list."""
        return self._raw(self._shape.llm_text_key) or self.output_messages

    @property
    def may_say_nothing(self) -> bool:
        """Whether the span may have recorded an empty output: a cheap superset.

        Read from the encoding: a text that is blank, a message list with no
        text part that has a non-blank character and no tool call, an answer
        recorded without a text. The record says for sure
        (:attr:`SpanRecord.says_nothing`); spans that recorded no output, or
        said something, or asked for a tool call, need no record.
        """
        shape = self._shape
        if openinference.FIRST_TOOL_CALL in self.present:
            return False
        encoded = self.encoded
        if shape.llm_text_key is not None:
            return _blank(encoded[shape.llm_text_key])
        if shape.messages:
            return _SAYS_SOMETHING.search(encoded[genai.OUTPUT_MESSAGES]) is None
        if shape.answer_role:  # an answer recorded without a text: empty unless it called tools
            return True
        return any(_blank(encoded[k]) for k in shape.result_keys)

    @property
    def has_objective(self) -> bool:
        """Whether the span's input names the run's task (see :meth:`objective`)."""
        return self._shape.objective_key is not None and bool(self._task())

    def objective(self) -> str:
        """The run's task in the span's input, as text (bounded); ``""`` if none.

        The first input message whose role is the user's, in whichever
        convention the span keeps its input: not the system prompt, which
        instrumentations put first. The first input only when no message
        records a role. Each adapter's ``input_task`` reads its own keys.
        """
        return (self._task() or "").strip()[:_MAX_OBJECTIVE]

    def _task(self) -> str | None:
        key = self._shape.objective_key
        if key is None:
            return None
        try:
            return _TASK_READERS[key](LazyConverted(self.attributes))
        except Exception:  # boundary: an input that cannot be read names no task
            return None

    def requested(self) -> dict[str, bytes] | None:
        """What names the tool calls the response asked for, as encoded; None when none.

        Kept by the run tracker, past the batch, for stall reports: only the
        few values that name the calls, each bounded, and only when there is
        one (most responses ask for nothing). :func:`requested_calls` reads them.
        """
        if not self._shape.requests:
            return None
        encoded = self.encoded
        kept: dict[str, bytes] | None = None
        messages = self.output_messages
        # find(), not `in`: bytes' `in` tries an int first and raises inside.
        if (
            messages is not None
            and len(messages) <= _MAX_KEPT_BYTES
            and messages.find(b"tool_call") >= 0
        ):
            kept = {genai.OUTPUT_MESSAGES: messages}
        if openinference.FIRST_TOOL_CALL not in self.present:
            return kept
        for name_key, args_key in openinference.REQUESTED_CALL_KEYS:
            found = raw_value(encoded, name_key)
            if found is None:
                break
            if kept is None:
                role = raw_value(encoded, openinference.OUTPUT_ROLE)  # the adapter reads it
                kept = {openinference.OUTPUT_ROLE: role} if role is not None else {}
            kept[name_key] = found
            arguments = raw_value(encoded, args_key)
            if arguments is not None and len(arguments) <= _MAX_KEPT_BYTES:
                kept[args_key] = arguments
        return kept or None

    def record(self) -> SpanRecord:
        """The whole record, error evidence included; made once, on the first call."""
        found = self._record
        if found is None:
            found = self._record = record_of(self)
        return found

    def _raw(self, key: str | None) -> bytes | None:
        # A shape's key is one the span carries: a subscript, not a lookup first.
        return self.encoded[key] if key is not None else None

    def __repr__(self) -> str:
        return f"Span({self.service!r}, {self.name!r}, trace={self.trace_hex})"


def _blank(raw: bytes) -> bool:
    """Whether an encoded value may be an empty or blank text (a superset: not decoded)."""
    if raw[:1] != _STRING_VALUE:
        return len(raw) <= _SHORT_OUTPUT  # another type: the record decides
    try:
        size, end = read_varint(raw, 1)
    except (IndexError, ValueError):
        return True
    text = raw[end:].strip()
    return size <= _SHORT_OUTPUT and (not text or text in (b'""', b"''"))


def _count(encoded: Any, key: str | None) -> int:
    """A token count (0 when absent or not a plausible count); ``key``: one the span carries."""
    if key is None:
        return 0
    raw: bytes = encoded[key]
    if raw[:1] == _INT_VALUE:  # how instrumentations write a count: read it here
        try:
            value, end = read_varint(raw, 1)
        except (IndexError, ValueError):
            return 0
        return value if end == len(raw) and value < 1 << 40 else 0
    count = as_int(value_of(raw))  # a double or a decimal string: the long way
    return count if count is not None and 0 <= count < 1 << 40 else 0


def requested_calls(kept: Mapping[str, bytes]) -> list[str]:
    """``name(arguments)`` of each tool call in what :meth:`Span.requested` kept."""
    attrs = LazyConverted(RawAttributes(kept))
    calls: list[tuple[str, object]] = []
    try:
        if openinference.OUTPUT_ROLE in kept or openinference.FIRST_TOOL_CALL in kept:
            calls.extend(openinference.output_messages(attrs)[1])
        if genai.OUTPUT_MESSAGES in kept:
            calls.extend(genai.message_output(attrs.full(genai.OUTPUT_MESSAGES))[1])
    except Exception:  # boundary: a report with fewer calls beats no report
        return []
    out: list[str] = []
    for name, arguments in calls[:32]:
        text = arguments if isinstance(arguments, str) else repr(arguments)
        out.append(f"{name}({text[:200]})")
    return out
