"""OpenTelemetry GenAI semantic conventions (``gen_ai.*``), old and new names.

Covers the names of semconv 1.26 through the current experimental ones:
``gen_ai.system`` → ``gen_ai.provider.name``, ``gen_ai.usage.prompt_tokens``
→ ``input_tokens``, ``completion_tokens`` → ``output_tokens``, and the
JSON message attributes ``gen_ai.input.messages`` / ``gen_ai.output.messages``
(``[{"role", "parts": [{"type": "text", "content"} | {"type": "tool_call",
"name", "arguments"}], "finish_reason"}]``), which the official
``opentelemetry-instrumentation-openai-v2`` and OpenLLMetry >= 0.5x write.

Provider names are normalised here to the semconv well-known values
(``openai``, ``anthropic``, ``azure.ai.openai``, ``aws.bedrock``...), since
every adapter needs the same spelling for the ``provider:model`` dependency.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, Final

from supervisor.normalize.attributes import (
    MAX_NAME_CHARS,
    MAX_OUTPUT_CHARS,
    AttributeSource,
    Draft,
    as_int,
    as_str,
    bounded,
    parse_json,
    text_value,
)
from supervisor.records import Role

__all__ = [
    "MARKERS",
    "applies",
    "content_text",
    "extract",
    "finish_reasons",
    "identify",
    "input_task",
    "message_output",
    "normalize_provider",
    "role_of",
    "tool_name_in",
    "tool_name_of",
    "tool_names",
    "user_input",
]

MARKERS: Final = frozenset(
    {
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.system",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "gen_ai.tool.name",
        "gen_ai.agent.name",
    }
)

#: What the run tracker reads, in the order tried (see supervisor.normalize.span).
SESSION_KEYS: Final[tuple[str, ...]] = ("gen_ai.conversation.id",)
INPUT_TOKEN_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.prompt_tokens",
)
OUTPUT_TOKEN_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.completion_tokens",
)
TOOL_ARGUMENT_KEYS: Final[tuple[str, ...]] = ("gen_ai.tool.call.arguments",)
TOOL_RESULT_KEYS: Final[tuple[str, ...]] = ("gen_ai.tool.call.result",)
#: The response as a message list: text, requested tool calls and finish reasons.
OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
OFFERED_TOOLS: Final = "gen_ai.tool.definitions"
#: Where a span's output is, when the instrumentation recorded it (openai-v2 and
#: util-genai write these only with content capture on; it is off by default).
#: An LLM's answer; a tool's, an agent's or a workflow's result.
ANSWER_KEYS: Final[tuple[str, ...]] = (OUTPUT_MESSAGES,)
RESULT_KEYS: Final[tuple[str, ...]] = (*TOOL_RESULT_KEYS, OUTPUT_MESSAGES)
#: The request as a message list: where a run's task is read (:func:`input_task`).
INPUT_MESSAGES: Final = "gen_ai.input.messages"
OBJECTIVE_KEYS: Final[tuple[str, ...]] = (INPUT_MESSAGES,)
#: The roles of a person's (or a calling program's) input, as conventions spell them.
USER_ROLES: Final = frozenset({"user", "human"})
#: Finish reasons in single attributes.
FINISH_REASON_KEYS: Final[tuple[str, ...]] = (
    "gen_ai.response.finish_reasons",
    "gen_ai.response.finish_reason",
    "gen_ai.response.stop_reason",
)
#: Without one of these a span cannot name a tool role or a failing finish.
QUIET_KEYS: Final = frozenset(
    {"gen_ai.operation.name", "gen_ai.tool.name", OUTPUT_MESSAGES, *FINISH_REASON_KEYS}
)

#: What a JSON object or a kvlist attribute converts to (concrete types: fast isinstance).
_MAPS: Final = (dict, MappingProxyType)

_OPERATION_ROLES: Final[Mapping[str, Role]] = {
    "chat": Role.LLM,
    "text_completion": Role.LLM,
    "completion": Role.LLM,
    "generate_content": Role.LLM,
    "embeddings": Role.LLM,
    "embedding": Role.LLM,
    "responses": Role.LLM,
    "rerank": Role.LLM,
    "execute_tool": Role.TOOL,
    "invoke_agent": Role.AGENT,
    "create_agent": Role.AGENT,
    "invoke_workflow": Role.CHAIN,
}

#: Spellings seen in the wild → the semconv well-known provider name.
_PROVIDERS: Final[Mapping[str, str]] = {
    "openai": "openai",
    "azure": "azure.ai.openai",
    "azure_openai": "azure.ai.openai",
    "azure-openai": "azure.ai.openai",
    "azure openai": "azure.ai.openai",
    "az.ai.openai": "azure.ai.openai",
    "azure.ai.openai": "azure.ai.openai",
    "az.ai.inference": "azure.ai.inference",
    "azure.ai.inference": "azure.ai.inference",
    "anthropic": "anthropic",
    "aws.bedrock": "aws.bedrock",
    "aws_bedrock": "aws.bedrock",
    "bedrock": "aws.bedrock",
    "aws": "aws.bedrock",
    "vertex_ai": "gcp.vertex_ai",
    "vertexai": "gcp.vertex_ai",
    "vertex ai": "gcp.vertex_ai",
    "gcp.vertex_ai": "gcp.vertex_ai",
    "gemini": "gcp.gemini",
    "gcp.gemini": "gcp.gemini",
    "google": "gcp.gemini",
    "google_genai": "gcp.gen_ai",
    "gcp.gen_ai": "gcp.gen_ai",
    "cohere": "cohere",
    "mistral": "mistral_ai",
    "mistralai": "mistral_ai",
    "mistral_ai": "mistral_ai",
    "groq": "groq",
    "deepseek": "deepseek",
    "perplexity": "perplexity",
    "xai": "x_ai",
    "x_ai": "x_ai",
    "x.ai": "x_ai",
    "watsonx": "ibm.watsonx.ai",
    "ibm.watsonx.ai": "ibm.watsonx.ai",
    "ollama": "ollama",
}


def normalize_provider(value: object) -> str:
    """A provider name as the semconv spells it; unknown names lower-cased."""
    text = as_str(value, MAX_NAME_CHARS)
    if not text:
        return ""
    known = _PROVIDERS.get(text)
    if known is not None:
        return known
    lowered = text.strip().lower()
    return _PROVIDERS.get(lowered, lowered)


def applies(keys: Collection[str]) -> bool:
    """Whether a span with these attribute keys carries GenAI semconv attributes."""
    return not MARKERS.isdisjoint(keys)


def role_of(a: Mapping[str, object]) -> Role | None:
    """The role ``gen_ai.*`` attributes give a span: its operation, else what it names."""
    op = a.get("gen_ai.operation.name")
    role = _OPERATION_ROLES.get(op) if isinstance(op, str) else None
    if role is None:
        if "gen_ai.tool.name" in a:
            role = Role.TOOL
        elif "gen_ai.request.model" in a or "gen_ai.response.model" in a:
            role = Role.LLM
        elif "gen_ai.agent.name" in a:
            role = Role.AGENT
    return role


def identify(draft: Draft) -> None:
    """Role, provider, models and tool name: what a span's dependency is made of."""
    a = draft.attrs.values
    if draft.role is None:
        draft.role = role_of(a)
    if not draft.provider:
        draft.provider = normalize_provider(a.get("gen_ai.provider.name") or a.get("gen_ai.system"))
    if not draft.request_model:
        draft.request_model = as_str(a.get("gen_ai.request.model"))
    if not draft.response_model:
        draft.response_model = as_str(a.get("gen_ai.response.model"))
    if not draft.tool_name and "gen_ai.tool.name" in a:
        draft.tool_name = as_str(a.get("gen_ai.tool.name"))


def extract(draft: Draft) -> None:
    """Fill the draft from ``gen_ai.*`` attributes (fields still empty only)."""
    a = draft.attrs.values
    draft.conventions.append("gen_ai")
    if draft.input_tokens is None:
        draft.input_tokens = as_int(
            a.get("gen_ai.usage.input_tokens", a.get("gen_ai.usage.prompt_tokens"))
        )
    if draft.output_tokens is None:
        draft.output_tokens = as_int(
            a.get("gen_ai.usage.output_tokens", a.get("gen_ai.usage.completion_tokens"))
        )
    if not draft.finish_reasons:
        draft.finish_reasons = finish_reasons(a.get("gen_ai.response.finish_reasons"))
    if "gen_ai.tool.name" in a:
        if draft.tool_args is None:
            draft.tool_args = draft.attrs.full("gen_ai.tool.call.arguments")
        if not draft.output_text:
            draft.output_text = text_value(draft.attrs.full("gen_ai.tool.call.result"))
    if "gen_ai.output.messages" in a:
        text, calls, reasons = message_output(draft.attrs.full("gen_ai.output.messages"))
        if not draft.output_text:
            draft.output_text = text
        if not draft.tool_calls:
            draft.tool_calls = calls
        if not draft.finish_reasons:
            draft.finish_reasons = reasons
    if draft.tool_calls and draft.offered_tools is None and "gen_ai.tool.definitions" in a:
        draft.offered_tools = draft.attrs.read("gen_ai.tool.definitions", tool_names)


def finish_reasons(value: object) -> tuple[str, ...]:
    """Finish reasons from a string or array attribute."""
    if isinstance(value, str):
        return (bounded(value, MAX_NAME_CHARS),) if value else ()
    if isinstance(value, tuple):
        return tuple(bounded(v, MAX_NAME_CHARS) for v in value[:16] if isinstance(v, str))
    return ()


def _as_list(value: object) -> list[Any] | tuple[Any, ...] | None:
    """A JSON-text or structured list attribute as a list (at most 64 items); else ``None``."""
    if isinstance(value, str):
        value = parse_json(value)
    if isinstance(value, (list, tuple)):
        return value if len(value) <= 64 else value[:64]
    return None


def message_output(
    value: object,
) -> tuple[str, list[tuple[str, object]], tuple[str, ...]]:
    """Text, requested tool calls and finish reasons from ``gen_ai.output.messages``."""
    messages = _as_list(value)
    if not messages:
        return "", [], ()
    texts: list[str] = []
    calls: list[tuple[str, object]] = []
    reasons: list[str] = []
    for message in messages:
        if not isinstance(message, _MAPS):
            continue
        reason = message.get("finish_reason")
        if isinstance(reason, str) and reason:
            reasons.append(bounded(reason, MAX_NAME_CHARS))
        content = message.get("content")
        if isinstance(content, str) and content:
            texts.append(content)
        parts = message.get("parts")
        if not isinstance(parts, (list, tuple)):
            continue
        for part in parts if len(parts) <= 64 else parts[:64]:
            if not isinstance(part, _MAPS):
                continue
            kind = part.get("type")
            if kind == "text":
                body = part.get("content", part.get("text"))
                if isinstance(body, str):
                    texts.append(body)
            elif kind == "tool_call":
                name = as_str(part.get("name"))
                if name:
                    calls.append((name, part.get("arguments")))
    text = "\n".join(texts) if len(texts) > 1 else (texts[0] if texts else "")
    return bounded(text, MAX_OUTPUT_CHARS), calls, tuple(reasons)


def input_task(attrs: AttributeSource) -> str | None:
    """The run's task in ``gen_ai.input.messages``: see :func:`user_input`."""
    return user_input(attrs.full(INPUT_MESSAGES))


def user_input(value: object) -> str | None:
    """The task in an input: the text of its first message whose role is a user's.

    ``value`` is a message list (GenAI's ``parts``, OpenAI's ``content``,
    LangChain's ``type``/``data`` or ``[role, text]`` pairs, as JSON text or
    structured, or an object whose ``messages`` is one) or plain text. Only
    when no message records a role is the first one taken, and plain text is
    the input itself. None when there is no task in it: a system prompt is
    an instruction to the agent, not what it was asked.
    """
    if isinstance(value, str):
        text = value.strip()
        if text[:1] not in ("[", "{"):
            return text or None
        parsed = parse_json(text)
        if parsed is None:
            return text  # not JSON after all: the input as written
        value = parsed
    if isinstance(value, _MAPS):
        messages = value.get("messages")
        if not isinstance(messages, (list, tuple)):
            return None
        value = messages
    if not isinstance(value, (list, tuple)):
        return None
    # LangGraph's input: one conversation, or a batch of them (the first).
    if value and isinstance(value[0], list) and value[0] and not isinstance(value[0][0], str):
        value = value[0]
    first: str | None = None
    roles = False
    for message in value[:64]:
        role, text = _role_and_text(message)
        roles = roles or bool(role)
        if role in USER_ROLES and text:
            return text
        if first is None:
            first = text or None
    return None if roles else first


def _role_and_text(message: object) -> tuple[str, str]:
    """One input message's role (``""``: none recorded) and text."""
    if isinstance(message, str):
        return "", message
    if isinstance(message, (list, tuple)) and len(message) == 2:  # ("user", "...")
        role, content = message
        return (role if isinstance(role, str) else ""), content_text(content)
    if not isinstance(message, _MAPS):
        return "", ""
    data = message.get("data") or message.get("kwargs")  # LangChain, serialized
    body = data if isinstance(data, _MAPS) else message
    role = message.get("role") or message.get("type") or body.get("type")
    if role == "constructor":  # LangChain's dumps(): the class names the role
        ident = message.get("id")
        name = ident[-1] if isinstance(ident, (list, tuple)) and ident else ""
        role = "human" if name == "HumanMessage" else str(name).lower()
    text = content_text(body.get("content") if "content" in body else body.get("parts"))
    return (role if isinstance(role, str) else ""), text


def content_text(content: object) -> str:
    """A message's text: the string, or its text parts (GenAI ``content``, OpenAI ``text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        return ""
    texts: list[str] = []
    for part in content[:64]:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, _MAPS) and part.get("type") in ("text", "input_text", None):
            body = part.get("content", part.get("text"))
            if isinstance(body, str) and body:
                texts.append(body)
    return " ".join(texts)


def tool_names(value: object) -> frozenset[str] | None:
    """Names of offered tools from a definitions list (GenAI, OpenAI or Anthropic shape)."""
    tools = _as_list(value)
    if tools is None:
        return None
    names = set()
    for tool in tools:
        name = tool_name_of(tool)
        if name:
            names.add(name)
    return frozenset(names)


def tool_name_in(definition: object) -> str:
    """The name in one tool definition, given as JSON text or structured."""
    return tool_name_of(parse_json(definition) if isinstance(definition, str) else definition)


def tool_name_of(tool: object) -> str:
    """The name in one tool definition: ``{"name"}`` or ``{"function": {"name"}}``."""
    if not isinstance(tool, _MAPS):
        return ""
    name = tool.get("name")
    if not name:
        function = tool.get("function")
        if isinstance(function, _MAPS):
            name = function.get("name")
    return as_str(name)
