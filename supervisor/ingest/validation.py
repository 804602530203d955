"""Which spans of a request no trace backend could store, removed for OTLP partial success.

A span with a bad id is rejected alone, so the rest of its batch still gets
through; the answer says how many were rejected and why, with where the
first of each reason was.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

from supervisor.ingest.messages import MAX_MESSAGE, clip

#: Stand-in for an OTLP/JSON id that is not hex. Its length (13) is neither 8
#: nor 16, so validation always rejects it, and it lets validation say *why*.
INVALID_HEX: Final = b"\xffinvalid-hex\xff"
_ZERO_TRACE: Final = bytes(16)
_ZERO_SPAN: Final = bytes(8)


@dataclass(frozen=True, slots=True)
class Validation:
    """What :func:`validate_spans` kept and dropped, for OTLP partial success."""

    accepted: int
    rejected: int
    #: Why spans were rejected, bounded in length; "" when none were.
    message: str


def validate_spans(request: Any) -> Validation:
    """Remove, in place, the spans no trace backend could store.

    A span is rejected when its trace_id is not 16 bytes or is all zero, its
    span_id is not 8 bytes or is all zero, its parent_span_id is set but not 8
    bytes, or one of its links has ids of the wrong length. Containers left
    empty by the removal are pruned too.
    """
    accepted = 0
    reasons: Counter[str] = Counter()
    first_at: dict[str, str] = {}
    for r, resource_spans in enumerate(request.resource_spans):
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            bad: list[int] = []
            for i, span in enumerate(scope_spans.spans):
                # Fast path for the well-formed span, which is nearly every span:
                # one comparison per id instead of the checks that name a problem.
                trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
                if (
                    len(trace_id) == 16
                    and len(span_id) == 8
                    and trace_id != _ZERO_TRACE
                    and span_id != _ZERO_SPAN
                    and (not parent or len(parent) == 8)
                    and not span.links
                ):
                    accepted += 1
                    continue
                reason = _span_problem(span)
                if reason is None:
                    accepted += 1
                    continue
                bad.append(i)
                reasons[reason] += 1
                first_at.setdefault(reason, f"resource_spans[{r}].scope_spans[{s}].spans[{i}]")
            for i in reversed(bad):
                del scope_spans.spans[i]
    rejected = sum(reasons.values())
    if rejected:
        _prune_emptied(request)
    return Validation(accepted, rejected, _summarise(accepted, rejected, reasons, first_at))


def _span_problem(span: Any) -> str | None:
    problem = _id_problem("trace_id", span.trace_id, 16) or _id_problem("span_id", span.span_id, 8)
    if problem is None and span.parent_span_id:
        # An all-zero parent is how some exporters spell "root": allowed.
        problem = _id_problem("parent_span_id", span.parent_span_id, 8, allow_zero=True)
    for link in span.links:
        if problem is not None:
            break
        problem = _id_problem("link trace_id", link.trace_id, 16, allow_zero=True) or _id_problem(
            "link span_id", link.span_id, 8, allow_zero=True
        )
    return problem


def _id_problem(name: str, value: bytes, size: int, *, allow_zero: bool = False) -> str | None:
    if value == INVALID_HEX:
        return f"{name} is not hex (OTLP/JSON ids are hex strings, not base64)"
    if not value:
        return f"{name} is missing"
    if len(value) != size:
        return f"{name} is {len(value)} bytes, want {size}"
    if not allow_zero and not any(value):
        return f"{name} is all zeros"
    return None


def _prune_emptied(request: Any) -> None:
    for resource_spans in request.resource_spans:
        for s in reversed(range(len(resource_spans.scope_spans))):
            if not resource_spans.scope_spans[s].spans:
                del resource_spans.scope_spans[s]
    for r in reversed(range(len(request.resource_spans))):
        if not request.resource_spans[r].scope_spans:
            del request.resource_spans[r]


def _summarise(
    accepted: int, rejected: int, reasons: Counter[str], first_at: dict[str, str]
) -> str:
    if not rejected:
        return ""
    parts = [f"{n} x {why} (first at {first_at[why]})" for why, n in reasons.most_common(3)]
    if len(reasons) > 3:
        parts.append(f"{len(reasons) - 3} other reasons")
    text = f"rejected {rejected} of {accepted + rejected} spans: " + "; ".join(parts)
    return clip(text, MAX_MESSAGE)
