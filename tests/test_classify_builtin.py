"""The built-in rules classify errors shaped as real SDKs and spans produce them.

Evidence is built here from real exception objects where that is easy
(``type(exc)``, ``str(exc)`` and the status / provider code a normalizer would
parse from the body), so the table pins what the sidecar sees in practice.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import httpx
import httpx2
import langgraph.errors
import openai
import pydantic
import pytest
import requests
import urllib3
from aiohttp.client_reqrep import ConnectionKey
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion

from policies import load_policy
from supervisor.records import ErrorEvidence, FailureClass, Role, SpanRecord

T, M, P, S = (
    FailureClass.TRANSIENT,
    FailureClass.MODEL,
    FailureClass.PERMANENT,
    FailureClass.SEMANTIC,
)
OPENAI_URL = "https://api.openai.com/v1/chat/completions"
ANTHROPIC_URL = "https://api.anthropic.com/v1/messages"
POLICY = load_policy()


# --- building evidence the way normalization does ---------------------------------


def type_name(exc: BaseException) -> str:
    """``exception.type`` as the OTel SDK records it: module-qualified unless builtin."""
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def provider_code(body: object) -> str:
    """The provider's code: OpenAI's ``error.code`` (else ``type``), Anthropic's ``error.type``."""
    if not isinstance(body, dict):
        return ""
    error = body.get("error", body)
    if not isinstance(error, dict):
        return ""
    return str(error.get("code") or error.get("type") or "")


def from_exception(
    exc: BaseException,
    *,
    http_status: int | None = None,
    code: str = "",
    swallowed: bool = False,
    finish_reasons: tuple[str, ...] = (),
) -> ErrorEvidence:
    return ErrorEvidence(
        status_error=not swallowed,
        status_message="" if swallowed else f"{type(exc).__name__}: {exc}",
        exception_type=type_name(exc),
        exception_message=str(exc),
        http_status=http_status,
        provider_code=code,
        finish_reasons=finish_reasons,
        swallowed=swallowed,
    )


def openai_status(
    cls: type[openai.APIStatusError], status: int, body: dict[str, Any]
) -> ErrorEvidence:
    """An OpenAI SDK status error, as ``_make_status_error_from_response`` builds it."""
    response = httpx2.Response(status, request=httpx2.Request("POST", OPENAI_URL))
    exc = cls(f"Error code: {status} - {body}", response=response, body=body.get("error"))
    return from_exception(exc, http_status=exc.status_code, code=provider_code(body))


def anthropic_status(
    cls: type[anthropic.APIStatusError], status: int, body: dict[str, Any], *, parsed: bool = True
) -> ErrorEvidence:
    response = httpx2.Response(status, request=httpx2.Request("POST", ANTHROPIC_URL))
    exc = cls(f"Error code: {status} - {body}", response=response, body=body)
    return from_exception(exc, http_status=status, code=provider_code(body) if parsed else "")


def openai_error(code: str | None, type_: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def anthropic_error(type_: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def raised(fn: Any) -> BaseException:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def text(
    message: str, *, exception_type: str = "", swallowed: bool = False, **kw: Any
) -> ErrorEvidence:
    return ErrorEvidence(
        status_error=not swallowed,
        exception_type=exception_type,
        exception_message=message,
        swallowed=swallowed,
        **kw,
    )


def record(
    evidence: ErrorEvidence | None, role: Role = Role.LLM, dependency: str = ""
) -> SpanRecord:
    return SpanRecord(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        parent_span_id="",
        name="span",
        service="agent",
        kind=1,
        start_ns=0,
        end_ns=1,
        role=role,
        dependency=dependency
        or {Role.LLM: "openai:gpt-4o", Role.TOOL: "tool:search"}.get(role, ""),
        error=evidence,
    )


_LEN = ChatCompletion(
    id="chatcmpl-1",
    choices=[],
    created=0,
    model="gpt-4o",
    object="chat.completion",
    usage=CompletionUsage(completion_tokens=16, prompt_tokens=5, total_tokens=21),
)
_REQ = httpx.Request("POST", "https://tools.example.com/search")
_REQ2 = httpx2.Request("POST", OPENAI_URL)
_POOL = urllib3.HTTPSConnectionPool("api.example.com", 443)
_CONN = urllib3.connection.HTTPSConnection("api.example.com", 443)
_AIO_KEY = ConnectionKey("api.example.com", 443, True, True, None, None, None)
_SWALLOWED_CONNECTION = (
    "Error: HTTPSConnectionPool(host='api.example.com', port=443): Max retries exceeded with"
    " url: /v1/search (Caused by NewConnectionError('<urllib3.connection.HTTPSConnection object>:"
    " Failed to establish a new connection: [Errno 111] Connection refused'))"
)


class _Model(pydantic.BaseModel):
    answer: int


def _pydantic_error() -> BaseException:
    return raised(lambda: _Model.model_validate_json('{"answer": "forty-two"}'))


CASES: list[Any] = [
    # --- OpenAI SDK --------------------------------------------------------------
    pytest.param(
        record(
            openai_status(
                openai.RateLimitError,
                429,
                openai_error(
                    "rate_limit_exceeded",
                    "requests",
                    "Rate limit reached for gpt-4o in organization org-x on requests per min (RPM):"
                    " Limit 500, Used 500, Requested 1.",
                ),
            )
        ),
        (T, "rate_limit", "builtin.openai.rate_limit"),
        id="openai-rate-limit",
    ),
    pytest.param(
        record(
            openai_status(
                openai.RateLimitError,
                429,
                openai_error(
                    "insufficient_quota",
                    "insufficient_quota",
                    "You exceeded your current quota, please check your plan and billing details.",
                ),
            )
        ),
        (P, "quota_exhausted", "builtin.openai.insufficient_quota"),
        id="openai-429-insufficient-quota-is-not-a-rate-limit",
    ),
    pytest.param(
        record(
            text(
                "Error code: 429 - You exceeded your current quota, please check your plan and"
                " billing details.",
                exception_type="openai.RateLimitError",
                http_status=429,
            )
        ),
        (P, "quota_exhausted", "builtin.provider.quota_message"),
        id="openai-quota-by-message-beats-429",
    ),
    pytest.param(
        record(text("Error code: 429", exception_type="openai.RateLimitError", http_status=429)),
        (T, "rate_limit", "builtin.http.rate_limit"),
        id="openai-429-without-body",
    ),
    pytest.param(
        record(text("rate limited", exception_type="RateLimitError")),
        (T, "rate_limit", "builtin.sdk.rate_limit"),
        id="bare-RateLimitError",
    ),
    pytest.param(
        record(from_exception(openai.APITimeoutError(request=_REQ2))),
        (T, "timeout", "builtin.sdk.timeout"),
        id="openai-APITimeoutError",
    ),
    pytest.param(
        record(from_exception(openai.APIConnectionError(request=_REQ2))),
        (T, "connection", "builtin.sdk.connection"),
        id="openai-APIConnectionError",
    ),
    pytest.param(
        # openai-python's SSE `error` event mid-stream (_streaming.py): a bare APIError.
        record(
            from_exception(
                openai.APIError(
                    "An error occurred during streaming",
                    _REQ2,
                    body={"type": "server_error", "message": None},
                )
            )
        ),
        (T, "unavailable", "builtin.openai.stream_error"),
        id="openai-APIError-mid-stream",
    ),
    pytest.param(
        record(
            openai_status(
                openai.InternalServerError,
                500,
                openai_error(
                    None, "server_error", "The server had an error while processing your request."
                ),
            )
        ),
        (T, "unavailable", "builtin.provider.server_error"),
        id="openai-500-server-error",
    ),
    pytest.param(
        record(
            openai_status(
                openai.InternalServerError, 503, {"error": {"message": "Service Unavailable"}}
            )
        ),
        (T, "unavailable", "builtin.http.unavailable"),
        id="openai-503",
    ),
    pytest.param(
        record(text("Internal server error", exception_type="openai.InternalServerError")),
        (T, "unavailable", "builtin.sdk.unavailable"),
        id="InternalServerError-without-status",
    ),
    pytest.param(
        record(
            openai_status(
                openai.AuthenticationError,
                401,
                openai_error(
                    "invalid_api_key",
                    "invalid_request_error",
                    "Incorrect API key provided: sk-test.",
                ),
            )
        ),
        (P, "auth", "builtin.provider.auth"),
        id="openai-401",
    ),
    pytest.param(
        record(
            openai_status(
                openai.PermissionDeniedError,
                403,
                openai_error(
                    "unsupported_country_region_territory",
                    "request_forbidden",
                    "Country, region, or territory not supported",
                ),
            )
        ),
        (P, "permission", "builtin.provider.permission"),
        id="openai-403",
    ),
    pytest.param(
        record(
            openai_status(
                openai.NotFoundError,
                404,
                openai_error(
                    "model_not_found",
                    "invalid_request_error",
                    "The model `gpt-9` does not exist or you do not have access to it.",
                ),
            )
        ),
        (P, "not_found", "builtin.provider.not_found"),
        id="openai-404-model-not-found",
    ),
    pytest.param(
        record(
            openai_status(
                openai.BadRequestError,
                400,
                openai_error(
                    "context_length_exceeded",
                    "invalid_request_error",
                    "This model's maximum context length is 128000 tokens. However, your messages"
                    " resulted in 130000 tokens.",
                ),
            )
        ),
        (M, "context_overflow", "builtin.openai.context_length"),
        id="openai-400-context-length",
    ),
    pytest.param(
        record(
            openai_status(
                openai.BadRequestError,
                400,
                openai_error(
                    "content_policy_violation",
                    "invalid_request_error",
                    "Your request was rejected as a result of our safety system.",
                ),
            )
        ),
        (M, "content_policy", "builtin.openai.content_policy"),
        id="openai-400-content-policy",
    ),
    pytest.param(
        record(
            text(
                "The response was filtered due to the prompt triggering Azure OpenAI's content"
                " management policy.",
                exception_type="openai.BadRequestError",
                http_status=400,
            )
        ),
        (M, "content_policy", "builtin.provider.content_policy_message"),
        id="azure-content-management-policy-message",
    ),
    pytest.param(
        record(from_exception(openai.ContentFilterFinishReasonError())),
        (M, "content_policy", "builtin.openai.content_filter_finish"),
        id="openai-ContentFilterFinishReasonError",
    ),
    pytest.param(
        # interrupt() inside a LangGraph node: recorded on an OK span, the graph waits.
        record(
            from_exception(langgraph.errors.GraphInterrupt(()), swallowed=True),
            Role.TOOL,
            "tool:issue_refund",
        ),
        ("semantic", "approval_required", "builtin.langgraph.interrupt"),
        id="langgraph-GraphInterrupt",
    ),
    pytest.param(
        record(from_exception(openai.LengthFinishReasonError(completion=_LEN))),
        (M, "output_truncated", "builtin.openai.length_finish"),
        id="openai-LengthFinishReasonError",
    ),
    pytest.param(
        record(
            openai_status(
                openai.BadRequestError,
                400,
                openai_error(
                    None, "invalid_request_error", "Invalid value for 'temperature': must be <= 2."
                ),
            )
        ),
        (P, "invalid_request", "builtin.http.client_error"),
        id="openai-400-other",
    ),
    pytest.param(
        record(
            openai_status(
                openai.UnprocessableEntityError, 422, {"error": {"message": "unprocessable"}}
            )
        ),
        (P, "invalid_request", "builtin.http.client_error"),
        id="openai-422",
    ),
    pytest.param(
        record(text("bad request", exception_type="openai.BadRequestError")),
        (P, "invalid_request", "builtin.sdk.invalid_request"),
        id="BadRequestError-without-status",
    ),
    pytest.param(
        record(
            text(
                "bad request",
                exception_type="openai.BadRequestError",
                provider_code="invalid_request_error",
            )
        ),
        (P, "invalid_request", "builtin.provider.invalid_request"),
        id="invalid_request_error-code-without-status",
    ),
    pytest.param(
        record(openai_status(openai.ConflictError, 409, {"error": {"message": "conflict"}})),
        (T, "unavailable", "builtin.http.conflict"),
        id="openai-409",
    ),
    pytest.param(
        record(text("conflict", exception_type="openai.ConflictError")),
        (T, "unavailable", "builtin.sdk.conflict"),
        id="ConflictError-without-status",
    ),
    # --- Anthropic SDK -------------------------------------------------------------
    pytest.param(
        record(
            anthropic_status(
                anthropic.RateLimitError,
                429,
                anthropic_error(
                    "rate_limit_error",
                    "Number of request tokens has exceeded your per-minute rate limit",
                ),
            )
        ),
        (T, "rate_limit", "builtin.anthropic.rate_limit"),
        id="anthropic-rate-limit",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.OverloadedError, 529, anthropic_error("overloaded_error", "Overloaded")
            )
        ),
        (T, "unavailable", "builtin.anthropic.overloaded"),
        id="anthropic-529-overloaded",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.APIStatusError,
                529,
                anthropic_error("overloaded_error", "Overloaded"),
                parsed=False,
            )
        ),
        (T, "unavailable", "builtin.http.unavailable"),
        id="generic-APIStatusError-529-is-unavailable",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.InternalServerError,
                500,
                anthropic_error("api_error", "Internal server error"),
            )
        ),
        (T, "unavailable", "builtin.provider.server_error"),
        id="anthropic-500-api-error",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.AuthenticationError,
                401,
                anthropic_error("authentication_error", "invalid x-api-key"),
            )
        ),
        (P, "auth", "builtin.provider.auth"),
        id="anthropic-401",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.PermissionDeniedError,
                403,
                anthropic_error(
                    "permission_error",
                    "Your API key does not have permission to use the specified resource.",
                ),
            )
        ),
        (P, "permission", "builtin.provider.permission"),
        id="anthropic-403",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.NotFoundError, 404, anthropic_error("not_found_error", "model: claude-9")
            )
        ),
        (P, "not_found", "builtin.provider.not_found"),
        id="anthropic-404",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.BadRequestError,
                400,
                anthropic_error(
                    "invalid_request_error", "prompt is too long: 208310 tokens > 200000 maximum"
                ),
            )
        ),
        (M, "context_overflow", "builtin.provider.context_overflow_message"),
        id="anthropic-prompt-too-long",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.BadRequestError,
                400,
                anthropic_error(
                    "invalid_request_error",
                    "Your credit balance is too low to access the Anthropic API. Please go to"
                    " Plans & Billing to upgrade or purchase credits.",
                ),
            )
        ),
        (P, "quota_exhausted", "builtin.provider.quota_message"),
        id="anthropic-credit-balance",
    ),
    pytest.param(
        record(
            anthropic_status(
                anthropic.BadRequestError,
                400,
                anthropic_error("invalid_request_error", "messages: roles must alternate"),
            )
        ),
        (P, "invalid_request", "builtin.http.client_error"),
        id="anthropic-400-other",
    ),
    pytest.param(
        record(
            anthropic_status(anthropic.PaymentRequiredError, 402, {"type": "error"}, parsed=False)
        ),
        (P, "quota_exhausted", "builtin.http.payment_required"),
        id="anthropic-402",
    ),
    pytest.param(
        record(text("payment required", exception_type="anthropic.PaymentRequiredError")),
        (P, "quota_exhausted", "builtin.sdk.quota"),
        id="PaymentRequiredError-without-status",
    ),
    pytest.param(
        record(from_exception(anthropic.APITimeoutError(request=_REQ2))),
        (T, "timeout", "builtin.sdk.timeout"),
        id="anthropic-APITimeoutError",
    ),
    # --- finish / stop reasons -----------------------------------------------------
    pytest.param(
        record(ErrorEvidence(finish_reasons=("content_filter",))),
        (M, "content_policy", "builtin.llm.finish_content_filter"),
        id="finish-content_filter",
    ),
    pytest.param(
        record(ErrorEvidence(finish_reasons=("refusal",))),
        (M, "content_policy", "builtin.llm.finish_content_filter"),
        id="anthropic-stop-refusal",
    ),
    pytest.param(
        record(ErrorEvidence(finish_reasons=("SAFETY",))),
        (M, "content_policy", "builtin.llm.finish_content_filter"),
        id="gemini-SAFETY-any-case",
    ),
    pytest.param(
        record(ErrorEvidence(finish_reasons=("length",))),
        (M, "output_truncated", "builtin.llm.finish_length"),
        id="finish-length",
    ),
    pytest.param(
        record(ErrorEvidence(finish_reasons=("max_tokens",))),
        (M, "output_truncated", "builtin.llm.finish_length"),
        id="anthropic-stop-max_tokens",
    ),
    pytest.param(
        record(ErrorEvidence(finish_reasons=("model_context_window_exceeded",))),
        (M, "context_overflow", "builtin.llm.finish_context_window"),
        id="anthropic-stop-context-window",
    ),
    pytest.param(
        record(ErrorEvidence(finish_reasons=("MALFORMED_FUNCTION_CALL",))),
        (M, "invalid_tool_call", "builtin.llm.finish_malformed_call"),
        id="gemini-malformed-function-call",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, provider_code="context_length_exceeded")),
        (M, "context_overflow", "builtin.openai.context_length"),
        id="context_length_exceeded-code-only",
    ),
    # --- invalid tool calls ---------------------------------------------------------
    pytest.param(
        record(ErrorEvidence(invalid_tool_calls=("get_wether",))),
        (M, "invalid_tool_call", "builtin.llm.invalid_tool_call"),
        id="invalid_tool_calls-non-empty",
    ),
    pytest.param(
        record(
            text(
                "Tool get_wether not found in agent Assistant",
                exception_type="agents.exceptions.ModelBehaviorError",
            )
        ),
        (M, "invalid_tool_call", "builtin.agents.invalid_tool_message"),
        id="openai-agents-tool-not-found",
    ),
    pytest.param(
        record(
            text(
                "Model produced something odd",
                exception_type="agents.exceptions.ModelBehaviorError",
            )
        ),
        (M, "invalid_tool_call", "builtin.agents.model_behavior"),
        id="openai-agents-ModelBehaviorError",
    ),
    pytest.param(
        record(
            text(
                "Error: get_wether is not a valid tool, try one of [get_weather].", swallowed=True
            ),
            role=Role.TOOL,
        ),
        (M, "invalid_tool_call", "builtin.agents.invalid_tool_message"),
        id="langgraph-not-a-valid-tool",
    ),
    pytest.param(
        record(
            text(
                "Failed to call a function. Please adjust your prompt.",
                exception_type="groq.BadRequestError",
                provider_code="tool_use_failed",
                http_status=400,
            )
        ),
        (M, "invalid_tool_call", "builtin.provider.tool_use_failed"),
        id="groq-tool_use_failed",
    ),
    # --- HTTP client libraries -------------------------------------------------------
    pytest.param(
        record(
            from_exception(httpx.ReadTimeout("The read operation timed out", request=_REQ)),
            role=Role.HTTP,
        ),
        (T, "timeout", "builtin.sdk.timeout"),
        id="httpx-ReadTimeout",
    ),
    pytest.param(
        record(from_exception(httpx.ConnectTimeout("timed out", request=_REQ)), role=Role.HTTP),
        (T, "timeout", "builtin.sdk.timeout"),
        id="httpx-ConnectTimeout",
    ),
    pytest.param(
        record(
            from_exception(httpx.ConnectError("[Errno 111] Connection refused", request=_REQ)),
            role=Role.HTTP,
        ),
        (T, "connection", "builtin.sdk.connection"),
        id="httpx-ConnectError",
    ),
    pytest.param(
        record(
            from_exception(
                httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=_REQ
                )
            ),
            role=Role.HTTP,
        ),
        (T, "connection", "builtin.sdk.connection"),
        id="httpx-RemoteProtocolError",
    ),
    pytest.param(
        record(
            from_exception(
                requests.exceptions.ConnectionError(
                    "HTTPSConnectionPool(host='api.example.com', port=443): Max retries exceeded"
                )
            ),
            role=Role.HTTP,
        ),
        (T, "connection", "builtin.python.connection"),
        id="requests-ConnectionError",
    ),
    pytest.param(
        record(
            from_exception(
                requests.exceptions.ReadTimeout(
                    "HTTPSConnectionPool(host='api.example.com', port=443): Read timed out."
                )
            ),
            role=Role.HTTP,
        ),
        (T, "timeout", "builtin.sdk.timeout"),
        id="requests-ReadTimeout",
    ),
    pytest.param(
        record(
            from_exception(
                aiohttp.ClientConnectorError(_AIO_KEY, OSError(111, "Connect call failed"))
            ),
            role=Role.HTTP,
        ),
        (T, "connection", "builtin.sdk.connection"),
        id="aiohttp-ClientConnectorError",
    ),
    pytest.param(
        record(
            from_exception(aiohttp.ServerTimeoutError("Timeout on reading data from socket")),
            role=Role.HTTP,
        ),
        (T, "timeout", "builtin.sdk.timeout"),
        id="aiohttp-ServerTimeoutError",
    ),
    pytest.param(
        record(from_exception(aiohttp.ServerDisconnectedError()), role=Role.HTTP),
        (T, "connection", "builtin.sdk.connection"),
        id="aiohttp-ServerDisconnectedError",
    ),
    pytest.param(
        record(
            from_exception(
                urllib3.exceptions.ReadTimeoutError(
                    _POOL, "/v1", "Read timed out. (read timeout=5)"
                )
            ),
            role=Role.HTTP,
        ),
        (T, "timeout", "builtin.sdk.timeout"),
        id="urllib3-ReadTimeoutError",
    ),
    pytest.param(
        record(
            from_exception(
                urllib3.exceptions.NewConnectionError(
                    _CONN, "Failed to establish a new connection: [Errno 111] Connection refused"
                )
            ),
            role=Role.HTTP,
        ),
        (T, "connection", "builtin.sdk.connection"),
        id="urllib3-NewConnectionError",
    ),
    # --- Python built-ins ---------------------------------------------------------------
    pytest.param(
        record(from_exception(TimeoutError("timed out")), role=Role.TOOL),
        (T, "timeout", "builtin.python.timeout"),
        id="TimeoutError",
    ),
    pytest.param(
        record(from_exception(asyncio.TimeoutError()), role=Role.TOOL),
        (T, "timeout", "builtin.python.timeout"),
        id="asyncio.TimeoutError",
    ),
    pytest.param(
        record(text("", exception_type="builtins.TimeoutError"), role=Role.TOOL),
        (T, "timeout", "builtin.python.timeout"),
        id="builtins.TimeoutError",
    ),
    pytest.param(
        record(from_exception(ConnectionError("down")), role=Role.TOOL),
        (T, "connection", "builtin.python.connection"),
        id="ConnectionError",
    ),
    pytest.param(
        record(
            from_exception(ConnectionResetError(104, "Connection reset by peer")), role=Role.TOOL
        ),
        (T, "connection", "builtin.python.connection"),
        id="ConnectionResetError",
    ),
    pytest.param(
        record(from_exception(ConnectionRefusedError(111, "Connection refused")), role=Role.TOOL),
        (T, "connection", "builtin.python.connection"),
        id="ConnectionRefusedError",
    ),
    pytest.param(
        record(from_exception(BrokenPipeError(32, "Broken pipe")), role=Role.TOOL),
        (T, "connection", "builtin.python.connection"),
        id="BrokenPipeError",
    ),
    pytest.param(
        record(
            from_exception(PermissionError(13, "Permission denied", "/etc/shadow")), role=Role.TOOL
        ),
        (P, "permission", "builtin.python.permission"),
        id="PermissionError",
    ),
    pytest.param(
        record(
            from_exception(FileNotFoundError(2, "No such file or directory", "notes.txt")),
            role=Role.TOOL,
        ),
        (P, "not_found", "builtin.python.not_found"),
        id="FileNotFoundError",
    ),
    # --- parsing --------------------------------------------------------------------------
    pytest.param(
        record(from_exception(raised(lambda: json.loads('{"answer": ')))),
        (M, "parse_error", "builtin.parse.json_model_output"),
        id="JSONDecodeError-on-llm",
    ),
    pytest.param(
        record(from_exception(raised(lambda: json.loads("{"))), role=Role.CHAIN),
        (M, "parse_error", "builtin.parse.json_model_output"),
        id="JSONDecodeError-in-output-parser-chain",
    ),
    pytest.param(
        record(from_exception(raised(lambda: json.loads("<html>"))), role=Role.TOOL),
        (P, "tool_error", "builtin.parse.tool_data"),
        id="JSONDecodeError-in-a-tools-body-is-the-tools",
    ),
    pytest.param(
        record(from_exception(_pydantic_error()), role=Role.TOOL),
        (P, "tool_error", "builtin.parse.tool_data"),
        id="ValidationError-in-a-tools-body-is-the-tools",
    ),
    pytest.param(
        record(from_exception(raised(lambda: json.loads("<html>"))), role=Role.HTTP),
        (P, "parse_error", "builtin.parse.json"),
        id="JSONDecodeError-on-http-is-permanent",
    ),
    pytest.param(
        record(from_exception(_pydantic_error()), role=Role.HTTP),
        (P, "parse_error", "builtin.parse.json"),
        id="ValidationError-on-http-is-permanent",
    ),
    pytest.param(
        record(
            text(
                "[Errno 13] Permission denied: '/srv/insufficient_quota/report.csv'",
                exception_type="PermissionError",
            ),
            role=Role.TOOL,
        ),
        (P, "permission", "builtin.python.permission"),
        id="PermissionError-whose-message-names-a-quota",
    ),
    pytest.param(
        record(
            text(
                "no answer in 5s after HTTP 503 from the backend",
                exception_type="TimeoutError",
                http_status=503,  # what normalization reads in such a message
            ),
            role=Role.TOOL,
        ),
        (T, "timeout", "builtin.python.timeout"),
        id="TimeoutError-whose-message-names-a-status",
    ),
    pytest.param(
        record(from_exception(_pydantic_error()), role=Role.CHAIN),
        (M, "parse_error", "builtin.parse.validation"),
        id="pydantic-ValidationError",
    ),
    pytest.param(
        record(
            text(
                "Invalid json output: Sure! Here is",
                exception_type="langchain_core.exceptions.OutputParserException",
            ),
            role=Role.CHAIN,
        ),
        (M, "parse_error", "builtin.parse.output_parser"),
        id="OutputParserException",
    ),
    # --- gRPC ---------------------------------------------------------------------------------
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=14)),
        (T, "unavailable", "builtin.grpc.unavailable"),
        id="grpc-UNAVAILABLE",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=10)),
        (T, "unavailable", "builtin.grpc.unavailable"),
        id="grpc-ABORTED",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=4)),
        (T, "timeout", "builtin.grpc.deadline_exceeded"),
        id="grpc-DEADLINE_EXCEEDED",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=8)),
        (T, "rate_limit", "builtin.grpc.resource_exhausted"),
        id="grpc-RESOURCE_EXHAUSTED",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=16)),
        (P, "auth", "builtin.grpc.unauthenticated"),
        id="grpc-UNAUTHENTICATED",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=7)),
        (P, "permission", "builtin.grpc.permission_denied"),
        id="grpc-PERMISSION_DENIED",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=5)),
        (P, "not_found", "builtin.grpc.not_found"),
        id="grpc-NOT_FOUND",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=3)),
        (P, "invalid_request", "builtin.grpc.invalid"),
        id="grpc-INVALID_ARGUMENT",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=9)),
        (P, "invalid_request", "builtin.grpc.invalid"),
        id="grpc-FAILED_PRECONDITION",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=12)),
        (P, "invalid_request", "builtin.grpc.invalid"),
        id="grpc-UNIMPLEMENTED",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, grpc_code=2)),
        (P, "unknown", "builtin.unknown"),
        id="grpc-UNKNOWN-is-unknown",
    ),
    # --- plain HTTP ------------------------------------------------------------------------------
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=408), Role.HTTP),
        (T, "timeout", "builtin.http.timeout"),
        id="http-408",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=504), Role.HTTP),
        (T, "timeout", "builtin.http.timeout"),
        id="http-504",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=429), Role.HTTP),
        (T, "rate_limit", "builtin.http.rate_limit"),
        id="http-429",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=503), Role.HTTP),
        (T, "unavailable", "builtin.http.unavailable"),
        id="http-503",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=501), Role.HTTP),
        (P, "invalid_request", "builtin.http.not_implemented"),
        id="http-501",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=401), Role.HTTP),
        (P, "auth", "builtin.http.auth"),
        id="http-401",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=403), Role.HTTP),
        (P, "permission", "builtin.http.permission"),
        id="http-403",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=404), Role.HTTP),
        (P, "not_found", "builtin.http.not_found"),
        id="http-404",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True, http_status=418), Role.HTTP),
        (P, "invalid_request", "builtin.http.client_error"),
        id="http-418",
    ),
    # --- other providers, through their words ------------------------------------------------
    pytest.param(
        record(
            text(
                "An error occurred (ThrottlingException) when calling the InvokeModel operation"
                " (reached max retries: 4): Too many requests, please wait before trying again.",
                exception_type="botocore.exceptions.ClientError",
            )
        ),
        (T, "rate_limit", "builtin.text.rate_limit"),
        id="bedrock-throttling-via-ClientError",
    ),
    pytest.param(
        record(
            text(
                "An error occurred (ValidationException) when calling the InvokeModel operation:"
                " Input is too long for requested model.",
                exception_type="botocore.exceptions.ClientError",
            )
        ),
        (M, "context_overflow", "builtin.provider.context_overflow_message"),
        id="bedrock-input-too-long",
    ),
    pytest.param(
        record(
            text(
                "An error occurred (ServiceQuotaExceededException)",
                exception_type="ServiceQuotaExceededException",
            )
        ),
        (P, "quota_exhausted", "builtin.sdk.quota"),
        id="bedrock-ServiceQuotaExceededException",
    ),
    pytest.param(
        record(text("The model is not ready", exception_type="ModelNotReadyException")),
        (T, "unavailable", "builtin.sdk.unavailable"),
        id="bedrock-ModelNotReadyException",
    ),
    pytest.param(
        record(text("Malformed input request", exception_type="ValidationException")),
        (P, "invalid_request", "builtin.sdk.invalid_request"),
        id="bedrock-ValidationException",
    ),
    pytest.param(
        record(
            text("401 Unauthorized", exception_type="google.api_core.exceptions.Unauthenticated")
        ),
        (P, "auth", "builtin.sdk.auth"),
        id="google-Unauthenticated",
    ),
    pytest.param(
        record(
            text(
                "403 Permission denied on resource project",
                exception_type="google.api_core.exceptions.PermissionDenied",
            )
        ),
        (P, "permission", "builtin.sdk.permission"),
        id="google-PermissionDenied",
    ),
    pytest.param(
        record(
            text(
                "404 models/gemini-9 is not found",
                exception_type="google.api_core.exceptions.NotFound",
            )
        ),
        (P, "not_found", "builtin.sdk.not_found"),
        id="google-NotFound",
    ),
    # --- agent frameworks ----------------------------------------------------------
    pytest.param(
        record(
            text(
                "Recursion limit of 25 reached without hitting a stop condition.",
                exception_type="langgraph.errors.GraphRecursionError",
            ),
            role=Role.AGENT,
        ),
        (S, "budget_exceeded", "builtin.agents.budget"),
        id="langgraph-GraphRecursionError",
    ),
    pytest.param(
        record(
            text(
                "This model's context window was exceeded",
                exception_type="litellm.ContextWindowExceededError",
            )
        ),
        (M, "context_overflow", "builtin.provider.context_overflow_message"),
        id="litellm-context-window-by-message",
    ),
    pytest.param(
        record(text("too big", exception_type="litellm.ContextWindowExceededError")),
        (M, "context_overflow", "builtin.litellm.context_window"),
        id="litellm-ContextWindowExceededError",
    ),
    # --- swallowed and unexplained tool errors -------------------------------------
    pytest.param(
        record(text(_SWALLOWED_CONNECTION, swallowed=True), role=Role.TOOL),
        (T, "connection", "builtin.text.connection"),
        id="swallowed-connection-refused-text",
    ),
    pytest.param(
        record(
            text(
                _SWALLOWED_CONNECTION,
                exception_type="requests.exceptions.ConnectionError",
                swallowed=True,
            ),
            role=Role.TOOL,
        ),
        (T, "connection", "builtin.python.connection"),
        id="swallowed-with-parsed-type",
    ),
    pytest.param(
        record(text("Error: Request timed out after 30s", swallowed=True), role=Role.TOOL),
        (T, "timeout", "builtin.text.timeout"),
        id="swallowed-timeout-text",
    ),
    pytest.param(
        record(text("Error: 503 Service Unavailable", swallowed=True), role=Role.TOOL),
        (T, "unavailable", "builtin.text.unavailable"),
        id="swallowed-503-text",
    ),
    pytest.param(
        record(text("Error: invalid API key", swallowed=True), role=Role.TOOL),
        (P, "auth", "builtin.text.auth"),
        id="swallowed-auth-text",
    ),
    pytest.param(
        record(text("Error: 403 Forbidden", swallowed=True), role=Role.TOOL),
        (P, "permission", "builtin.text.permission"),
        id="swallowed-forbidden-text",
    ),
    pytest.param(
        record(text("Error: city 'Atlantis' not found", swallowed=True), role=Role.TOOL),
        (P, "not_found", "builtin.text.not_found"),
        id="swallowed-not-found-text",
    ),
    pytest.param(
        record(text("Error: rate limit hit, slow down", swallowed=True), role=Role.TOOL),
        (T, "rate_limit", "builtin.text.rate_limit"),
        id="swallowed-rate-limit-text",
    ),
    pytest.param(
        record(
            text("Error: 'NoneType' object is not subscriptable", swallowed=True), role=Role.TOOL
        ),
        (T, "tool_error", "builtin.tool.error"),
        id="swallowed-unexplained-tool-error",
    ),
    pytest.param(
        record(from_exception(ValueError("unsupported unit: kelvin")), role=Role.TOOL),
        (T, "tool_error", "builtin.tool.error"),
        id="tool-raises-ValueError",
    ),
    pytest.param(
        record(text("Something odd in the output", swallowed=True), role=Role.CHAIN),
        (T, "tool_error", "builtin.tool.swallowed"),
        id="swallowed-on-a-non-tool-span",
    ),
    # --- catch-all -------------------------------------------------------------------------------
    pytest.param(
        record(from_exception(KeyError("choices"))),
        (P, "unknown", "builtin.unknown"),
        id="KeyError-on-llm",
    ),
    pytest.param(
        record(ErrorEvidence(status_error=True)),
        (P, "unknown", "builtin.unknown"),
        id="bare-error-status",
    ),
]


@pytest.mark.parametrize(("span", "expected"), CASES)
def test_builtin_rules_classify_real_errors(
    span: SpanRecord, expected: tuple[FailureClass, str, str]
) -> None:
    verdict = POLICY.classify(span)

    assert verdict is not None
    assert expected == (verdict.failure_class, verdict.kind, verdict.rule)
    assert span.dependency == verdict.dependency


def test_the_table_exercises_every_builtin_rule() -> None:
    hit = {POLICY.classify(p.values[0]).rule for p in CASES}  # type: ignore[union-attr]

    assert set(POLICY.rules) - hit == set()


def test_a_span_without_evidence_has_no_class() -> None:
    assert POLICY.classify(record(None)) is None


def test_classification_is_deterministic() -> None:
    spans = [p.values[0] for p in CASES]

    assert [POLICY.classify(s) for s in spans] == [POLICY.classify(s) for s in spans]


def test_message_search_is_bounded_and_fast_on_huge_text() -> None:
    huge = record(text("x" * 5_000_000 + " connection refused"), role=Role.TOOL)

    verdict = POLICY.classify(huge)

    # The words are beyond the searched prefix, so only the tool fallback applies.
    assert verdict is not None
    assert (verdict.kind, verdict.rule) == ("tool_error", "builtin.tool.error")
