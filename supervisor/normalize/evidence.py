"""Error evidence: what a failing span says, pulled out of attributes and free text.

Only spans that show a sign of failure get here (see
:func:`supervisor.normalize.normalize_span`), so this module can afford
regex searches. Every regex is precompiled and every scan is bounded to the
first ``SCAN_CHARS`` characters of a text.

What the free text looks like, per producer:

* openai-python >= 2 raises ``Error code: 429 - <the error message>``;
  older versions and the anthropic SDK put the whole body in the message:
  ``Error code: 429 - {'error': {'message': ..., 'type': 'insufficient_quota',
  'code': 'insufficient_quota'}}`` / ``Error code: 529 - {'type': 'error',
  'error': {'type': 'overloaded_error', 'message': 'Overloaded'}}``. The
  provider code is the body's ``code``, else its inner error ``type``, else
  Google's ``status``; when the body is absent it is inferred from OpenAI's
  and Anthropic's documented wording (``_PHRASES``).
* anthropic-python from 2.17 writes the status, the error's message and a
  trailer of what the response said: ``529 Overloaded (request_id: req_1,
  path: /v1/messages, type: overloaded_error)`` (``error_code: ...`` first
  when the body has one). The status and the trailer's ``type`` are read as
  the older message's status and inner type were.
* OpenInference sets the status description to ``"RateLimitError: <message>"``
  and records an ``exception`` event (type ``openai.RateLimitError``);
  OpenLLMetry sets the description to the bare message, ``error.type`` to the
  class name and records the event; the official openai-v2 instrumentation
  sets the bare message and ``error.type`` (``"<class 'openai.RateLimitError'>"``
  with opentelemetry-util-genai 1.1), and records no event.
* Retry delays: captured headers (``http.response.header.retry-after`` and
  friends), else OpenAI's "Please try again in 1.5s" / "in 20ms" / "in 1m3s",
  Azure's "Please retry after 20 seconds".

Where a tool span's output and failure are, per producer (the adapters read
the output; this module what it says):

* opentelemetry-util-genai (openai-v2's helper) ``execute_tool``: the result in
  ``gen_ai.tool.call.result``, only with content capture on; a raised exception
  is status ERROR with the bare message and ``error.type`` = the class name.
* OpenInference LangChain: ``output.value`` holds the ``ToolMessage`` as
  ``{"type": "tool", "data": {"content", "status", ...}}``; a raised exception is
  status ERROR plus an ``exception`` event (``json.decoder.JSONDecodeError``).
* OpenLLMetry LangChain: ``traceloop.entity.output`` (and
  ``gen_ai.tool.call.result``) hold ``{"output": <LangChain's serialised
  ToolMessage>, "kwargs": ...}``; traceloop-sdk's ``@tool`` the JSON-encoded
  return value. A raised exception is status ERROR plus an ``exception`` event.
* OpenInference Agents SDK: ``output.value`` is the tool's text; a failure is
  status ERROR ``Error running tool (non-fatal): {...}`` with no event, the
  exception redacted unless a ``failure_error_function`` wrote it into the output.

Errors swallowed by tools (status OK, output describes a caught error) are
recognised conservatively, by shape and never by a mere word — see
:func:`detect_swallowed` for the list of patterns. A LangChain ``ToolMessage``
is read through the envelope each instrumentation writes it in
(:func:`tool_message`): its ``status="error"`` is the most specific evidence
there is, whatever its text; a ``"success"`` message is judged by its text.

Arguments the model wrote that a tool refused before it ran (LangChain's
schema validation, the Agents SDK's ``Invalid JSON input for tool``,
LangGraph's ``Error invoking tool ... with kwargs``) are the model's fault,
not the tool's: :func:`rejected_arguments` names them as
``bad_arguments:<tool>`` invalid tool calls.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Final, NamedTuple

import regex

from supervisor.normalize.attributes import (
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    as_str,
    bounded,
    parse_json,
)
from supervisor.normalize.http_rpc import GRPC_CODES
from supervisor.records import AttrValue, ErrorEvidence
from supervisor.retry_after import (
    RETRY_HEADERS,
    parse_duration,
    retry_after_from_headers,
    retry_after_from_text,
)

__all__ = [
    "FAILURE_FINISH_REASONS",
    "SCAN_CHARS",
    "Swallowed",
    "build_evidence",
    "check_tool_calls",
    "detect_swallowed",
    "exception_type_from_error_type",
    "failing_finish",
    "header_keys",
    "header_text",
    "http_status_from_text",
    "parse_duration",
    "provider_code_from_text",
    "rejected_arguments",
    "retry_after_from_attributes",
    "retry_after_from_text",
    "split_exception_prefix",
    "tool_message",
]

#: Characters of any free text that are scanned.
SCAN_CHARS: Final = 8 * 1024

#: Finish/stop reasons that mean the response is cut or refused (lower-case):
#: OpenAI, Anthropic, Gemini (upper-case there), Bedrock.
FAILURE_FINISH_REASONS: Final = frozenset(
    {
        "length",
        "max_tokens",
        "max_output_tokens",
        "model_length",
        "content_filter",
        "content_filtered",
        "refusal",
        "safety",
        "recitation",
        "blocklist",
        "prohibited_content",
        "spii",
        "guardrail_intervened",
        "model_context_window_exceeded",
    }
)


def failing_finish(reasons: tuple[str, ...]) -> bool:
    """Whether any finish reason says the output was cut or refused."""
    return any(reason.lower() in FAILURE_FINISH_REASONS for reason in reasons)


# -- tool calls --------------------------------------------------------------


def check_tool_calls(
    calls: Iterable[tuple[str, object]], offered: frozenset[str] | None
) -> tuple[str, ...]:
    """``unknown_tool:<name>`` / ``bad_arguments:<name>`` for each invalid tool call.

    A name is unknown only when the offered tools are known (``offered`` is
    not ``None`` and not empty). Arguments are bad when they are text that
    is not a JSON object (empty text counts as no arguments).
    """
    out: list[str] = []
    for name, arguments in list(calls)[:64]:
        short = bounded(name, MAX_NAME_CHARS)
        if offered and name not in offered:
            out.append(f"unknown_tool:{short}")
        if isinstance(arguments, str) and arguments.strip():
            if not isinstance(parse_json(arguments), dict):
                out.append(f"bad_arguments:{short}")
        elif arguments is not None and not isinstance(arguments, (str, Mapping)):
            out.append(f"bad_arguments:{short}")
    return tuple(out)


# -- exception names ---------------------------------------------------------

_EXC_SUFFIXES: Final[tuple[str, ...]] = (
    "Error",
    "Exception",
    "Timeout",
    "Exceeded",
    "Interrupt",
    "Exit",
    "Failure",
    "Fault",
    "Cancelled",
    "Canceled",
    "Refused",
    "Unavailable",
    "Denied",
    "Expired",
)
_DOTTED_NAME: Final = re.compile(r"[A-Za-z_]\w{0,100}(?:\.[A-Za-z_]\w{0,100}){0,10}\Z")
_CLASS_REPR: Final = re.compile(r"<class '([^']{1,300})'>")
_PREFIX_NAME: Final = re.compile(r"\s*<?([A-Za-z_][\w.]{0,200}?)>?\s*:\s?(.*)\Z", re.S)


def _looks_like_exception(name: str) -> bool:
    if not _DOTTED_NAME.match(name):
        return False
    last = name.rpartition(".")[2]
    return last[:1].isupper() and last.endswith(_EXC_SUFFIXES)


def split_exception_prefix(text: str) -> tuple[str, str]:
    """``("RateLimitError", "Error code: 429 ...")`` from ``"RateLimitError: Error code: 429 ..."``.

    Returns ``("", text)`` unless the prefix is an exception-like class name
    (``SomethingError``, ``pkg.SomethingException``, ``ReadTimeout``...).
    """
    match = _PREFIX_NAME.match(text[:SCAN_CHARS])
    if match and _looks_like_exception(match.group(1)):
        return match.group(1), match.group(2)
    return "", text


def exception_type_from_error_type(error_type: str) -> str:
    """The exception class in an ``error.type`` value, if it names one.

    ``error.type`` may be a class name (``RateLimitError``), a qualified one,
    a repr (``<class 'openai.RateLimitError'>``), or not a class at all
    (``timeout``, ``500``, ``_OTHER``), which gives ``""``.
    """
    match = _CLASS_REPR.search(error_type[:400])
    name = match.group(1) if match else error_type.strip()
    return name if _looks_like_exception(name) else ""


#: SDK exception classes that imply an HTTP status, for messages without one.
_SDK_MODULES: Final = frozenset({"openai", "anthropic", "groq", "together", "cerebras"})
_CLASS_STATUS: Final[Mapping[str, int]] = {
    "BadRequestError": 400,
    "AuthenticationError": 401,
    "PaymentRequiredError": 402,
    "PermissionDeniedError": 403,
    "NotFoundError": 404,
    "RequestTimeoutError": 408,
    "ConflictError": 409,
    "ContentTooLargeError": 413,
    "RequestTooLargeError": 413,
    "UnprocessableEntityError": 422,
    "RateLimitError": 429,
    "HTTPNotImplementedError": 501,
    "ServiceUnavailableError": 503,
    "GatewayTimeoutError": 504,
    "DeadlineExceededError": 504,
    "OverloadedError": 529,
}


def _status_from_class(exception_type: str) -> int | None:
    module, _, name = exception_type.rpartition(".")
    if module.partition(".")[0] not in _SDK_MODULES:
        return None
    return _CLASS_STATUS.get(name)


# -- HTTP status, provider code, gRPC code in text ---------------------------
# These patterns search whole messages, so they are compiled with ``regex``,
# which skips ahead to the literal words of a pattern (``Error code: ``,
# ``'type'``, ``StatusCode.``) where ``re`` tries most of them at every
# character. An alternation of different words leaves nothing to skip to, so
# each form of a status or a phrase is a pattern of its own, and the form that
# matches first in the text wins, as it would in an alternation (:func:`_earliest`).


class _TextPattern:
    """A pattern compiled with ``regex``, searched holding the GIL.

    ``regex`` releases the GIL around a search of a ``str`` unless told not to;
    in the sidecar, where the store writer and the remediation threads are
    busy, every search then became a hand-off between threads: a few
    microseconds of matching cost hundreds in waiting.
    """

    __slots__ = ("_compiled",)

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self._compiled = regex.compile(pattern, flags)

    @property
    def pattern(self) -> str:
        return str(self._compiled.pattern)

    @property
    def flags(self) -> int:
        return int(self._compiled.flags)

    def search(self, text: str) -> re.Match[str] | None:
        found: re.Match[str] | None = self._compiled.search(text, concurrent=False)
        return found

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        found: Iterator[re.Match[str]] = self._compiled.finditer(text, concurrent=False)
        return found


def _text_pattern(pattern: str, flags: int = 0) -> _TextPattern:
    return _TextPattern(pattern, flags)


def _earliest(
    patterns: Iterable[_TextPattern], text: str
) -> tuple[_TextPattern, re.Match[str]] | None:
    """The pattern whose match starts first in ``text`` (on a tie, the earlier), and its match."""
    first: tuple[_TextPattern, re.Match[str]] | None = None
    for pattern in patterns:
        match = pattern.search(text)
        if match is not None and (first is None or match.start() < first[1].start()):
            first = (pattern, match)
    return first


#: How SDKs and HTTP clients write a response's status into an error message.
_HTTP_STATUS_FORMS: Final = tuple(
    _text_pattern(pattern, regex.IGNORECASE)
    for pattern in (
        r"Error code: (\d{3})\b",  # openai, anthropic
        r"\b(?:Client|Server) error '(\d{3}) ",  # httpx
        r"\b(\d{3}) Client Error\b",  # requests
        r"\b(\d{3}) Server Error\b",
        r"\bstatus(?:[ _]code)?\s*[=:]\s*(\d{3})\b",
        r"\bHTTP(?:/\d(?:\.\d)?)? (\d{3})\b",
    )
)

#: anthropic-python >= 2.17: ``<status> <message> (request_id: ..., path: /v1/..., type: ...)``,
#: at the start of a line or after a ``Name: `` prefix (a status description).
_SDK_TRAILER: Final = (
    r" [^\n]{0,2000}?\((?:error_code: [^,()\n]{1,200}, )?(?:request_id: [^,()\n]{1,200}, )?path: /"
)
_SDK_TRAILER_STATUS_FORMS: Final = (
    _text_pattern(r"^([1-5]\d\d)" + _SDK_TRAILER, regex.MULTILINE),
    _text_pattern(r": ([1-5]\d\d)" + _SDK_TRAILER),
)
_SDK_TRAILER_TYPE: Final = _text_pattern(r"path: /[^,()\n]{0,500}, type: ([\w.\-]{1,64})\)")


def http_status_from_text(text: str) -> int | None:
    """The first HTTP status an SDK or HTTP client wrote into an error message."""
    head = text[:SCAN_CHARS]
    found = _earliest(_HTTP_STATUS_FORMS, head) or _earliest(_SDK_TRAILER_STATUS_FORMS, head)
    match = found[1] if found is not None else None
    if match is None:
        return None
    code = int(match.group(1))
    return code if 100 <= code <= 599 else None


_BODY_CODE: Final = _text_pattern(r"""['"]code['"]\s*:\s*['"]([\w.\-]{1,64})['"]""")
_BODY_TYPE: Final = _text_pattern(r"""['"]type['"]\s*:\s*['"]([\w.\-]{1,64})['"]""")
_BODY_STATUS: Final = _text_pattern(r"""['"]status['"]\s*:\s*['"]([A-Z][A-Z_]{2,63})['"]""")

#: Providers' documented wording → their error code, for messages without a body.
_PHRASES: Final[Mapping[_TextPattern, str]] = {
    _text_pattern(pattern, regex.IGNORECASE): code
    for pattern, code in (
        (r"You exceeded your current quota", "insufficient_quota"),
        (r"credit balance is too low", "insufficient_quota"),
        (r"Rate limit reached for", "rate_limit_exceeded"),
        (r"maximum context length is \d+ tokens", "context_length_exceeded"),
        (r"prompt is too long: \d+ tokens > \d+", "context_length_exceeded"),
        (r"Incorrect API key provided", "invalid_api_key"),
        (r"invalid x-api-key", "invalid_api_key"),
        (r"The model `[^`]{1,200}` does not exist", "model_not_found"),
        (r"rejected as a result of our safety system", "content_policy_violation"),
        (r"content management policy", "content_filter"),
    )
}


def provider_code_from_text(text: str) -> str:
    """A provider's error code in an SDK error message: body ``code``, inner ``type``, phrase."""
    head = text[:SCAN_CHARS]
    match = _BODY_CODE.search(head)
    if match:
        return match.group(1)
    for match in _BODY_TYPE.finditer(head):
        if match.group(1) != "error":  # the first inner type that is not just "error"
            return match.group(1)
    match = _SDK_TRAILER_TYPE.search(head) or _BODY_STATUS.search(head)
    if match:
        return match.group(1)
    phrase = _earliest(_PHRASES, head)
    return _PHRASES[phrase[0]] if phrase is not None else ""


_GRPC_IN_TEXT: Final = _text_pattern(r"\bStatusCode\.([A-Z_]{2,24})\b")


def _grpc_from_text(text: str) -> int | None:
    match = _GRPC_IN_TEXT.search(text[:SCAN_CHARS])
    return GRPC_CODES.get(match.group(1)) if match else None


# -- retry delays ------------------------------------------------------------
# Parsed by supervisor.retry_after, which the agent-side client asks too.


def header_keys(name: str) -> tuple[str, ...]:
    """The attribute keys response header ``name`` (lower case) may be recorded under.

    As the semantic conventions spell it (``http.response.header.retry-after``),
    as opentelemetry-util-http writes it (``-`` as ``_``: the httpx and requests
    instrumentations' ``..._CAPTURE_HEADERS_CLIENT_RESPONSE``), and the plain
    name an agent sets on its own span.
    """
    semconv = "http.response.header." + name
    return tuple(dict.fromkeys((semconv, semconv.replace("-", "_"), name)))


def header_text(value: AttrValue) -> str:
    if isinstance(value, tuple):
        value = value[0] if value else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return as_str(value, 128)


_RETRY_KEYS: Final = frozenset(key for name, _ in RETRY_HEADERS for key in header_keys(name))


def retry_after_from_attributes(attrs: Mapping[str, AttrValue], now_ns: int) -> float | None:
    """A delay from captured response headers, if an instrumentation recorded any.

    See :func:`supervisor.retry_after.retry_after_from_headers` for which header wins.
    """
    if _RETRY_KEYS.isdisjoint(attrs):  # most spans carry no captured response headers
        return None

    def values(name: str) -> Iterator[str]:
        for key in header_keys(name):
            value = attrs.get(key)
            if value is not None:
                yield header_text(value)

    return retry_after_from_headers(values, now=now_ns / 1e9)


# -- errors swallowed into OK output -----------------------------------------


class Swallowed(NamedTuple):
    """A caught error a tool returned as its output."""

    exception_type: str
    message: str
    invalid_tool_calls: tuple[str, ...] = ()


#: How instrumentations write a LangChain ``ToolMessage`` as a tool's output:
#: OpenInference ``{"type": "tool", "data": {...}}``, LangChain's serialised
#: form ``{"lc": 1, "type": "constructor", "id": [..., "ToolMessage"], "kwargs": {...}}``
#: (OpenLLMetry wraps it in ``{"output": ...}``), or the message's own fields.
_ENVELOPE_HEAD: Final = re.compile(
    r'\{\s*"(?:output"\s*:\s*\{\s*")?(?:type"\s*:\s*"tool"|lc"\s*:\s*1\b|content"\s*:)'
)
_OI_TOOL_MESSAGE: Final = re.compile(r'\{\s*"type"\s*:\s*"tool"\s*,\s*"data"\s*:\s*\{')
#: The ``content`` string of a message whose JSON was cut before its end.
_CUT_CONTENT: Final = re.compile(r'"content"\s*:\s*"((?:[^"\\]|\\.){0,8192})')


def tool_message(text: str) -> tuple[str, str] | None:
    """``(content, status)`` of a LangChain ``ToolMessage`` a tool span's output holds.

    ``None`` when the output is not one. ``status`` is ``"error"``,
    ``"success"`` or ``""`` (unknown: the JSON was cut before it). Only text
    that starts like one of the envelopes is parsed.
    """
    head = text[:SCAN_CHARS]
    if not _ENVELOPE_HEAD.match(head):
        return None
    obj = parse_json(text)
    if isinstance(obj, dict):
        if isinstance(obj.get("output"), dict):
            obj = obj["output"]
        fields = obj.get("data") if obj.get("type") == "tool" else obj.get("kwargs")
        if not isinstance(fields, dict):
            fields = obj if obj.get("type") == "tool" else None
        if fields is None or "tool_call_id" not in fields or "content" not in fields:
            return None
        content = fields.get("content")
        status = fields.get("status")
        body = content if isinstance(content, str) else str(content)
        return body, status if isinstance(status, str) else ""
    # Cut by the output bound before its end: the content is read from what is left.
    if not (_OI_TOOL_MESSAGE.match(head) or "ToolMessage" in head[:300]):
        return None
    match = _CUT_CONTENT.search(head)
    if match is None:
        return None
    body = parse_json(f'"{match.group(1).rstrip(chr(92))}"')
    return (body, "") if isinstance(body, str) else None


_ERROR_PREFIX: Final = re.compile(r"(?:error|exception)\s*:\s*", re.IGNORECASE)
_INVALID_TOOL: Final = re.compile(r"(\S{1,256}) is not a valid tool, try one of \[")
_PLEASE_FIX: Final = re.compile(r"\s*Please fix your mistakes\.?\s*\Z")
_REPR: Final = re.compile(r"([A-Za-z_][\w.]{0,200})\((.*)\)\s*\Z", re.S)
_TRACEBACK: Final = "Traceback (most recent call last)"
_TB_LAST: Final = re.compile(r"^([A-Za-z_][\w.]{0,200})(?::[ \t]*(.*))?$", re.M)
#: LangChain's answer for arguments its schema refused (``handle_validation_error=True``).
_INPUT_VALIDATION_DEFAULT: Final = "Tool input validation error"
_LANGCHAIN_DEFAULTS: Final[Mapping[str, str]] = {
    # langchain_core.tools: handle_tool_error=True / handle_validation_error=True
    "Tool execution error": "ToolException",
    "Tool input validation error": "ValidationError",
    # openai-agents: default_tool_error_function (the exception itself is not shown)
    "An error occurred while running the tool. Please try again.": "",
}
#: What a tool answers when it refused the arguments the model wrote, by framework:
#: LangGraph's ToolNode (ToolInvocationError), the Agents SDK (ModelBehaviorError).
_REFUSED_ARGUMENTS: Final = (
    re.compile(r"Error invoking tool '([^'\n]{1,256})' with kwargs "),
    re.compile(r"Invalid JSON input for tool (\S{1,256}?)(?::|\s|'|\"|\)|\Z)"),
)
#: What may stand before those words at the start of a tool's output:
#: ``Error: ``, then ``SomeError('`` (a repr, as LangGraph and custom handlers write).
_REFUSED_LEAD: Final = re.compile(
    r"""(?:(?:error|exception)\s*:\s*)?(?:[A-Za-z_][\w.]{0,200}\(\s*['"])?""", re.I
)
#: ``N validation error(s) for <Model>``: pydantic's title line.
_VALIDATION_TITLE: Final = re.compile(r"\d+ validation errors? for (\S{1,256})")
#: Frames of a framework parsing a tool's input, in a stack trace (langchain_core.tools).
_INPUT_FRAMES: Final = re.compile(r", in (?:_parse_input|_to_args_and_kwargs)\n")


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _typed(text: str) -> tuple[str, str] | None:
    """``SomeError: message`` / ``<SomeError>: message`` / ``SomeError('message')``.

    And pydantic's own words, which name no type: ``1 validation error for Model``.
    """
    if _VALIDATION_TITLE.match(text):
        return "ValidationError", text.strip()
    match = _REPR.match(text)
    if match and _looks_like_exception(match.group(1)):
        return match.group(1), _unquote(match.group(2))
    exc_type, rest = split_exception_prefix(text)
    if exc_type:
        return exc_type, rest.strip()
    return None


def _json_error(text: str) -> Swallowed | None:
    head = text[:256]
    # Parsed only when one of the keys below appears near the start: most tool
    # outputs that are JSON objects are results, often large, not errors.
    if '"error"' not in head and '"isError"' not in head and '"status"' not in head:
        return None
    obj = parse_json(text)
    if not isinstance(obj, dict):
        return None
    if obj.get("isError") is True:  # MCP CallToolResult
        parts = obj.get("content")
        texts = [
            p["text"]
            for p in (parts if isinstance(parts, list) else [])[:16]
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        message = "\n".join(texts)
        typed = _typed(message)
        return Swallowed(*typed) if typed else Swallowed("", message)
    error = obj.get("error")
    if error and not any(obj.get(k) for k in ("result", "results", "data", "output")):
        if isinstance(error, dict):
            message = as_str(error.get("message"), MAX_MESSAGE_CHARS) or str(error)
            return Swallowed(as_str(error.get("type")), message)
        message = error if isinstance(error, str) else str(error)
        typed = _typed(message)
        return Swallowed(*typed) if typed else Swallowed("", message)
    if obj.get("status") == "error":  # LangChain ToolMessage(status="error"), {"status", "message"}
        body = obj.get("content", obj.get("message", ""))
        message = body if isinstance(body, str) else str(body)
        typed = _typed(message)
        return Swallowed(*typed) if typed else Swallowed("", message)
    return None


def detect_swallowed(text: str) -> Swallowed | None:
    """Recognise a tool output that is really a caught error; ``None`` for normal output.

    Patterns (anchored at the start of the output unless said otherwise):

    1. ``Error: ...`` / ``Exception: ...`` (any case). LangGraph's ToolNode
       writes ``Error: ValueError('boom')\\n Please fix your mistakes.`` and,
       for a tool the model made up, ``Error: get_wether is not a valid tool,
       try one of [get_weather].`` (which also yields ``unknown_tool:get_wether``).
    2. A Python traceback (``Traceback (most recent call last)`` within the
       first 256 characters); the type and message come from its last line.
    3. ``SomeError: message``, ``<SomeError>: message`` or ``SomeError('message')``
       where the name ends like an exception class (``Error``, ``Exception``,
       ``Timeout``...).
    4. LangChain's ``handle_tool_error``/``handle_validation_error`` defaults:
       exactly ``Tool execution error`` / ``Tool input validation error``, and
       the Agents SDK's ``failure_error_function`` default, exactly ``An error
       occurred while running the tool. Please try again.``
    5. A JSON object with a truthy ``"error"`` (and no result/data/output),
       an MCP result with ``"isError": true``, or ``"status": "error"``.
    6. A LangChain ``ToolMessage`` (:func:`tool_message`): ``status="error"``
       whatever its content, else its content judged by these patterns.
    7. A framework refusing the call's arguments, at the start (``Error
       invoking tool 'x' with kwargs``, ``Invalid JSON input for tool x``):
       also an invalid tool call, ``bad_arguments:x``.

    Prose that merely mentions an error ("no errors found", "Error rates
    fell") matches none of these.
    """
    head = text[:SCAN_CHARS].lstrip()
    if not head:
        return None
    first = head[0]
    if first == "{":
        returned = tool_message(head)
        if returned is None:
            return _json_error(head)
        content, status = returned
        found = detect_swallowed(content) if content[:1] != "{" else _json_error(content)
        if status != "error":
            return found
        # A ToolMessage marked as an error is one, whatever its text says.
        return found or Swallowed("", content.strip())
    refused = _refused_in(head)
    if refused:
        prefix = _ERROR_PREFIX.match(head)
        rest = _PLEASE_FIX.sub("", head[prefix.end() :] if prefix else head).strip()
        exc_type, said = _typed(rest) or ("", rest)
        return Swallowed(exc_type, said, refused)
    match = _ERROR_PREFIX.match(head)
    if match:
        rest = _PLEASE_FIX.sub("", head[match.end() :])
        invalid = _INVALID_TOOL.match(rest)
        if invalid:
            return Swallowed("", rest, (f"unknown_tool:{invalid.group(1)}",))
        typed = _typed(rest)
        return Swallowed(*typed) if typed else Swallowed("", rest.strip())
    if _TRACEBACK in head[:256]:
        last: tuple[str, str] | None = None
        for tb in _TB_LAST.finditer(head):
            if _looks_like_exception(tb.group(1)):
                last = (tb.group(1), (tb.group(2) or "").strip())
        return Swallowed(*last) if last else Swallowed("", head)
    if first.isalpha() or first in "<_":
        typed = _typed(head)
        if typed:
            return Swallowed(*typed)
        stripped = head.rstrip()
        if stripped in _LANGCHAIN_DEFAULTS:
            return Swallowed(_LANGCHAIN_DEFAULTS[stripped], stripped)
    return None


def _refused_in(text: str, *, anywhere: bool = False) -> tuple[str, ...]:
    """``bad_arguments:<tool>`` when a framework's message refuses a call's arguments.

    At the start of ``text`` (a tool's output: prose that quotes such a
    message is not one), or ``anywhere`` in an error message.
    """
    head = text[:1024]
    start = 0 if anywhere else _REFUSED_LEAD.match(head).end()  # type: ignore[union-attr]
    for pattern in _REFUSED_ARGUMENTS:
        match = pattern.search(head, start) if anywhere else pattern.match(head, start)
        if match:
            return (f"bad_arguments:{bounded(match.group(1), MAX_NAME_CHARS)}",)
    return ()


def rejected_arguments(
    tool: str, exception_type: str, message: str, arguments: object, stacktrace: str = ""
) -> tuple[str, ...]:
    """``bad_arguments:<tool>`` when a failing tool refused the arguments the model wrote.

    The same exception type means two things on a tool span: a pydantic
    ``ValidationError`` or a ``JSONDecodeError`` on the call's arguments is
    the model's mistake (asking it again fixes it), on data a backend
    returned it is the tool's. Told apart by what the span says:

    * a ``ValidationError`` whose model is the tool's argument schema
      (LangChain and the Agents SDK name it after the tool: ``read_file``,
      ``read_file_args``), raised from LangChain's input parsing frames, or
      answered with LangChain's ``Tool input validation error``;
    * a ``JSONDecodeError`` on a span whose own recorded arguments are not a
      JSON object (the tool parsed what the model wrote);
    * a framework's own words for refused arguments (:data:`_REFUSED_ARGUMENTS`).
    """
    if not tool:
        return ()
    bad = (f"bad_arguments:{bounded(tool, MAX_NAME_CHARS)}",)
    last = exception_type.rpartition(".")[2]
    if last == "ValidationError":
        if message.strip() == _INPUT_VALIDATION_DEFAULT:  # handle_validation_error=True
            return bad
        title = _VALIDATION_TITLE.match(message.lstrip()[:512])
        if title and title.group(1) in (tool, f"{tool}_args", f"{tool}Args", f"{tool}Input"):
            return bad
        if stacktrace and _INPUT_FRAMES.search(stacktrace[-SCAN_CHARS:]):
            return bad
    elif (
        last == "JSONDecodeError"
        and isinstance(arguments, str)
        # Arguments meant as a JSON object that are not one (a tool given a bare
        # string, as LangChain records a one-argument call, parsed something else).
        and arguments.lstrip()[:1] == "{"
        and not isinstance(parse_json(arguments), dict)
    ):
        return bad
    return _refused_in(message, anywhere=True)


# -- assembly ----------------------------------------------------------------


def build_evidence(
    *,
    status_error: bool,
    status_message: str,
    exception: tuple[str, str] | None,
    error_type: str,
    http_status: int | None,
    grpc_code: int | None,
    finish_reasons: tuple[str, ...],
    invalid_tool_calls: tuple[str, ...],
    swallowed: Swallowed | None,
    attrs: Mapping[str, AttrValue],
    now_ns: int,
    caught: Swallowed | None = None,
    stream_began: bool = False,
) -> ErrorEvidence:
    """Gather everything a failing span says into one :class:`ErrorEvidence`.

    ``swallowed``: the error an OK tool span's output describes. ``caught``:
    the one a failing tool span's output describes (the Agents SDK's
    ``failure_error_function`` writes the exception there, not on the span):
    it only fills what the span itself does not say.
    """
    exc_type, exc_message = exception if exception is not None else ("", "")
    if not exc_type and status_message:
        parsed_type, remainder = split_exception_prefix(status_message)
        if parsed_type:
            exc_type = parsed_type
            exc_message = exc_message or remainder
    if not exc_type and error_type:
        exc_type = exception_type_from_error_type(error_type)
    invalid = invalid_tool_calls
    for said in (swallowed, caught):
        if said is not None:
            exc_type = exc_type or said.exception_type
            exc_message = exc_message or said.message
            invalid = invalid + tuple(c for c in said.invalid_tool_calls if c not in invalid)
    if status_message and status_message not in exc_message:
        text = f"{exc_message[:SCAN_CHARS]}\n{status_message[:SCAN_CHARS]}"
    else:
        text = exc_message[:SCAN_CHARS]
    if http_status is None and text:
        http_status = http_status_from_text(text)
    if http_status is None and exc_type:
        http_status = _status_from_class(exc_type)
    if grpc_code is None and text:
        grpc_code = _grpc_from_text(text)
    retry = retry_after_from_attributes(attrs, now_ns)
    if retry is None and text:
        retry = retry_after_from_text(text)
    return ErrorEvidence(
        status_error=status_error,
        status_message=bounded(status_message, MAX_MESSAGE_CHARS),
        exception_type=bounded(exc_type, MAX_NAME_CHARS),
        exception_message=bounded(exc_message, MAX_MESSAGE_CHARS),
        error_type=bounded(error_type, MAX_NAME_CHARS),
        http_status=http_status,
        grpc_code=grpc_code,
        provider_code=provider_code_from_text(text) if text else "",
        finish_reasons=finish_reasons,
        swallowed=swallowed is not None,
        retry_after_s=retry,
        invalid_tool_calls=invalid,
        stream_began=stream_began,
    )
