"""Which spans can be failures, decided before normalizing them.

Normalizing a span (every convention's attributes, the error evidence) costs
many times what reading a few keys does, and most spans succeed, so the
pipeline normalizes only the spans these screens pass: work that only
failures need stays off the per-span path. Two screens:

* :func:`shows_failure_signal`: the usual signs (ERROR status, an event, an
  ``error.type``, an HTTP status of 400 or more, a non-OK RPC status, a
  failing finish reason in the usual places). Spans with these are judged
  first, so that most decisions do not wait for the rest of the batch.
* :func:`may_fail_quietly`: for the others, the failures a status does not
  show: a finish reason in a message list, a tool call the model was not
  offered or with arguments that are not a JSON object, a tool output that
  is a caught error. It reads the attributes that decide these with the
  adapters' own functions, for every convention present, so it passes a
  superset of what :meth:`~supervisor.normalize.span.Span.record` finds failing
  (a property test holds it to that).

Both must err towards True: a span wrongly passed costs a normalization, a
span wrongly dropped is a missed failure.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from supervisor.normalize import genai, http_rpc, openinference, openllmetry
from supervisor.normalize.attributes import text_value
from supervisor.normalize.evidence import (
    FAILURE_FINISH_REASONS,
    check_tool_calls,
    detect_swallowed,
    failing_finish,
)
from supervisor.normalize.span import WATCHED_RUN_KEYS
from supervisor.normalize.wire import LazyConverted
from supervisor.records import Role

if TYPE_CHECKING:
    from supervisor.normalize.span import Span

__all__ = ["WATCHED_KEYS", "may_fail_quietly", "shows_failure_signal"]

#: Finish reasons in single attributes, of every convention (the message lists are read below).
_REASON_KEYS: Final[tuple[str, ...]] = (
    genai.FINISH_REASON_KEYS + openinference.FINISH_REASON_KEYS + openllmetry.FINISH_REASON_KEYS
)
#: Finish reasons the early look reads (the quiet screen reads the rest).
_FINISH_KEYS: Final[tuple[str, ...]] = (
    genai.FINISH_REASON_KEYS[0],
    *openinference.FINISH_REASON_KEYS,
    *openllmetry.FINISH_REASON_KEYS,
)
#: Every attribute the early look reads; most spans carry none of them.
_SIGNAL_KEYS: Final = frozenset(
    {http_rpc.ERROR_TYPE, *http_rpc.HTTP_STATUS_KEYS, *http_rpc.RPC_STATUS_KEYS, *_FINISH_KEYS}
)
#: Any failing finish reason inside an encoded value, lower-cased (a superset
#: test: the adapters decide). On lower-cased bytes rather than IGNORECASE: a
#: third of the time, and the same answer (both fold ASCII letters only).
_FAILING_FINISH: Final = re.compile(
    b"|".join(re.escape(reason.lower().encode()) for reason in sorted(FAILURE_FINISH_REASONS))
)
#: A tool span's output, whichever convention wrote it.
_TOOL_OUTPUT_KEYS: Final[tuple[str, ...]] = (
    openinference.TOOL_RESULT_KEYS + genai.TOOL_RESULT_KEYS + openllmetry.TOOL_RESULT_KEYS
)
#: Keys without which a span that shows no signal cannot fail: no finish
#: reason, no tool call and no tool role can be read from it.
_QUIET_KEYS: Final = genai.QUIET_KEYS | openinference.QUIET_KEYS | openllmetry.QUIET_KEYS

#: Every key the screens test for, the conventions' markers (for the
#: dependency) and what the run tracker reads: the reader notes which of
#: these each span carries, in one pass over its attributes.
WATCHED_KEYS: Final = (
    _SIGNAL_KEYS
    | _QUIET_KEYS
    | {openinference.OUTPUT_ROLE, genai.OFFERED_TOOLS}
    | frozenset(_TOOL_OUTPUT_KEYS)
    | genai.MARKERS
    | openllmetry.MARKERS
    | WATCHED_RUN_KEYS
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


def shows_failure_signal(span: Span) -> bool:
    """A cheap look, before normalizing, for the usual signs of a failure.

    True for an ERROR status, any event (``exception`` events), an
    ``error.type``, an HTTP status of 400 or more, a non-OK RPC status or a
    failing finish reason. Spans without these can still fail; see
    :func:`may_fail_quietly`.
    """
    if span.status_error or span.has_events:
        return True
    present = span.present
    if not _meets(present)[0]:
        return False
    if http_rpc.ERROR_TYPE in present:
        return True
    # Every key read here is watched: ``present`` says which the span carries.
    attrs = span.attributes
    for key in http_rpc.HTTP_STATUS_KEYS:
        if key in present:
            status = attrs.get(key)
            if not (isinstance(status, int) and status < 400):
                return True
            break  # the first present is the one normalization reads
    for key in http_rpc.RPC_STATUS_KEYS:
        if key in present:
            code = attrs.get(key)
            if code is not None and code not in (0, "OK", "0"):
                return True
    for key in _FINISH_KEYS:
        if key in present and _FAILING_FINISH.search(span.encoded[key].lower()):
            return True
    return False


def may_fail_quietly(span: Span) -> bool:
    """Whether a span without a :func:`shows_failure_signal` may still be a failure.

    Where conventions disagree (a span written by two instrumentations),
    every one's reading is tested, since normalization keeps only the first.
    """
    present = span.present
    if not _meets(present)[1]:
        return False
    try:
        return _quiet_failure(LazyConverted(span.attributes), present)
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
    if oi_role is Role.LLM and openinference.OUTPUT_ROLE in keys:
        text, found = openinference.output_messages(attrs)
        texts.append(text)
        calls.append(found)
    if genai.OUTPUT_MESSAGES in keys:
        text, found, finish = genai.message_output(attrs.full(genai.OUTPUT_MESSAGES))
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
        or openllmetry.kind_role(a.get(openllmetry.KIND_KEY)) is Role.TOOL
    ):
        return False
    texts.extend(text_value(attrs.full(key)) for key in _TOOL_OUTPUT_KEYS if key in keys)
    return any(text and detect_swallowed(text) is not None for text in texts)


def _any_invalid(
    attrs: LazyConverted, keys: frozenset[str], calls: list[list[tuple[str, object]]]
) -> bool:
    """Whether any convention's calls are invalid against any offered tools the span records."""
    offered = {openinference.offered_tools(attrs), openllmetry.offered_functions(attrs)}
    if genai.OFFERED_TOOLS in keys:
        offered.add(attrs.read(genai.OFFERED_TOOLS, genai.tool_names))
    # A call checked against no list finds only bad arguments; any non-empty list finds those too.
    lists: list[frozenset[str] | None] = [tools for tools in offered if tools]
    lists = lists or [None]
    return any(check_tool_calls(found, tools) for found in calls if found for tools in lists)
