"""A policy's decisions, revised by what every run's spans show.

The policy decides from one failure; the governor knows the fleet: a circuit
breaker per dependency (fed by the transient failures and the successes the
sidecar sees, from every run of every service), a retry budget per
dependency, and the restart intensity of each step. It revises a decision in
this order:

1. **Breaker open or isolated** for the failed dependency: a decision that
   would call it again (retry, fallback), and any decision but ``none`` about
   a transient failure, becomes a fallback to the first alternative whose
   breaker is not open (the policy's ``fallbacks:``), else ``fail_fast`` with
   the time the run may resume (``breaker_reopens_in_s``: the run is paused
   and resumed, see below). A permanent, model or semantic failure says
   nothing of the dependency's health: its ``fail_fast`` or ``escalate``
   stands, so a revoked key aborts instead of waiting for the breaker; and a
   permanent failure is never paused (no alternative left: ``fail_fast``).
2. A **fallback** whose target's breaker is open moves on along the chain.
3. **Restart intensity**: a retry, fallback or pause that would be the
   ``max_actions + 1``-th corrective action for the same dependency in the
   same run within ``period_s`` is escalated instead (Erlang's supervisor
   gives up restarting; here a person decides, for at most the escalation's
   ``timeout_s``).
4. **Retry budget**: a retry over the dependency's budget becomes a fallback
   when there is one, else ``fail_fast``: a fleet cannot multiply an outage.

No fallback is offered for a failed call whose streamed answer had begun
(``evidence.stream_began``): what reached the agent cannot be taken back.

**Slow calls** open a breaker too, when its settings have ``slow_call_s``:
the pipeline then hands over each call's duration (:meth:`observe_durations`).

**Keyed per credential.** A failure or call whose span names its credential
(``failure.credential``) counts for the breaker, the retry budget and the
pace of ``provider:model@credential`` (:attr:`~supervisor.records.Failure.breaker_key`),
with the breaker settings of ``provider:model``: one exhausted API key does
not open the breaker of the model's other keys. Policies, fallbacks and
restart intensity still see the dependency.

**Pauses behind an open breaker are staggered.** The first
``half_open_trials`` runs paused while a breaker is open resume when it
half-opens: they are its trial calls. Every other run resumes later, at a
point of the ``resume_spread_s`` after that, from a quarter of it on, placed
by a hash of its run id and the dependency (the same run always gets the same
place, so a replay decides the same). The decision carries the pause's
deadline and outcome for the ``pause_run`` command: ``pause_timeout_s`` (the
resume delay) and ``on_timeout: resume``.

**Paced at the dependency's capacity.** Given a :class:`~policies._pacer.Capacity`
(the supervisor's admission rates), the resumes of an opening and the retry
delays of a dependency go through its :class:`~policies._pacer.Pacer`: each
takes the first free slot at or after the time computed above (the
breaker's, the policy's backoff), ``60/rpm`` from any other, so the k-th run
paused behind an opening resumes no earlier than its half-open time plus k
intervals, and twenty retries decided in one batch leave one interval apart.
A run asked again in the same opening keeps its slot. Rate unknown: nothing
changes.

**In a fleet** (``shared_counts``, the sidecar's Redis) retry budgets,
restart intensity and cascade windows are counted by every sidecar together
(:mod:`policies._window_counter`); this one's own counts decide whenever the
shared ones cannot be asked. Only failures ask: successes are handed over
without waiting and sent with the next failure of the same dependency.

Decisions in observe mode are revised by the breakers (read only) but spend
no budget and count no action: nothing will be delivered.

Lifecycle: built with a policy; :meth:`set_policy` on reload (breakers keep
their settings until they are next created; budgets and intensity take the new
ones at once); called from one thread (the pipeline's).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from operator import itemgetter
from typing import Final

import pybreaker

from policies._actions import pause_params
from policies._backoff import jitter_fraction
from policies._breakers import (
    BreakerBoard,
    BreakerChange,
    BreakerInfo,
    BreakerSettings,
    BreakerState,
)
from policies._budget import BudgetSettings, RetryBudget
from policies._cascade import Cascade, CascadeDetector
from policies._intensity import IntensitySettings, RestartIntensity
from policies._pacer import Capacity, Pacer
from policies._policy import Policy
from policies._window_counter import WindowCounter
from supervisor.records import Action, AttrValue, Decision, Failure, FailureClass

_BLOCKED: Final[tuple[BreakerState, ...]] = (BreakerState.OPEN, BreakerState.ISOLATED)
#: Decisions that call a dependency again: restart intensity counts them (and
#: breaker pauses), and an open breaker diverts them whatever the failure.
_CORRECTIVE: Final[tuple[Action, ...]] = (Action.RETRY, Action.FALLBACK)
#: What an open breaker turns into a fallback or a pause when the failure is
#: transient: every decision about its dependency but ``none`` (an outage must
#: not become a queue of approval requests).
_DIVERTED: Final[tuple[Action, ...]] = (
    Action.RETRY,
    Action.FALLBACK,
    Action.FAIL_FAST,
    Action.ESCALATE,
    Action.REMEDIATE,
)
#: Failures of a run, not calls of its dependency: an open breaker on the run's
#: last model says nothing about them (a stall's resume_run must keep its list of
#: unverified work, a person must still be asked about an interrupt).
RUN_KINDS: Final = frozenset(
    {
        "stall",
        "reasoning_loop",
        "goal_drift",
        "budget_exceeded",
        "budget_forecast",
        "approval_required",
    }
)
#: Where in ``resume_spread_s`` the runs after the first trials start resuming.
_SPREAD_FROM: Final = 0.25


def counts_for_breaker(failure: Failure) -> bool:
    """Whether ``failure`` says its dependency is unhealthy: counted by its breaker.

    Only transient failures of calls do. A 401, a 404, a bad request or an
    exhausted quota is the caller's (``permanent``); a bad answer is the
    model's (``model``, ``semantic``); a stall or a loop is the run's. Counting
    them would let one run with a revoked key open the breaker for the fleet.
    """
    return failure.failure_class is FailureClass.TRANSIENT and failure.kind not in RUN_KINDS


class _Paused:
    """The runs paused behind one opening of one breaker that resume first (its trials),
    and, when paced, the time each run was given (asked again, it keeps it)."""

    __slots__ = ("first", "opened_at", "resumes")

    def __init__(self, opened_at: float | None) -> None:
        self.opened_at = opened_at
        self.first: set[str] = set()
        self.resumes: dict[str, float] = {}


class Governor:
    """Breakers, retry budgets and restart intensity around a policy; see the module."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_breaker_change: Callable[[BreakerChange], None] | None = None,
        breaker_storage: Callable[[str], pybreaker.CircuitBreakerStorage] | None = None,
        max_dependencies: int = 10_000,
        max_runs: int = 10_000,
        shared_counts: WindowCounter | None = None,
        capacity: Capacity | None = None,
    ) -> None:
        self.policy = policy
        self._clock = clock
        #: Resumes and retries of a dependency spaced at its rate (module doc).
        self.pacer = Pacer(capacity, clock=clock, max_dependencies=max_dependencies)
        self._max_runs = max_runs
        self.board = BreakerBoard(
            self._breaker_settings,
            on_change=on_breaker_change,
            clock=clock,
            max_breakers=max_dependencies,
            storage_factory=breaker_storage,
        )
        self.budget = RetryBudget(
            self._budget_settings,
            clock=clock,
            max_dependencies=max_dependencies,
            shared=shared_counts,
        )
        self.intensity = RestartIntensity(
            self._intensity_settings(), clock=clock, max_runs=max_runs, shared=shared_counts
        )
        # Dependencies whose breaker has something a success can change (failures
        # counted, or not closed): successes of all others skip the board.
        self._watched: set[str] = set()
        #: dependency -> the runs resumed first since its breaker last opened (bounded).
        self._paused: dict[str, _Paused] = {}
        self._max_dependencies = max_dependencies
        #: One dependency failing across runs: one incident, and its breaker opened.
        self.cascade = CascadeDetector(
            policy.detectors.cascades,
            clock=clock,
            max_dependencies=max_dependencies,
            shared=shared_counts,
        )

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.intensity.settings = self._intensity_settings()
        self.cascade.settings = policy.detectors.cascades

    def observe_cascades(self, successes: list[str], failures: list[Failure]) -> list[Cascade]:
        """A batch's successful calls and failures; the cascades that started, breakers opened.

        The breaker of a cascading dependency opens at once, for every run,
        rather than after each run's own failures have added up.
        """
        self.cascade.observe(successes, [f for f in failures if counts_for_breaker(f)])
        started = self.cascade.cascades()
        for found in started:
            if self.policy.limits.breakers_enabled:
                self.board.trip(found.dependency, "cascade")
        return started

    def _breaker_settings(self, dependency: str) -> BreakerSettings:
        spec = self.policy.limits.breaker_for(dependency)
        return BreakerSettings(
            spec.fail_max,
            spec.reset_timeout_s,
            spec.success_threshold,
            spec.trials,
            spec.slow_call_s,
            spec.slow_call_rate,
            spec.min_calls,
        )

    def _budget_settings(self, _dependency: str) -> BudgetSettings:
        spec = self.policy.limits.retry_budget
        return BudgetSettings(spec.ratio, spec.min_retries, spec.window_s)

    def _intensity_settings(self) -> IntensitySettings:
        spec = self.policy.limits.restart_intensity
        return IntensitySettings(spec.max_actions, spec.period_s)

    # -- what the spans show -------------------------------------------------

    def observe(self, dependency: str, ok: bool) -> None:
        """One call of ``dependency`` ended, well or not (from any run of any service)."""
        self.observe_calls([(0, dependency, ok)])

    def observe_calls(self, calls: list[tuple[int, str, bool]]) -> None:
        """Calls that ended, as (end time, dependency, ok), in any order.

        Budgets need only how many calls each dependency had; breakers count
        failures in a row, so failures and the successes of breakers that have
        something to reset are fed in the order the calls ended.
        """
        limits = self.policy.limits
        if limits.retry_budget.enabled:
            for dependency, count in Counter(call[1] for call in calls).items():
                self.budget.record_call(dependency, count)
        if not limits.breakers_enabled:
            return
        watched = self._watched
        # Successes matter for breakers with failures counted: those watched
        # already, and those that fail in this very batch.
        relevant = watched | {call[1] for call in calls if not call[2]}
        ordered = [call for call in calls if call[1] in relevant]
        ordered.sort(key=itemgetter(0))  # by end time; stable: a tie keeps arrival order
        by_dependency: dict[str, list[bool]] = {}
        for _, dependency, ok in ordered:
            outcomes = by_dependency.get(dependency)
            if outcomes is not None:
                outcomes.append(ok)
            elif not ok or dependency in watched:  # a success on a clean breaker changes nothing
                by_dependency[dependency] = [ok]
        for dependency, outcomes in by_dependency.items():
            state = self.board.record_all(dependency, outcomes)
            if state is BreakerState.CLOSED and self.board.info(dependency).failures == 0:
                self._watched.discard(dependency)
            else:
                self._watch(dependency)

    @property
    def times_calls(self) -> bool:
        """Whether a breaker counts slow calls: the pipeline then hands over call durations."""
        return self.policy.limits.times_calls

    def observe_durations(self, calls: list[tuple[str, int]]) -> None:
        """Calls that ended, as (dependency, duration in ns), in the order they ended."""
        if not self.times_calls:
            return
        by_dependency: dict[str, list[float]] = {}
        for dependency, duration_ns in calls:
            by_dependency.setdefault(dependency, []).append(duration_ns / 1e9)
        breaker_for = self.policy.limits.breaker_for
        for dependency, durations in by_dependency.items():
            if breaker_for(dependency).slow_call_s is None:
                continue  # its breaker counts no durations: none is made for them
            if self.board.record_durations(dependency, durations) is not BreakerState.CLOSED:
                self._watch(dependency)  # its trials' outcomes must reach it

    def _watch(self, dependency: str) -> None:
        """Remember a breaker that successes can change; never more than the board holds.

        Dependency names come from spans, so their variety is the agents' to
        choose: when full, breakers with nothing left to reset (evicted from
        the board, or closed with no failures) are forgotten first.
        """
        watched = self._watched
        if dependency in watched:
            return
        if len(watched) >= self.board.max_breakers:
            for name in list(watched):
                info = self.board.info(name)
                if info.state is BreakerState.CLOSED and info.failures == 0:
                    watched.discard(name)
        if len(watched) < self.board.max_breakers:
            watched.add(dependency)

    def breaker_state(self, dependency: str) -> BreakerState:
        if not self.policy.limits.breakers_enabled or not dependency:
            return BreakerState.CLOSED
        state = self.board.state(dependency)
        if state is not BreakerState.CLOSED:
            # Perhaps opened by another sidecar: its trials seen here must count.
            self._watch(dependency)
        return state

    def isolate(self, dependency: str) -> bool:
        self._watch(dependency)
        return self.board.isolate(dependency)

    def close(self, dependency: str) -> None:
        self.board.close(dependency)

    # -- revising decisions ----------------------------------------------------

    def review(self, failure: Failure, decision: Decision) -> Decision:
        """The decision to act on, given breakers, budget and intensity (see the module)."""
        dependency = failure.dependency
        key = failure.breaker_key  # its breaker, budget and pace: per credential when named
        action = decision.action
        state = self.breaker_state(key)
        if state in _BLOCKED and _diverted(failure, action):
            decision = self._around_open(failure, decision, state)
        elif action is Action.FALLBACK:
            decision = self._next_open_alternative(failure, decision)
        if decision.observe_only or not _corrective(decision):
            return decision
        limits = self.policy.limits
        if limits.restart_intensity.enabled and not self.intensity.allow(_step(failure)):
            spec = limits.restart_intensity
            return _revised(
                decision,
                Action.ESCALATE,
                {
                    "proposed_action": _command_for(decision),
                    **decision.params,
                    **pause_params(spec.timeout_s, spec.on_timeout),
                },
                f"more than {spec.max_actions} corrective actions for"
                f" {dependency or 'this step'} in {spec.period_s:g}s in this run: a person decides",
            )
        if (
            decision.action is Action.RETRY
            and limits.retry_budget.enabled
            and dependency
            and not self.budget.try_spend(key)
        ):
            snap = self.budget.snapshot(key)
            why = (
                f"retry budget of {key} spent ({snap.retries} retries for"
                f" {snap.calls} calls in {limits.retry_budget.window_s:g}s)"
            )
            target = self._alternative(failure)
            if target is not None:
                to, chain = target
                return _revised(decision, Action.FALLBACK, {"to": to, "chain": chain}, why)
            return _revised(decision, Action.FAIL_FAST, {}, why)
        if decision.action is Action.RETRY and dependency:
            return self._paced(key, decision)
        return decision

    def _paced(self, dependency: str, decision: Decision) -> Decision:
        """A retry's delay moved to its dependency's next free slot (never shortened)."""
        delay = decision.params.get("delay_s")
        if not isinstance(delay, (int, float)) or isinstance(delay, bool):
            return decision
        paced = self.pacer.pace(dependency, float(delay))
        if paced == delay:
            return decision
        later = round(paced, 3)
        return Decision(
            action=decision.action,
            policy=decision.policy,
            params={**decision.params, "delay_s": later},
            reason=f"{decision.reason}; spaced at the rate of {dependency}: retry in {later:g}s",
            observe_only=decision.observe_only,
        )

    def _around_open(self, failure: Failure, decision: Decision, state: BreakerState) -> Decision:
        key = failure.breaker_key
        why = f"breaker of {key} is {state.value}"
        if failure.evidence.stream_began:
            why += " (the streamed response had begun: no fallback to another model)"
        target = self._alternative(failure)
        if target is not None:
            to, chain = target
            params: dict[str, AttrValue] = {"to": to, "chain": chain, "breaker": state.value}
            return _revised(decision, Action.FALLBACK, params, why)
        params = {"breaker": state.value}
        info = self.board.info(key)
        if failure.failure_class is FailureClass.PERMANENT:
            # Waiting cannot help (a quota, a retry a policy asked for): never paused.
            return _revised(decision, Action.FAIL_FAST, params, f"{why}, no alternative left")
        if state is BreakerState.OPEN and info.reopens_at is not None:
            wait = self._resume_delay(failure.run_id, info)
            params["breaker_reopens_in_s"] = wait
            params.update(pause_params(wait, "resume"))
            why += f": paused, resumed in {wait:g}s"
        return _revised(decision, Action.FAIL_FAST, params, why)

    def _resume_delay(self, run_id: str, info: BreakerInfo) -> float:
        """Seconds until ``run_id``, paused behind ``info``'s open breaker, resumes.

        The first ``half_open_trials`` runs of this opening resume when it
        half-opens; the others over ``resume_spread_s`` after that, from a
        quarter of it on, each at a point fixed by its run id; then, the rate
        known, in the next free slot from there (module doc).
        """
        dependency = info.dependency
        reopens_in = max(0.0, (info.reopens_at or 0.0) - self._clock())
        spec = self.policy.limits.breaker_for(dependency)
        paused = self._paused.get(dependency)
        if paused is None or paused.opened_at != info.opened_at:
            if paused is None and len(self._paused) >= self._max_dependencies:
                del self._paused[next(iter(self._paused))]  # the oldest opening
            paused = self._paused[dependency] = _Paused(info.opened_at)
        paced = self.pacer.interval(dependency) is not None
        if paced and run_id in paused.resumes:  # asked again: the slot it was given
            return round(max(0.0, paused.resumes[run_id] - self._clock()), 3)
        if run_id in paused.first or len(paused.first) < spec.trials:
            paused.first.add(run_id)
            wait = reopens_in
        else:
            place = jitter_fraction(run_id, dependency, "resume")
            wait = reopens_in + spec.resume_spread_s * (_SPREAD_FROM + (1 - _SPREAD_FROM) * place)
        if not paced:
            return round(wait, 3)
        wait = self.pacer.pace(dependency, wait)
        if len(paused.resumes) < self._max_runs:
            paused.resumes[run_id] = self._clock() + wait
        return round(wait, 3)

    def _next_open_alternative(self, failure: Failure, decision: Decision) -> Decision:
        to = decision.params.get("to")
        if not isinstance(to, str) or self.breaker_state(to) not in _BLOCKED:
            return decision
        target = self._alternative(failure)
        why = f"breaker of fallback {to} is {self.breaker_state(to).value}"
        if target is None:
            return _revised(decision, Action.FAIL_FAST, {}, f"{why}; no other alternative")
        new_to, chain = target
        return _revised(decision, Action.FALLBACK, {"to": new_to, "chain": chain}, why)

    def _alternative(self, failure: Failure) -> tuple[str, tuple[str, ...]] | None:
        """The first alternative after the failed dependency in its chain whose breaker is not open.

        None once the failed call's answer had begun streaming: no other model
        can take back what reached the agent.
        """
        if failure.evidence.stream_began:
            return None
        dependency = failure.dependency
        chain = self.policy.fallback_chain(dependency)
        if not chain:
            return None
        start = chain.index(dependency) + 1 if dependency in chain else 0
        for candidate in chain[start:]:
            if candidate != dependency and self.breaker_state(candidate) not in _BLOCKED:
                return candidate, chain
        return None


def _diverted(failure: Failure, action: Action) -> bool:
    """Whether an open breaker of the failure's dependency changes ``action`` (module, 1.)."""
    if failure.kind in RUN_KINDS:
        return False
    return action in _CORRECTIVE or (action in _DIVERTED and counts_for_breaker(failure))


def _corrective(decision: Decision) -> bool:
    """A retry, a fallback, or a pause the run resumes from: restart intensity counts it."""
    action = decision.action
    return action in _CORRECTIVE or (
        action is Action.FAIL_FAST and "breaker_reopens_in_s" in decision.params
    )


def _step(failure: Failure) -> str:
    """Restart intensity's key: the run and the dependency that keeps failing in it."""
    return f"{failure.run_id}\x1f{failure.dependency or failure.kind}"


def _command_for(decision: Decision) -> str:
    """The command an escalated corrective action proposes to a person."""
    if decision.action is Action.FALLBACK:
        return "switch_fallback"
    if decision.action is Action.FAIL_FAST:
        return "resume_run"
    return "retry_step"


def _revised(
    decision: Decision, action: Action, params: dict[str, AttrValue], why: str
) -> Decision:
    """``decision`` turned into ``action``; the reason says what changed it and why."""
    kept = {k: v for k, v in decision.params.items() if k in ("attempt", "max_attempts")}
    # Built whole, not by dataclasses.replace, which looks the fields up each call.
    return Decision(
        action=action,
        policy=decision.policy,
        params={**kept, **params},
        reason=f"{decision.reason}; {why}: {action.value}" if decision.reason else why,
        observe_only=decision.observe_only,
    )
