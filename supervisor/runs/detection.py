"""What a run detector reports: a :class:`Detection`, under one of the detectors' rules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from supervisor.runs.loops import Repeat
    from supervisor.runs.state import RunState

__all__ = [
    "BUDGET_RULE",
    "CASCADE_RULE",
    "LOOP_RULE",
    "NOTICE_RULES",
    "PRESSURE_RULE",
    "REANCHOR_RULE",
    "STALL_RULE",
    "Detection",
    "detection_at",
    "loop_detection",
]

#: The rules that run detectors report under (policies match on them like any other).
LOOP_RULE: Final = "builtin.detect.reasoning_loop"
STALL_RULE: Final = "builtin.detect.stall"
PRESSURE_RULE: Final = "builtin.detect.context_pressure"
BUDGET_RULE: Final = "builtin.detect.run_budget"
CASCADE_RULE: Final = "builtin.detect.cascade"
REANCHOR_RULE: Final = "builtin.detect.reanchor"
#: What these rules report is a prediction or a reminder, not an error of the run:
#: it is judged and acted on, but the run's error count and its SLO do not count it.
NOTICE_RULES: Final = frozenset({PRESSURE_RULE, REANCHOR_RULE})


@dataclass(frozen=True, slots=True)
class Detection:
    """What a run detector found at one span: a failure to classify and decide on."""

    kind: str
    failure_class: str
    rule: str
    run_id: str
    service: str
    trace_id: str
    #: Where the failure is reported (a loop: its first repeated call).
    span_id: str
    span_name: str
    #: ``tool:<name>`` or the LLM's ``provider:model``.
    dependency: str
    message: str
    details: Mapping[str, Any]
    #: The failing role when it is not the dependency's (a stall: the agent's).
    role: str = ""


def detection_at(
    run: RunState,
    span_id: bytes,
    dependency: str,
    *,
    kind: str,
    failure_class: str,
    rule: str,
    message: str,
    details: Mapping[str, Any],
    name: str | None = None,
    role: str = "",
) -> Detection:
    """What a detector found in ``run`` at the span ``span_id`` (``name``: the run's step)."""
    return Detection(
        kind=kind,
        failure_class=failure_class,
        rule=rule,
        run_id=run.run_id,
        service=run.service,
        trace_id=run.trace.hex(),
        span_id=span_id.hex(),
        span_name=(run.step if name is None else name)[:256],
        dependency=dependency,
        message=message,
        details=details,
        role=role,
    )


def loop_detection(
    run: RunState, dependency: str, first: Repeat, *, repeats: int, what: str
) -> Detection:
    """A reasoning loop in ``run``, reported at its first repeated call (see :mod:`.loops`)."""
    span_id, name, occurrence = first
    return detection_at(
        run,
        span_id,
        dependency,
        name=name,
        kind="reasoning_loop",
        failure_class="model",
        rule=LOOP_RULE,
        message=f"{what} {repeats} times: {name[:256]}"
        + (f" (still looping, report {occurrence})" if occurrence > 1 else ""),
        details={"repeats": repeats, "repeated_call": name[:256], "occurrence": occurrence},
    )
