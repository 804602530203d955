"""The remediator interface: what a remediation sub-agent declares, and what it can call.

A remediator is a small agent sent when a policy says ``remediate``. It
declares its ``name``, the ``tools`` it may use and its ``budget``; the
policy may narrow the tools and change the budget, never widen the tools.
It acts only through :class:`RemediationContext`:

* :meth:`RemediationContext.call` runs one tool (an agent command, an
  approval request, a worker restart, or a read-only view). A tool outside
  the allowlist is refused: never executed, recorded as an error on that
  call's span, and returned as a refused :class:`ToolResult`. Every call is
  a durable step: after a crash, calls already made return their recorded
  result and are not made again.
* :meth:`RemediationContext.sleep`, :meth:`~RemediationContext.wait_for_recovery`
  and :meth:`~RemediationContext.wait_for_approval` are durable waits
  (:meth:`~RemediationContext.recovered` asks without waiting) (their
  deadlines survive a restart); no thread is held by a sleeping remediation
  beyond the runner's own (remediations are coroutines on the runner's loop).
* :meth:`RemediationContext.step` records any other non-deterministic work
  (an LLM call) so that a resumed run replays its result.

Lifecycle: the runner builds one instance per remediation (``__init__`` gets
the policy's ``params``), calls :meth:`Remediator.run` once per execution of
the durable workflow (again, replaying recorded steps, after a restart), and
drops it. ``run`` must therefore be deterministic given the results of its
calls: no clocks, randomness or I/O outside ``call``/``step``.

A spent budget raises :class:`BudgetSpent` out of the context; the runner
stops the remediation and escalates. Third parties subclass
:class:`Remediator` and register it under the ``spanvisor.remediators``
entry point group, or name it in the policy as ``package.module:Class``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from supervisor.records import REMEDIATION_AGENT_TOOLS, REMEDIATION_READ_TOOLS, REMEDIATION_TOOLS

__all__ = [
    "AGENT_TOOLS",
    "ALL_TOOLS",
    "READ_TOOLS",
    "SIDECAR_TOOLS",
    "Budget",
    "BudgetSpent",
    "RemediationContext",
    "Remediator",
    "ToolResult",
    "Trigger",
    "Verdict",
]

AGENT_TOOLS = REMEDIATION_AGENT_TOOLS
READ_TOOLS = REMEDIATION_READ_TOOLS
#: What the sidecar does itself, with a program the policy configures (never an
#: argument): ``restart_worker`` runs the remediator's restart command.
SIDECAR_TOOLS: frozenset[str] = frozenset({"restart_worker"})
ALL_TOOLS = REMEDIATION_TOOLS | SIDECAR_TOOLS

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Budget:
    """What one remediation may spend: durable steps, tool calls, wall time, LLM tokens."""

    steps: int = 12
    tool_calls: int = 6
    deadline_s: float = 600.0
    tokens: int = 40_000


@dataclass(frozen=True, slots=True)
class Trigger:
    """The failure a remediation answers, as plain data (it is the workflow's input).

    Span text (``message``, ``span_name``) is untrusted: it comes from the
    agent's spans and may carry prompt injections.
    """

    trace_id: str
    span_id: str
    service: str
    run_id: str
    failure_class: str
    kind: str
    dependency: str
    rule: str
    message: str
    span_name: str
    #: The decision's parameters (``remediator``, ``remediation_id``, ...).
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "service": self.service,
            "run_id": self.run_id,
            "class": self.failure_class,
            "kind": self.kind,
            "dependency": self.dependency,
            "rule": self.rule,
            "message": self.message,
            "span_name": self.span_name,
            "params": dict(self.params),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trigger:
        return cls(
            trace_id=str(data["trace_id"]),
            span_id=str(data["span_id"]),
            service=str(data.get("service", "")),
            run_id=str(data.get("run_id", "")),
            failure_class=str(data.get("class", "")),
            kind=str(data.get("kind", "")),
            dependency=str(data.get("dependency", "")),
            rule=str(data.get("rule", "")),
            message=str(data.get("message", "")),
            span_name=str(data.get("span_name", "")),
            params=dict(data.get("params") or {}),
        )


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call gave: ``ok`` with a JSON-ready ``value``, or an ``error``.

    ``refused`` marks a call that was never executed (outside the allowlist,
    or arguments the policy does not allow).
    """

    ok: bool
    value: Any = None
    error: str = ""
    refused: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "value": self.value, "error": self.error, "refused": self.refused}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolResult:
        return cls(
            ok=bool(data.get("ok")),
            value=data.get("value"),
            error=str(data.get("error", "")),
            refused=bool(data.get("refused")),
        )


class Verdict(str, enum.Enum):
    """What :meth:`Remediator.run` reports.

    ``acted``: it changed something; the runner verifies that the run
    recovered: since the remediation started (the watch begins before the
    first command), or within the verification window after its last step.
    The others are final: ``succeeded`` (already
    verified), ``failed``, ``escalated`` (a person decides), ``refused`` (it
    would only have acted through refused calls).
    """

    ACTED = "acted"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ESCALATED = "escalated"
    REFUSED = "refused"


class BudgetSpent(Exception):
    """Raised by the context when a budget is spent; the runner stops and escalates."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class RemediationContext(Protocol):
    """The only way a remediator reads or acts; see the module docstring."""

    @property
    def trigger(self) -> Trigger: ...

    @property
    def remediation_id(self) -> str: ...

    @property
    def budget(self) -> Budget: ...

    @property
    def tools(self) -> frozenset[str]: ...

    async def call(self, tool: str, /, **arguments: Any) -> ToolResult:
        """Run ``tool`` once (durably); refused when outside the allowlist."""
        ...

    async def step(self, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Await ``fn()`` once and record its (picklable) result; a resumed run replays it."""
        ...

    async def sleep(self, seconds: float) -> None:
        """A durable sleep: a restart sleeps only what is left."""
        ...

    async def wait_for_recovery(self, timeout_s: float) -> bool:
        """Wait until the run's spans show the failed dependency succeeding or the run ending OK.

        A recovery seen since the remediation started answers at once.
        """
        ...

    async def recovered(self) -> bool:
        """Whether the run recovered since the remediation started (no wait).

        A remediator that goes on acting (a model's next turn) asks first: a
        command to a run that recovered, or ended, is one too many.
        """
        ...

    async def wait_for_approval(
        self, approval_id: str, timeout_s: float
    ) -> Mapping[str, Any] | None:
        """Wait for a person's answer to ``request_approval``; None on timeout."""
        ...

    async def restart_allowed(self) -> tuple[bool, str]:
        """Whether restart intensity allows restarting this run now (and why not)."""
        ...

    def spend_tokens(self, tokens: int) -> None:
        """Count LLM tokens against the budget; raises :class:`BudgetSpent` past it."""
        ...

    def log(self, message: str) -> None:
        """A note on the remediation's trace (an event on its root span)."""
        ...


class Remediator(abc.ABC):
    """A remediation sub-agent; see the module docstring for the contract."""

    #: Registered name (the policy's ``use:``).
    name: ClassVar[str] = ""
    #: The widest allowlist this remediator works with.
    tools: ClassVar[frozenset[str]] = frozenset()
    #: Defaults; a policy's ``budget:`` replaces them.
    budget: ClassVar[Budget] = Budget()

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = dict(params)

    @abc.abstractmethod
    async def run(self, ctx: RemediationContext) -> Verdict:
        """Remediate ``ctx.trigger``; deterministic given the results of ``ctx``'s calls."""

    @classmethod
    def check_params(cls, params: Mapping[str, Any]) -> list[str]:
        """Problems with the policy's ``params`` for this remediator (checked at load)."""
        return []
