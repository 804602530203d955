"""Error evidence: what a failing span says, pulled out of attributes and free text.

Only spans that show a sign of failure get here (see
:func:`supervisor.normalize.normalize_span`), so this module may spend a
few microseconds on regexes. Every regex is precompiled and every scan is
bounded to the first ``SCAN_CHARS`` characters of a text.

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

Errors swallowed by tools (status OK, output describes a caught error) are
recognised conservatively, by shape and never by a mere word — see
:func:`detect_swallowed` for the list of patterns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Final, NamedTuple

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
    "http_status_from_text",
    "parse_duration",
    "provider_code_from_text",
    "retry_after_from_attributes",
    "retry_after_from_text",
    "split_exception_prefix",
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


def _lowered(pattern: re.Pattern[str]) -> re.Pattern[str]:
    """A case-insensitive pattern for lower-case ASCII text: matched without IGNORECASE."""
    if re.search(r"\\[A-Z]", pattern.pattern):  # \D, \S, \W... would change meaning
        raise ValueError(f"cannot lower-case {pattern.pattern!r}")
    return re.compile(pattern.pattern.lower().replace("(?p<", "(?P<"))


_HTTP_IN_TEXT: Final = re.compile(
    r"Error code: (\d{3})\b"
    r"|\b(?:Client|Server) error '(\d{3}) "
    r"|\b(\d{3}) (?:Client|Server) Error\b"
    r"|\bstatus(?:[ _]code)?\s*[=:]\s*(\d{3})\b"
    r"|\bHTTP(?:/\d(?:\.\d)?)?[ ](\d{3})\b",
    re.IGNORECASE,
)
#: The same in lower case, matched only where a match can start (see ``_first_match``).
_HTTP_IN_LOWER: Final = _lowered(_HTTP_IN_TEXT)
#: (word, characters before it where a match starts): every match holds one.
_HTTP_ANCHORS: Final[tuple[tuple[str, int], ...]] = (
    ("error code: ", 0),
    (" error '", len("client")),
    (" error", len("000 client")),
    ("status", 0),
    ("http", 0),
)


#: anthropic-python >= 2.17: ``<status> <message> (request_id: ..., path: /v1/..., type: ...)``,
#: at the start of a line or after a ``Name: `` prefix (a status description).
_SDK_TRAILER_STATUS: Final = re.compile(
    r"(?:^|: )([1-5]\d\d) [^\n]{0,2000}?\((?:error_code: [^,()\n]{1,200}, )?"
    r"(?:request_id: [^,()\n]{1,200}, )?path: /",
    re.MULTILINE,
)
_SDK_TRAILER_TYPE: Final = re.compile(r"path: /[^,()\n]{0,500}, type: ([\w.\-]{1,64})\)")
#: What every such trailer holds (the request's path), so that most messages skip both.
_SDK_TRAILER_WORD: Final = "path: /"


def http_status_from_text(text: str) -> int | None:
    """The first HTTP status an SDK or HTTP client wrote into an error message."""
    head = text[:SCAN_CHARS]
    if head.isascii():
        lowered = head.lower()
        match = _first_match(_HTTP_IN_LOWER, lowered, _starts(lowered, _HTTP_ANCHORS))
    else:
        match = _HTTP_IN_TEXT.search(head)
    if match is None and _SDK_TRAILER_WORD in head:
        match = _SDK_TRAILER_STATUS.search(head)
    if match is None:
        return None
    for group in match.groups():
        if group is not None:
            code = int(group)
            return code if 100 <= code <= 599 else None
    return None  # pragma: no cover - the regex always captures one group


def _starts(text: str, anchors: tuple[tuple[str, int], ...]) -> list[int]:
    """Where a match can start: each anchor word's occurrences, less its offset, in order."""
    starts: set[int] = set()
    for word, back in anchors:
        at = text.find(word, back)
        while at >= 0:
            starts.add(at - back)
            at = text.find(word, at + 1)
    return sorted(starts)


def _first_match(pattern: re.Pattern[str], text: str, starts: list[int]) -> re.Match[str] | None:
    """What ``pattern.search(text)`` finds, when every match starts at one of ``starts``.

    Why: an alternation that starts with a word boundary or a group gives the
    regex engine no literal to skip ahead to, so a search tries every
    alternative at every character (20-30 µs for a 400-character message
    without a match). ``str.find`` of a word each match holds is a fast
    scan, and the pattern is tried only there; a match also looks behind its
    start for ``\b``, as in a search.
    """
    return next(_matches(pattern, text, starts), None)


def _matches(pattern: re.Pattern[str], text: str, starts: list[int]) -> Iterator[re.Match[str]]:
    """What ``pattern.finditer(text)`` finds, when every match starts at one of ``starts``."""
    pos = 0
    for begin in starts:
        if begin >= pos:
            match = pattern.match(text, begin)
            if match is not None:
                yield match
                pos = max(match.end(), begin + 1)


_BODY_CODE: Final = re.compile(r"""['"]code['"]\s*:\s*['"]([\w.\-]{1,64})['"]""")
_BODY_TYPE: Final = re.compile(r"""['"]type['"]\s*:\s*['"]([\w.\-]{1,64})['"]""")
_BODY_STATUS: Final = re.compile(r"""['"]status['"]\s*:\s*['"]([A-Z][A-Z_]{2,63})['"]""")

#: Providers' documented wording → their error code, for messages without a body.
_PHRASE_LIST: Final[tuple[tuple[str, str], ...]] = (
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
#: All phrases in one pattern (one scan of the message instead of ten).
_PHRASES: Final = re.compile(
    "|".join(f"(?P<p{i}>{pattern})" for i, (pattern, _) in enumerate(_PHRASE_LIST)),
    re.IGNORECASE,
)
_PHRASES_LOWER: Final = _lowered(_PHRASES)
#: Each phrase's literal beginning: where a match of one can start.
_PHRASE_ANCHORS: Final[tuple[tuple[str, int], ...]] = tuple(
    (re.split(r"[\\`]", pattern.lower(), maxsplit=1)[0], 0) for pattern, _ in _PHRASE_LIST
)
_BODY_ANCHORS: Final[dict[re.Pattern[str], tuple[tuple[str, int], ...]]] = {
    _BODY_CODE: (("code", 1),),
    _BODY_TYPE: (("type", 1),),
    _BODY_STATUS: (("status", 1),),
}
_PHRASE_CODES: Final = {f"p{i}": code for i, (_, code) in enumerate(_PHRASE_LIST)}
#: A word every phrase contains: a substring test rules most messages out cheaply.
_PHRASE_WORDS: Final[tuple[str, ...]] = (
    "quota",
    "credit",
    "rate limit",
    "context length",
    "too long",
    "api key",
    "x-api-key",
    "does not exist",
    "safety system",
    "content management",
)


def provider_code_from_text(text: str) -> str:
    """A provider's error code in an SDK error message: body ``code``, inner ``type``, phrase."""
    head = text[:SCAN_CHARS]
    match = _body_match(_BODY_CODE, head)
    if match:
        return match.group(1)
    for match in _matches(_BODY_TYPE, head, _starts(head, _BODY_ANCHORS[_BODY_TYPE])):
        if match.group(1) != "error":  # the first inner type that is not just "error"
            return match.group(1)
    if _SDK_TRAILER_WORD in head:
        match = _SDK_TRAILER_TYPE.search(head)
        if match:
            return match.group(1)
    match = _body_match(_BODY_STATUS, head)
    if match:
        return match.group(1)
    lowered = head.lower()
    if not any(word in lowered for word in _PHRASE_WORDS):
        return ""
    if head.isascii():
        match = _first_match(_PHRASES_LOWER, lowered, _starts(lowered, _PHRASE_ANCHORS))
    else:
        match = _PHRASES.search(head)
    return _PHRASE_CODES[match.lastgroup] if match is not None and match.lastgroup else ""


def _body_match(pattern: re.Pattern[str], head: str) -> re.Match[str] | None:
    """``pattern.search(head)`` for a body pattern: a quote, then its key."""
    return _first_match(pattern, head, _starts(head, _BODY_ANCHORS[pattern]))


_GRPC_IN_TEXT: Final = re.compile(r"\bStatusCode\.([A-Z_]{2,24})\b")


def _grpc_from_text(text: str) -> int | None:
    if "StatusCode." not in text:  # a plain substring test is ten times cheaper than the regex
        return None
    match = _GRPC_IN_TEXT.search(text[:SCAN_CHARS])
    return GRPC_CODES.get(match.group(1)) if match else None


# -- retry delays ------------------------------------------------------------
# Parsed by supervisor.retry_after, which the agent-side client asks too.

#: Attribute keys an instrumentation records a response header under.
_HEADER_PREFIXES: Final[tuple[str, ...]] = ("http.response.header.", "")


def _header_text(value: AttrValue) -> str:
    if isinstance(value, tuple):
        value = value[0] if value else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return as_str(value, 128)


_RETRY_KEYS: Final = frozenset(
    prefix + name for name, _ in RETRY_HEADERS for prefix in _HEADER_PREFIXES
)


def retry_after_from_attributes(attrs: Mapping[str, AttrValue], now_ns: int) -> float | None:
    """A delay from captured response headers, if an instrumentation recorded any.

    See :func:`supervisor.retry_after.retry_after_from_headers` for which header wins.
    """
    if _RETRY_KEYS.isdisjoint(attrs):  # one pass over the keys instead of 16 lookups
        return None

    def values(name: str) -> Iterator[str]:
        for prefix in _HEADER_PREFIXES:
            value = attrs.get(prefix + name)
            if value is not None:
                yield _header_text(value)

    return retry_after_from_headers(values, now=now_ns / 1e9)


# -- errors swallowed into OK output -----------------------------------------


class Swallowed(NamedTuple):
    """A caught error a tool returned as its output."""

    exception_type: str
    message: str
    invalid_tool_calls: tuple[str, ...] = ()


_ERROR_PREFIX: Final = re.compile(r"(?:error|exception)\s*:\s*", re.IGNORECASE)
_INVALID_TOOL: Final = re.compile(r"(\S{1,256}) is not a valid tool, try one of \[")
_PLEASE_FIX: Final = re.compile(r"\s*Please fix your mistakes\.?\s*\Z")
_REPR: Final = re.compile(r"([A-Za-z_][\w.]{0,200})\((.*)\)\s*\Z", re.S)
_TRACEBACK: Final = "Traceback (most recent call last)"
_TB_LAST: Final = re.compile(r"^([A-Za-z_][\w.]{0,200})(?::[ \t]*(.*))?$", re.M)
_LANGCHAIN_DEFAULTS: Final[Mapping[str, str]] = {
    # langchain_core.tools: handle_tool_error=True / handle_validation_error=True
    "Tool execution error": "ToolException",
    "Tool input validation error": "ValidationError",
}


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _typed(text: str) -> tuple[str, str] | None:
    """``SomeError: message`` / ``<SomeError>: message`` / ``SomeError('message')``."""
    match = _REPR.match(text)
    if match and _looks_like_exception(match.group(1)):
        return match.group(1), _unquote(match.group(2))
    exc_type, rest = split_exception_prefix(text)
    if exc_type:
        return exc_type, rest.strip()
    return None


def _json_error(text: str) -> Swallowed | None:
    head = text[:256]
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
       exactly ``Tool execution error`` / ``Tool input validation error``.
    5. A JSON object with a truthy ``"error"`` (and no result/data/output),
       an MCP result with ``"isError": true``, or ``"status": "error"``.

    Prose that merely mentions an error ("no errors found", "Error rates
    fell") matches none of these.
    """
    head = text[:SCAN_CHARS].lstrip()
    if not head:
        return None
    first = head[0]
    if first == "{":
        return _json_error(head)
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
) -> ErrorEvidence:
    """Gather everything a failing span says into one :class:`ErrorEvidence`."""
    exc_type, exc_message = exception if exception is not None else ("", "")
    if not exc_type and status_message:
        parsed_type, remainder = split_exception_prefix(status_message)
        if parsed_type:
            exc_type = parsed_type
            exc_message = exc_message or remainder
    if not exc_type and error_type:
        exc_type = exception_type_from_error_type(error_type)
    invalid = invalid_tool_calls
    if swallowed is not None:
        exc_type = exc_type or swallowed.exception_type
        exc_message = exc_message or swallowed.message
        invalid = invalid + swallowed.invalid_tool_calls
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
    )
