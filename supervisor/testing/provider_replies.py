"""What the fake provider answers: scripted replies in both providers' vocabularies.

A :class:`Reply` is a success (text, tool calls, a truncated answer) or a
fault shaped as OpenAI and Anthropic document it (a 429 with ``retry-after``,
a 529, a context overflow, a dropped connection...); a :class:`FaultPlan`
injects seeded faults into the requests no script answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the fake model asks for.

    ``arguments`` is the JSON text sent to the client, verbatim, so a test can
    send arguments that are not valid JSON.
    """

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted answer: a success (status 200) or a fault (status >= 400).

    A fault carries both providers' error vocabularies: the OpenAI endpoint
    answers ``{"error": {"message", "type", "param", "code"}}`` and the
    Anthropic endpoint ``{"type": "error", "error": {"type", "message"}}``.
    ``body`` replaces the generated error body entirely when given.
    """

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    #: OpenAI vocabulary (``stop``, ``length``, ``tool_calls``, ``content_filter``);
    #: mapped to Anthropic's ``stop_reason`` on ``/v1/messages``. ``""`` = inferred.
    finish_reason: str = ""
    #: ``(input_tokens, output_tokens)``; estimated from the text when ``None``.
    usage: tuple[int, int] | None = None
    #: Response model; the request's model when ``""``.
    model: str = ""
    status: int = 200
    #: OpenAI ``error.type``.
    error_type: str = ""
    #: OpenAI ``error.code``.
    error_code: str = ""
    #: OpenAI ``error.param``.
    error_param: str = ""
    #: Anthropic ``error.type``.
    anthropic_error_type: str = ""
    error_message: str = ""
    #: Anthropic's wording of the error; ``error_message`` when ``""``.
    anthropic_message: str = ""
    body: Mapping[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = ()
    #: Wait this long before answering (to provoke client timeouts).
    delay_s: float = 0.0
    #: Close the connection without answering (to provoke connection errors).
    drop_connection: bool = False
    #: Streamed (OpenAI): after the first chunk of ``content``, an error event
    #: instead of the rest, as OpenAI sends a ``server_error`` mid-stream.
    stream_breaks: bool = False

    @property
    def is_fault(self) -> bool:
        """Whether this reply is an HTTP error, a broken connection or a broken stream."""
        return self.status >= 400 or self.drop_connection or self.stream_breaks

    # -- successes ---------------------------------------------------------

    @classmethod
    def text(
        cls,
        content: str,
        finish_reason: str = "stop",
        usage: tuple[int, int] | None = None,
        model: str = "",
    ) -> Reply:
        """A plain text answer."""
        return cls(content=content, finish_reason=finish_reason, usage=usage, model=model)

    @classmethod
    def tool_call(
        cls,
        name: str,
        arguments: str | Mapping[str, Any] = "{}",
        *more: ToolCall,
        content: str = "",
        usage: tuple[int, int] | None = None,
    ) -> Reply:
        """An answer that calls ``name`` (and any ``more`` tool calls)."""
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls = (ToolCall(name, args), *more)
        return cls(content=content, tool_calls=calls, finish_reason="tool_calls", usage=usage)

    @classmethod
    def truncated(cls, content: str = "The answer is cut sho") -> Reply:
        """A text answer cut by the token limit (``finish_reason=length``)."""
        return cls(content=content, finish_reason="length")

    # -- faults ------------------------------------------------------------

    @classmethod
    def fault(
        cls,
        status: int,
        message: str,
        *,
        error_type: str = "",
        error_code: str = "",
        anthropic_error_type: str = "",
        param: str = "",
        headers: Mapping[str, str] | None = None,
        anthropic_message: str = "",
    ) -> Reply:
        """Any HTTP error, in both providers' body shapes."""
        return cls(
            anthropic_message=anthropic_message,
            status=status,
            error_type=error_type,
            error_code=error_code,
            error_param=param,
            anthropic_error_type=anthropic_error_type or _anthropic_type_for(status),
            error_message=message,
            headers=tuple((headers or {}).items()),
        )

    @classmethod
    def rate_limited(cls, retry_after_s: float = 1.0, model: str = "gpt-4o-mini") -> Reply:
        """429 ``rate_limit_exceeded`` with ``retry-after`` headers and OpenAI's wording."""
        wait = f"{retry_after_s:g}s"
        return cls.fault(
            429,
            f"Rate limit reached for {model} in organization org-fake on requests per min "
            f"(RPM): Limit 3, Used 3, Requested 1. Please try again in {wait}. Visit "
            "https://platform.openai.com/account/rate-limits to learn more.",
            error_type="requests",
            error_code="rate_limit_exceeded",
            anthropic_error_type="rate_limit_error",
            anthropic_message="Number of request tokens has exceeded your per-minute rate "
            "limit (https://docs.anthropic.com/en/api/rate-limits); see the response headers "
            "for current usage. Please reduce the prompt length or the maximum tokens "
            "requested, or try again later.",
            headers={
                "retry-after": f"{retry_after_s:g}",
                "retry-after-ms": str(round(retry_after_s * 1000)),
                "x-ratelimit-reset-requests": wait,
            },
        )

    @classmethod
    def quota_exhausted(cls) -> Reply:
        """429 ``insufficient_quota``: retrying does not help."""
        return cls.fault(
            429,
            "You exceeded your current quota, please check your plan and billing details. "
            "For more information on this error, read the docs: "
            "https://platform.openai.com/docs/guides/error-codes/api-errors.",
            error_type="insufficient_quota",
            error_code="insufficient_quota",
            anthropic_error_type="invalid_request_error",
            anthropic_message="Your credit balance is too low to access the Anthropic API. "
            "Please go to Plans & Billing to upgrade or purchase credits.",
        )

    @classmethod
    def overloaded(cls, retry_after_s: float | None = None) -> Reply:
        """Anthropic's 529 ``overloaded_error``."""
        headers = {} if retry_after_s is None else {"retry-after": f"{retry_after_s:g}"}
        return cls.fault(
            529,
            "Overloaded",
            error_type="overloaded_error",
            anthropic_error_type="overloaded_error",
            headers=headers,
        )

    @classmethod
    def context_length_exceeded(cls, limit: int = 128000, used: int = 130571) -> Reply:
        """400 ``context_length_exceeded``."""
        return cls.fault(
            400,
            f"This model's maximum context length is {limit} tokens. However, your messages "
            f"resulted in {used} tokens. Please reduce the length of the messages.",
            error_type="invalid_request_error",
            error_code="context_length_exceeded",
            anthropic_error_type="invalid_request_error",
            anthropic_message=f"prompt is too long: {used} tokens > {limit} maximum",
            param="messages",
        )

    @classmethod
    def unauthorized(cls) -> Reply:
        """401 ``invalid_api_key`` / ``authentication_error``."""
        return cls.fault(
            401,
            "Incorrect API key provided: sk-fake***. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            error_type="invalid_request_error",
            error_code="invalid_api_key",
            anthropic_error_type="authentication_error",
            anthropic_message="invalid x-api-key",
        )

    @classmethod
    def permission_denied(cls) -> Reply:
        """403 ``permission_error``."""
        return cls.fault(
            403,
            "Your API key does not have permission to use the specified resource.",
            error_type="invalid_request_error",
            error_code="unsupported_country_region_territory",
            anthropic_error_type="permission_error",
        )

    @classmethod
    def not_found(cls, model: str = "gpt-9-imaginary") -> Reply:
        """404 ``model_not_found`` / ``not_found_error``."""
        return cls.fault(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            error_type="invalid_request_error",
            error_code="model_not_found",
            anthropic_error_type="not_found_error",
            anthropic_message=f"model: {model}",
        )

    @classmethod
    def content_filtered(cls, azure: bool = False) -> Reply:
        """400 ``content_policy_violation`` (OpenAI) or ``content_filter`` (Azure OpenAI)."""
        if azure:
            return cls.fault(
                400,
                "The response was filtered due to the prompt triggering Azure OpenAI's "
                "content management policy.",
                error_code="content_filter",
                anthropic_error_type="invalid_request_error",
                param="prompt",
            )
        return cls.fault(
            400,
            "Your request was rejected as a result of our safety system.",
            error_type="invalid_request_error",
            error_code="content_policy_violation",
            anthropic_error_type="invalid_request_error",
        )

    @classmethod
    def invalid_request(cls, message: str = "Invalid value for 'temperature'.") -> Reply:
        """400 ``invalid_request_error``."""
        return cls.fault(
            400,
            message,
            error_type="invalid_request_error",
            error_code="invalid_value",
            anthropic_error_type="invalid_request_error",
        )

    @classmethod
    def server_error(cls, status: int = 500) -> Reply:
        """A 5xx: ``server_error`` / ``api_error``."""
        message = (
            "The server is overloaded or not ready yet."
            if status == 503
            else "The server had an error while processing your request. Sorry about that!"
        )
        return cls.fault(
            status,
            message,
            error_type="server_error",
            anthropic_error_type="api_error",
            anthropic_message="Internal server error",
        )

    @classmethod
    def timeout(cls, delay_s: float = 5.0, content: str = "late answer") -> Reply:
        """A success that arrives after ``delay_s``: a client with a shorter timeout gives up."""
        return cls(content=content, finish_reason="stop", delay_s=delay_s)

    @classmethod
    def connection_dropped(cls) -> Reply:
        """The server closes the connection without answering."""
        return cls(drop_connection=True)

    @classmethod
    def stream_broken(cls, content: str) -> Reply:
        """A streamed answer that breaks with a server error after its first chunk."""
        return cls(
            content=content,
            stream_breaks=True,
            error_type="server_error",
            error_message="The server had an error while processing your request.",
        )


def _anthropic_type_for(status: int) -> str:
    """Anthropic's documented ``error.type`` for an HTTP status."""
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        402: "billing_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        504: "timeout_error",
        529: "overloaded_error",
    }.get(status, "api_error")


def _default_faults() -> tuple[Reply, ...]:
    return (
        Reply.rate_limited(retry_after_s=0.5),
        Reply.server_error(503),
        Reply.overloaded(),
        Reply.server_error(500),
    )


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Seeded random fault injection for requests that no script answers.

    Each such request fails with probability ``rate``, with a fault drawn
    from ``faults``; the same seed gives the same sequence of outcomes.
    """

    rate: float = 0.05
    seed: int = 0
    faults: tuple[Reply, ...] = field(default_factory=_default_faults)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            msg = f"FaultPlan.rate must be within [0, 1], got {self.rate!r}"
            raise ValueError(msg)
        if not self.faults:
            msg = "FaultPlan.faults must name at least one fault reply"
            raise ValueError(msg)
