"""Each run's progress, from every span, and the detectors that need it.

A run is a trace, or the session it names (see
:func:`supervisor.normalize.span.session_of`). A span that names no session
belongs to the session its trace named, if any: :meth:`RunTracker.run_of`
says which run a span belongs to, and the judging asks it, so that a failure,
its attempts and the run detectors all speak of the same run.

The detectors that need a run's history:

* **loops** (:mod:`.loops`): the same call repeated within the run's recent calls;
* **stalls**: a run whose turn has not ended and that has had no span for
  ``idle_seconds`` (per service), one detection per silence, from a timer
  (:meth:`RunTracker.stalled`, with an injectable clock); it lists the tool
  calls the last LLM response asked for that no tool span answered, the work
  whose effects are unverified;
* **context pressure and budgets** (:mod:`.spend`), from token counts;
* **re-anchoring**: a long run reminded of its objective.

Bounded: at most ``max_runs`` runs (the least recently active is evicted),
and runs idle for ``max_idle_s`` are dropped; both are counted.

Lifecycle: built by the wiring; :meth:`observe`, :meth:`run_of` and
:meth:`failed` from the pipeline's thread; :meth:`stalled`, :meth:`snapshot`
from the same thread (the event loop), never concurrently.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Final

from policies import DetectorSettings, ModelTable, SloSpec, SloTracker
from supervisor.normalize.span import Span, requested_calls
from supervisor.records import own_run
from supervisor.runs.detection import (
    LOOP_RULE,
    REANCHOR_RULE,
    STALL_RULE,
    Detection,
    detection_at,
)
from supervisor.runs.loops import RecentCalls, Repeat, digest, instance_of
from supervisor.runs.spend import Charges
from supervisor.runs.state import RunState, RunView, view

__all__ = ["RunTracker"]

_MAX_SERVICES: Final = 1024
#: Tools remembered per run since its last LLM response (for stall reports).
_MAX_SINCE_LLM: Final = 64
#: Traces whose run the batch cache keeps (a request holds a few dozen).
_MAX_BATCH_TRACES: Final = 4096
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
    ) -> None:
        self._settings = settings
        self._charges = Charges(models)
        #: Run outcomes per service, against the policy's SLO (None: no SLOs).
        self.slo = SloTracker(slo, clock=clock) if slo is not None else None
        #: Runs whose turn ended in this batch: counted in the SLO once it is judged.
        self._ending: list[RunState] = []
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
        self._charges = Charges(table)

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
        self._turn(run, span, failed=not repeats)
        dependency = span.dependency
        if not dependency or dependency.startswith("http:"):
            return
        name = span.name
        run.step = name
        run.last_dependency = dependency
        settings = self._settings_memo.get(span.service) or self.settings_for(span.service)
        if settings.reanchor_after is not None or settings.reanchor_after_s is not None:
            self._reanchor(run, settings, span_id, dependency, now=now, found=found)
        tool = dependency.startswith("tool:")
        compared = (
            self._tool_call(run, span, dependency)
            if tool
            else self._llm_call(run, span, dependency, settings, found)
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
        if first is not None:
            found.append(_loop(run, dependency, first, repeats=settings.loop_repeats, what=what))

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
    ) -> _Compared | None:
        """Count an LLM call, its tokens and spend; what a loop of it compares (its answer)."""
        prompt, completion = span.input_tokens, span.output_tokens
        run.llm_calls += 1
        run.input_tokens += prompt
        run.output_tokens += completion
        if prompt or completion:
            self._charges.charge(
                run, span.span_id, dependency, prompt, completion, settings=settings, found=found
            )
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

    def _turn(self, run: RunState, span: Span, *, failed: bool) -> None:
        """Whether the run's turn ended (its root span arrived), and its objective.

        A root span that failed does not end a run the sidecar has told to go
        on: its spans may arrive after the decision (a later batch).
        """
        child = not span.is_root
        if not child:
            if failed and run.go_on_at:
                child = True  # still open: the agent was told to retry, resume...
            else:
                run.go_on_at = 0.0
                if run.open and self.slo is not None and len(self._ending) < 10_000:
                    self._ending.append(run)  # for the SLO, once the batch is judged
        run.open = child  # a root span ends its run's turn
        if run.objective is None and span.has_objective:
            # Kept only where it can be used (re-anchoring is off by default), and as
            # bounded text: a first input can be a whole document.
            settings = self.settings_for(run.service)
            anchoring = settings.reanchor_after is not None or settings.reanchor_after_s is not None
            run.objective = span.objective() if anchoring else ""

    def _run_for(self, span: Span, now: float) -> RunState:
        """The span's run, made if new; the batch's cache first (see ``_batch``)."""
        trace_id = span.trace_id
        run = self._batch.get(trace_id)
        if run is not None and not run.gone and not (run.by_trace and span.names_session):
            return run
        if len(self._batch) >= _MAX_BATCH_TRACES:
            self._batch.clear()  # a caller that never settles: bounded all the same
        run = self._batch[trace_id] = self._find_run(span, now)
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
                runs.popitem(last=False)[1].gone = True
                self.evicted += 1
            run = runs[run_id] = RunState(run_id, span.service, span.trace_id, now)
        else:
            runs.move_to_end(run_id)
        if early is not None:
            run.fold(early)
            early.gone = True
        run.by_trace = run_id == trace
        run.trace = span.trace_id
        return run

    def settle(self, now: float | None = None) -> None:
        """The batch is judged: runs that ended in it count in their service's SLO."""
        self._batch.clear()
        ending, self._ending = self._ending, []
        slo = self.slo
        if slo is None:
            return
        for run in ending:
            spend = run.spend
            cost = (
                spend.cost_usd if spend is not None and spend.calls and not spend.partial else None
            )
            slo.record_run(
                run.service,
                run.errors == 0,
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

    def failed(self, run_id: str) -> None:
        """A failure was reported in ``run_id`` (from the pipeline's judging)."""
        run = self._runs.get(run_id)
        if run is not None:
            run.errors += 1

    def expect_more(self, run_id: str, after: float) -> None:
        """The sidecar tells ``run_id`` to go on at ``after``: silence from then is a stall.

        A run whose turn ended in a failure has its root span ended, so it
        would never stall; but an agent killed after it was told to retry
        leaves exactly that run behind, half done. Its idle time counts from
        when the command may be delivered, so a long backoff is no stall.
        """
        run = self._runs.get(run_id)
        if run is not None:
            run.open = True
            run.stalled = False
            run.go_on_at = max(run.go_on_at, after)

    # -- the timer ------------------------------------------------------------

    def stalled(self, now: float | None = None) -> list[Detection]:
        """Runs silent past their ``idle_seconds``, each once per silence; drops expired runs."""
        now = self._clock() if now is None else now
        found: list[Detection] = []
        horizon = min(self.stall_horizon_s, self.max_idle_s)
        expired: list[RunState] = []
        for run in self._runs.values():  # least recently active first
            idle = now - run.last_seen
            if 0 <= idle < horizon:
                # The runs after it were active later (a run seen "in the future"
                # after the clock went back is passed over, not taken as recent).
                break
            if idle >= self.max_idle_s:
                expired.append(run)
                continue
            if run.stalled or not run.open:
                continue
            if run.go_on_at > run.last_seen:  # silent since it was told to go on
                idle = now - run.go_on_at
            settings = self.settings_for(run.service)
            if not settings.stalls or idle < settings.idle_seconds:
                continue
            run.stalled = True
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
                    message=f"no span for {idle:.0f} s; unverified work: {listed}",
                    details={"idle_s": round(idle, 3), "unverified": unverified},
                    role="agent",
                )
            )
        for run in expired:
            del self._runs[run.run_id]
            run.gone = True
            self.expired += 1
        return found

    # -- views ---------------------------------------------------------------

    def snapshot(self, limit: int = 100, now: float | None = None) -> list[RunView]:
        """The most recently active runs first."""
        now = self._clock() if now is None else now
        views: list[RunView] = []
        for run in reversed(self._runs.values()):
            if len(views) >= limit:
                break
            views.append(view(run, now, self.settings_for(run.service)))
        return views

    def stats(self) -> dict[str, int]:
        return {"tracked": len(self._runs), "evicted": self.evicted, "expired": self.expired}


def _loop(run: RunState, dependency: str, first: Repeat, *, repeats: int, what: str) -> Detection:
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


def _unanswered(run: RunState) -> tuple[str, ...]:
    """The tool calls the last LLM response asked for, less the tool spans seen since."""
    if run.last_llm is None:
        return ()
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
