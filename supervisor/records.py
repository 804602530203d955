"""Frozen records that flow between the stages of the sidecar.

This module is the contract between ingest, normalization, classification,
decision and delivery. It imports nothing of ours, so ``policies`` can judge
records without pulling in any I/O, and every stage can be tested on its own.

Ids are lowercase hex strings (32 characters for a trace, 16 for a span), as
the ``replay`` output and trace viewers show them. A missing parent is ``""``.

Every record is a frozen, slotted dataclass: it cannot change once made, and
it can be handed to another thread or stage without a copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from types import MappingProxyType
from typing import Final, Union

#: An attribute value as OTLP carries it, converted to plain Python.
AttrValue = Union[  # noqa: UP007 - a recursive alias needs Union on Python 3.10
    str, bool, int, float, bytes, None, tuple["AttrValue", ...], Mapping[str, "AttrValue"]
]

_EMPTY: Final[Mapping[str, AttrValue]] = MappingProxyType({})


#: gRPC status code names → numbers (google.rpc.Code).
GRPC_CODES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "OK": 0,
        "CANCELLED": 1,
        "CANCELED": 1,
        "UNKNOWN": 2,
        "INVALID_ARGUMENT": 3,
        "DEADLINE_EXCEEDED": 4,
        "NOT_FOUND": 5,
        "ALREADY_EXISTS": 6,
        "PERMISSION_DENIED": 7,
        "RESOURCE_EXHAUSTED": 8,
        "FAILED_PRECONDITION": 9,
        "ABORTED": 10,
        "OUT_OF_RANGE": 11,
        "UNIMPLEMENTED": 12,
        "INTERNAL": 13,
        "UNAVAILABLE": 14,
        "DATA_LOSS": 15,
        "UNAUTHENTICATED": 16,
    }
)


class Role(str, Enum):
    """What a span does in the agent, whatever convention named it."""

    LLM = "llm"
    TOOL = "tool"
    AGENT = "agent"
    CHAIN = "chain"
    HTTP = "http"
    OTHER = "other"


class FailureClass(str, Enum):
    """The four classes of failure, by what would get past one.

    ``transient``: trying again later; ``model``: changing the model's input or
    the model; ``permanent``: someone changing something; ``semantic``: the call
    succeeded, but its result is wrong or a person must decide.
    """

    TRANSIENT = "transient"
    MODEL = "model"
    PERMANENT = "permanent"
    SEMANTIC = "semantic"


#: Built-in failure kinds, the names rules and decisions use. A policy may add its own.
BUILTIN_KINDS: Final[tuple[str, ...]] = (
    "rate_limit",
    "quota_exhausted",
    "timeout",
    "connection",
    "unavailable",
    "auth",
    "permission",
    "not_found",
    "invalid_request",
    "content_policy",
    "context_overflow",
    "output_truncated",
    "parse_error",
    "invalid_tool_call",
    "reasoning_loop",
    "stall",
    "verification_failed",
    "budget_exceeded",
    "budget_forecast",
    "goal_drift",
    "approval_required",
    "tool_error",
    "unknown",
)


class Action(str, Enum):
    """What the sidecar decides to do about a failure."""

    RETRY = "retry"
    FALLBACK = "fallback"
    FAIL_FAST = "fail_fast"
    ESCALATE = "escalate"
    REMEDIATE = "remediate"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class ErrorEvidence:
    """Everything a span says about a failure, in one place.

    Built only for spans that show some sign of failure, so spans that
    succeed pay nothing for it. Strings are ``""`` when absent.
    """

    #: The span's status is ERROR.
    status_error: bool = False
    status_message: str = ""
    #: From the first ``exception`` event, or parsed from the status message.
    exception_type: str = ""
    exception_message: str = ""
    #: The ``error.type`` attribute (semconv), verbatim.
    error_type: str = ""
    http_status: int | None = None
    #: Numeric gRPC status code (0..16).
    grpc_code: int | None = None
    #: A provider's own error code or type found in the body, e.g.
    #: ``insufficient_quota``, ``rate_limit_exceeded``, ``overloaded_error``,
    #: ``context_length_exceeded``, ``content_filter``.
    provider_code: str = ""
    #: Finish/stop reasons reported by an LLM response.
    finish_reasons: tuple[str, ...] = ()
    #: The evidence came from the output of a span whose status is OK
    #: (a tool that caught its own exception and returned an error message).
    swallowed: bool = False
    #: A server-requested delay before retrying, in seconds, when the span
    #: carries one (a header or the provider's own words).
    retry_after_s: float | None = None
    #: Tool calls requested by an LLM response to tools it was not offered,
    #: or with arguments that are not valid JSON.
    invalid_tool_calls: tuple[str, ...] = ()
    #: An LLM call whose streamed response had begun (chunks reached the agent)
    #: when it failed: no fallback can take them back (:mod:`supervisor.normalize.streaming`).
    stream_began: bool = False

    def text(self) -> str:
        """All free-text evidence, for message matching."""
        return " | ".join(part for part in (self.exception_message, self.status_message) if part)


@dataclass(frozen=True, slots=True)
class RateLimitHeaders:
    """What a provider's rate-limit headers said on one response (OK or not).

    OpenAI's ``x-ratelimit-*`` and Anthropic's ``anthropic-ratelimit-*``, as an
    instrumentation captured them or the agent recorded them; read by
    :mod:`supervisor.normalize.ratelimits`. Limits are a minute's.
    """

    limit_requests: int | None = None
    #: The total tokens limit, else (Anthropic) the input tokens one.
    limit_tokens: int | None = None
    #: A limit's ``remaining`` was 0: seconds until its reset (the longest such).
    exhausted_for_s: float | None = None


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One span, normalized from whatever convention produced it.

    Made for the spans that may be failures and the ones a verifier reads
    (:meth:`supervisor.normalize.span.Span.record`); every other stage reads
    the span's view.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    #: OTLP SpanKind as an integer (0 unspecified .. 5 consumer).
    kind: int
    start_ns: int
    end_ns: int
    role: Role
    #: Conventions recognised on the span, e.g. ``("openinference",)``.
    conventions: tuple[str, ...] = ()
    #: ``provider:model`` for LLM calls, ``tool:<name>`` for tools,
    #: ``http:<host>`` for plain HTTP, ``""`` when unknown.
    dependency: str = ""
    provider: str = ""
    model: str = ""
    tool_name: str = ""
    #: Short stable digest of the tool call's arguments (``""`` if none).
    tool_args_digest: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    #: The span's output text when it carries one (bounded in length). A
    #: LangChain ``ToolMessage`` a tool returned is read for its content.
    output_text: str = ""
    #: Whether the span carries its output at all. False when the
    #: instrumentation did not record it (content capture off, the default of
    #: the OTel GenAI instrumentations; OpenInference's ``hide_outputs``): then
    #: an empty ``output_text`` says nothing of what the output was.
    output_recorded: bool = True
    #: The LLM response asked for tool calls: with no text, it is a step, not an
    #: empty answer.
    calls_tools: bool = False
    #: ``gen_ai.conversation.id`` / ``session.id`` when present, else ``""``.
    session_id: str = ""
    #: ``None`` when the span shows no sign of failure.
    error: ErrorEvidence | None = None
    #: The provider's rate-limit headers, when the span recorded any.
    rate_limits: RateLimitHeaders | None = None
    #: The span's attributes, read-only, for policies that match on them.
    attributes: Mapping[str, AttrValue] = field(default_factory=lambda: _EMPTY)
    resource_attributes: Mapping[str, AttrValue] = field(default_factory=lambda: _EMPTY)
    #: The name of the credential the call used (``spanvisor.credential``), else ``""``.
    credential: str = ""

    @property
    def says_nothing(self) -> bool:
        """The output was recorded, and is empty: no text and no tool call.

        The one test of an empty output, for every verifier and detector: an
        output that was not recorded is not empty, and an answer that only
        calls tools is not an empty answer.
        """
        text = self.output_text
        return self.output_recorded and not self.calls_tools and (not text or text.isspace())

    @property
    def run_id(self) -> str:
        """The span's own run (:func:`own_run`); the run tracker may know its trace's session."""
        return own_run(self.trace_id, self.session_id)


def breaker_key(dependency: str, credential: str) -> str:
    """A breaker's key: ``provider:model@credential`` for a call that names its credential,
    else the dependency (one exhausted API key must not open the breaker of the others)."""
    return f"{dependency}@{credential}" if credential and dependency else dependency


def own_run(trace_id: str, session_id: str) -> str:
    """A span's own run: the session it names, else its trace.

    The one rule; :meth:`supervisor.runs.RunTracker.resolve` adds what a trace
    named in its other spans.
    """
    return session_id or trace_id


#: Dependency keys that name something other than a model: ``tool:<name>``, ``http:<host>``.
NON_MODEL_PREFIXES: Final[tuple[str, ...]] = ("tool", "http")
#: What a model dependency key says when the span named no provider or no model.
UNKNOWN_PART: Final = "unknown"


def model_dependency(provider: str, model: str) -> str:
    """The ``provider:model`` key of an LLM call (``""`` when neither is known).

    The one spelling of the key (:attr:`SpanRecord.dependency`);
    :func:`split_model_dependency` reads it back.
    """
    if not provider and not model:
        return ""
    return f"{provider or UNKNOWN_PART}:{model or UNKNOWN_PART}"


def split_model_dependency(dependency: str) -> tuple[str, str] | None:
    """``(provider, model)`` of a ``provider:model`` key; ``None`` for a tool, host or ``""``.

    The model is what the agent's SDK calls it: ``openai:gpt-4o-mini`` gives
    ``("openai", "gpt-4o-mini")``; a model name may hold colons itself
    (``ollama:llama3:8b`` gives ``("ollama", "llama3:8b")``), a provider name
    never does. A part the span did not name comes back as ``""``.
    """
    provider, sep, model = dependency.partition(":")
    if not sep or provider in NON_MODEL_PREFIXES or not (provider or model):
        return None
    return (
        "" if provider == UNKNOWN_PART else provider,
        "" if model == UNKNOWN_PART else model,
    )


@dataclass(frozen=True, slots=True)
class Classification:
    """The verdict of a classification rule on one span."""

    failure_class: FailureClass
    kind: str
    dependency: str
    rule: str


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure, reported once, at the span where it originates."""

    trace_id: str
    span_id: str
    parent_span_id: str
    service: str
    span_name: str
    run_id: str
    role: Role
    failure_class: FailureClass
    kind: str
    dependency: str
    rule: str
    #: A one-line human summary of the evidence (bounded).
    message: str
    evidence: ErrorEvidence
    #: When the sidecar received the span (unix ns).
    received_ns: int
    #: Span ids of ancestors that only propagated this failure.
    attributed: tuple[str, ...] = ()
    #: What a run detector found (repeats, idle seconds, unverified work); empty otherwise.
    details: Mapping[str, AttrValue] = field(default_factory=lambda: _EMPTY)
    #: The service's run SLO was burning its error budget fast when this was decided.
    slo_burning: bool = False
    #: The name of the credential the failed call used, else ``""``: its breaker's key.
    credential: str = ""

    @property
    def breaker_key(self) -> str:
        """The breaker the failure counts for (:func:`breaker_key`)."""
        return breaker_key(self.dependency, self.credential)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy says to do about one failure.

    ``params`` holds the action's parameters (for ``retry``: ``attempt``,
    ``max_attempts``, ``delay_s``; for ``fallback``: ``chain``...).
    """

    action: Action
    #: Name of the policy entry that produced the decision.
    policy: str
    params: Mapping[str, AttrValue] = field(default_factory=lambda: _EMPTY)
    reason: str = ""
    #: True when the decision is computed and reported but not delivered.
    observe_only: bool = False


class CommandType(str, Enum):
    """What a command asks the agent to do (the ``type`` of a command's JSON)."""

    RETRY_STEP = "retry_step"
    RESUME_RUN = "resume_run"
    REWIND_RUN = "rewind_run"
    SWITCH_FALLBACK = "switch_fallback"
    PAUSE_RUN = "pause_run"
    ABORT_RUN = "abort_run"
    INJECT_GUIDANCE = "inject_guidance"
    COMPACT_CONTEXT = "compact_context"
    APPROVAL_RESULT = "approval_result"


def command_key(trace_id: str, span_id: str, rule: str, step: str = "") -> str:
    """The idempotency key of a command: a digest of what triggered it.

    The same triggering span and rule always give the same key, so a span seen
    twice (an exporter re-sending, a sidecar restarted mid-way) cannot make a
    second command. ``step`` tells apart the commands one failure leads to in
    turn (``"approval_result"`` after ``"pause_run"``).
    """
    text = f"{trace_id}/{span_id}/{rule}/{step}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(text).hexdigest()[:32]


#: What a remediator may be allowed to do to the agent (each becomes a command or,
#: for ``request_approval``, an approval request to a person).
REMEDIATION_AGENT_TOOLS: Final[frozenset[str]] = frozenset(
    {
        "retry_step",
        "resume_run",
        "rewind_run",
        "switch_fallback",
        "pause_run",
        "abort_run",
        "inject_guidance",
        "compact_context",
        "request_approval",
    }
)
#: What a remediator may read: never the store or the receivers themselves.
REMEDIATION_READ_TOOLS: Final[frozenset[str]] = frozenset(
    {"recent_spans", "incident_history", "breaker_states"}
)
REMEDIATION_TOOLS: Final[frozenset[str]] = REMEDIATION_AGENT_TOOLS | REMEDIATION_READ_TOOLS
#: How a remediation ends (the ``spanvisor.remediation.outcome`` attribute).
REMEDIATION_OUTCOMES: Final[tuple[str, ...]] = ("succeeded", "failed", "escalated", "refused")
#: What a remediation takes for its run's recovery besides a success of the failed
#: dependency: the run's root span ending OK. Watched beside dependencies, and spelled
#: as none is (every dependency has a colon).
RUN_ENDED_OK: Final = "run ended ok"
#: The states of a remediation's durable workflow (DBOS's), which it can be listed by.
#: How a run is listed (``GET /v1/runs``), as :func:`supervisor.runs.phase.status` says.
RUN_STATUSES: Final[tuple[str, ...]] = (
    "running",
    "failing",
    "waiting",
    "stalled",
    "paused",
    "ended",
)

REMEDIATION_STATUSES: Final[tuple[str, ...]] = (
    "PENDING",
    "ENQUEUED",
    "DELAYED",
    "SUCCESS",
    "ERROR",
    "CANCELLED",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED",
)


def remediation_ids(trace_id: str, span_id: str, rule: str) -> tuple[str, str]:
    """The remediation's workflow id and trace id (hex) for a triggering span and rule.

    Both derive from the trigger, so the same span and rule never start a
    second remediation, and the decision span can name the remediation's
    trace before it exists (a restarted sidecar re-creates the same trace).
    """
    key = command_key(trace_id, span_id, rule, "remediate")
    trace = hashlib.sha256(f"trace/{key}".encode()).hexdigest()[:32]
    return f"rem_{key[:24]}", trace


@dataclass(frozen=True, slots=True)
class Command:
    """One instruction to an agent, as delivered (webhook body, pull answer, command env).

    ``not_before`` is when it may be delivered (unix seconds): the sidecar
    keeps delays itself, so the agent is never asked to block.
    """

    id: str
    idempotency_key: str
    type: CommandType
    service: str
    run_id: str
    trigger_trace_id: str
    trigger_span_id: str
    #: ``class``, ``kind``, ``dependency``, ``rule``, ``message`` of the failure (may be empty).
    failure: Mapping[str, AttrValue]
    params: Mapping[str, AttrValue]
    not_before: float
    created_at: float

    def to_json(self) -> dict[str, object]:
        """The command as agents receive it, by webhook or pull (times as RFC 3339 UTC)."""
        return {
            "id": self.id,
            "idempotency_key": self.idempotency_key,
            "type": self.type.value,
            "service": self.service,
            "run_id": self.run_id,
            "trigger": {"trace_id": self.trigger_trace_id, "span_id": self.trigger_span_id},
            "failure": dict(self.failure),
            "params": _jsonable(self.params),
            "not_before": _rfc3339(self.not_before),
            "created_at": _rfc3339(self.created_at),
        }


def _rfc3339(unix_s: float) -> str:
    """``2024-05-01T12:00:00.250Z``: UTC, to the millisecond."""
    when = datetime.fromtimestamp(unix_s, tz=timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(value: object) -> object:
    """Tuples and read-only mappings as JSON lists and objects."""
    if isinstance(value, (str, int, float)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value
