"""Where a failure originates: each failure is reported once, at its origin.

Ancestors that only propagate a failure are attributed to it instead of
being reported again:

* within one request (the usual case: an SDK exports a child and the parent
  it fails in the same batch) by walking failing parents up from each
  failing span;
* across requests through a bounded map from a parent's ids to a small
  signature of the origin already reported, for parents that end in a later batch;
* through spans that did not fail: a framework often puts an OK span between
  the call that failed and the agent span that fails with it (the OpenAI
  Agents SDK's ``turn``), and those spans are never normalized. A failing
  agent or chain span whose time range contains an origin's in the same
  trace, and that shows nothing beyond its error, propagates it; the closest
  such origin is taken, within the request and from a few origins remembered
  per trace. (Calls are not containers: parallel siblings overlap in time.)
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from supervisor.bounded import BoundedMap
from supervisor.records import Classification, FailureClass, Role, SpanRecord

__all__ = ["Attribution", "Candidate", "Signature", "signature"]

#: Spans that may propagate a failure from below an OK span: the ones that run
#: others. Calls (LLM, tool, HTTP) overlap in time as parallel siblings, and two
#: parallel calls timing out are two failures, not one propagating the other.
_CONTAINER_ROLES: Final[tuple[Role, ...]] = (Role.AGENT, Role.CHAIN)
#: Characters of an origin's message kept to recognise it in a parent's.
_SIGNATURE_TEXT: Final = 120
#: Origins remembered per trace for attribution through spans that did not fail.
_ORIGINS_PER_TRACE: Final = 8
#: Shorter failing spans of its trace a container is compared with, longest
#: first, to find the one it propagates (the closest is among the first few
#: in real traces).
_CONTAINED_SCAN: Final = 256


class Signature:
    """What attribution compares of an origin; small, so many can be remembered."""

    __slots__ = ("exception_tail", "failure_class", "kind", "text")

    def __init__(
        self, failure_class: FailureClass, kind: str, exception_tail: str, text: str
    ) -> None:
        self.failure_class = failure_class
        self.kind = kind
        self.exception_tail = exception_tail
        self.text = text


class _Reported:
    """An origin reported in a trace, for ancestors that end in a later request."""

    __slots__ = ("end_ns", "sig", "start_ns")

    def __init__(self, start_ns: int, end_ns: int, sig: Signature) -> None:
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.sig = sig


@dataclass(slots=True)
class Candidate:
    """A failing span of the batch, classified, and what it is attributed to."""

    record: SpanRecord
    #: The run the span belongs to (the run tracker's answer).
    run_id: str
    verdict: Classification
    sig: Signature
    attributed_to: Candidate | None = None


class Attribution:
    """Attributes a batch's failing spans to their origins, remembering origins across batches.

    Bounded: ``seen_capacity`` parents and ``traces_capacity`` traces
    remembered; what is evicted is counted (:attr:`evictions`). Called from
    the pipeline's thread only.
    """

    def __init__(self, *, seen_capacity: int, traces_capacity: int) -> None:
        # trace + span id of a parent → the signature of the origin below it.
        self._origin_below: BoundedMap[str, Signature] = BoundedMap(seen_capacity)
        # trace id → the last origins reported in it, for ancestors above OK spans.
        self._origins_in: BoundedMap[str, list[_Reported]] = BoundedMap(traces_capacity)
        #: Failing spans attributed to another, since start.
        self.attributed = 0

    @property
    def evictions(self) -> int:
        return self._origin_below.evictions + self._origins_in.evictions

    def link(self, candidates: dict[str, Candidate]) -> None:
        """Within the request: each failing parent that only propagates its failing child."""
        for cand in candidates.values():
            rec = cand.record
            if not rec.parent_span_id:
                continue
            parent = candidates.get(rec.trace_id + rec.parent_span_id)
            if (
                parent is not None
                and parent is not cand  # a malformed span that names itself its parent
                and parent.attributed_to is None
                and propagates(parent, cand.sig)
            ):
                parent.attributed_to = cand
        if len(candidates) > 1:
            _attribute_through_ok_spans(candidates)

    def origins(
        self, candidates: dict[str, Candidate]
    ) -> Iterator[tuple[Candidate, list[Candidate]]]:
        """The linked candidates that originate a failure, each with its ancestors, nearest first.

        The others propagate a failure reported in this batch or an earlier
        one; they are counted in :attr:`attributed`. Lazy, so that a caller
        may take them a chunk at a time; what it does with them changes
        nothing here.
        """
        attributed_by = _attributions(candidates)
        for key, cand in candidates.items():
            if cand.attributed_to is not None:
                self.attributed += 1
                continue
            earlier = self._origin_below.get(key) or self._origin_within(cand)
            if earlier is not None and propagates(cand, earlier):
                # A descendant failed in an earlier request with the same error.
                self.attributed += 1
                self._remember_origin(cand.record, earlier)
                continue
            parents = _ancestors_attributed_to(cand, candidates, attributed_by)
            self._remember_origin((parents[-1] if parents else cand).record, cand.sig)
            self._remember_in_trace(cand)
            yield cand, parents

    def _remember_origin(self, record: SpanRecord, sig: Signature) -> None:
        if record.parent_span_id:
            self._origin_below.set(record.trace_id + record.parent_span_id, sig)

    def _remember_in_trace(self, origin: Candidate) -> None:
        rec = origin.record
        reported = self._origins_in.get(rec.trace_id)
        if reported is None:
            reported = []
            self._origins_in.set(rec.trace_id, reported)
        if len(reported) >= _ORIGINS_PER_TRACE:
            del reported[0]
        reported.append(_Reported(rec.start_ns, rec.end_ns, origin.sig))

    def _origin_within(self, cand: Candidate) -> Signature | None:
        """The closest origin reported earlier in the trace within the span's time."""
        reported = self._origins_in.get(cand.record.trace_id)
        if not reported or cand.record.role not in _CONTAINER_ROLES:
            return None
        rec = cand.record
        inside = [
            r
            for r in reported
            if _contains(rec.start_ns, rec.end_ns, r.start_ns, r.end_ns) and propagates(cand, r.sig)
        ]
        if not inside:
            return None
        return min(inside, key=lambda r: r.end_ns - r.start_ns).sig


def _attributions(candidates: dict[str, Candidate]) -> dict[str, Candidate]:
    """Candidate key -> the first candidate (in the batch's order) attributed to it.

    Built once per batch, after attribution: looking each origin's containers
    up by scanning every candidate made a batch of n failures cost n squared,
    which is at its worst in an outage, when most spans fail.
    """
    index: dict[str, Candidate] = {}
    for cand in candidates.values():
        target = cand.attributed_to
        if target is not None:
            index.setdefault(target.record.trace_id + target.record.span_id, cand)
    return index


def _ancestors_attributed_to(
    origin: Candidate, candidates: dict[str, Candidate], attributed_by: dict[str, Candidate]
) -> list[Candidate]:
    """The candidates attributed to ``origin``, nearest first (a parent, or a container)."""
    chain: list[Candidate] = []
    current = origin
    for _ in range(64):  # spans nest deeply only in pathological traces
        rec = current.record
        parent = candidates.get(rec.trace_id + rec.parent_span_id) if rec.parent_span_id else None
        if parent is None or parent.attributed_to is not current:
            parent = attributed_by.get(rec.trace_id + rec.span_id)
        if parent is None:
            break
        chain.append(parent)
        current = parent
    return chain


def _contains(start: int, end: int, inner_start: int, inner_end: int) -> bool:
    """Whether [start, end] holds [inner_start, inner_end] and is longer."""
    return start <= inner_start and inner_end <= end and end - start > inner_end - inner_start


def _attribute_through_ok_spans(candidates: dict[str, Candidate]) -> None:
    """Attribute failing ancestors whose failing descendant sits below a span that did not fail.

    A candidate not attributed yet that contains others of its trace in time
    and propagates their error is attributed to the closest of them: the
    longest, which holds the rest, so that nested containers (agent > step >
    call) form one chain and the failure lists each of them, nearest first.
    Durations strictly shrink along these links, and a candidate is never
    attributed to one whose own chain already leads back to it, so no cycle
    can form.

    Each container looks at the shorter failing spans of its trace longest
    first and takes the first that fits, looking at no more than
    :data:`_CONTAINED_SCAN`: a request whose one trace holds thousands of
    failing containers costs time in proportion to its size, not its square.
    """
    by_trace: dict[str, list[Candidate]] = {}
    for cand in candidates.values():
        by_trace.setdefault(cand.record.trace_id, []).append(cand)
    for group in by_trace.values():
        if len(group) < 2:
            continue
        longest_first = sorted(group, key=_duration, reverse=True)  # stable: ties keep order
        negated = [-_duration(c) for c in longest_first]  # ascending, for bisect
        for outer in group:
            if outer.attributed_to is not None or outer.record.role not in _CONTAINER_ROLES:
                continue
            o = outer.record
            shorter = bisect_right(negated, -_duration(outer))
            for inner in longest_first[shorter : shorter + _CONTAINED_SCAN]:
                i = inner.record
                if (
                    o.start_ns <= i.start_ns
                    and i.end_ns <= o.end_ns
                    and propagates(outer, inner.sig)
                    and not _leads_to(inner, outer)
                ):
                    outer.attributed_to = inner
                    break


def _duration(cand: Candidate) -> int:
    return cand.record.end_ns - cand.record.start_ns


def _leads_to(cand: Candidate, target: Candidate) -> bool:
    current = cand.attributed_to
    for _ in range(64):
        if current is None:
            return False
        if current is target:
            return True
        current = current.attributed_to
    return True  # a chain this long: refuse the link rather than risk a cycle


def signature(record: SpanRecord, verdict: Classification) -> Signature:
    ev = record.error
    assert ev is not None  # only failing records are judged
    return Signature(
        verdict.failure_class,
        verdict.kind,
        _tail(ev.exception_type) if ev.exception_type else "",
        (ev.exception_message or ev.status_message)[:_SIGNATURE_TEXT],
    )


def propagates(parent: Candidate, child: Signature) -> bool:
    """Whether a failing parent shows nothing beyond its failing child's error."""
    verdict, evidence = parent.verdict, parent.record.error
    if evidence is None:
        return False
    if verdict.kind == "unknown":
        return True  # the parent says nothing more specific than "it failed"
    if (verdict.failure_class, verdict.kind) == (child.failure_class, child.kind):
        return True
    if evidence.exception_type and child.exception_tail:
        return _tail(evidence.exception_type) == child.exception_tail
    return bool(child.text) and child.text in evidence.text()


def _tail(exception_type: str) -> str:
    return exception_type.rsplit(".", 1)[-1]
