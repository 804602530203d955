"""A remediation's spans: its root, linked to the span that triggered it, and a child per step.

The root's ids are fixed in advance (:mod:`remediators.tracing`), so a
remediation resumed after a crash ends the same root; each tool call, step and
finished wait is a child span, recorded once (the durable step that makes it
is not run again on a replay).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from remediators.base import ToolResult
from remediators.tracing import preset_ids, root_span_id

#: Longest text recorded on a span or in a result (characters).
MAX_TEXT: Final = 512


class RemediationSpans:
    """Makes a remediation's spans with ``tracer``."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start_root(self, request: Mapping[str, Any]) -> trace.Span:
        trigger = request["trigger"]
        link = Link(
            SpanContext(
                trace_id=int(trigger["trace_id"], 16),
                span_id=int(trigger["span_id"], 16),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            ),
            attributes={
                "spanvisor.link.type": "triggered_by",
                "spanvisor.failure.class": str(trigger.get("class", "")),
                "spanvisor.failure.kind": str(trigger.get("kind", "")),
            },
        )
        with preset_ids(str(request["trace_id"]), root_span_id(str(request["id"]))):
            return self._tracer.start_span(
                f"spanvisor.remediate {request['remediator']}",
                context=trace.set_span_in_context(trace.INVALID_SPAN),
                kind=SpanKind.INTERNAL,
                links=[link],
                start_time=int(float(request["dispatched_at"]) * 1e9),
                attributes={
                    "spanvisor.remediation.id": str(request["id"]),
                    "spanvisor.remediator": str(request["remediator"]),
                    "spanvisor.remediator_use": str(request["use"]),
                    "spanvisor.remediation.tools": list(request["tools"]),
                    "spanvisor.service": str(trigger.get("service", "")),
                    "spanvisor.run_id": str(trigger.get("run_id", "")),
                    "spanvisor.trigger.trace_id": str(trigger["trace_id"]),
                    "spanvisor.trigger.span_id": str(trigger["span_id"]),
                },
            )

    def end_root(
        self,
        root: trace.Span,
        outcome: str,
        reason: str,
        *,
        steps: int,
        tool_calls: int,
        refused: int,
    ) -> None:
        root.set_attribute("spanvisor.remediation.outcome", outcome)
        root.set_attribute("spanvisor.remediation.steps", steps)
        root.set_attribute("spanvisor.remediation.tool_calls", tool_calls)
        root.set_attribute("spanvisor.remediation.refused_calls", refused)
        if reason:
            root.set_attribute("spanvisor.remediation.reason", reason[:MAX_TEXT])
        if outcome in ("failed", "refused"):
            root.set_status(Status(StatusCode.ERROR, reason[:MAX_TEXT] or outcome))
        root.end()

    def tool(
        self,
        root: trace.Span,
        tool: str,
        arguments: Mapping[str, Any],
        result: ToolResult,
        *,
        seq: int,
        started_ns: int,
        allowed: bool,
    ) -> None:
        span = self._tracer.start_span(
            f"spanvisor.tool {tool[:64]}",
            context=trace.set_span_in_context(root),
            start_time=started_ns,
            attributes={
                "spanvisor.tool.name": tool[:128],
                "spanvisor.tool.step": seq,
                "spanvisor.tool.allowed": allowed,
                "spanvisor.tool.refused": result.refused,
                "spanvisor.tool.arguments": clip(repr(dict(arguments))),
            },
        )
        if not result.ok:
            span.set_status(Status(StatusCode.ERROR, result.error[:MAX_TEXT]))
            span.add_event(
                "exception",
                {
                    "exception.type": "ToolRefused" if result.refused else "ToolFailed",
                    "exception.message": result.error[:MAX_TEXT],
                },
            )
        span.end()

    def step(
        self, root: trace.Span, name: str, seq: int, started_ns: int, error: BaseException | None
    ) -> None:
        span = self._tracer.start_span(
            name[:128],
            context=trace.set_span_in_context(root),
            start_time=started_ns,
            attributes={"spanvisor.step": seq},
        )
        if error is not None:
            text = f"{type(error).__name__}: {error}"
            span.set_status(Status(StatusCode.ERROR, text[:MAX_TEXT]))
        span.end()

    def event(self, root: trace.Span, name: str, attributes: Mapping[str, Any]) -> None:
        span = self._tracer.start_span(
            name, context=trace.set_span_in_context(root), attributes=dict(attributes)
        )
        span.end()


def clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"
