"""The policy file's schema: pydantic models that validate, nothing that runs.

Shape (``default_policy.yaml`` documents every key with comments)::

    version: 1
    builtin: true            # layer on top of the built-in policy (false drops it)
    observe: false           # true: every decision is computed and reported, not delivered
    rules:                   # classification, ordered, first match wins
      - name: my.rule
        match: {exception_type: "*Timeout*", role: tool}
        class: transient
        kind: timeout
    policies:                # decisions, ordered, first match wins
      - name: my.retry
        match: {kind: timeout}
        action: retry
        max_attempts: 3

Every model forbids unknown keys and is strict (``"3"`` is not ``3``, ``1`` is
not ``true``), every float must be finite and every knob has a finite bound,
so a typo fails at load with its path instead of changing behaviour quietly.
Regexes, globs, status codes and templates are checked by the field types of
:mod:`policies._schema_fields`, where pydantic can report the field path; the
budget and verifier sections are declared in :mod:`policies._schema_budgets`
and :mod:`policies._schema_verifiers`. Nothing here imports the code that runs
a policy: :mod:`policies._compile` and the others import these models and turn
them into callables.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema, model_validator

from policies._schema_admission import AdmissionLimitSpec, AdmissionSpec
from policies._schema_budgets import (
    ContextPressureSpec,
    ModelInfoSpec,
    RunBudgetSpec,
    ServiceBudgets,
    ServiceBudgetSpec,
    SloSpec,
)
from policies._schema_fields import (
    MAX_ATTEMPTS,
    MAX_ITEMS,
    MAX_RETRY_AFTER_S,
    MAX_SECONDS,
    AttrCondition,
    Classes,
    ClassName,
    DependencyKey,
    Description,
    Glob,
    Globs,
    GrpcCodes,
    HttpStatuses,
    Ident,
    JitterName,
    Kind,
    Kinds,
    Name,
    Regexes,
    Roles,
    SimpleActionName,
    Template,
    Version,
    Words,
    _Strict,
)
from policies._schema_verifiers import (
    AttributeRangeSpec,
    OutputRegexSpec,
    VerifierMatch,
    Verifiers,
    VerifierSpec,
)


class RuleMatch(_Strict):
    """Conditions of a classification rule: all must hold; a list holds if any item does.

    An empty match holds for every failing span (a catch-all).
    """

    exception_type: Globs | None = Field(
        default=None, description="Globs on the exception type, full dotted name or its last part."
    )
    error_type: Globs | None = Field(
        default=None, description="Globs on the `error.type` attribute, full or last dotted part."
    )
    message: Regexes | None = Field(
        default=None,
        description="Regexes searched in the exception message and the status message.",
    )
    http_status: HttpStatuses | None = Field(
        default=None,
        description="Codes (429), classes ('5xx') or ranges ('500-599', [[500, 599]]).",
    )
    grpc_code: GrpcCodes | None = Field(default=None, description="Numbers or names (UNAVAILABLE).")
    provider_code: Globs | None = Field(
        default=None, description="The provider's own error code/type, e.g. insufficient_quota."
    )
    finish_reason: Words | None = Field(
        default=None, description="Finish/stop reasons, compared case-insensitively."
    )
    role: Roles | None = None
    service: Globs | None = None
    dependency: Globs | None = None
    span_name: Globs | None = None
    attributes: Annotated[dict[str, AttrCondition], Field(max_length=64)] | None = Field(
        default=None, description="Span attributes: {key: exact scalar | {regex: pattern}}."
    )
    swallowed: bool | None = Field(
        default=None, description="The error was found in the output of a span whose status is OK."
    )
    invalid_tool_call: bool | None = Field(
        default=None,
        description="The LLM asked for tools it was not offered or sent invalid arguments.",
    )


class Rule(_Strict):
    """One classification rule: when ``match`` holds, the span fails with ``class``/``kind``."""

    name: Name
    description: Description | None = None
    match: RuleMatch = Field(default_factory=RuleMatch)
    failure_class: ClassName = Field(alias="class")
    kind: Kind
    dependency: Template | None = Field(
        default=None,
        description="Override the dependency key; may use {dependency}, {service}, {provider},"
        " {model}, {tool}.",
    )


class DecisionMatch(_Strict):
    """Conditions of a decision entry, on the classified failure; all must hold."""

    failure_class: Classes | None = Field(default=None, alias="class")
    kind: Kinds | None = None
    dependency: Globs | None = None
    service: Globs | None = None
    role: Roles | None = None
    rule: Globs | None = None
    slo_burning: bool | None = Field(
        default=None,
        description="True: only while the service's run SLO burns its error budget fast"
        " (both windows); false: only while it does not.",
    )


class FixedWait(_Strict):
    """The same delay before every retry (tenacity ``wait_fixed``)."""

    type: Literal["fixed"]
    seconds: float = Field(default=1.0, ge=0, le=MAX_SECONDS)
    jitter: JitterName = "none"


class ExponentialWait(_Strict):
    """``multiplier * exp_base ** (attempt - 1)`` within [min, max] (tenacity ``wait_exponential``).

    ``random_exponential`` is tenacity's name for the same schedule with full jitter.
    Jitter defaults to ``full`` (AWS's "full jitter"), which spreads a herd of
    clients that failed together.
    """

    # Left out, it is ``exponential`` (see ``_default_wait_type``).
    type: Literal["exponential", "random_exponential"] = "exponential"
    multiplier: float = Field(default=1.0, gt=0, le=MAX_SECONDS)
    min: float = Field(default=0.0, ge=0, le=MAX_SECONDS)
    max: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    exp_base: float = Field(default=2.0, gt=1, le=10)
    jitter: JitterName | None = None

    @model_validator(mode="after")
    def _coherent(self) -> ExponentialWait:
        if self.min > self.max:
            raise ValueError(f"wait.min ({self.min}) is above wait.max ({self.max})")
        if self.type == "random_exponential" and self.jitter not in (None, "full"):
            raise ValueError(
                "random_exponential always uses full jitter; use type: exponential"
                f" with jitter: {self.jitter}"
            )
        return self


def _default_wait_type(value: object) -> object:
    """A ``wait:`` without ``type`` is exponential (the union needs its tag to pick a model)."""
    if isinstance(value, dict) and "type" not in value:
        return {**value, "type": ExponentialWait.model_fields["type"].default}
    return value


def _action_shorthand(value: object) -> object:
    """``on_exhausted: escalate`` is short for ``on_exhausted: {action: escalate}``."""
    if isinstance(value, str):
        return {"action": value}
    return value


#: The actions ``on_exhausted:`` may name alone: those that need no other key
#: (``remediate`` needs its ``remediator``).
ShorthandAction = Literal["fallback", "escalate", "fail_fast", "none"]


Wait = Annotated[
    Annotated[FixedWait | ExponentialWait, Field(discriminator="type")],
    BeforeValidator(_default_wait_type),
]


class FallbackSpec(_Strict):
    """Switch to the next dependency in the chain that the failed one belongs to."""

    action: Literal["fallback"]
    chain: Annotated[
        dict[Glob, Annotated[list[DependencyKey], Field(min_length=1, max_length=32)]],
        Field(max_length=MAX_ITEMS),
    ] = Field(
        default_factory=dict,
        description="Dependency glob -> ordered alternatives; the first matching glob wins.",
    )
    on_exhausted: Exhausted = Field(
        default_factory=lambda: EscalateSpec(action="escalate"),
        description="What to do when there is no alternative left.",
    )


class RemediateSpec(_Strict):
    """Dispatch a remediation sub-agent by name."""

    action: Literal["remediate"]
    remediator: Ident


class SimpleSpec(_Strict):
    """An action without parameters (``fail_fast``, ``none``)."""

    action: SimpleActionName


#: How long an escalation's pause lasts when nobody answers, by default: an hour.
DEFAULT_ESCALATION_TIMEOUT_S = 3600.0


class EscalateSpec(_Strict):
    """Pause the run and ask a person; the pause ends after ``timeout_s`` without an answer.

    The decision carries ``pause_timeout_s`` and ``on_timeout``, which the
    ``pause_run`` command passes on: every pause has a deadline and a stated
    outcome (``abort``: the run is aborted; ``resume``: it goes on as if approved).
    """

    action: Literal["escalate"]
    timeout_s: float = Field(
        default=DEFAULT_ESCALATION_TIMEOUT_S,
        gt=0,
        le=7 * 86_400,
        description="How long the run stays paused waiting for a person.",
    )
    on_timeout: Literal["abort", "resume"] = Field(
        default="abort", description="What happens to the run when nobody answered in time."
    )


_ExhaustedSpec = Annotated[
    FallbackSpec | RemediateSpec | EscalateSpec | SimpleSpec, Field(discriminator="action")
]
Exhausted = Annotated[
    _ExhaustedSpec,
    BeforeValidator(_action_shorthand, json_schema_input_type=ShorthandAction | _ExhaustedSpec),
]


class RetrySpec(_Strict):
    """Retry the step after a delay, up to ``max_attempts`` attempts in all."""

    action: Literal["retry"]
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=MAX_ATTEMPTS,
        description="Attempts in all, the failed first one included.",
    )
    wait: Wait = Field(default_factory=lambda: ExponentialWait(type="exponential"))
    honour_retry_after: bool = True
    max_retry_after_s: float = Field(default=60.0, ge=0, le=MAX_RETRY_AFTER_S)
    on_exhausted: Exhausted = Field(default_factory=lambda: EscalateSpec(action="escalate"))


class _EntryBase(_Strict):
    name: Name
    description: Description | None = None
    match: DecisionMatch = Field(default_factory=DecisionMatch)
    observe: bool = Field(
        default=False, description="Compute and report the decision, do not deliver it."
    )


class RetryEntry(_EntryBase, RetrySpec):
    """A decision entry whose action is ``retry``."""


class FallbackEntry(_EntryBase, FallbackSpec):
    """A decision entry whose action is ``fallback``."""


class RemediateEntry(_EntryBase, RemediateSpec):
    """A decision entry whose action is ``remediate``."""


class EscalateEntry(_EntryBase, EscalateSpec):
    """A decision entry whose action is ``escalate``."""


class SimpleEntry(_EntryBase, SimpleSpec):
    """A decision entry whose action is ``fail_fast`` or ``none``."""


Entry = Annotated[
    RetryEntry | FallbackEntry | RemediateEntry | EscalateEntry | SimpleEntry,
    Field(discriminator="action"),
]
ActionSpec = RetrySpec | FallbackSpec | RemediateSpec | EscalateSpec | SimpleSpec


class BreakerSpec(_Strict):
    """A circuit breaker: ``fail_max`` transient failures in a row open it for ``reset_timeout_s``.

    With ``slow_call_s`` set, so does a share ``slow_call_rate`` of slow calls
    among its last ``min_calls`` calls (a dependency that answers, too slowly).

    Only transient failures count (a 401 or a 404 says nothing of the
    dependency's health). Half-open, it admits ``half_open_trials`` trial
    calls: ``success_threshold`` successes close it, and it opens again only
    once the failed trials make that threshold out of reach. Runs paused
    behind it resume in turn: ``half_open_trials`` of them when it half-opens,
    the rest spread over the ``resume_spread_s`` that follow.
    """

    fail_max: int = Field(default=5, ge=1, le=10_000)
    reset_timeout_s: float = Field(default=30.0, gt=0, le=86_400)
    success_threshold: int = Field(
        default=2, ge=1, le=10_000, description="Trial successes that close a half-open breaker."
    )
    half_open_trials: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="Trial calls a half-open breaker admits (and paused runs resumed first);"
        " unset: success_threshold + 1.",
    )
    resume_spread_s: float = Field(
        default=30.0,
        ge=0,
        le=86_400,
        description="Runs paused behind an open breaker beyond the first trials resume"
        " spread over this many seconds after it half-opens.",
    )
    slow_call_s: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description="A call (span) that lasts at least this many seconds is slow; unset:"
        " durations do not count.",
    )
    slow_call_rate: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="The breaker opens (reason slow_calls) once this share of its last"
        " min_calls calls were slow (with slow_call_s set).",
    )
    min_calls: int = Field(
        default=10, ge=1, le=10_000, description="Calls the slow-call rate is taken over."
    )

    @property
    def trials(self) -> int:
        """``half_open_trials``, or one more than ``success_threshold`` when unset."""
        return self.half_open_trials or self.success_threshold + 1

    @model_validator(mode="after")
    def _coherent(self) -> BreakerSpec:
        if self.half_open_trials is not None and self.success_threshold > self.half_open_trials:
            raise ValueError(
                f"success_threshold ({self.success_threshold}) is above half_open_trials"
                f" ({self.half_open_trials}): the breaker could never close"
            )
        return self


class BreakersSpec(_Strict):
    """One breaker per dependency, fed by every run's spans."""

    enabled: bool = True
    default: BreakerSpec = Field(default_factory=BreakerSpec)
    dependencies: Annotated[dict[Glob, BreakerSpec], Field(max_length=256)] = Field(
        default_factory=dict, description="Per dependency glob; the first matching glob wins."
    )


class RetryBudgetSpec(_Strict):
    """Envoy's retry budget: retries at most ``ratio`` of recent calls, never below a floor."""

    enabled: bool = True
    ratio: float = Field(default=0.2, gt=0, le=10)
    min_retries: int = Field(
        default=3, ge=0, le=1_000_000, description="Retries always allowed per window."
    )
    window_s: float = Field(default=10.0, ge=1, le=3600)


class RestartIntensitySpec(_Strict):
    """Erlang's restart intensity, per step: more corrective actions than this escalate.

    Counted per run and dependency (the step that keeps failing), not per run:
    independent faults spread over a run's many calls are not a run that fails
    to recover. Retries, fallbacks and pause/resume cycles behind an open
    breaker count; the escalation pauses the run for ``escalation`` limits.
    """

    enabled: bool = True
    max_actions: int = Field(
        default=10,
        ge=1,
        le=10_000,
        description="Corrective actions for one dependency in one run within period_s.",
    )
    period_s: float = Field(default=60.0, gt=0, le=86_400)
    timeout_s: float = Field(
        default=DEFAULT_ESCALATION_TIMEOUT_S,
        gt=0,
        le=7 * 86_400,
        description="How long the escalation's pause waits for a person.",
    )
    on_timeout: Literal["abort", "resume"] = Field(
        default="abort", description="What happens to the run when nobody answered in time."
    )


#: Remediators that ship with spanvisor (``remediators.builtin``).
BUILTIN_REMEDIATORS: tuple[str, ...] = (
    "retry_step",
    "fallback_switch",
    "loop_breaker",
    "rewind",
    "escalate",
    "restart_worker",
    "llm",
    "compact_context",
    "resume_run",
    "reanchor",
)
ToolName = Literal[
    "retry_step",
    "resume_run",
    "rewind_run",
    "switch_fallback",
    "pause_run",
    "abort_run",
    "inject_guidance",
    "compact_context",
    "request_approval",
    "recent_spans",
    "incident_history",
    "breaker_states",
    "restart_worker",
]
_REMEDIATOR_USE = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?")
_MAX_USE_LEN = 256


def _check_use(value: str) -> str:
    if len(value) > _MAX_USE_LEN or not _REMEDIATOR_USE.fullmatch(value):
        raise ValueError(
            f"bad remediator {value!r}: a built-in or entry-point name, or 'package.module:Class'"
        )
    return value


class RemediatorBudgetSpec(_Strict):
    """What one remediation may spend before it stops and escalates."""

    steps: int = Field(default=12, ge=1, le=1000, description="Durable steps in all.")
    tool_calls: int = Field(default=6, ge=1, le=1000, description="Tool calls, refused ones too.")
    deadline_s: float = Field(default=600.0, gt=0, le=7 * 86_400)
    tokens: int = Field(default=40_000, ge=0, le=10_000_000, description="LLM remediators only.")


class RemediatorSpec(_Strict):
    """A named remediator: which implementation, which tools, what budget."""

    use: Annotated[
        str,
        AfterValidator(_check_use),
        WithJsonSchema(
            {
                "type": "string",
                "maxLength": _MAX_USE_LEN,
                "pattern": f"^{_REMEDIATOR_USE.pattern}$",
            }
        ),
    ] = Field(description="A built-in or entry-point name, or 'package.module:Class'.")
    tools: Annotated[list[ToolName], Field(max_length=16)] | None = Field(
        default=None,
        description="Allowlist; unset: the remediator's own. Never wider than its own.",
    )
    budget: RemediatorBudgetSpec = Field(default_factory=RemediatorBudgetSpec)
    params: Annotated[dict[Ident, Any], Field(max_length=64)] = Field(default_factory=dict)
    verify_window_s: float = Field(
        default=120.0,
        ge=0,
        le=86_400,
        description="How long to watch the run's later spans for a recovery after acting.",
    )
    on_unresolved: Literal["escalate", "abort_run", "none"] = Field(
        default="escalate", description="What follows when no recovery comes in time."
    )


class LoopsSpec(_Strict):
    """The same tool call (or LLM output) ``repeats`` times within the last ``window``."""

    enabled: bool = True
    repeats: int = Field(default=3, ge=2, le=1000)
    window: int = Field(default=20, ge=2, le=1000, description="The run's last N calls.")


class StallsSpec(_Strict):
    """An open run silent for longer than its service's rhythm allows (or ``idle_seconds``)."""

    enabled: bool = True
    idle_seconds: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86_400,
        description="A fixed silence that is a stall; unset: idle_multiple times the longest"
        " silence seen between the run's (or its service's) spans, within min/max_idle_s.",
    )
    idle_multiple: float = Field(default=4.0, ge=1, le=1000)
    min_idle_s: float = Field(default=30.0, gt=0, le=7 * 86_400)
    max_idle_s: float = Field(default=600.0, gt=0, le=7 * 86_400)

    @model_validator(mode="after")
    def _ordered(self) -> StallsSpec:
        if self.min_idle_s > self.max_idle_s:
            raise ValueError("min_idle_s must not exceed max_idle_s")
        return self


class CascadesSpec(_Strict):
    """A dependency failing across runs: ``min_failures`` from ``min_runs`` runs in the window."""

    enabled: bool = True
    window_s: float = Field(default=60.0, gt=0, le=86_400)
    min_failures: int = Field(default=10, ge=2, le=1_000_000)
    min_runs: int = Field(default=3, ge=2, le=100_000)
    min_error_rate: float = Field(default=0.5, gt=0, le=1)


class ReanchorSpec(_Strict):
    """Remind a long run of its objective (its first input) every ``every_steps`` steps."""

    enabled: bool = True
    after_steps: int = Field(default=20, ge=1, le=1_000_000, description="LLM and tool calls.")
    after_minutes: float | None = Field(default=None, gt=0, le=7 * 1440)
    every_steps: int = Field(default=10, ge=1, le=1_000_000)


class ServiceDetectorsSpec(_Strict):
    loops: LoopsSpec | None = None
    stalls: StallsSpec | None = None
    reanchor: ReanchorSpec | None = Field(
        default=None, description="Unset: runs are not reminded of their objective."
    )


class DetectorsSpec(ServiceDetectorsSpec):
    """Run detectors for every service; ``services`` overrides by service glob."""

    services: dict[Glob, ServiceDetectorsSpec] = Field(default_factory=dict, max_length=256)
    cascades: CascadesSpec | None = Field(
        default=None, description="Across runs, not per service: one dependency failing for many."
    )


Fallbacks = Annotated[
    dict[
        Glob,
        Annotated[
            list[DependencyKey],
            Field(min_length=1, max_length=32, json_schema_extra={"uniqueItems": True}),
        ],
    ],
    Field(max_length=MAX_ITEMS),
]
"""``fallbacks:``: dependency glob -> ordered alternatives. A key that lists
itself, or an alternative listed twice, is refused at load (with its path)."""


class PolicyFile(_Strict):
    """A spanvisor policy file (``version: 1``)."""

    version: Version
    builtin: bool = Field(
        default=True, description="Layer this file on top of the built-in policy; false drops it."
    )
    observe: bool = Field(
        default=False, description="Every decision is observe-only (shadow mode)."
    )
    rules: Annotated[list[Rule], Field(max_length=1000)] = Field(default_factory=list)
    policies: Annotated[list[Entry], Field(max_length=1000)] = Field(default_factory=list)
    breakers: BreakersSpec | None = Field(
        default=None, description="Unset: the built-in policy's (or the defaults)."
    )
    fallbacks: Fallbacks = Field(
        default_factory=dict,
        description="Dependency glob -> ordered alternatives, declared once: every decision"
        " that falls back (fallback entries without a chain, an open breaker, a spent retry"
        " budget) follows it.",
    )
    retry_budget: RetryBudgetSpec | None = None
    restart_intensity: RestartIntensitySpec | None = None
    admission: AdmissionSpec | None = Field(
        default=None, description="Limits per provider, model and credential; unset: built-in's."
    )
    remediators: Annotated[dict[Ident, RemediatorSpec], Field(max_length=256)] = Field(
        default_factory=dict, description="Named remediators for 'remediate' actions."
    )
    detectors: DetectorsSpec | None = Field(
        default=None, description="Run detectors (loops, stalls); unset: the built-in policy's."
    )
    context_pressure: ContextPressureSpec | None = Field(
        default=None, description="Predict context overflows; unset: the built-in policy's."
    )
    run_budget: RunBudgetSpec | None = Field(
        default=None, description="Tokens and cost one run may spend; unset: the built-in's."
    )
    service_budgets: ServiceBudgets = Field(
        default_factory=dict,
        description="Service glob -> tokens and cost all its runs may spend over a window;"
        " first match wins.",
    )
    slo: SloSpec | None = Field(
        default=None,
        description="Run SLO per service (success, duration, cost) with burn-rate windows.",
    )
    verifiers: Verifiers = Field(
        default_factory=list,
        description="Semantic checks of outputs (per service, role or span name).",
    )


FallbackSpec.model_rebuild()
FallbackEntry.model_rebuild()
RetrySpec.model_rebuild()
RetryEntry.model_rebuild()
PolicyFile.model_rebuild()

#: Every key a policy file may use, for "did you mean" hints.
KNOWN_KEYS: frozenset[str] = frozenset(
    (field.alias or name)
    for model in (
        PolicyFile,
        Rule,
        RuleMatch,
        DecisionMatch,
        RetryEntry,
        FallbackEntry,
        RemediateEntry,
        SimpleEntry,
        EscalateEntry,
        FixedWait,
        ExponentialWait,
        BreakersSpec,
        BreakerSpec,
        RetryBudgetSpec,
        RestartIntensitySpec,
        AdmissionSpec,
        AdmissionLimitSpec,
        RemediatorSpec,
        RemediatorBudgetSpec,
        DetectorsSpec,
        CascadesSpec,
        ReanchorSpec,
        LoopsSpec,
        StallsSpec,
        ServiceDetectorsSpec,
        ContextPressureSpec,
        RunBudgetSpec,
        ServiceBudgetSpec,
        ModelInfoSpec,
        SloSpec,
        VerifierSpec,
        VerifierMatch,
        OutputRegexSpec,
        AttributeRangeSpec,
    )
    for name, field in model.model_fields.items()
)
