"""OpenLLMetry / Traceloop: ``traceloop.*``, ``llm.*``, indexed ``gen_ai.prompt/completion``.

Two layers. The Traceloop SDK's decorators (``@workflow``, ``@task``,
``@agent``, ``@tool``) write ``traceloop.span.kind`` with
``traceloop.entity.name``/``input``/``output`` (input and output JSON-encoded).
The provider instrumentations (``opentelemetry-instrumentation-openai`` and
friends) wrote, before they moved to the GenAI message attributes, indexed
keys: ``gen_ai.completion.N.content/finish_reason/tool_calls.M.name/arguments``,
``llm.request.functions.N.name``, ``llm.request.type``,
``llm.usage.total_tokens``. Version 0.62 writes ``gen_ai.input.messages``,
``gen_ai.output.messages`` and ``gen_ai.tool.definitions`` instead, which
:mod:`supervisor.normalize.genai` reads; both layers are handled here so
older agents normalise too.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping
from typing import Final

from supervisor.normalize.attributes import (
    MAX_NAME_CHARS,
    MAX_OUTPUT_CHARS,
    AttributeSource,
    Draft,
    as_str,
    bounded,
    parse_json,
    text_value,
)
from supervisor.normalize.genai import USER_ROLES, content_text
from supervisor.records import Role

__all__ = [
    "MARKERS",
    "applies",
    "completions",
    "extract",
    "has_completions",
    "identify",
    "input_task",
    "kind_role",
    "offered_functions",
    "role_of",
]

MARKERS: Final = frozenset(
    {
        "traceloop.span.kind",
        "traceloop.entity.name",
        "llm.request.type",
        "gen_ai.completion.0.content",
        "gen_ai.completion.0.role",
        "gen_ai.completion.0.finish_reason",
        "gen_ai.completion.0.tool_calls.0.name",
        "llm.usage.total_tokens",
    }
)

_KIND_ROLES: Final[Mapping[str, Role]] = {
    "workflow": Role.CHAIN,
    "task": Role.CHAIN,
    "agent": Role.AGENT,
    "tool": Role.TOOL,
}

_REQUEST_TYPES: Final = frozenset({"chat", "completion", "embedding", "rerank"})
#: The Traceloop SDK's span kind (workflow, task, agent, tool).
KIND_KEY: Final = "traceloop.span.kind"
#: What the run tracker reads, in the order tried (see supervisor.normalize.span).
SESSION_KEYS: Final[tuple[str, ...]] = (
    "traceloop.association.properties.session_id",
    "traceloop.association.properties.thread_id",
    "traceloop.association.properties.conversation_id",
)
TOOL_ARGUMENT_KEYS: Final[tuple[str, ...]] = ("traceloop.entity.input",)
TOOL_RESULT_KEYS: Final[tuple[str, ...]] = ("traceloop.entity.output",)
LLM_TEXT_KEYS: Final[tuple[str, ...]] = ("gen_ai.completion.0.content",)
#: Where a span keeps its input messages, before 0.5x (:func:`input_task` reads them).
OBJECTIVE_KEYS: Final[tuple[str, ...]] = ("gen_ai.prompt.0.role", "gen_ai.prompt.0.content")
#: Per prompt message: its role and content keys (a task is in the first few).
_PROMPT_KEYS: Final[tuple[tuple[str, str], ...]] = tuple(
    (f"gen_ai.prompt.{n}.role", f"gen_ai.prompt.{n}.content") for n in range(16)
)
FINISH_REASON_KEYS: Final[tuple[str, ...]] = ("gen_ai.completion.0.finish_reason",)
#: Where a span's output is, when recorded (``TRACELOOP_TRACE_CONTENT=false`` leaves
#: them out; a finish reason alone says nothing of the content).
ANSWER_KEYS: Final[tuple[str, ...]] = (*LLM_TEXT_KEYS, "gen_ai.completion.0.tool_calls.0.name")
RESULT_KEYS: Final[tuple[str, ...]] = TOOL_RESULT_KEYS
#: Without one of these a span cannot name a tool role, a tool call or a failing finish.
QUIET_KEYS: Final = frozenset(
    {KIND_KEY, "gen_ai.completion.0.role", "gen_ai.completion.0.content", *FINISH_REASON_KEYS}
)
_MAX_COMPLETIONS: Final = 8
_MAX_CALLS: Final = 64
_MAX_FUNCTIONS: Final = 128


def input_task(attrs: AttributeSource) -> str | None:
    """The run's task in ``gen_ai.prompt.N``: the first prompt message whose role is ``user``.

    Only when no prompt message records a role is the first one taken; a
    content written as a JSON list of parts is read for its text. None when
    the span names no task (a system prompt alone).
    """
    a = attrs.values
    first: str | None = None
    roles = False
    for role_key, content_key in _PROMPT_KEYS:
        role = a.get(role_key)
        content = attrs.full(content_key)
        if role is None and content is None:
            break
        text = _prompt_text(content)
        roles = roles or (isinstance(role, str) and bool(role))
        if isinstance(role, str) and role.lower() in USER_ROLES and text:
            return text
        if first is None:
            first = text or None
    return None if roles else first


def _prompt_text(content: object) -> str:
    if isinstance(content, str) and content[:1] == "[":  # multi-part content, as JSON
        parts = parse_json(content)
        if isinstance(parts, list):
            return content_text(parts)
    return content_text(content)


def applies(keys: Collection[str]) -> bool:
    """Whether a span with these attribute keys carries OpenLLMetry / Traceloop attributes."""
    return not MARKERS.isdisjoint(keys)


def role_of(a: Mapping[str, object]) -> Role | None:
    """The role Traceloop attributes give a span: its kind, else an LLM request type."""
    role = kind_role(a.get("traceloop.span.kind"))
    request_type = a.get("llm.request.type")
    if role is None and isinstance(request_type, str) and request_type in _REQUEST_TYPES:
        role = Role.LLM
    return role


def identify(draft: Draft) -> None:
    """Role and tool name: what a span's dependency is made of."""
    a = draft.attrs.values
    role = role_of(a)
    if draft.role is None and role is not None:
        draft.role = role
    if role is Role.TOOL and not draft.tool_name:
        draft.tool_name = as_str(a.get("traceloop.entity.name"))


def extract(draft: Draft) -> None:
    """Fill the draft from Traceloop attributes (fields still empty only)."""
    a = draft.attrs.values
    draft.conventions.append("openllmetry")
    kind = a.get("traceloop.span.kind")
    role = role_of(a)
    if role is Role.TOOL and draft.tool_args is None:
        draft.tool_args = draft.attrs.full("traceloop.entity.input")
    if kind is not None and not draft.output_text:
        draft.output_text = text_value(draft.attrs.full("traceloop.entity.output"))
    if not draft.finish_reasons:
        reason = a.get("gen_ai.response.finish_reason") or a.get("gen_ai.response.stop_reason")
        if isinstance(reason, str) and reason:
            draft.finish_reasons = (bounded(reason, MAX_NAME_CHARS),)
    if has_completions(a):
        text, reasons, calls = completions(draft.attrs)
        if text and not draft.output_text:
            draft.output_text = text
        if reasons and not draft.finish_reasons:
            draft.finish_reasons = reasons
        if calls and not draft.tool_calls:
            draft.tool_calls = calls
            if draft.offered_tools is None:
                draft.offered_tools = offered_functions(draft.attrs)


def kind_role(kind: object) -> Role | None:
    """The role a ``traceloop.span.kind`` value names, if any."""
    return _KIND_ROLES.get(kind) if isinstance(kind, str) else None


def has_completions(keys: Container[str]) -> bool:
    """Whether indexed ``gen_ai.completion.N.*`` attributes are present."""
    return (
        "gen_ai.completion.0.role" in keys
        or "gen_ai.completion.0.content" in keys
        or "gen_ai.completion.0.finish_reason" in keys
    )


def completions(
    attrs: AttributeSource,
) -> tuple[str, tuple[str, ...], list[tuple[str, object]]]:
    """Text, finish reasons and requested tool calls of ``gen_ai.completion.N``."""
    a = attrs.values
    texts: list[str] = []
    reasons: list[str] = []
    calls: list[tuple[str, object]] = []
    for n in range(_MAX_COMPLETIONS):
        prefix = f"gen_ai.completion.{n}."
        content = a.get(prefix + "content")
        reason = a.get(prefix + "finish_reason")
        has_call = prefix + "tool_calls.0.name" in a or prefix + "function_call.name" in a
        if content is None and reason is None and not has_call and prefix + "role" not in a:
            break
        if isinstance(content, str) and content:
            texts.append(content)
        if isinstance(reason, str) and reason:
            reasons.append(bounded(reason, MAX_NAME_CHARS))
        for m in range(_MAX_CALLS if has_call else 0):
            key = f"{prefix}tool_calls.{m}."
            name = a.get(key + "name")
            if name is None:
                break
            calls.append((as_str(name), attrs.full(key + "arguments")))
        legacy = a.get(prefix + "function_call.name")
        if legacy is not None:
            calls.append((as_str(legacy), attrs.full(prefix + "function_call.arguments")))
    text = bounded("\n".join(texts), MAX_OUTPUT_CHARS) if texts else ""
    return text, tuple(reasons), calls


def offered_functions(attrs: AttributeSource) -> frozenset[str] | None:
    """Names in ``llm.request.functions.N.name``; ``None`` when none are recorded."""
    a = attrs.values
    if "llm.request.functions.0.name" not in a:
        return None
    names = set()
    for i in range(_MAX_FUNCTIONS):
        name = as_str(a.get(f"llm.request.functions.{i}.name"))
        if not name:
            break
        names.add(name)
    return frozenset(names)
