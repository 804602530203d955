"""The failures the judging reports: built from a failing record, a detection, a
verifier's finding or a cascade, each with a one-line summary of its evidence."""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from policies import Cascade, VerificationFailure
from supervisor.judge.attribution import Candidate
from supervisor.records import ErrorEvidence, Failure, FailureClass, Role, SpanRecord
from supervisor.runs import CASCADE_RULE, Detection

__all__ = [
    "cascade_failure",
    "detected_failure",
    "failure_at",
    "summary",
    "verification_failure",
]

_MESSAGE_LIMIT: Final = 300
_SPECIFIC_ROLES: Final[tuple[Role, ...]] = (Role.LLM, Role.TOOL)


def failure_at(
    origin: Candidate,
    parents: list[Candidate],
    received_ns: int,
) -> Failure:
    """The failure ``origin`` reports; ``parents``: its ancestors that propagate it.

    When the origin is a plain HTTP or unlabelled span under an LLM or tool span
    that propagated it, the failure keeps the origin's span but takes the
    dependency of that LLM or tool span: a breaker belongs to ``openai:gpt-4o``,
    not to ``http:api.openai.com``. The credential named with it (if any)
    comes from the same span: with it, the breaker's key.
    """
    rec = origin.record
    verdict = origin.verdict
    attributed: list[str] = []
    dependency = verdict.dependency or rec.dependency
    credential = rec.credential
    for parent in parents:
        attributed.append(parent.record.span_id)
        above = parent.record
        if rec.role not in _SPECIFIC_ROLES and above.role in _SPECIFIC_ROLES and above.dependency:
            dependency, credential = above.dependency, above.credential
    return Failure(
        trace_id=rec.trace_id,
        span_id=rec.span_id,
        parent_span_id=rec.parent_span_id,
        service=rec.service,
        span_name=rec.name,
        run_id=origin.run_id,
        role=rec.role,
        failure_class=verdict.failure_class,
        kind=verdict.kind,
        dependency=dependency,
        rule=verdict.rule,
        message=summary(rec),
        evidence=rec.error,  # type: ignore[arg-type]  # only failing records get here
        received_ns=received_ns,
        attributed=tuple(attributed),
        credential=credential,
    )


def summary(record: SpanRecord) -> str:
    ev = record.error
    if ev is None:
        return ""
    parts: list[str] = []
    if ev.exception_type:
        parts.append(ev.exception_type)
    text = ev.exception_message or ev.status_message
    if text:
        parts.append(text)
    if ev.http_status is not None and f"{ev.http_status}" not in text:
        parts.append(f"HTTP {ev.http_status}")
    if ev.grpc_code is not None:
        parts.append(f"gRPC {ev.grpc_code}")
    if ev.provider_code and ev.provider_code not in text:
        parts.append(ev.provider_code)
    if ev.finish_reasons:
        parts.append("finish_reason=" + ",".join(ev.finish_reasons))
    if ev.invalid_tool_calls:
        parts.append("invalid tool calls: " + ", ".join(ev.invalid_tool_calls))
    if ev.swallowed:
        parts.append("(caught by the tool, span status OK)")
    line = ": ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")
    line = " ".join(line.split())  # one line, whatever the message held
    return line if len(line) <= _MESSAGE_LIMIT else line[: _MESSAGE_LIMIT - 1] + "…"


def detected_failure(found: Detection, received_ns: int) -> Failure:
    """What a run detector found, as a failure at its span."""
    if found.role:
        role = Role(found.role)
    else:
        role = Role.TOOL if found.dependency.startswith("tool:") else Role.LLM
    return Failure(
        trace_id=found.trace_id,
        span_id=found.span_id,
        parent_span_id="",
        service=found.service,
        span_name=found.span_name,
        run_id=found.run_id,
        role=role,
        failure_class=FailureClass(found.failure_class),
        kind=found.kind,
        dependency=found.dependency,
        rule=found.rule,
        message=found.message[:512],
        evidence=ErrorEvidence(),
        received_ns=received_ns,
        details=found.details,
    )


def verification_failure(
    record: SpanRecord, run_id: str, found: VerificationFailure, received_ns: int
) -> Failure:
    return Failure(
        trace_id=record.trace_id,
        span_id=record.span_id,
        parent_span_id=record.parent_span_id,
        service=record.service,
        span_name=record.name,
        run_id=run_id,
        role=record.role,
        failure_class=FailureClass.SEMANTIC,
        kind="verification_failed",
        dependency=record.dependency,
        rule=f"verifier.{found.verifier}",
        message=f"{found.verifier}: {found.message}"[:512],
        evidence=ErrorEvidence(),
        received_ns=received_ns,
        details={"verifier": found.verifier},
    )


def cascade_failure(found: Cascade) -> Failure:
    """A cascade as one incident, at the failure that completed it, listing the runs hit."""
    last = found.trigger
    runs = ", ".join(found.runs[:5]) + (" ..." if len(found.runs) > 5 else "")
    return replace(
        last,
        rule=CASCADE_RULE,
        message=(
            f"{found.dependency} failing across runs: {found.failures} of {found.calls} calls"
            f" ({found.error_rate:.0%}) from {len(found.runs)} runs ({runs})"
        )[:512],
        attributed=(),
        details={
            "runs": found.runs,
            "failures": found.failures,
            "calls": found.calls,
            "error_rate": round(found.error_rate, 4),
        },
    )
