"""Which spans can be failures, decided before normalizing them.

Normalizing a span costs 7-20 µs in Python and ~95% of spans succeed, so the
pipeline normalizes only the spans these screens pass (the issue's rule: keep
work that only failures need off the per-span path). Two screens:

* :func:`shows_failure_signal`: the usual signs (ERROR status, an event, an
  ``error.type``, an HTTP status of 400 or more, a non-OK RPC status, a
  failing finish reason in the usual places). Spans with these are judged
  first, so that most decisions do not wait for the rest of the batch.
* :func:`may_fail_quietly`: for the others, the failures a status does not
  show: a finish reason in a message list, a tool call the model was not
  offered or with arguments that are not a JSON object, a tool output that
  is a caught error. It reads the attributes that decide these with the
  adapters' own functions, for every convention present, so it passes a
  superset of what :func:`supervisor.normalize.normalize_wire` finds failing
  (a property test holds it to that).

Both must err towards True: a span wrongly passed costs a normalization, a
span wrongly dropped is a missed failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from supervisor.normalize import genai, openinference, openllmetry
from supervisor.normalize.attributes import text_value
from supervisor.normalize.evidence import (
    FAILURE_FINISH_REASONS,
    check_tool_calls,
    detect_swallowed,
    failing_finish,
)
from supervisor.normalize.walk import error_status_or_events
from supervisor.normalize.wire import LazyConverted, RawAttributes, raw_value
from supervisor.records import AttrValue, Role

__all__ = ["WATCHED_KEYS", "WireSpan", "may_fail_quietly", "shows_failure_signal"]

#: A span as the wire path holds it: (lite span, resource attributes, service,
#: which of :data:`WATCHED_KEYS` it carries, its encoded attribute map). That
#: subset is found in one pass over the attribute map
#: (``WATCHED_KEYS.intersection``), which costs a third of building the set of
#: all its keys, and answers every test below. The map is the one that pass
#: read: each ``span.attributes`` builds a new wrapper, and every stage reads it.
WireSpan = tuple[Any, Mapping[str, AttrValue], str, frozenset[str], Any]

_STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR

#: Every attribute the early look reads; most spans carry none of them.
_SIGNAL_KEYS: Final = frozenset(
    {
        "error.type",
        "http.response.status_code",
        "http.status_code",
        "rpc.grpc.status_code",
        "rpc.response.status_code",
        "rpc.status_code",
        "gen_ai.response.finish_reasons",
        "llm.finish_reason",
        "gen_ai.completion.0.finish_reason",
    }
)
_HTTP_STATUS_KEYS: Final[tuple[str, ...]] = ("http.response.status_code", "http.status_code")
_RPC_STATUS_KEYS: Final[tuple[str, ...]] = (
    "rpc.grpc.status_code",
    "rpc.response.status_code",
    "rpc.status_code",
)
_FINISH_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.response.finish_reasons",
    "llm.finish_reason",
    "gen_ai.completion.0.finish_reason",
)
#: Any failing finish reason inside an encoded value, lower-cased (a superset
#: test: the adapters decide). On lower-cased bytes rather than IGNORECASE: a
#: third of the time, and the same answer (both fold ASCII letters only).
_FAILING_FINISH: Final = re.compile(
    b"|".join(re.escape(reason.lower().encode()) for reason in sorted(FAILURE_FINISH_REASONS))
)

#: Finish reasons in single attributes, of every convention (the message
#: lists are read below).
_REASON_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.response.finish_reasons",
    "gen_ai.response.finish_reason",
    "gen_ai.response.stop_reason",
    "llm.finish_reason",
)
#: A tool span's output, whichever convention wrote it.
_TOOL_OUTPUT_KEYS: Final[tuple[str, ...]] = (
    "output.value",
    "gen_ai.tool.call.result",
    "traceloop.entity.output",
)
_OUTPUT_MESSAGES: Final = "llm.output_messages.0.message.role"
#: Keys without which a span that shows no signal cannot fail: no finish
#: reason, no tool call and no tool role can be read from it.
_QUIET_KEYS: Final = frozenset(
    {
        openinference.MARKER,
        "gen_ai.operation.name",
        "gen_ai.tool.name",
        "gen_ai.output.messages",
        "traceloop.span.kind",
        "gen_ai.completion.0.role",
        "gen_ai.completion.0.content",
        "gen_ai.completion.0.finish_reason",
        *_REASON_KEYS,
    }
)


#: What the run tracker (:mod:`supervisor.runs`) reads from every span.
SESSION_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.conversation.id",
    "session.id",
    "traceloop.association.properties.session_id",
    "traceloop.association.properties.conversation_id",
)
INPUT_TOKEN_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.prompt_tokens",
    "llm.token_count.prompt",
)
OUTPUT_TOKEN_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.completion_tokens",
    "llm.token_count.completion",
)
TOOL_ARGUMENT_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.tool.call.arguments",
    "input.value",
    "traceloop.entity.input",
)
#: The answer's text where a convention keeps it apart (cheaper to compare than the
#: whole response JSON), else the new GenAI convention's message list.
LLM_OUTPUT_KEYS: Final[tuple[str, ...]] = (
    "llm.output_messages.0.message.content",
    # openinference-instrumentation-anthropic writes the text as content blocks
    "llm.output_messages.0.message.contents.0.message_content.text",
    "gen_ai.completion.0.content",
    "gen_ai.output.messages",
)
#: Where a run's first input (its objective, for re-anchoring) is found, in order.
OBJECTIVE_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.input.messages",
    "llm.input_messages.0.message.content",
    "gen_ai.prompt.0.content",
    "input.value",
)
#: OpenInference's first requested tool call: its presence says the response asked for one.
FIRST_TOOL_CALL: Final = "llm.output_messages.0.message.tool_calls.0.tool_call.function.name"
#: An LLM span whose response may ask for tool calls (kept for stall reports).
REQUEST_MARKERS: Final = frozenset({FIRST_TOOL_CALL, "gen_ai.output.messages"})
#: Every key the run tracker (supervisor.runs) looks for in a span's present keys.
RUN_KEYS: Final = (
    frozenset(
        SESSION_KEYS
        + INPUT_TOKEN_KEYS
        + OUTPUT_TOKEN_KEYS
        + TOOL_ARGUMENT_KEYS
        + LLM_OUTPUT_KEYS
        + OBJECTIVE_KEYS
    )
    | REQUEST_MARKERS
)

#: Every key the screens test for, the conventions' markers (for
#: :func:`supervisor.normalize.dependency_of`) and what the run tracker reads.
WATCHED_KEYS: Final = (
    _SIGNAL_KEYS
    | _QUIET_KEYS
    | {_OUTPUT_MESSAGES, "gen_ai.tool.definitions"}
    | frozenset(_TOOL_OUTPUT_KEYS)
    | genai.MARKERS
    | openllmetry.MARKERS
    | RUN_KEYS
)


#: Whether a set of present keys meets :data:`_SIGNAL_KEYS` and :data:`_QUIET_KEYS`,
#: by the set. The walker interns one set per kind of span, so this is one lookup
#: by a cached hash instead of two set intersections per span. Bounded.
_MEETS: Final[dict[frozenset[str], tuple[bool, bool]]] = {}
_MEETS_ENTRIES: Final = 4096


def _meets(present: frozenset[str]) -> tuple[bool, bool]:
    """(has a signal key, has a quiet key) for these present keys."""
    found = _MEETS.get(present)
    if found is None:
        found = (not _SIGNAL_KEYS.isdisjoint(present), not _QUIET_KEYS.isdisjoint(present))
        if len(_MEETS) >= _MEETS_ENTRIES:
            _MEETS.clear()  # bounded; rebuilt from the next spans
        _MEETS[present] = found
    return found


def shows_failure_signal(item: WireSpan) -> bool:
    """A cheap look, before normalizing, for the usual signs of a failure.

    True for an ERROR status, any event (``exception`` events), an
    ``error.type``, an HTTP status of 400 or more, a non-OK RPC status or a
    failing finish reason. Spans without these can still fail; see
    :func:`may_fail_quietly`.
    """
    span, _, _, present, encoded = item
    if error_status_or_events(span, _STATUS_ERROR):
        return True
    if not _meets(present)[0]:
        return False
    if "error.type" in present:
        return True
    attrs = RawAttributes(encoded)
    for key in _HTTP_STATUS_KEYS:
        status = attrs.get(key)
        if status is not None:
            if not (isinstance(status, int) and status < 400):
                return True
            break  # the first present is the one normalization reads
    for key in _RPC_STATUS_KEYS:
        code = attrs.get(key)
        if code is not None and code not in (0, "OK", "0"):
            return True
    for key in _FINISH_KEYS:
        raw = raw_value(encoded, key)
        if raw is not None and _FAILING_FINISH.search(raw.lower()):
            return True
    return False


def may_fail_quietly(item: WireSpan) -> bool:
    """Whether a span without a :func:`shows_failure_signal` may still be a failure.

    Where conventions disagree (a span written by two instrumentations),
    every one's reading is tested, since normalization keeps only the first.
    """
    _, _, _, present, encoded = item
    if not _meets(present)[1]:
        return False
    try:
        return _quiet_failure(LazyConverted(RawAttributes(encoded)), present)
    except Exception:  # boundary: what cannot be screened is normalized, never dropped
        return True


def _quiet_failure(attrs: LazyConverted, keys: frozenset[str]) -> bool:
    a = attrs.values
    reasons: list[str] = []
    for key in _REASON_KEYS:
        if key in keys:
            reasons.extend(genai.finish_reasons(a.get(key)))
    texts: list[str] = []
    calls: list[list[tuple[str, object]]] = []  # each convention's, checked apart
    oi_role = openinference.kind_role(a.get(openinference.MARKER))
    if oi_role is Role.LLM and _OUTPUT_MESSAGES in keys:
        text, found = openinference.output_messages(attrs)
        texts.append(text)
        calls.append(found)
    if "gen_ai.output.messages" in keys:
        text, found, finish = genai.message_output(attrs.full("gen_ai.output.messages"))
        texts.append(text)
        calls.append(found)
        reasons.extend(finish)
    if openllmetry.has_completions(keys):
        text, finish, found = openllmetry.completions(attrs)
        texts.append(text)
        calls.append(found)
        reasons.extend(finish)
    if reasons and failing_finish(tuple(reasons)):
        return True
    if any(calls) and _any_invalid(attrs, keys, calls):
        return True
    if not (
        oi_role is Role.TOOL
        or genai.role_of(a) is Role.TOOL
        or openllmetry.kind_role(a.get("traceloop.span.kind")) is Role.TOOL
    ):
        return False
    texts.extend(text_value(attrs.full(key)) for key in _TOOL_OUTPUT_KEYS if key in keys)
    return any(text and detect_swallowed(text) is not None for text in texts)


def _any_invalid(
    attrs: LazyConverted, keys: frozenset[str], calls: list[list[tuple[str, object]]]
) -> bool:
    """Whether any convention's calls are invalid against any offered tools the span records."""
    offered = {openinference.offered_tools(attrs), openllmetry.offered_functions(attrs)}
    if "gen_ai.tool.definitions" in keys:
        offered.add(attrs.read("gen_ai.tool.definitions", genai.tool_names))
    # A call checked against no list finds only bad arguments; any non-empty list finds those too.
    lists: list[frozenset[str] | None] = [tools for tools in offered if tools]
    lists = lists or [None]
    return any(check_tool_calls(found, tools) for found in calls if found for tools in lists)
