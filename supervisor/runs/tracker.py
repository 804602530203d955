"""Each run's progress, from every span, and the detectors that need it.

A run is a trace, or the session it names (see
:func:`supervisor.normalize.span.session_of`). A span that names no session
belongs to the session its trace named, if any: :meth:`RunTracker.run_of`
says which run a span belongs to, and the judging asks it, so that a failure,
its attempts and the run detectors all speak of the same run.

The detectors that need a run's history:

* **loops** (:mod:`.loops`): the same call repeated within the run's recent calls;
* **stalls**: a run that is open, or was told to go on, and has been silent
  for longer than its service's rhythm allows (:mod:`.rhythm`), one detection
  per silence, from a timer (:meth:`RunTracker.stalled`, with an injectable
  clock); it lists the tool calls the last LLM response asked for that no tool
  span answered, the work whose effects are unverified. A run that ended, or
  that is paused, never stalls: where a run is in its life is kept by
  :mod:`.phase`, from its spans and from the commands the sidecar sends it;
* **context pressure and budgets** (:mod:`.spend`), from token counts;
* **re-anchoring**: a long run reminded of its objective.

Every LLM call is also told to :attr:`RunTracker.llm_calls` (admission control
learns a model's usual tokens and its provider's published limits): its key
(``provider:model``, ``@credential`` when the span names one: a provider's
limits are its API key's), its tokens, and the provider's rate-limit headers
the span recorded, or the plain HTTP span under it did (an instrumentation
that captures response headers puts them there; the child ends, and is seen,
first).

A session's run may reach several sidecars of a fleet: with a ``fleet``
(:mod:`.fleet`, through the breakers' Redis), its loops and budget are
counted fleet-wide too, one round trip per batch (:meth:`RunTracker.share_begin`).

Bounded: at most ``max_runs`` runs (the least recently active is evicted),
and runs idle for ``max_idle_s`` are dropped; both are counted.

Lifecycle: built by the wiring, then :meth:`restore` d from the journal of a
sidecar that ran before (:mod:`.journal`); :meth:`observe`, :meth:`share_begin`
(once a batch's spans are observed) and :meth:`share_end_steps`,
:meth:`run_of`, :meth:`commanded` and :meth:`failed` from the pipeline's
thread; :meth:`stalled`, :meth:`share_backlog`, :meth:`snapshot` and
:meth:`journal_changes` from the
same thread (the event loop), never concurrently. :meth:`notice` is the one
method other threads may call: what it is told is applied on the next tick.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from policies import SERVICE_BUDGET_RULE, DetectorSettings, ModelTable, SloSpec, SloTracker
from supervisor.judge.steps import Steps
from supervisor.normalize.span import Span, requested_calls
from supervisor.records import RateLimitHeaders, own_run
from supervisor.runs import phase
from supervisor.runs.detection import (
    NOTICE_RULES,
    REANCHOR_RULE,
    STALL_RULE,
    Detection,
    detection_at,
    loop_detection,
)
from supervisor.runs.journal import SavedRun
from supervisor.runs.loops import RecentCalls, digest, instance_of, stable_digest
from supervisor.runs.rhythm import MIN_GAP_S, Rhythm, idle_limit
from supervisor.runs.spend import Charges
from supervisor.runs.state import RunState, RunView, view

if TYPE_CHECKING:
    from supervisor.runs.fleet import FleetRuns, RunShare

__all__ = ["RunTracker"]

_MAX_SERVICES: Final = 1024
#: Tools remembered per run since its last LLM response (for stall reports).
_MAX_SINCE_LLM: Final = 64
#: Traces whose run the batch cache keeps (a request holds a few dozen).
_MAX_BATCH_TRACES: Final = 4096
#: Spans whose contributions to the fleet's counts are gathered before they are sent
#: (mid-batch if need be): one script call of this many takes Redis a few milliseconds.
_MAX_SHARED: Final = 1024
#: HTTP spans' rate-limit headers kept for their LLM parent (which ends after them).
_MAX_HEADERS_PENDING: Final = 1024
#: Commands and delivery failures told by other threads, applied on the next tick.
_MAX_NOTICES: Final = 100_000
#: A run's end counts in its SLO once it stayed ended this long: the decision on
#: the failure that ended it may still tell it to go on.
SLO_GRACE_S: Final = 5.0
#: How stale a journaled run's last span may be (see :meth:`RunTracker.journal_changes`).
JOURNAL_SLACK_S: Final = 5.0
_SAME_CALL: Final = "the same tool call"
_SAME_OUTPUT: Final = "the same LLM output"
#: What a loop compares of a call: its encoded value, what tells its instances
#: apart, and how a report names it.
_Compared = tuple[bytes, int, str]


class RunTracker:
    """Per-run state for every span; see the module docstring."""

    def __init__(
        self,
        *,
        settings: Callable[[str], DetectorSettings] = lambda service: DetectorSettings(),
        models: ModelTable | None = None,
        slo: SloSpec | None = None,
        max_runs: int = 10_000,
        max_idle_s: float = 6 * 3600.0,
        clock: Callable[[], float] = time.time,
        slo_grace_s: float = SLO_GRACE_S,
        journaling: bool = False,
        fleet: FleetRuns | None = None,
    ) -> None:
        self._settings = settings
        #: Told every LLM call: its dependency (``@credential`` when named), tokens and
        #: rate-limit headers (set by the wiring).
        self.llm_calls: Callable[[str, int, RateLimitHeaders | None], None] | None = None
        #: Parent span id -> the rate-limit headers its HTTP child recorded.
        self._headers: OrderedDict[bytes, RateLimitHeaders] = OrderedDict()
        #: Where a session's loops and budget are counted fleet-wide (None: here only).
        self.fleet = fleet
        self._charges = Charges(models, fleet=None if fleet is None else fleet.services)
        #: Run outcomes per service, against the policy's SLO (None: no SLOs).
        self.slo = SloTracker(slo, clock=clock) if slo is not None else None
        #: Runs that ended, with when: counted in the SLO once they stayed ended
        #: ``slo_grace_s`` (a decision may yet tell them to go on).
        self._ending: deque[tuple[RunState, float]] = deque()
        self.slo_grace_s = slo_grace_s
        #: Each service's rhythm: how long a silence is a stall.
        self.rhythm = Rhythm()
        #: (run id, command type, not_before, params, dead) from other threads.
        self._notices: deque[tuple[str, str, float, Mapping[str, object], bool]] = deque()
        self.notices_dropped = 0
        #: Whether a journal reads :meth:`journal_changes` (set by the wiring): without
        #: one, changed runs are not remembered at all.
        self.journaling = journaling
        #: Runs changed since the journal last saved them, and runs that left.
        self._dirty: set[str] = set()
        self._left: set[str] = set()
        #: Whether a fleet's run table reads :meth:`publish_changes` (set by the wiring).
        self.publishing = False
        #: Runs to publish at the next round, and the last span time already looked at.
        self._unpublished: set[str] = set()
        self._published_to = 0.0
        self._settings_memo: dict[str, DetectorSettings] = {}
        self.max_runs = max_runs
        self.max_idle_s = max_idle_s
        #: No run silent for less than this can stall: the policy's shortest
        #: ``idle_seconds`` (0: not known, the timer looks at every run). Runs are
        #: kept least recently active first, so the timer stops at the first run
        #: this recent instead of visiting a full table.
        self.stall_horizon_s = 0.0
        self._clock = clock
        #: run id -> state, least recently active first
        self._runs: OrderedDict[str, RunState] = OrderedDict()
        #: trace (hex) -> the session it named, for its spans that do not name it. Two
        #: generations: the older is dropped whole when the newer holds half the bound.
        self._sessions: dict[str, str] = {}
        self._sessions_before: dict[str, str] = {}
        self.evicted = 0
        self.expired = 0
        #: trace id -> its run, for the rest of the batch: a batch holds the interleaved
        #: spans of a few dozen traces, and most spans then find their run in one lookup.
        #: A run that left the tracker is marked gone and looked up again.
        self._batch: dict[bytes, RunState] = {}

    def __len__(self) -> int:
        return len(self._runs)

    @property
    def models(self) -> ModelTable | None:
        """Context windows and prices (None: no context pressure, no budgets, no cost)."""
        return self._charges.models

    @models.setter
    def models(self, table: ModelTable | None) -> None:
        self._charges = Charges(table, self._charges.services, self._charges.fleet)

    def settings_for(self, service: str) -> DetectorSettings:
        found = self._settings_memo.get(service)
        if found is None:
            if len(self._settings_memo) >= _MAX_SERVICES:
                self._settings_memo.clear()
            found = self._settings_memo[service] = self._settings(service)
        return found

    def reset_settings(self) -> None:
        """The policy changed: settings are read again."""
        self._settings_memo.clear()

    # -- which run --------------------------------------------------------------

    def run_of(self, span: Span) -> str:
        """The run ``span`` belongs to: the session its trace named, else its trace.

        A trace never changes session: once one of its spans named a session,
        its later spans are that session's, whatever they carry.
        """
        return self.resolve(span.trace_hex, span.session_id)

    def resolve(self, trace_id: str, session_id: str) -> str:
        """:meth:`run_of` for a span known by its trace id (hex) and the session it names."""
        known = self._sessions.get(trace_id) or self._sessions_before.get(trace_id)
        if known:
            return known
        if session_id:
            self._remember_session(trace_id, session_id)
        return own_run(trace_id, session_id)

    def _remember_session(self, trace_id: str, session_id: str) -> None:
        sessions = self._sessions
        if len(sessions) >= max(1, self.max_runs // 2):
            self._sessions_before = sessions
            sessions = self._sessions = {}
        sessions[trace_id] = session_id

    # -- the span path ------------------------------------------------------------

    def observe_all(self, spans: Iterable[Span], now: float, found: list[Detection]) -> None:
        """:meth:`observe` each of a batch's spans that showed no failure."""
        for span in spans:
            self.observe(span, now, found)

    def observe(
        self, span: Span, now: float, found: list[Detection], *, repeats: bool = True
    ) -> None:
        """Count one span in its run; what it makes a detector find is appended to ``found``.

        ``repeats`` false for a span that failed: a failed call tried again is
        a retry, which policies handle, not a loop.
        """
        run = self._run_for(span, now)
        span_id = span.span_id
        run.last_seen = now
        run.spans += 1
        run.stalled = False
        run.last_span = span_id
        self._turn(run, span, now)
        dependency = span.dependency
        if not dependency or dependency.startswith("http:"):
            if span.has_rate_limits and self.llm_calls is not None:
                self._held_headers(span)
            return
        name = span.name
        run.step = name
        run.last_dependency = dependency
        settings = self._settings_memo.get(span.service) or self.settings_for(span.service)
        if settings.reanchor_after is not None or settings.reanchor_after_s is not None:
            self._reanchor(run, settings, span_id, dependency, now=now, found=found)
        tool = dependency.startswith("tool:")
        # A session's run may be seen by several sidecars: its loops and budget are
        # counted fleet-wide too (a trace's run stays here: it reaches one sidecar).
        fleet = self.fleet
        share = None
        if fleet is not None and not run.by_trace:
            if fleet.pending >= _MAX_SHARED:
                fleet.count(found)  # a batch this big is sent in parts: bounded
            share = fleet.share_of(run)
        compared = (
            self._tool_call(run, span, dependency)
            if tool
            else self._llm_call(run, span, dependency, settings, found, share=share, now=now)
        )
        if compared is None or not settings.loops or not repeats:
            return
        raw, instance, what = compared
        calls = run.tools if tool else run.outputs
        if calls is None:
            calls = RecentCalls()
            if tool:
                run.tools = calls
            else:
                run.outputs = calls
        first = calls.count(
            digest(raw, dependency),
            instance,
            span_id=span_id,
            name=name,
            start_ns=span.start_ns,
            now_ns=int(now * 1e9),
            repeats=settings.loop_repeats,
            window=settings.loop_window,
        )
        loop = (
            None
            if first is None
            else loop_detection(run, dependency, first, repeats=settings.loop_repeats, what=what)
        )
        if share is None:
            if loop is not None:
                found.append(loop)
            return
        share.call(
            tool=tool,
            digest=stable_digest(raw, dependency),
            # What tells its calls apart, as ``instance`` does (see _llm_call): its span
            # id (""), or an LLM call's prompt size.
            instance="" if tool or not span.input_tokens else f"p{span.input_tokens}",
            span_id=span_id,
            name=name,
            start_ns=span.start_ns,
            now_ns=int(now * 1e9),
            settings=settings,
            dependency=dependency,
            what=what,
            held=loop,
        )

    def share(self, found: list[Detection]) -> None:
        """:meth:`share_begin` and :meth:`share_end_steps` in one go."""
        if self.fleet is not None:
            self.fleet.count(found)

    def share_begin(self, found: list[Detection]) -> None:
        """Once the batch's spans are observed: start counting what sessions' runs add to
        the fleet's counts (one Redis round trip, in a worker thread; see :mod:`.fleet`).

        Without a fleet, nothing. ``found`` gets what a round trip not collected found.
        """
        if self.fleet is not None:
            self.fleet.send(found)

    def share_backlog(self, found: list[Detection]) -> None:
        """Between batches: what the fleet did not count while Redis was away, sent when it
        may answer (see :meth:`.FleetRuns.catch_up`); never waits. Without a fleet, nothing."""
        if self.fleet is not None:
            self.fleet.catch_up(found)

    def share_end_steps(self, found: list[Detection]) -> Steps[None]:
        """What the fleet, or this sidecar's own count, found in sessions' runs goes to
        ``found``: awaited if Redis has not answered yet."""
        if self.fleet is not None:
            yield from self.fleet.collect_steps(found)

    def _held_headers(self, span: Span) -> None:
        """An HTTP span's rate-limit headers, kept for the LLM call it made (its parent)."""
        parent = span.message.parent_span_id
        limits = span.rate_limits()
        if not parent or limits is None:
            return
        held = self._headers
        held[parent] = limits
        if len(held) > _MAX_HEADERS_PENDING:
            held.popitem(last=False)

    @staticmethod
    def _tool_call(run: RunState, span: Span, dependency: str) -> _Compared:
        """Count a tool call; what a loop of it compares (its arguments, as encoded)."""
        run.tool_calls += 1
        if run.last_llm is not None:
            since = run.tools_since_llm
            if since is None:
                since = run.tools_since_llm = []
            if len(since) < _MAX_SINCE_LLM:
                since.append(dependency)
        raw = span.tool_arguments or b""  # a tool called without arguments: b""
        return raw, instance_of(span.span_id), _SAME_CALL

    def _llm_call(
        self,
        run: RunState,
        span: Span,
        dependency: str,
        settings: DetectorSettings,
        found: list[Detection],
        *,
        share: RunShare | None,
        now: float,
    ) -> _Compared | None:
        """Count an LLM call, its tokens and spend; what a loop of it compares (its answer).

        ``share``: the run's fleet-wide counts, which its spend goes to when it has
        a budget (a crossing is then reported as the fleet says).
        """
        prompt, completion = span.input_tokens, span.output_tokens
        run.llm_calls += 1
        run.input_tokens += prompt
        run.output_tokens += completion
        if prompt or completion:
            charges = self._charges
            # A run the fleet counts: its budget crossing, and its service's budget's stop,
            # wait for the fleet's answer (each reported once fleet-wide).
            shared = (
                share is not None
                and (settings.budget is not None or settings.service_budget is not None)
                and charges.models is not None
            )
            over: list[Detection] | None = [] if shared else None
            # The run's burn rate is timed by its own spans (exports come in batches).
            end = span.end_ns / 1e9
            cost = charges.charge(
                run,
                span.span_id,
                dependency,
                prompt,
                completion,
                settings=settings,
                found=found,
                over=over,
                at=end if end > 0 else now,
                now=now,
            )
            if share is not None and over is not None:
                crossed = [d for d in over if d.rule != SERVICE_BUDGET_RULE]
                share.charge(
                    span_id=span.span_id,
                    dependency=dependency,
                    tokens=(prompt, completion),
                    cost=cost,
                    settings=settings,
                    held=crossed[0] if crossed else None,
                )
                for stop in over:
                    if stop.rule == SERVICE_BUDGET_RULE:
                        share.stopped(span_id=span.span_id, dependency=dependency, held=stop)
        told = self.llm_calls
        if told is not None:
            limits = span.rate_limits() if span.has_rate_limits else None
            if limits is None and self._headers:
                limits = self._headers.pop(span.span_id, None)
            told(span.breaker_key, prompt + completion, limits)
        run.last_llm = span.requested()
        if run.tools_since_llm:
            run.tools_since_llm.clear()
        answer = span.answer
        if not answer:
            return None  # no output recorded: nothing to compare
        # The same answer to the same prompt (as long: its token count) is a call
        # tried again; a loop answers the same to a context that keeps growing.
        instance = prompt & 0xFFFFFFFF if prompt else instance_of(span.span_id)
        return answer, instance, _SAME_OUTPUT

    def _reanchor(
        self,
        run: RunState,
        settings: DetectorSettings,
        span_id: bytes,
        dependency: str,
        *,
        now: float,
        found: list[Detection],
    ) -> None:
        """Every ``reanchor_every`` steps of a long run: remind it of its first input."""
        steps = run.llm_calls + run.tool_calls + 1  # this call included
        long_by_steps = settings.reanchor_after is not None and steps >= settings.reanchor_after
        long_by_time = (
            settings.reanchor_after_s is not None and now - run.started >= settings.reanchor_after_s
        )
        objective = run.objective
        if not (long_by_steps or long_by_time) or not objective:
            return
        if run.anchored and steps - run.anchored < settings.reanchor_every:
            return
        run.anchored = steps
        found.append(
            detection_at(
                run,
                span_id,
                dependency,
                kind="goal_drift",
                failure_class="semantic",
                rule=REANCHOR_RULE,
                message=f"step {steps} of a long run: re-anchoring it on its objective",
                details={"objective": objective, "steps": steps},
            )
        )

    def _turn(self, run: RunState, span: Span, now: float) -> None:
        """Where the run is now that ``span`` arrived (:mod:`.phase`), and its objective."""
        root = span.is_root
        # Most spans are a child in an open run, which changes nothing of its phase.
        if (root or run.phase != phase.OPEN) and phase.span_seen(
            run, span.trace_id, root=root, failed=root and span.failed, now=now
        ):
            self._ended(run)
        if run.objective is None:
            # Looked for only where it can be used (re-anchoring is off by default): finding
            # the first user message means reading the input messages. Kept as bounded
            # text: a first input can be a whole document.
            settings = self.settings_for(run.service)
            if settings.reanchor_after is None and settings.reanchor_after_s is None:
                run.objective = ""
            elif span.has_objective:
                run.objective = span.objective()

    def _changed(self, run_id: str) -> None:
        """``run_id`` changed: the journal writes it at its next save, if there is one, and
        the fleet's run table at its next round."""
        if self.journaling:
            self._dirty.add(run_id)
        if self.publishing and len(self._unpublished) < self.max_runs:
            self._unpublished.add(run_id)

    def _ended(self, run: RunState) -> None:
        """The run ended: its SLO counts it once it stays ended (see ``_ending``)."""
        self._changed(run.run_id)
        if self.slo is not None and len(self._ending) < 10_000:
            self._ending.append((run, run.ended_at))

    def _run_for(self, span: Span, now: float) -> RunState:
        """The span's run, made if new; the batch's cache first (see ``_batch``).

        The first span of a trace in a batch also measures the run's silence
        since its previous request (its rhythm, :mod:`.rhythm`).
        """
        trace_id = span.trace_id
        run = self._batch.get(trace_id)
        if run is not None and not run.gone and not (run.by_trace and span.names_session):
            return run
        if len(self._batch) >= _MAX_BATCH_TRACES:
            self._batch.clear()  # a caller that never settles: bounded all the same
        run = self._batch[trace_id] = self._find_run(span, now)
        silence = now - run.last_seen
        if silence >= MIN_GAP_S and run.phase == phase.OPEN:
            run.gap = max(run.gap, silence)
            self.rhythm.gap(run.service, silence)
        self._changed(run.run_id)
        return run

    def _find_run(self, span: Span, now: float) -> RunState:
        trace = span.trace_hex
        run_id = self.run_of(span)
        runs = self._runs
        # Spans of the trace seen before one named its session: their run is this one.
        early = runs.pop(trace) if run_id != trace and trace in runs else None
        run = runs.get(run_id)
        if run is None and early is not None:
            # The session's first run here: the trace's run becomes it, all it holds kept.
            run, early = early, None
            run.run_id = run_id
            runs[run_id] = run
        elif run is None:
            while len(runs) >= self.max_runs:
                left = runs.popitem(last=False)[1]
                left.gone = True
                if left.journaled is not None:
                    self._left.add(left.run_id)
                self.evicted += 1
            run = runs[run_id] = RunState(run_id, span.service, span.trace_id, now)
        else:
            runs.move_to_end(run_id)
        if early is not None:
            run.fold(early)
            early.gone = True
            if early.journaled is not None:
                self._left.add(trace)
        run.by_trace = run_id == trace
        run.trace = span.trace_id
        return run

    def settle(self, now: float | None = None) -> None:
        """The batch is judged: commands told meanwhile apply, ended runs count in SLOs."""
        self._batch.clear()
        self._apply_notices()
        self._count_ended(self._clock() if now is None else now)

    def _count_ended(self, now: float) -> None:
        """Runs that stayed ended ``slo_grace_s`` count in their SLO: failed or not."""
        ending = self._ending
        slo = self.slo
        while ending:
            run, ended_at = ending[0]
            if now - ended_at < self.slo_grace_s:
                break
            ending.popleft()
            if slo is None or run.phase != phase.ENDED or run.ended_at != ended_at:
                continue  # told to go on since, or ended again later: counted then
            spend = run.spend
            cost = (
                spend.cost_usd if spend is not None and spend.calls and not spend.partial else None
            )
            slo.record_run(
                run.service,
                not run.failed,
                max(0.0, run.last_seen - run.started),
                cost,
                now=now,
            )

    def set_slo(self, spec: SloSpec | None) -> None:
        """A reloaded policy's SLO (history kept where its windows did not change)."""
        if spec is None:
            self.slo = None
        elif self.slo is None:
            self.slo = SloTracker(spec, clock=self._clock)
        else:
            self.slo.set_spec(spec)

    def burning(self, service: str) -> bool:
        """Whether ``service``'s run SLO burns its error budget fast (policies may match it)."""
        return self.slo is not None and self.slo.burning(service)

    def slo_status(self) -> dict[str, Any]:
        """Each service's SLO status (success rate, burn rates, durations, cost per run)."""
        slo = self.slo
        if slo is None:
            return {}
        return {service: slo.status(service).to_json() for service in slo.services()[:100]}

    def failed(self, run_id: str, rule: str = "") -> None:
        """A failure was reported in ``run_id`` under ``rule`` (from the pipeline's judging).

        A prediction or a reminder (context pressure, re-anchoring) is no error.
        """
        run = self._runs.get(run_id)
        if run is not None and rule not in NOTICE_RULES:
            run.errors += 1

    # -- commands: where the sidecar told a run to go ------------------------

    def commanded(
        self,
        run_id: str,
        kind: str,
        not_before: float,
        params: Mapping[str, object],
        now: float | None = None,
    ) -> None:
        """The sidecar sent ``run_id`` a command (see :func:`.phase.commanded`)."""
        run = self._runs.get(run_id)
        if run is None:
            return
        before = run.phase
        phase.commanded(run, kind, not_before, params, self._clock() if now is None else now)
        if run.phase == phase.ENDED and before != phase.ENDED:
            self._ended(run)
        self._changed(run_id)

    def notice(
        self,
        run_id: str,
        kind: str,
        not_before: float,
        params: Mapping[str, object],
        *,
        dead: bool = False,
    ) -> None:
        """From any thread: a command was stored (or, ``dead``, could not be delivered).

        Applied on the pipeline's thread at its next batch or tick. Bounded:
        beyond ``_MAX_NOTICES`` waiting, notices are dropped and counted.
        """
        if len(self._notices) >= _MAX_NOTICES:
            self.notices_dropped += 1
            return
        self._notices.append((run_id, kind, not_before, params, dead))

    def _apply_notices(self) -> None:
        notices = self._notices
        if not notices:
            return
        now = self._clock()
        while notices:
            run_id, kind, not_before, params, dead = notices.popleft()
            if not dead:
                self.commanded(run_id, kind, not_before, params, now)
                continue
            run = self._runs.get(run_id)
            if run is not None:
                phase.command_dead(run, kind, now)
                if run.phase == phase.ENDED:
                    self._ended(run)
                self._changed(run_id)

    def turn_ended(self, run_id: str, trace_id: str) -> bool:
        """Whether ``run_id`` is one trace whose root ended, well or not: nothing runs to pause.

        A session's run goes on past the end of one of its turns.
        """
        run = self._runs.get(run_id)
        if run is None or run.ended_traces is None or not run.by_trace:
            return False
        try:
            return bytes.fromhex(trace_id) in run.ended_traces
        except ValueError:
            return False

    def awaiting_person(self, run_id: str) -> bool:
        """Whether ``run_id`` is paused until a person answers."""
        run = self._runs.get(run_id)
        return run is not None and phase.awaiting_person(run)

    def idle_limit(self, run: RunState) -> float:
        """The silence after which ``run`` is stalled (see :mod:`.rhythm`)."""
        return idle_limit(
            self.settings_for(run.service), run.gap, self.rhythm.long_gap(run.service)
        )

    # -- the timer ------------------------------------------------------------

    def stalled(self, now: float | None = None) -> list[Detection]:
        """Runs silent past their limit, each once per silence; pauses that ran out; expiry.

        Commands told from other threads are applied first, so a run told to
        go on, paused or aborted a moment ago is judged as it now is.
        """
        now = self._clock() if now is None else now
        self._apply_notices()
        self._count_ended(now)
        found: list[Detection] = []
        horizon = min(self.stall_horizon_s, self.max_idle_s)
        expired: list[RunState] = []
        for run in self._runs.values():  # least recently active first
            idle = now - run.last_seen
            if 0 <= idle < horizon and run.phase != phase.PAUSED:
                # The runs after it were active later (a run seen "in the future"
                # after the clock went back is passed over, not taken as recent).
                # A paused run is not passed over: its deadline may be due.
                break
            if idle >= self.max_idle_s:
                expired.append(run)
                continue
            if phase.due(run, now):
                self._changed(run.run_id)
                if run.phase == phase.ENDED:
                    self._ended(run)
            if not phase.may_stall(run):
                continue
            settings = self.settings_for(run.service)
            if not settings.stalls:
                continue
            idle = now - phase.idle_since(run)
            limit = self.idle_limit(run)
            if idle < limit:
                continue
            run.stalled = True
            self._changed(run.run_id)
            unverified = _unanswered(run)
            listed = ", ".join(unverified) or "none seen"
            found.append(
                detection_at(
                    run,
                    run.last_span,
                    run.last_dependency,
                    kind="stall",
                    failure_class="transient",
                    rule=STALL_RULE,
                    message=f"no span for {idle:.0f} s (its limit: {limit:.0f} s);"
                    f" unverified work: {listed}",
                    details={
                        "idle_s": round(idle, 3),
                        "limit_s": round(limit, 3),
                        "unverified": unverified,
                    },
                    role="agent",
                )
            )
        for run in expired:
            del self._runs[run.run_id]
            run.gone = True
            if run.journaled is not None:
                self._left.add(run.run_id)
            self.expired += 1
        return found

    # -- views ---------------------------------------------------------------

    def snapshot(
        self,
        limit: int = 100,
        now: float | None = None,
        *,
        before: tuple[float, str] | None = None,
        service: str | None = None,
        status: str | None = None,
    ) -> list[RunView]:
        """The most recently active runs first: ``limit`` of them, of ``service`` and in
        ``status`` when given.

        ``before`` (last span time, run id) starts after that run, for the
        control API's pages: runs are kept in the order of their last span. A
        filter is checked before a run's view is built: a filter that matches
        few runs walks all of them (``max_runs``) in a few milliseconds.
        """
        now = self._clock() if now is None else now
        views: list[RunView] = []
        for run in reversed(self._runs.values()):
            if len(views) >= limit:
                break
            if before is not None and (run.last_seen, run.run_id) >= before:
                continue
            if service is not None and run.service != service:
                continue
            found = self._status(run, now)
            if status is None or found == status:
                views.append(view(run, now, found))
        return views

    def find(self, run_id: str, now: float | None = None) -> RunView | None:
        """One run's view by its id (None: not tracked here), as :meth:`snapshot` lists it."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        now = self._clock() if now is None else now
        return view(run, now, self._status(run, now))

    def _status(self, run: RunState, now: float) -> str:
        """Where the run is (:func:`supervisor.runs.phase.status`), stalls as its service's."""
        stalls = self.settings_for(run.service).stalls
        return phase.status(run, now, self.idle_limit(run) if stalls else None)

    def publish_changes(self, limit: int, now: float | None = None) -> list[RunView]:
        """Runs changed since the last call (a span, or a change of phase or stall): at
        most ``limit``, the rest at the next call. For a fleet's run table
        (:mod:`.publish`); a run that left the tracker is not said (its row ages out).
        """
        now = self._clock() if now is None else now
        unpublished = self._unpublished
        newest = self._published_to
        for run in reversed(self._runs.values()):  # most recently active first
            if run.last_seen <= self._published_to:
                break
            newest = max(newest, run.last_seen)
            unpublished.add(run.run_id)
        self._published_to = newest
        views: list[RunView] = []
        while unpublished and len(views) < limit:
            found = self._runs.get(unpublished.pop())
            if found is not None:
                views.append(view(found, now, self._status(found, now)))
        return views

    def publish_again(self, run_ids: Iterable[str]) -> None:
        """Runs :meth:`publish_changes` gave whose write failed: given again next time."""
        for run_id in run_ids:
            if len(self._unpublished) >= self.max_runs:
                break
            self._unpublished.add(run_id)

    # -- the journal: what a restart must not forget --------------------------

    def journal_changes(self) -> tuple[list[SavedRun], list[str]]:
        """Runs to write to the journal since the last call, and runs to delete from it.

        A run that ended (or left the tracker) is deleted: a restart only needs
        the runs that may still stall or be resumed. A run is written when it
        is new to the journal, when its phase, deadlines or stall changed, or
        when its last span is ``JOURNAL_SLACK_S`` newer than the journal's:
        after a restart its silence may count from up to that much too early,
        and a busy run is not written every second.
        """
        saved: list[SavedRun] = []
        gone = set(self._left)
        self._left.clear()
        for run_id in self._dirty:
            run = self._runs.get(run_id)
            if run is None:
                gone.add(run_id)
                continue
            if run.phase == phase.ENDED:
                if run.journaled is not None:
                    run.journaled = None
                    gone.add(run_id)
                continue
            state = _journal_state(run)
            kept = run.journaled
            if kept is not None and kept[0] == state and run.last_seen - kept[1] < JOURNAL_SLACK_S:
                continue
            run.journaled = (state, run.last_seen)
            saved.append(_saved(run))
            gone.discard(run_id)
        self._dirty.clear()
        return saved, sorted(gone)

    def restore(self, saved: Iterable[SavedRun]) -> int:
        """Take back the open runs a sidecar before this one journaled; how many.

        A run already seen since this sidecar started keeps what it saw.
        """
        count = 0
        for item in saved:
            if item.run_id in self._runs or len(self._runs) >= self.max_runs:
                continue
            try:
                trace = bytes.fromhex(item.trace_id)
                last_span = bytes.fromhex(item.last_span)
            except ValueError:
                continue
            run = RunState(item.run_id, item.service, trace, item.started)
            run.last_seen = item.last_seen
            run.last_span = last_span
            run.last_dependency = item.last_dependency
            run.step = item.step
            run.spans, run.llm_calls, run.tool_calls, run.errors = item.counts
            run.phase = item.phase
            run.go_on_at = item.go_on_at
            run.paused_until = item.paused_until
            run.on_timeout = item.on_timeout
            run.paused_for = item.paused_for
            run.stalled = item.stalled
            run.gap = item.gap
            run.unverified = item.unverified
            run.by_trace = item.run_id == item.trace_id
            run.journaled = (
                (run.phase, run.go_on_at, run.paused_until, run.stalled),
                run.last_seen,
            )
            if not run.by_trace:
                self._remember_session(item.trace_id, item.run_id)
            self._runs[item.run_id] = run
            count += 1
        # Least recently active first, as the timer expects.
        for run in sorted(self._runs.values(), key=lambda r: r.last_seen):
            self._runs.move_to_end(run.run_id)
        return count

    def stats(self) -> dict[str, int]:
        found = {
            "tracked": len(self._runs),
            "evicted": self.evicted,
            "expired": self.expired,
            "notices_dropped": self.notices_dropped,
            # Runs stopped before their cap (a forecast of their budget), and by
            # their service's budget (forecast or crossed).
            "budget_forecasts": self._charges.forecasts,
            "service_budget_stops": self._charges.service_stops,
            "service_budgets_tracked": len(self._charges.services),
        }
        fleet = self.fleet
        if fleet is not None:  # sessions' batches counted fleet-wide, and judged here alone
            found["fleet_shared"] = fleet.shared
            found["fleet_unshared"] = fleet.unshared
            found["fleet_backlog"] = fleet.backlog
            found["fleet_backlog_dropped"] = fleet.backlog_dropped
            found["fleet_backlog_calls_dropped"] = fleet.backlog_calls_dropped
            found["fleet_service_backlog"] = fleet.services.backlog
            found["fleet_service_backlog_dropped"] = fleet.services.backlog_dropped
        return found


def _journal_state(run: RunState) -> tuple[str, float, float, bool]:
    """What of a run the journal must hold at once when it changes."""
    return (run.phase, run.go_on_at, run.paused_until, run.stalled)


def _saved(run: RunState) -> SavedRun:
    return SavedRun(
        run_id=run.run_id,
        service=run.service,
        trace_id=run.trace.hex(),
        started=run.started,
        last_seen=run.last_seen,
        last_span=run.last_span.hex(),
        last_dependency=run.last_dependency,
        step=run.step[:256],
        counts=(run.spans, run.llm_calls, run.tool_calls, run.errors),
        phase=run.phase,
        go_on_at=run.go_on_at,
        paused_until=run.paused_until,
        on_timeout=run.on_timeout,
        paused_for=run.paused_for,
        stalled=run.stalled,
        gap=run.gap,
        unverified=_unanswered(run),
    )


def _unanswered(run: RunState) -> tuple[str, ...]:
    """The tool calls the last LLM response asked for, less the tool spans seen since.

    A run taken back from the journal after a restart lists what was saved.
    """
    if run.last_llm is None:
        return run.unverified or ()
    requested = requested_calls(run.last_llm)
    answered = [dependency[5:] for dependency in run.tools_since_llm or ()]
    left: list[str] = []
    for call in requested:
        name = call.split("(", 1)[0]
        if name in answered:
            answered.remove(name)
        else:
            left.append(call)
    return tuple(left)
