"""From a decoded OTLP request to failures and decisions, with no I/O.

The pipeline is synchronous and deterministic so that ``spanvisor run`` and
``spanvisor replay`` give the same verdicts on the same spans. Only spans that
may be failures are normalized (:mod:`supervisor.normalize.screen` decides
that from a few attributes), and only those that are go further (dedup,
classification, attribution, decision), so spans that succeed pay little.

A failure is reported once, at the span where it originates. Ancestors that
only propagate it are attributed to it instead of being reported again:

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

When the origin is a plain HTTP or unlabelled span under an LLM or tool span
that propagated it, the failure keeps the origin's span but takes the
dependency of that LLM or tool span: a breaker belongs to ``openai:gpt-4o``,
not to ``http:api.openai.com``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from policies import RUN_KINDS, Cascade, Policy, VerificationFailure, VerifierSet
from supervisor.bounded import BoundedMap
from supervisor.normalize import (
    Span,
    SpanReader,
    may_fail_quietly,
    shows_failure_signal,
)
from supervisor.normalize.span import requested_calls
from supervisor.records import (
    Action,
    Classification,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
    SpanRecord,
)
from supervisor.runs import CASCADE_RULE, Detection, RunTracker

#: Resource ``service.name`` of the sidecar's own spans, never judged again.
OWN_SERVICE: Final = "spanvisor"
_MESSAGE_LIMIT: Final = 300
_SPECIFIC_ROLES: Final[tuple[Role, ...]] = (Role.LLM, Role.TOOL)
#: Decisions after which the run is expected to go on (a silence is then a stall).
_GOES_ON: Final[tuple[Action, ...]] = (Action.RETRY, Action.FALLBACK, Action.REMEDIATE)
#: Spans that may propagate a failure from below an OK span: the ones that run
#: others. Calls (LLM, tool, HTTP) overlap in time as parallel siblings, and two
#: parallel calls timing out are two failures, not one propagating the other.
_CONTAINER_ROLES: Final[tuple[Role, ...]] = (Role.AGENT, Role.CHAIN)
#: Characters of an origin's message kept to recognise it in a parent's.
_SIGNATURE_TEXT: Final = 120
#: Spans read at a time from a request (SpanReader): about 45 KB of attributes,
#: which stay in the caches while each step goes over them.
_CHUNK_SPANS: Final = 32


class Governor(Protocol):
    """State kept across failures (breakers, retry budget, restart intensity).

    The pipeline tells it every call outcome it sees, as (end time, dependency,
    ok) (``observe_calls``), and lets it revise each decision (``review``) after
    the failure it is about was observed, so the failure that trips a breaker
    already gets the breaker's decision. Called from the pipeline's thread only.
    """

    def observe_calls(self, calls: list[tuple[int, str, bool]]) -> None: ...

    def observe_cascades(self, successes: list[str], failures: list[Failure]) -> list[Cascade]: ...

    def review(self, failure: Failure, decision: Decision) -> Decision: ...


class RecoveryListener(Protocol):
    """What waits for a run's later successes (remediation verification).

    ``dependencies`` and ``waiting`` are looked up on the success path
    without a lock, so they must be a set and a dict (or alike); only a
    (run, dependency) pair in ``waiting`` is passed to ``succeeded``, which
    runs on the pipeline's thread and must not block.
    """

    @property
    def dependencies(self) -> Collection[str]: ...

    @property
    def waiting(self) -> Collection[tuple[str, str]]: ...

    def succeeded(self, run: str, dependency: str, span_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """One reported failure and the decision for it."""

    failure: Failure
    decision: Decision


@dataclass(frozen=True, slots=True)
class PipelineStats:
    processed_batches: int
    processed_spans: int
    failing_spans: int
    failures: int
    attributed: int
    duplicates: int
    own_spans_skipped: int
    evictions: int


class _Signature:
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

    def __init__(self, start_ns: int, end_ns: int, sig: _Signature) -> None:
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.sig = sig


#: Origins remembered per trace for attribution through spans that did not fail.
_ORIGINS_PER_TRACE: Final = 8


@dataclass(frozen=True, slots=True)
class Remainder:
    """The spans of a batch left after :meth:`Pipeline.first_pass`.

    ``quiet``: spans that may fail quietly, judged now (their successes not
    yet booked). ``verify``: spans that succeeded and were booked, which a
    verifier reads.
    """

    quiet: list[Span]
    verify: list[Span]
    received_ns: int


@dataclass(slots=True)
class _Candidate:
    record: SpanRecord
    #: The run the span belongs to (the run tracker's answer).
    run_id: str
    verdict: Classification
    sig: _Signature
    attributed_to: _Candidate | None = None


class Pipeline:
    """Normalize, classify, attribute and decide; one instance per sidecar.

    Not thread-safe: the app calls :meth:`process_payload` from its one event loop.
    Memory is bounded by ``seen_capacity`` failing spans and ``runs_capacity``
    attempt counters; evictions are counted in :meth:`stats`.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        seen_capacity: int = 20_000,
        runs_capacity: int = 10_000,
        observe_only: bool = False,
        governor: Governor | None = None,
        runs: RunTracker | None = None,
        recovery: RecoveryListener | None = None,
    ) -> None:
        self.policy = policy
        #: Sees every call outcome and revises decisions; None: the policy alone decides.
        self.governor = governor
        # The whole sidecar in observe mode: decisions are computed and traced, not delivered.
        self.observe_only = observe_only
        # trace + span id of failing spans already judged: exporters re-send batches.
        self._seen: BoundedMap[str, bool] = BoundedMap(seen_capacity)
        # trace + span id of a parent → the signature of the origin below it.
        self._origin_below: BoundedMap[str, _Signature] = BoundedMap(seen_capacity)
        # trace id → the last origins reported in it, for ancestors above OK spans.
        self._origins_in: BoundedMap[str, list[_Reported]] = BoundedMap(runs_capacity)
        # (run, dependency) → failures since its last success in the run: a step's
        # attempts (the retry of a step is another call of the same dependency).
        self._attempts: BoundedMap[tuple[str, str], int] = BoundedMap(runs_capacity)
        # Dependencies with attempts counted: only their successes are looked up.
        self._attempted: set[str] = set()
        # Which verifiers want a successful span, memoized per policy (_WantedBy).
        self._wants = _WantedBy(None)
        #: Told when a dependency that a remediation waits for succeeds in a run.
        self.recovery = recovery
        #: Every span's run: progress, loops, stalls (None: not tracked).
        self.runs = runs
        self._batches = 0
        self._spans = 0
        self._failing = 0
        self._failures = 0
        self._attributed = 0
        self._duplicates = 0
        self._own = 0

    def process(self, request: ExportTraceServiceRequest, received_ns: int) -> list[Outcome]:
        """Judge every span of one decoded request; see :meth:`process_payload`."""
        return self.process_payload(request.SerializeToString(), received_ns)

    def process_payload(self, payload: bytes | Any, received_ns: int) -> list[Outcome]:
        """Judge every span of one request; return the failures it originates."""
        outcomes, rest = self.first_pass(payload, received_ns)
        return outcomes + self.rest_pass(rest)

    def first_pass(self, payload: bytes | Any, received_ns: int) -> tuple[list[Outcome], Remainder]:
        """Judge the spans of one request that show signs of failure.

        ``payload`` is an ``ExportTraceServiceRequest``, encoded (as ingest
        accepted it) or decoded with the lite schema. Every span is counted in
        its run. Spans with the usual signs of failure (an ERROR status, an
        exception, a status code, a cut-off answer) are judged now, so their
        decisions do not wait for the whole batch. Of the rest, those that may
        fail quietly (a tool output that is a caught error, a call to a tool
        the model was not offered) are returned, to be judged by
        :meth:`rest_pass` once those decisions are out; the others cannot be
        failures and are never normalized (:mod:`supervisor.normalize.screen`).
        """
        reader = SpanReader(payload)
        self._batches += 1
        self._spans += len(reader)
        now_s = received_ns / 1e9
        first: list[Span] = []
        quiet: list[Span] = []
        calls: list[tuple[int, str, bool]] = []
        verify: list[Span] = []
        detected: list[Detection] = []
        runs = self.runs
        # A chunk at a time (see SpanReader), and within a chunk a step at a time.
        while spans := reader.read(_CHUNK_SPANS):
            ok: list[Span] = []
            for span in spans:
                if shows_failure_signal(span):
                    first.append(span)
                elif may_fail_quietly(span):
                    quiet.append(span)
                else:
                    ok.append(span)
            if runs is not None:
                runs.observe_all(ok, now_s, detected)
                for span in quiet:  # no error signal: a loop of them is a loop, not retries
                    runs.observe(span, now_s, detected)
            self._book_successes(ok, calls, verify)
        if runs is not None:  # a failed call tried again is a retry, not a loop
            for span in first:
                runs.observe(span, now_s, detected, repeats=not span.failed)
        if self._attempted and quiet:
            quiet = self._book_quiet_successes(quiet, calls, verify)
        outcomes = self._judge_spans(first, received_ns, calls)
        if detected:
            outcomes += self.judge_detected([detected_failure(d, received_ns) for d in detected])
        return outcomes, Remainder(quiet, verify, received_ns)

    def rest_pass(self, rest: Remainder) -> list[Outcome]:
        """Judge the spans a :meth:`first_pass` left; the batch is then settled."""
        calls: list[tuple[int, str, bool]] = []
        outcomes = self._judge_spans(rest.quiet, rest.received_ns, calls)
        if rest.verify:
            answers = [s.record() for s in rest.verify if not _only_calls_tools(s, s.record())]
            outcomes += self._verify(answers, rest.received_ns)
        if self.runs is not None:
            self.runs.settle()
        return outcomes

    def _run_of(self, trace_id: str, session_id: str) -> str:
        """A span's run, as the run tracker has it (its own session or trace, untracked)."""
        runs = self.runs
        return runs.resolve(trace_id, session_id) if runs is not None else session_id or trace_id

    def _book_successes(
        self, ok: list[Span], calls: list[tuple[int, str, bool]], verify: list[Span]
    ) -> None:
        """Spans that cannot be failures: each success booked once, and the verifiers' picks.

        Fills ``calls`` (each success, for the governor) and ``verify`` (the
        spans a verifier must see normalized).
        """
        verifiers = self.policy.verifiers
        wants = self._wants
        if wants.verifiers is not verifiers:  # a new policy
            wants = self._wants = _WantedBy(verifiers)
        for span in ok:
            if wants.verifying and wants.wanted(span):
                verify.append(span)  # its output must pass a verifier: normalize it
            dependency = span.dependency
            if dependency:
                self._succeeded(span.trace_hex, span.session_id, span, dependency, calls)

    def _book_quiet_successes(
        self, quiet: list[Span], calls: list[tuple[int, str, bool]], verify: list[Span]
    ) -> list[Span]:
        """Successes among the quiet spans of dependencies with attempts counted, booked now.

        A step's retry that succeeded with a tool call (a span the quiet
        screen keeps for later) must reset the step's attempts before the
        batch's failures are counted, or the next failure of the run counts
        as the step's next attempt. Returns the quiet spans still to judge.
        """
        left: list[Span] = []
        for span in quiet:
            dependency = span.dependency
            if dependency in self._attempted and span.record().error is None:
                self._book_successes([span], calls, verify)
            else:
                left.append(span)
        return left

    def _succeeded(
        self,
        trace_id: str,
        session_id: str,
        span: Span | SpanRecord,
        dependency: str,
        calls: list[tuple[int, str, bool]],
    ) -> None:
        """One successful call: the governor's count, the step's attempts, a recovery."""
        if self.governor is not None:
            calls.append((span.end_ns, dependency, True))
        watched = dependency in self._attempted
        recovery = self.recovery
        recovering = recovery is not None and dependency in recovery.dependencies
        if not (watched or recovering):
            return
        run_id = self._run_of(trace_id, session_id)
        if watched:
            self._attempts.pop((run_id, dependency))
        if recovering and recovery is not None:
            _recovered(recovery, trace_id, run_id, dependency, span.span_id)

    def _judge_spans(
        self, spans: list[Span], received_ns: int, calls: list[tuple[int, str, bool]]
    ) -> list[Outcome]:
        """Normalize and judge spans that may be failures; book the ones that succeeded."""
        records = [span.record() for span in spans]
        failing: list[SpanRecord] = []
        passed: list[SpanRecord] = []
        for span, record in zip(spans, records, strict=True):
            if record.error is not None:
                failing.append(record)
                continue
            if record.dependency:
                self._succeeded(span.trace_hex, span.session_id, span, record.dependency, calls)
            if not _only_calls_tools(span, record):
                passed.append(record)
        outcomes = self._judge(failing, received_ns, calls)
        return outcomes + self._verify(passed, received_ns)

    def _verify(self, records: list[SpanRecord], received_ns: int) -> list[Outcome]:
        """The policy's verifiers on spans that succeeded; what fails them is judged."""
        verifiers = self.policy.verifiers
        if not len(verifiers) or not records:
            return []
        unverified = [
            _verification_failure(
                record, self._run_of(record.trace_id, record.session_id), found, received_ns
            )
            for record in records
            for found in verifiers.check(record)
        ]
        return self.judge_detected(unverified) if unverified else []

    def _with_slo(self, failure: Failure) -> Failure:
        """The failure as policies see it: whether its service's SLO is burning fast."""
        if self.runs is not None and self.runs.burning(failure.service):
            return replace(failure, slo_burning=True)
        return failure

    def judge_detected(self, failures: list[Failure]) -> list[Outcome]:
        """Decide on failures a run detector found (loops, stalls); each once."""
        outcomes: list[Outcome] = []
        for found in failures:
            key = found.trace_id + found.span_id + found.rule
            if key in self._seen:
                self._duplicates += 1
                continue
            self._seen.set(key, True)
            self._failures += 1
            if self.runs is not None:
                self.runs.failed(found.run_id)
            failure = self._with_slo(found)
            outcomes.append(Outcome(failure, self.policy.decide(failure, attempt=1)))
        return self._finish(outcomes, [], cascades=False)

    def process_records(self, records: Iterable[SpanRecord], received_ns: int) -> list[Outcome]:
        """Like :meth:`process`, for records normalized elsewhere (tests, detectors)."""
        failing = [r for r in records if r.error is not None]
        self._batches += 1
        self._spans += len(failing)
        return self._judge(failing, received_ns, [])

    def stats(self) -> PipelineStats:
        return PipelineStats(
            processed_batches=self._batches,
            processed_spans=self._spans,
            failing_spans=self._failing,
            failures=self._failures,
            attributed=self._attributed,
            duplicates=self._duplicates,
            own_spans_skipped=self._own,
            evictions=self._seen.evictions
            + self._origin_below.evictions
            + self._origins_in.evictions
            + self._attempts.evictions,
        )

    # -- the failure path -------------------------------------------------

    def _judge(
        self, failing: list[SpanRecord], received_ns: int, calls: list[tuple[int, str, bool]]
    ) -> list[Outcome]:
        """Report each failure once, at its origin, with its decision.

        ``calls`` are the batch's successful calls; with the failures found
        here they are told to the governor in the order the calls ended
        (breakers count failures in a row), before it reviews the decisions.
        """
        candidates = self._candidates(failing)
        outcomes: list[Outcome] = []
        attributed_by = _attributions(candidates)
        for key, cand in candidates.items():
            if cand.attributed_to is not None:
                self._attributed += 1
                continue
            earlier = self._origin_below.get(key) or self._origin_within(cand)
            if earlier is not None and _propagates(cand, earlier):
                # A descendant failed in an earlier request with the same error.
                self._attributed += 1
                self._remember_origin(cand.record, earlier)
                continue
            parents = _ancestors_attributed_to(cand, candidates, attributed_by)
            failure = self._failure(cand, parents, received_ns)
            self._remember_origin((parents[-1] if parents else cand).record, cand.sig)
            self._remember_in_trace(cand)
            attempt_key = (failure.run_id, failure.dependency)
            attempt = (self._attempts.get(attempt_key) or 0) + 1
            self._attempts.set(attempt_key, attempt)
            if len(self._attempted) < 10_000:  # bounded; beyond it successes reset nothing
                self._attempted.add(failure.dependency)
            self._failures += 1
            failure = self._with_slo(failure)
            decision = self.policy.decide(failure, attempt=attempt)
            if failure.dependency and self.governor is not None and failure.kind not in RUN_KINDS:
                # A run waiting for a person is no failed call: breakers do not count it.
                calls.append((cand.record.end_ns, failure.dependency, False))
            outcomes.append(Outcome(failure, decision))
            if self.runs is not None:
                self.runs.failed(failure.run_id)
        return self._finish(outcomes, calls)

    def _candidates(self, failing: list[SpanRecord]) -> dict[str, _Candidate]:
        """The failing spans not judged before, classified, each attributed within the batch."""
        candidates: dict[str, _Candidate] = {}
        for record in failing:
            if record.service == OWN_SERVICE and record.name.startswith("spanvisor."):
                self._own += 1
                continue
            key = record.trace_id + record.span_id
            if key in self._seen or key in candidates:
                self._duplicates += 1
                continue
            self._seen.set(key, True)
            self._failing += 1
            verdict = self.policy.classify(record)
            if verdict is None:  # the policy found nothing to report
                continue
            run_id = self._run_of(record.trace_id, record.session_id)
            candidates[key] = _Candidate(record, run_id, verdict, _signature(record, verdict))
        # Within the request: a failing parent that only propagates its
        # failing child is attributed to the child.
        for cand in candidates.values():
            rec = cand.record
            if not rec.parent_span_id:
                continue
            parent = candidates.get(rec.trace_id + rec.parent_span_id)
            if (
                parent is not None
                and parent is not cand  # a malformed span that names itself its parent
                and parent.attributed_to is None
                and _propagates(parent, cand.sig)
            ):
                parent.attributed_to = cand
        if len(candidates) > 1:
            _attribute_through_ok_spans(candidates)

        return candidates

    def _finish(
        self, outcomes: list[Outcome], calls: list[tuple[int, str, bool]], *, cascades: bool = True
    ) -> list[Outcome]:
        """The governor's review and observe mode, on a batch's decisions.

        ``cascades`` false for what detectors found: those are not calls that failed.
        """
        if self.governor is not None:
            started: list[Cascade] = []
            if cascades:
                started = self.governor.observe_cascades(
                    [dependency for _, dependency, ok in calls if ok],
                    [o.failure for o in outcomes],
                )
            outcomes = self._govern(self.governor, outcomes, calls)
            if started:
                outcomes += self.judge_detected([_cascade_failure(c) for c in started])
        if self.observe_only:
            outcomes = [
                o if o.decision.observe_only else replace(o, decision=_observed(o.decision))
                for o in outcomes
            ]
        runs = self.runs
        if runs is not None:
            for o in outcomes:
                after = _goes_on_after(o)
                if after is not None:
                    runs.expect_more(o.failure.run_id, after)
        return outcomes

    @staticmethod
    def _govern(
        governor: Governor, outcomes: list[Outcome], calls: list[tuple[int, str, bool]]
    ) -> list[Outcome]:
        governor.observe_calls(calls)
        reviewed: list[Outcome] = []
        for o in outcomes:
            decision = governor.review(o.failure, o.decision)
            # Kept as it was, mostly: dataclasses.replace is the slow way to copy.
            reviewed.append(o if decision is o.decision else Outcome(o.failure, decision))
        return reviewed

    def _remember_origin(self, record: SpanRecord, sig: _Signature) -> None:
        if record.parent_span_id:
            self._origin_below.set(record.trace_id + record.parent_span_id, sig)

    def _remember_in_trace(self, origin: _Candidate) -> None:
        rec = origin.record
        reported = self._origins_in.get(rec.trace_id)
        if reported is None:
            reported = []
            self._origins_in.set(rec.trace_id, reported)
        if len(reported) >= _ORIGINS_PER_TRACE:
            del reported[0]
        reported.append(_Reported(rec.start_ns, rec.end_ns, origin.sig))

    def _origin_within(self, cand: _Candidate) -> _Signature | None:
        """The closest origin reported earlier in the trace within the span's time."""
        reported = self._origins_in.get(cand.record.trace_id)
        if not reported or cand.record.role not in _CONTAINER_ROLES:
            return None
        rec = cand.record
        inside = [
            r
            for r in reported
            if _contains(rec.start_ns, rec.end_ns, r.start_ns, r.end_ns)
            and _propagates(cand, r.sig)
        ]
        if not inside:
            return None
        return min(inside, key=lambda r: r.end_ns - r.start_ns).sig

    def _failure(
        self,
        origin: _Candidate,
        parents: list[_Candidate],
        received_ns: int,
    ) -> Failure:
        """The failure ``origin`` reports; ``parents``: its ancestors that propagate it."""
        rec = origin.record
        verdict = origin.verdict
        attributed: list[str] = []
        dependency = verdict.dependency or rec.dependency
        for parent in parents:
            attributed.append(parent.record.span_id)
            if rec.role not in _SPECIFIC_ROLES and parent.record.role in _SPECIFIC_ROLES:
                dependency = parent.record.dependency or dependency
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
            message=_summary(rec),
            evidence=rec.error,  # type: ignore[arg-type]  # only failing records get here
            received_ns=received_ns,
            attributed=tuple(attributed),
        )


def _goes_on_after(outcome: Outcome) -> float | None:
    """When a decision tells the run to go on (Unix seconds); None when it does not."""
    decision = outcome.decision
    if decision.observe_only:
        return None
    params = decision.params
    if decision.action in _GOES_ON:
        wait = params.get("delay_s")
    elif decision.action is Action.FAIL_FAST and "breaker_reopens_in_s" in params:
        wait = params.get("breaker_reopens_in_s")  # paused, resumed when it may half-open
    else:
        return None
    delay = float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) else 0.0
    return outcome.failure.received_ns / 1e9 + max(0.0, delay)


def _attributions(candidates: dict[str, _Candidate]) -> dict[str, _Candidate]:
    """Candidate key -> the first candidate (in the batch's order) attributed to it.

    Built once per batch, after attribution: looking each origin's containers
    up by scanning every candidate made a batch of n failures cost n squared,
    which is at its worst in an outage, when most spans fail.
    """
    index: dict[str, _Candidate] = {}
    for cand in candidates.values():
        target = cand.attributed_to
        if target is not None:
            index.setdefault(target.record.trace_id + target.record.span_id, cand)
    return index


def _ancestors_attributed_to(
    origin: _Candidate, candidates: dict[str, _Candidate], attributed_by: dict[str, _Candidate]
) -> list[_Candidate]:
    """The candidates attributed to ``origin``, nearest first (a parent, or a container)."""
    chain: list[_Candidate] = []
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


def _attribute_through_ok_spans(candidates: dict[str, _Candidate]) -> None:
    """Attribute failing ancestors whose failing descendant sits below a span that did not fail.

    A candidate not attributed yet that contains others of its trace in time
    and propagates their error is attributed to the closest of them: the
    longest, which holds the rest, so that nested containers (agent > step >
    call) form one chain and the failure lists each of them, nearest first.
    Durations strictly shrink along these links, and a candidate is never
    attributed to one whose own chain already leads back to it, so no cycle
    can form.
    """
    by_trace: dict[str, list[_Candidate]] = {}
    for cand in candidates.values():
        by_trace.setdefault(cand.record.trace_id, []).append(cand)
    for group in by_trace.values():
        if len(group) < 2:
            continue
        for outer in group:
            if outer.attributed_to is not None or outer.record.role not in _CONTAINER_ROLES:
                continue
            o = outer.record
            inside = [
                c
                for c in group
                if c is not outer
                and _contains(o.start_ns, o.end_ns, c.record.start_ns, c.record.end_ns)
                and _propagates(outer, c.sig)
                and not _leads_to(c, outer)
            ]
            if inside:
                outer.attributed_to = max(inside, key=lambda c: c.record.end_ns - c.record.start_ns)


def _leads_to(cand: _Candidate, target: _Candidate) -> bool:
    current = cand.attributed_to
    for _ in range(64):
        if current is None:
            return False
        if current is target:
            return True
        current = current.attributed_to
    return True  # a chain this long: refuse the link rather than risk a cycle


def _observed(decision: Decision) -> Decision:
    return replace(decision, observe_only=True)


def _signature(record: SpanRecord, verdict: Classification) -> _Signature:
    ev = record.error
    assert ev is not None  # only failing records are judged
    return _Signature(
        verdict.failure_class,
        verdict.kind,
        _tail(ev.exception_type) if ev.exception_type else "",
        (ev.exception_message or ev.status_message)[:_SIGNATURE_TEXT],
    )


def _propagates(parent: _Candidate, child: _Signature) -> bool:
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


def _summary(record: SpanRecord) -> str:
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


#: Roles a span without a dependency may have, for choosing the verifiers that want it.
_UNNAMED_ROLES: Final[tuple[Role, ...]] = (Role.AGENT, Role.CHAIN, Role.OTHER)


def _recovered(
    recovery: RecoveryListener, trace_id: str, run_id: str, dependency: str, span_id: str | bytes
) -> None:
    """Tell ``recovery`` of a success in a run (by run id and by trace id) it waits for.

    Most successes of a watched dependency are in other runs: they cost two
    lookups, not a call with a lock (nor the span id in hex).
    """
    waiting = recovery.waiting
    by_run = (run_id, dependency) in waiting
    by_trace = run_id != trace_id and (trace_id, dependency) in waiting
    if not (by_run or by_trace):
        return
    span_hex = span_id if isinstance(span_id, str) else span_id.hex()
    if by_run:
        recovery.succeeded(run_id, dependency, span_hex)
    if by_trace:
        recovery.succeeded(trace_id, dependency, span_hex)


class _WantedBy:
    """Whether some verifier looks at a successful span (it is then normalized), memoized.

    The answer depends on the span's service, name and role only, and asking
    the verifier set (interpreted, a generator per span) cost more than the
    rest of a successful span's bookkeeping. Span names are the agents' to
    choose, so the memo is bounded: cleared when full.
    """

    __slots__ = ("_by_service", "_size", "verifiers", "verifying")

    def __init__(self, verifiers: VerifierSet | None) -> None:
        self.verifiers = verifiers
        #: Whether there are any (``len`` of the set runs interpreted: asked once).
        self.verifying = verifiers is not None and len(verifiers) > 0
        # service -> span name -> a bit per role group (_TOOL, _HTTP, _LLM, _UNNAMED)
        self._by_service: dict[str, dict[str, int]] = {}
        self._size = 0

    def wanted(self, span: Span) -> bool:
        service, name, dependency = span.service, span.name, span.dependency
        by_name = self._by_service.get(service)
        if by_name is None:
            by_name = self._by_service[service] = {}
        bits = by_name.get(name)
        if bits is None:
            bits = self._ask(service, name)
            if self._size >= _WANTED_ENTRIES:
                self._by_service = {service: by_name}
                by_name.clear()
                self._size = 0
            by_name[name] = bits
            self._size += 1
        if dependency.startswith("tool:"):
            return bits & _TOOL != 0
        if dependency.startswith("http:"):
            return bits & _HTTP != 0
        if dependency:
            return bits & _LLM != 0
        return bits & _UNNAMED != 0

    def _ask(self, service: str, name: str) -> int:
        verifiers = self.verifiers
        if verifiers is None:
            return 0
        bits = 0
        if verifiers.wants(service, Role.TOOL, name):
            bits |= _TOOL
        if verifiers.wants(service, Role.HTTP, name):
            bits |= _HTTP
        if verifiers.wants(service, Role.LLM, name):
            bits |= _LLM
        if any(verifiers.wants(service, role, name) for role in _UNNAMED_ROLES):
            bits |= _UNNAMED
        return bits


_TOOL: Final = 1
_HTTP: Final = 2
_LLM: Final = 4
_UNNAMED: Final = 8
_WANTED_ENTRIES: Final = 4096


def _verification_failure(
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


def _cascade_failure(found: Cascade) -> Failure:
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


def _only_calls_tools(span: Span, record: SpanRecord) -> bool:
    """An LLM turn with no text that asked for tool calls: not an answer to verify."""
    if record.role is not Role.LLM or record.output_text:
        return False
    requested = span.requested()
    return requested is not None and bool(requested_calls(requested))
