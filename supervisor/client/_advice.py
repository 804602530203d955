"""The ``/v1/decide`` exchange: the question an agent asks, and the :class:`Advice` it gets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from supervisor.records import Action

#: Breaker states in which a guarded call is not attempted.
OPEN_STATES = frozenset({"open", "isolated"})
#: Every state the sidecar reports for a breaker.
BREAKER_STATES = frozenset({"closed", "open", "half_open", "isolated"})
#: What the client reports for a breaker when the sidecar cannot say.
UNKNOWN_STATE = "unknown"


@dataclass(frozen=True, slots=True)
class Advice:
    """What to do about one failure: the sidecar's answer to ``/v1/decide``, or the local one."""

    action: Action
    #: Seconds to wait before retrying (0 for other actions).
    delay_s: float = 0.0
    reason: str = ""
    #: Name of the policy entry that decided.
    policy: str = ""
    #: ``transient`` / ``model`` / ``permanent`` / ``semantic``; ``""`` when unclassified.
    failure_class: str = ""
    kind: str = ""
    rule: str = ""
    params: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    #: The dependency to switch to, for ``fallback``.
    fallback_to: str | None = None
    #: The dependency the breaker hangs on (a rule may key it differently from the request).
    dependency: str = ""
    #: closed / open / half_open / isolated, or ``"unknown"`` (local advice).
    breaker_state: str = UNKNOWN_STATE
    #: Shadow mode: the decision is reported, not meant to be acted on.
    observe_only: bool = False
    source: Literal["sidecar", "local"] = "sidecar"


@dataclass(frozen=True, slots=True)
class Question:
    """One failure as ``/v1/decide`` takes it, plus what only the local policy reads."""

    dependency: str
    exception_type: str
    message: str
    status_code: int | None
    service: str
    run_id: str
    attempt: int
    #: The failed response's own delay; the sidecar reads it from the agent's spans instead.
    retry_after_s: float | None

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"dependency": self.dependency, "attempt": self.attempt}
        for key in ("exception_type", "message", "service", "run_id"):
            if value := getattr(self, key):
                body[key] = value
        if self.status_code is not None:
            body["status_code"] = self.status_code
        return body


class UnreadableAnswer(ValueError):
    """A sidecar answer that cannot be understood."""


def advice_from_json(payload: object, dependency: str) -> Advice:
    """The sidecar's answer about ``dependency``; raises :class:`UnreadableAnswer` if garbled."""
    if not isinstance(payload, dict):
        raise UnreadableAnswer("the answer is not a JSON object")
    try:
        action = Action(payload.get("action"))
    except ValueError:
        raise UnreadableAnswer(f"unknown action {payload.get('action')!r}") from None
    delay = payload.get("delay_s")
    if delay is None:
        delay = 0.0
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < math.inf:
        raise UnreadableAnswer(f"delay_s {delay!r} is not a non-negative number")
    params = payload.get("params")
    breaker = payload.get("breaker")
    breaker = breaker if isinstance(breaker, dict) else {}
    fallback_to = payload.get("fallback_to")
    return Advice(
        action=action,
        delay_s=float(delay),
        reason=_str(payload.get("reason")),
        policy=_str(payload.get("policy")),
        failure_class=_str(payload.get("class")),
        kind=_str(payload.get("kind")),
        rule=_str(payload.get("rule")),
        params=MappingProxyType(dict(params) if isinstance(params, dict) else {}),
        fallback_to=fallback_to if isinstance(fallback_to, str) and fallback_to else None,
        dependency=_str(breaker.get("dependency")) or dependency,
        breaker_state=_breaker_state(breaker.get("state")),
        observe_only=payload.get("observe_only") is True,
        source="sidecar",
    )


def _breaker_state(value: object) -> str:
    """A breaker state the sidecar reported, or ``"unknown"`` for anything else."""
    return value if isinstance(value, str) and value in BREAKER_STATES else UNKNOWN_STATE


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""
