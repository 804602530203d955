"""OpenInference conventions (Arize/Phoenix): ``openinference.span.kind``, ``llm.*``, ``tool.*``.

OpenInference flattens lists into indexed keys
(``llm.output_messages.0.message.tool_calls.1.tool_call.function.name``), so
this adapter probes indexed keys in order and stops at the first gap, with a
bound on every index. What the instrumentations write (checked against
``openinference-instrumentation-openai`` 0.1.66 and ``-anthropic`` 3.1):
``llm.system``/``llm.provider``, ``llm.model_name`` (the response model),
``llm.request.model_name``/``llm.response.model_name`` (Anthropic),
``llm.token_count.prompt/completion``, ``llm.finish_reason``, output text in
``llm.output_messages.N.message.content`` (OpenAI) or
``...message.contents.K.message_content.text`` (Anthropic), offered tools in
``llm.tools.N.tool.json_schema``, and for failures status ERROR with the
description ``"<ExceptionClass>: <message>"`` plus an ``exception`` event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from supervisor.normalize.attributes import (
    MAX_OUTPUT_CHARS,
    AttributeSource,
    Draft,
    as_int,
    as_str,
    bounded,
    parse_json,
    text_value,
)
from supervisor.normalize.genai import USER_ROLES, normalize_provider, tool_name_in, user_input
from supervisor.records import AttrValue, Role

__all__ = [
    "MARKER",
    "extract",
    "identify",
    "input_task",
    "kind_role",
    "offered_tools",
    "output_messages",
]

#: The attribute whose presence says the span follows OpenInference.
MARKER: Final = "openinference.span.kind"

#: What the run tracker reads, in the order tried (see supervisor.normalize.span).
#: ``session.id`` is read whatever the span's kind: OpenInference's
#: ``using_session`` puts it on every span, and other instrumentations write it too.
SESSION_KEYS: Final[tuple[str, ...]] = ("session.id",)
INPUT_TOKEN_KEYS: Final[tuple[str, ...]] = ("llm.token_count.prompt",)
OUTPUT_TOKEN_KEYS: Final[tuple[str, ...]] = ("llm.token_count.completion",)
TOOL_ARGUMENT_KEYS: Final[tuple[str, ...]] = ("input.value",)
TOOL_RESULT_KEYS: Final[tuple[str, ...]] = ("output.value",)
#: The answer's text where the instrumentation keeps it apart (Anthropic's as content blocks).
LLM_TEXT_KEYS: Final[tuple[str, ...]] = (
    "llm.output_messages.0.message.content",
    "llm.output_messages.0.message.contents.0.message_content.text",
)
#: Where a span keeps its input (:func:`input_task` reads it): the input messages
#: (``llm.input_messages.N.message.role/content``), else ``input.value``.
OBJECTIVE_KEYS: Final[tuple[str, ...]] = (
    "llm.input_messages.0.message.role",
    "llm.input_messages.0.message.content",
    "llm.input_messages.0.message.contents.0.message_content.text",
    "input.value",
)
FINISH_REASON_KEYS: Final[tuple[str, ...]] = ("llm.finish_reason",)
#: The first output message's role: present when the response was recorded.
OUTPUT_ROLE: Final = "llm.output_messages.0.message.role"
#: Where a span's output is, when recorded (``TraceConfig(hide_outputs=True)``
#: and the Agents SDK without sensitive data leave them out).
#: An LLM's answer (``output.value`` there is the raw response, not the answer);
#: the result of any other span.
ANSWER_KEYS: Final[tuple[str, ...]] = (OUTPUT_ROLE, *LLM_TEXT_KEYS)
RESULT_KEYS: Final[tuple[str, ...]] = TOOL_RESULT_KEYS
#: The first requested tool call: its presence says the response asked for one.
FIRST_TOOL_CALL: Final = "llm.output_messages.0.message.tool_calls.0.tool_call.function.name"
#: Without one of these a span cannot name a tool role or a failing finish.
QUIET_KEYS: Final = frozenset({MARKER, *FINISH_REASON_KEYS})
#: The first output message's requested tool calls, probed in order: (name, arguments) keys.
REQUESTED_CALL_KEYS: Final[tuple[tuple[str, str], ...]] = tuple(
    (
        f"llm.output_messages.0.message.tool_calls.{m}.tool_call.function.name",
        f"llm.output_messages.0.message.tool_calls.{m}.tool_call.function.arguments",
    )
    for m in range(8)
)

_KIND_ROLES: Final[Mapping[str, Role]] = {
    "LLM": Role.LLM,
    "EMBEDDING": Role.LLM,
    "TOOL": Role.TOOL,
    "RETRIEVER": Role.TOOL,
    "RERANKER": Role.TOOL,
    "AGENT": Role.AGENT,
    "CHAIN": Role.CHAIN,
}

#: Bounds on the indexed keys probed.
_MAX_MESSAGES: Final = 8
_MAX_CALLS: Final = 64
_MAX_CONTENTS: Final = 16
_MAX_TOOLS: Final = 128

#: The indexed keys, built once: building them per span cost more than reading them.
#: Per output message: its role, content, tool-call prefix and content-part prefix.
_MESSAGE_KEYS: Final[tuple[tuple[str, str, str, str], ...]] = tuple(
    (
        f"llm.output_messages.{n}.message.role",
        f"llm.output_messages.{n}.message.content",
        f"llm.output_messages.{n}.message.tool_calls.",
        f"llm.output_messages.{n}.message.contents.",
    )
    for n in range(_MAX_MESSAGES)
)
#: Per input message: its role, content and content-part prefix (a task is in the first few).
_INPUT_KEYS: Final[tuple[tuple[str, str, str], ...]] = tuple(
    (
        f"llm.input_messages.{n}.message.role",
        f"llm.input_messages.{n}.message.content",
        f"llm.input_messages.{n}.message.contents.",
    )
    for n in range(16)
)
#: Kinds whose ``input.value`` is not what the run was asked (a tool's arguments, a query).
_NOT_A_TASK: Final = frozenset({Role.TOOL})
#: Per offered tool: its ``json_schema`` and ``name`` keys.
_TOOL_KEYS: Final[tuple[tuple[str, str], ...]] = tuple(
    (f"llm.tools.{n}.tool.json_schema", f"llm.tools.{n}.tool.name") for n in range(_MAX_TOOLS)
)


def identify(draft: Draft) -> None:
    """Role, provider, models and tool name: what a span's dependency is made of."""
    a = draft.attrs.values
    role = kind_role(a.get(MARKER))
    if draft.role is None:
        draft.role = role
    if role is Role.LLM:
        _llm_identity(draft, a)
    elif role is Role.TOOL and not draft.tool_name:
        draft.tool_name = as_str(a.get("tool.name"))


def extract(draft: Draft) -> None:
    """Fill the rest of the draft from OpenInference attributes (fields still empty only)."""
    a = draft.attrs.values
    draft.conventions.append("openinference")
    kind = a.get(MARKER)
    kind_name = kind.upper() if isinstance(kind, str) else ""
    role = kind_role(kind)
    if role is Role.LLM:
        _llm(draft, a, kind_name)
    elif role is Role.TOOL and draft.tool_args is None:
        draft.tool_args = draft.attrs.full("input.value")
    if not draft.output_text and role is not Role.LLM:
        draft.output_text = text_value(draft.attrs.full("output.value"))


def kind_role(kind: object) -> Role:
    """The role an ``openinference.span.kind`` value names (``OTHER`` if none)."""
    return _KIND_ROLES.get(kind.upper(), Role.OTHER) if isinstance(kind, str) else Role.OTHER


def _llm_identity(draft: Draft, a: Mapping[str, AttrValue]) -> None:
    if not draft.provider:
        draft.provider = normalize_provider(a.get("llm.provider") or a.get("llm.system"))
    if not draft.response_model:
        draft.response_model = as_str(
            a.get("llm.response.model_name")
            or a.get("llm.model_name")
            or a.get("embedding.model_name")
        )
    if not draft.request_model:
        draft.request_model = as_str(a.get("llm.request.model_name"))
    if not draft.request_model and not draft.response_model:
        # Failed calls carry no response: the model is only in the request parameters.
        params = a.get("llm.invocation_parameters")
        parsed = parse_json(params) if isinstance(params, str) else None
        if isinstance(parsed, dict):
            draft.request_model = as_str(parsed.get("model"))


def _llm(draft: Draft, a: Mapping[str, AttrValue], kind_name: str) -> None:
    if draft.input_tokens is None:
        draft.input_tokens = as_int(a.get("llm.token_count.prompt"))
    if draft.output_tokens is None:
        draft.output_tokens = as_int(a.get("llm.token_count.completion"))
    if not draft.finish_reasons:
        reason = a.get("llm.finish_reason")
        if isinstance(reason, str) and reason:
            draft.finish_reasons = (bounded(reason, 256),)
    if kind_name != "LLM" or "llm.output_messages.0.message.role" not in a:
        return
    text, calls = output_messages(draft.attrs)
    if not draft.output_text and text:
        draft.output_text = text
    if calls and not draft.tool_calls:
        draft.tool_calls = calls
        if draft.offered_tools is None:
            draft.offered_tools = offered_tools(draft.attrs)


def output_messages(attrs: AttributeSource) -> tuple[str, list[tuple[str, object]]]:
    """Text and requested tool calls of ``llm.output_messages.N``."""
    a = attrs.values
    texts: list[str] = []
    calls: list[tuple[str, object]] = []
    for role_key, content_key, calls_prefix, contents_prefix in _MESSAGE_KEYS:
        if role_key not in a:
            break
        content = a.get(content_key)
        if isinstance(content, str) and content:
            texts.append(content)
        found = _calls(attrs, calls_prefix, calls)
        for k in range(_MAX_CONTENTS):
            item = f"{contents_prefix}{k}."
            kind = a.get(item + "message_content.type")
            if kind is None:
                break
            if kind == "text":
                text = attrs.full(item + "message_content.text")
                if isinstance(text, str) and text:
                    texts.append(text)
            elif not found:
                name = as_str(a.get(item + "tool_call.function.name"))
                if name:
                    calls.append((name, attrs.full(item + "tool_call.function.arguments")))
    return (bounded("\n".join(texts), MAX_OUTPUT_CHARS) if texts else ""), calls


def input_task(attrs: AttributeSource) -> str | None:
    """The run's task in a span's input: the first input message whose role is ``user``.

    OpenInference puts the system prompt first in ``llm.input_messages``: it
    is an instruction to the agent, not its task. Only when no input message
    records a role is the first one taken; with no input messages,
    ``input.value`` (read as :func:`~supervisor.normalize.genai.user_input`
    reads a message list), except a tool's, whose input is its arguments.
    None when the span names no task.
    """
    a = attrs.values
    first: str | None = None
    roles = False
    for role_key, content_key, contents_prefix in _INPUT_KEYS:
        role = a.get(role_key)
        text = _input_text(attrs, content_key, contents_prefix)
        if role is None and text is None:
            break
        roles = roles or (isinstance(role, str) and bool(role))
        if isinstance(role, str) and role.lower() in USER_ROLES and text:
            return text
        if first is None:
            first = text or None
    if roles or first is not None:
        return None if roles else first
    if kind_role(a.get(MARKER)) in _NOT_A_TASK:
        return None
    return user_input(attrs.full("input.value"))


def _input_text(attrs: AttributeSource, content_key: str, contents_prefix: str) -> str | None:
    """An input message's text: its content, or its text parts; None when it has neither."""
    content = attrs.full(content_key)
    if isinstance(content, str):
        return content
    a = attrs.values
    texts: list[str] = []
    for k in range(_MAX_CONTENTS):
        item = f"{contents_prefix}{k}.message_content."
        kind = a.get(item + "type")
        if kind is None:
            break
        text = attrs.full(item + "text") if kind == "text" else None
        if isinstance(text, str) and text:
            texts.append(text)
    return " ".join(texts) if texts else (None if content is None else "")


def _calls(attrs: AttributeSource, prefix: str, out: list[tuple[str, object]]) -> bool:
    """Append ``tool_calls.M`` under ``prefix``; whether any was found."""
    a = attrs.values
    found = False
    for m in range(_MAX_CALLS):
        key = f"{prefix}{m}.tool_call.function."
        name = a.get(key + "name")
        if name is None:
            break
        found = True
        out.append((as_str(name), attrs.full(key + "arguments")))
    return found


def offered_tools(attrs: AttributeSource) -> frozenset[str] | None:
    """Names in ``llm.tools.N.tool.json_schema``; ``None`` when none are recorded."""
    a = attrs.values
    if "llm.tools.0.tool.json_schema" not in a and "llm.tools.0.tool.name" not in a:
        return None
    names: set[str] = set()
    for schema_key, name_key in _TOOL_KEYS:
        name = attrs.read(schema_key, _schema_name)  # the same on every call: memoized
        if name is None:
            name = as_str(a.get(name_key))
            if not name:
                break
        if name:
            names.add(name)
    return frozenset(names)


def _schema_name(schema: AttrValue) -> str | None:
    """The tool's name in a ``json_schema`` value; ``None`` when there is no value."""
    return None if schema is None else tool_name_in(schema)
