"""From a decoded OTLP request to failures and decisions, with no I/O.

The pipeline is synchronous and deterministic so that ``spanvisor run`` and
``spanvisor replay`` give the same verdicts on the same spans. Only spans that
may be failures are normalized (:mod:`supervisor.normalize.screen` decides
that from a few attributes), and only those that are go further (dedup,
classification, attribution, decision), so spans that succeed pay little.

Each stage has its module: which successes verifiers read
(:mod:`.verifying`), where each failure originates (:mod:`.attribution`),
what a failure says (:mod:`.failures`); the policy classifies and decides,
the governor (breakers, budgets) revises.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from policies import Cascade, Policy, counts_for_breaker
from supervisor.act.commands import plan_commands
from supervisor.bounded import BoundedMap
from supervisor.judge.attribution import Attribution, Candidate, signature
from supervisor.judge.failures import (
    cascade_failure,
    detected_failure,
    failure_at,
    verification_failure,
)
from supervisor.judge.steps import Steps, chunks, drive
from supervisor.judge.verifying import WantedBy, only_calls_tools
from supervisor.normalize import Span, SpanReader, may_fail_quietly, shows_failure_signal
from supervisor.records import Action, Decision, Failure, SpanRecord, own_run
from supervisor.runs import Detection, RunTracker

__all__ = [
    "OWN_SERVICE",
    "Governor",
    "Outcome",
    "Pipeline",
    "PipelineStats",
    "RecoveryListener",
    "Remainder",
    "detected_failure",
]

#: Resource ``service.name`` of the sidecar's own spans, never judged again.
OWN_SERVICE: Final = "spanvisor"
#: Spans read at a time from a request (SpanReader): about 45 KB of attributes,
#: which stay in the caches while each step goes over them.
_CHUNK_SPANS: Final = 32


class Governor(Protocol):
    """State kept across failures (breakers, retry budget, restart intensity).

    The pipeline tells it every call outcome it sees, as (end time, breaker
    key, ok) (``observe_calls``; the key is the dependency, with ``@credential``
    when the span names one), and lets it revise each decision (``review``) after
    the failure it is about was observed, so the failure that trips a breaker
    already gets the breaker's decision. Called from the pipeline's thread only.
    """

    def observe_calls(self, calls: list[tuple[int, str, bool]]) -> None: ...

    @property
    def times_calls(self) -> bool:
        """Whether ``observe_durations`` wants the calls' durations (a slow-call breaker)."""
        ...

    def observe_durations(self, calls: list[tuple[str, int]]) -> None: ...

    def observe_cascades(self, successes: list[str], failures: list[Failure]) -> list[Cascade]: ...

    def review(self, failure: Failure, decision: Decision) -> Decision: ...


class RecoveryListener(Protocol):
    """What waits for a run's later successes (remediation verification).

    ``dependencies`` and ``waiting`` are looked up on the success path
    without a lock, so they must be a set and a dict (or alike); only a
    (run, dependency) pair in ``waiting`` is passed to ``succeeded``, which
    runs on the pipeline's thread and must not block. ``ended`` hears of
    every root span that ended OK (a run that ended is a recovery too), on
    the same thread, and must not block either.
    """

    @property
    def dependencies(self) -> Collection[str]: ...

    @property
    def waiting(self) -> Collection[tuple[str, str]]: ...

    def succeeded(self, run: str, dependency: str, span_id: str) -> None: ...

    def ended(self, trace_id: str, run: str, span_id: str) -> None: ...


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
        self._attribution = Attribution(seen_capacity=seen_capacity, traces_capacity=runs_capacity)
        # (run, dependency) → failures since its last success in the run: a step's
        # attempts (the retry of a step is another call of the same dependency).
        self._attempts: BoundedMap[tuple[str, str], int] = BoundedMap(runs_capacity)
        # Dependencies with attempts counted: only their successes are looked up.
        self._attempted: set[str] = set()
        # (dependency, duration ns) of the calls seen since the governor was last told,
        # filled only when it counts slow calls.
        self._durations: list[tuple[str, int]] = []
        # Which verifiers want a successful span, memoized per policy (_WantedBy).
        self._wants = WantedBy(None)
        #: Told when a dependency that a remediation waits for succeeds in a run.
        self.recovery = recovery
        #: Every span's run: progress, loops, stalls (None: not tracked).
        self.runs = runs
        self._batches = 0
        self._spans = 0
        self._failing = 0
        self._failures = 0
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
        """Judge the spans of a request showing signs of failure; see :meth:`first_pass_steps`."""
        return drive(self.first_pass_steps(payload, received_ns))

    def first_pass_steps(
        self, payload: bytes | Any, received_ns: int
    ) -> Steps[tuple[list[Outcome], Remainder]]:
        """Judge the spans of one request that show signs of failure, a chunk at a time.

        Work in steps (:mod:`.steps`): it yields after each chunk of spans read
        and of failures judged, so a caller on an event loop can let other
        work run while a big request is judged, and returns what
        :meth:`first_pass` returns. Driven to the end with nothing else
        touching this pipeline in between, the decisions are those of one go:
        attribution still sees every failing span of the request.

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
            maybe: list[Span] = []
            for span in spans:
                if shows_failure_signal(span):
                    span.record()  # made (once) here, a chunk at a time, not all at the end
                    first.append(span)
                elif may_fail_quietly(span):
                    maybe.append(span)
                else:
                    ok.append(span)
            if runs is not None:
                runs.observe_all(ok, now_s, detected)
                # No error signal: a loop of these is a loop, not retries.
                runs.observe_all(maybe, now_s, detected)
            self._book_successes(ok, calls, verify)
            quiet += maybe
            yield
        if runs is not None:  # a failed call tried again is a retry, not a loop
            for chunk in chunks(first):
                for span in chunk:
                    runs.observe(span, now_s, detected, repeats=not span.failed)
                yield
            # Sessions' loops and budgets, fleet-wide: one round trip, made while the
            # batch's failures are judged and reported; its answer in the rest pass.
            runs.share_begin(detected)
        if self._attempted and quiet:
            quiet = yield from self._book_quiet_successes(quiet, calls, verify)
        outcomes = yield from self._judge_spans(first, received_ns, calls)
        if detected:
            outcomes += yield from self.judge_detected_steps(self._found(detected, received_ns))
        return outcomes, Remainder(quiet, verify, received_ns)

    def _found(self, detected: list[Detection], received_ns: int) -> list[Failure]:
        """What run detectors found while the batch was read, as failures of their run.

        A span read later may have named the trace's session since, and the
        trace's run became the session's.
        """
        return [
            replace(detected_failure(d, received_ns), run_id=self._run_of(d.trace_id, ""))
            for d in detected
        ]

    def rest_pass(self, rest: Remainder) -> list[Outcome]:
        """Judge the spans a :meth:`first_pass` left; see :meth:`rest_pass_steps`."""
        return drive(self.rest_pass_steps(rest))

    def rest_pass_steps(self, rest: Remainder) -> Steps[list[Outcome]]:
        """Judge the spans a :meth:`first_pass_steps` left, in steps; the batch is then settled."""
        calls: list[tuple[int, str, bool]] = []
        outcomes: list[Outcome] = []
        if self.runs is not None:  # what the fleet found in sessions' runs (its answer)
            shared: list[Detection] = []
            yield from self.runs.share_end_steps(shared)
            if shared:
                found = self._found(shared, rest.received_ns)
                outcomes += yield from self.judge_detected_steps(found)
        outcomes += yield from self._judge_spans(rest.quiet, rest.received_ns, calls)
        if rest.verify:
            answers: list[SpanRecord] = []
            for chunk in chunks(rest.verify):
                answers += [r for r in (s.record() for s in chunk) if not only_calls_tools(r)]
                yield
            outcomes += yield from self._verify(answers, rest.received_ns)
        if self.runs is not None:
            self.runs.settle()
        return outcomes

    def _run_of(self, trace_id: str, session_id: str) -> str:
        """A span's run, as the run tracker has it (its own session or trace, untracked)."""
        runs = self.runs
        if runs is None:
            return own_run(trace_id, session_id)
        return runs.resolve(trace_id, session_id)

    def _book_successes(
        self, ok: list[Span], calls: list[tuple[int, str, bool]], verify: list[Span]
    ) -> None:
        """Spans that cannot be failures: each success booked once, and the verifiers' picks.

        Fills ``calls`` (each success, for the governor) and ``verify`` (the
        spans a verifier must see normalized). Most successes only count for
        the governor; the rest of :meth:`_succeeded` is asked only of those
        whose dependency has attempts counted or a remediation waiting.
        """
        verifiers = self.policy.verifiers
        wants = self._wants
        if wants.verifiers is not verifiers:  # a new policy
            wants = self._wants = WantedBy(verifiers)
        counting = self.governor is not None
        timing = self.governor is not None and self.governor.times_calls
        durations = self._durations
        attempted = self._attempted
        recovery = self.recovery
        recovering = recovery.dependencies if recovery is not None else ()
        for span in ok:
            if wants.verifying and wants.wanted(span):
                verify.append(span)  # its output must pass a verifier: normalize it
            if recovery is not None and span.is_root:
                self._ended_ok(recovery, span)
            dependency = span.dependency
            if not dependency:
                continue
            if counting:
                key = span.breaker_key
                calls.append((span.end_ns, key, True))
                if timing:
                    durations.append((key, span.end_ns - span.start_ns))
            if dependency in attempted or dependency in recovering:
                self._step_succeeded(span, dependency)

    def _book_quiet_successes(
        self, quiet: list[Span], calls: list[tuple[int, str, bool]], verify: list[Span]
    ) -> Steps[list[Span]]:
        """Successes among the quiet spans of dependencies with attempts counted, booked now.

        A step's retry that succeeded with a tool call (a span the quiet
        screen keeps for later) must reset the step's attempts before the
        batch's failures are counted, or the next failure of the run counts
        as the step's next attempt. Returns the quiet spans still to judge.
        """
        left: list[Span] = []
        for chunk in chunks(quiet):
            for span in chunk:
                dependency = span.dependency
                if dependency in self._attempted and span.record().error is None:
                    self._book_successes([span], calls, verify)
                else:
                    left.append(span)
            yield
        return left

    def _succeeded(self, span: Span, dependency: str, calls: list[tuple[int, str, bool]]) -> None:
        """One successful call: the governor's count, the step's attempts, a recovery."""
        governor = self.governor
        if governor is not None:
            key = span.breaker_key
            calls.append((span.end_ns, key, True))
            if governor.times_calls:
                self._durations.append((key, span.end_ns - span.start_ns))
        self._step_succeeded(span, dependency)

    def _step_succeeded(self, span: Span, dependency: str) -> None:
        """A success ends its step's attempts, and may be the recovery a remediation waits for."""
        watched = dependency in self._attempted
        recovery = self.recovery
        recovering = recovery is not None and dependency in recovery.dependencies
        if not (watched or recovering):
            return
        trace_id = span.trace_hex
        run_id = self._run_of(trace_id, span.session_id)
        if watched:
            self._attempts.pop((run_id, dependency))
        if recovering and recovery is not None:
            _recovered(recovery, trace_id, run_id, dependency, span.span_id)

    def _ended_ok(self, recovery: RecoveryListener, span: Span) -> None:
        """A root span that ended OK: its run may be what a remediation waits to recover."""
        trace_id = span.trace_hex
        recovery.ended(trace_id, self._run_of(trace_id, span.session_id), span.span_id.hex())

    def _judge_spans(
        self, spans: list[Span], received_ns: int, calls: list[tuple[int, str, bool]]
    ) -> Steps[list[Outcome]]:
        """Normalize and judge spans that may be failures; book the ones that succeeded."""
        failing: list[SpanRecord] = []
        passed: list[SpanRecord] = []
        for chunk in chunks(spans):
            for span in chunk:
                record = span.record()
                if record.error is not None:
                    failing.append(record)
                    continue
                if self.recovery is not None and span.is_root:
                    self._ended_ok(self.recovery, span)
                if record.dependency:
                    self._succeeded(span, record.dependency, calls)
                if not only_calls_tools(record):
                    passed.append(record)
            yield
        outcomes = yield from self._judge(failing, received_ns, calls)
        return outcomes + (yield from self._verify(passed, received_ns))

    def _verify(self, records: list[SpanRecord], received_ns: int) -> Steps[list[Outcome]]:
        """The policy's verifiers on spans that succeeded; what fails them is judged."""
        verifiers = self.policy.verifiers
        if not len(verifiers) or not records:
            return []
        unverified: list[Failure] = []
        for record in records:
            found = verifiers.check(record)
            yield  # a span at a time: a verifier's regex or schema may search for its time limit
            if found:
                run_id = self._run_of(record.trace_id, record.session_id)
                unverified += [verification_failure(record, run_id, f, received_ns) for f in found]
        return (yield from self.judge_detected_steps(unverified)) if unverified else []

    def _with_slo(self, failure: Failure) -> Failure:
        """The failure as policies see it: whether its service's SLO is burning fast."""
        if self.runs is not None and self.runs.burning(failure.service):
            return replace(failure, slo_burning=True)
        return failure

    def judge_detected(self, failures: list[Failure]) -> list[Outcome]:
        """Decide on failures a run detector found (loops, stalls); each once."""
        return drive(self.judge_detected_steps(failures))

    def judge_detected_steps(self, failures: list[Failure]) -> Steps[list[Outcome]]:
        """:meth:`judge_detected`, in steps."""
        outcomes: list[Outcome] = []
        for chunk in chunks(failures):
            for found in chunk:
                key = found.trace_id + found.span_id + found.rule
                if key in self._seen:
                    self._duplicates += 1
                    continue
                self._seen.set(key, True)
                self._failures += 1
                if self.runs is not None:
                    self.runs.failed(found.run_id, found.rule)
                failure = self._with_slo(found)
                outcomes.append(Outcome(failure, self.policy.decide(failure, attempt=1)))
            yield
        return (yield from self._finish(outcomes, [], cascades=False))

    def process_records(self, records: Iterable[SpanRecord], received_ns: int) -> list[Outcome]:
        """Like :meth:`process`, for records normalized elsewhere (tests, detectors)."""
        failing = [r for r in records if r.error is not None]
        self._batches += 1
        self._spans += len(failing)
        return drive(self._judge(failing, received_ns, []))

    def stats(self) -> PipelineStats:
        return PipelineStats(
            processed_batches=self._batches,
            processed_spans=self._spans,
            failing_spans=self._failing,
            failures=self._failures,
            attributed=self._attribution.attributed,
            duplicates=self._duplicates,
            own_spans_skipped=self._own,
            evictions=self._seen.evictions + self._attribution.evictions + self._attempts.evictions,
        )

    # -- the failure path -------------------------------------------------

    def _judge(
        self, failing: list[SpanRecord], received_ns: int, calls: list[tuple[int, str, bool]]
    ) -> Steps[list[Outcome]]:
        """Report each failure once, at its origin, with its decision.

        ``calls`` are the batch's successful calls; with the failures found
        here they are told to the governor in the order the calls ended
        (breakers count failures in a row), before it reviews the decisions.
        """
        candidates = yield from self._candidates(failing)
        self._attribution.link(candidates)
        yield
        outcomes: list[Outcome] = []
        for chunk in chunks(self._attribution.origins(candidates)):
            yield from self._decide(chunk, received_ns, calls, outcomes)
        outcomes = yield from self._finish(outcomes, calls)
        del candidates
        yield
        return outcomes

    def _decide(
        self,
        origins: list[tuple[Candidate, list[Candidate]]],
        received_ns: int,
        calls: list[tuple[int, str, bool]],
        outcomes: list[Outcome],
    ) -> Steps[None]:
        """Each origin's failure, counted as its step's next attempt, decided; into ``outcomes``."""
        for cand, parents in origins:
            failure = failure_at(cand, parents, received_ns)
            attempt_key = (failure.run_id, failure.dependency)
            attempt = (self._attempts.get(attempt_key) or 0) + 1
            self._attempts.set(attempt_key, attempt)
            if len(self._attempted) < 10_000:  # bounded; beyond it successes reset nothing
                self._attempted.add(failure.dependency)
            self._failures += 1
            failure = self._with_slo(failure)
            decision = self.policy.decide(failure, attempt=attempt)
            if failure.dependency and self.governor is not None and counts_for_breaker(failure):
                # Only a transient failure says the dependency is unhealthy: a 401, a bad
                # answer or a run waiting for a person is no failed call to its breaker.
                record = cand.record
                key = failure.breaker_key
                calls.append((record.end_ns, key, False))
                if self.governor.times_calls:
                    self._durations.append((key, record.end_ns - record.start_ns))
            outcomes.append(Outcome(failure, decision))
            if self.runs is not None:
                self.runs.failed(failure.run_id, failure.rule)
        yield

    def _candidates(self, failing: list[SpanRecord]) -> Steps[dict[str, Candidate]]:
        """The failing spans not judged before (nor the sidecar's own), classified."""
        candidates: dict[str, Candidate] = {}
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
            yield  # a span at a time: a rule's regex may search for its time limit
            if verdict is None:  # the policy found nothing to report
                continue
            run_id = self._run_of(record.trace_id, record.session_id)
            candidates[key] = Candidate(record, run_id, verdict, signature(record, verdict))
        return candidates

    def _finish(
        self, outcomes: list[Outcome], calls: list[tuple[int, str, bool]], *, cascades: bool = True
    ) -> Steps[list[Outcome]]:
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
            durations, self._durations = self._durations, []
            outcomes = yield from self._govern(self.governor, outcomes, calls, durations)
            if started:
                outcomes += yield from self.judge_detected_steps(
                    [cascade_failure(c) for c in started]
                )
        if self.observe_only:
            outcomes = [
                o if o.decision.observe_only else replace(o, decision=_observed(o.decision))
                for o in outcomes
            ]
        runs = self.runs
        if runs is not None:
            # Every decision for its run as it was, then the commands' effect on the runs.
            as_it_is: list[Outcome] = []
            for chunk in chunks(outcomes):
                as_it_is += [_for_run_as_it_is(runs, o) for o in chunk]
                yield
            outcomes = as_it_is
            for chunk in chunks(outcomes):
                for o in chunk:
                    if not o.decision.observe_only:
                        _tell_commands(runs, o)
                yield
        return outcomes

    @staticmethod
    def _govern(
        governor: Governor,
        outcomes: list[Outcome],
        calls: list[tuple[int, str, bool]],
        durations: list[tuple[str, int]],
    ) -> Steps[list[Outcome]]:
        governor.observe_calls(calls)
        if durations:
            governor.observe_durations(durations)
        yield
        reviewed: list[Outcome] = []
        for chunk in chunks(outcomes):
            for o in chunk:
                decision = governor.review(o.failure, o.decision)
                # Kept as it was, mostly: dataclasses.replace is the slow way to copy.
                reviewed.append(o if decision is o.decision else Outcome(o.failure, decision))
            yield
        return reviewed


def _for_run_as_it_is(runs: RunTracker, outcome: Outcome) -> Outcome:
    """The decision, for the run as it now is (:mod:`supervisor.runs.phase`).

    A run paused for a person's answer is moved on by nothing but that answer
    (or its deadline): a decision about another of its failures sends nothing.
    A run that is one trace whose root span arrived is not paused (nothing
    runs); an escalation still asks the person, whose answer the agent may be
    waiting for. Commands that start a run again (retry, fallback) still go to
    a run whose root span ended: an agent that caught the error may be
    waiting for the sidecar's verdict, and a silence after it is a stall.
    """
    failure, decision = outcome.failure, outcome.decision
    if decision.action is Action.NONE or decision.observe_only:
        return outcome
    if decision.action is Action.ESCALATE and runs.turn_ended(failure.run_id, failure.trace_id):
        params = {**decision.params, "run_ended": True}
        return Outcome(failure, replace(decision, params=params))
    if not runs.awaiting_person(failure.run_id) or failure.kind == "approval_required":
        return outcome
    why = "the run is paused for a person's answer: only that answer resumes it"
    params = {**decision.params, "proposed_action": decision.action.value}
    reason = f"{decision.reason}; {why}" if decision.reason else why
    return Outcome(failure, replace(decision, action=Action.NONE, params=params, reason=reason))


def _tell_commands(runs: RunTracker, outcome: Outcome) -> None:
    """The phase the commands planned for an outcome put its run in."""
    now = outcome.failure.received_ns / 1e9
    for command in plan_commands(outcome.failure, outcome.decision, now):
        runs.commanded(command.run_id, command.type.value, command.not_before, command.params, now)


def _observed(decision: Decision) -> Decision:
    return replace(decision, observe_only=True)


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
