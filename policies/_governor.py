"""A policy's decisions, revised by what every run's spans show.

The policy decides from one failure; the governor knows the fleet: a circuit
breaker per dependency (fed by every call outcome the sidecar sees, from every
run of every service), a retry budget per dependency, and each run's restart
intensity. It revises a decision in this order:

1. **Breaker open or isolated** for the failed dependency: any decision but
   ``none`` becomes a fallback to the first alternative in the policy's chain
   whose breaker is not open, else ``fail_fast`` with the time the breaker may
   half-open (``breaker_reopens_in_s``, so the run can be paused and resumed).
2. A **fallback** whose target's breaker is open moves on along the chain.
3. **Restart intensity**: a retry or fallback that would be the run's
   ``max_actions + 1``-th corrective action within ``period_s`` is escalated
   instead (Erlang's supervisor gives up restarting; here a person decides).
4. **Retry budget**: a retry over the dependency's budget becomes a fallback
   when there is one, else ``fail_fast``: a fleet cannot multiply an outage.

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

from policies._breakers import BreakerBoard, BreakerChange, BreakerSettings, BreakerState
from policies._budget import BudgetSettings, RetryBudget
from policies._cascade import Cascade, CascadeDetector
from policies._intensity import IntensitySettings, RestartIntensity
from policies._policy import Policy
from supervisor.records import Action, AttrValue, Decision, Failure

_BLOCKED: Final[tuple[BreakerState, ...]] = (BreakerState.OPEN, BreakerState.ISOLATED)
_CORRECTIVE: Final[tuple[Action, ...]] = (Action.RETRY, Action.FALLBACK)
#: What an open breaker turns into a fallback or fail_fast: every decision about its
#: dependency but ``none`` (an outage must not become a queue of approval requests).
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
    {"stall", "reasoning_loop", "goal_drift", "budget_exceeded", "approval_required"}
)


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
    ) -> None:
        self.policy = policy
        self._clock = clock
        self.board = BreakerBoard(
            self._breaker_settings,
            on_change=on_breaker_change,
            clock=clock,
            max_breakers=max_dependencies,
            storage_factory=breaker_storage,
        )
        self.budget = RetryBudget(
            self._budget_settings, clock=clock, max_dependencies=max_dependencies
        )
        self.intensity = RestartIntensity(
            self._intensity_settings(), clock=clock, max_runs=max_runs
        )
        # Dependencies whose breaker has something a success can change (failures
        # counted, or not closed): successes of all others skip the board.
        self._watched: set[str] = set()
        #: One dependency failing across runs: one incident, and its breaker opened.
        self.cascade = CascadeDetector(
            policy.detectors.cascades, clock=clock, max_dependencies=max_dependencies
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
        self.cascade.observe(successes, failures)
        started = self.cascade.cascades()
        for found in started:
            if self.policy.limits.breakers_enabled:
                self.board.trip(found.dependency, "cascade")
        return started

    def _breaker_settings(self, dependency: str) -> BreakerSettings:
        spec = self.policy.limits.breaker_for(dependency)
        return BreakerSettings(spec.fail_max, spec.reset_timeout_s, spec.success_threshold)

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
        return self.board.state(dependency)

    def isolate(self, dependency: str) -> bool:
        self._watch(dependency)
        return self.board.isolate(dependency)

    def close(self, dependency: str) -> None:
        self.board.close(dependency)

    # -- revising decisions ----------------------------------------------------

    def review(self, failure: Failure, decision: Decision) -> Decision:
        """The decision to act on, given breakers, budget and intensity (see the module)."""
        dependency = failure.dependency
        action = decision.action
        state = self.breaker_state(dependency)
        if state in _BLOCKED and action in _DIVERTED and failure.kind not in RUN_KINDS:
            decision = self._around_open(failure, decision, state)
        elif action is Action.FALLBACK:
            decision = self._next_open_alternative(failure, decision)
        if decision.observe_only or decision.action not in _CORRECTIVE:
            return decision
        limits = self.policy.limits
        if limits.restart_intensity.enabled and not self.intensity.allow(failure.run_id):
            spec = limits.restart_intensity
            return _revised(
                decision,
                Action.ESCALATE,
                {"proposed_action": _command_for(decision.action), **decision.params},
                f"more than {spec.max_actions} corrective actions in {spec.period_s:g}s"
                " in this run: a person decides",
            )
        if (
            decision.action is Action.RETRY
            and limits.retry_budget.enabled
            and dependency
            and not self.budget.try_spend(dependency)
        ):
            snap = self.budget.snapshot(dependency)
            why = (
                f"retry budget of {dependency} spent ({snap.retries} retries for"
                f" {snap.calls} calls in {limits.retry_budget.window_s:g}s)"
            )
            target = self._alternative(dependency)
            if target is not None:
                to, chain = target
                return _revised(decision, Action.FALLBACK, {"to": to, "chain": chain}, why)
            return _revised(decision, Action.FAIL_FAST, {}, why)
        return decision

    def _around_open(self, failure: Failure, decision: Decision, state: BreakerState) -> Decision:
        dependency = failure.dependency
        why = f"breaker of {dependency} is {state.value}"
        target = self._alternative(dependency)
        if target is not None:
            to, chain = target
            params: dict[str, AttrValue] = {"to": to, "chain": chain, "breaker": state.value}
            return _revised(decision, Action.FALLBACK, params, why)
        params = {"breaker": state.value}
        info = self.board.info(dependency)
        if state is BreakerState.OPEN and info.reopens_at is not None:
            params["breaker_reopens_in_s"] = round(max(0.0, info.reopens_at - self._clock()), 3)
        return _revised(decision, Action.FAIL_FAST, params, why)

    def _next_open_alternative(self, failure: Failure, decision: Decision) -> Decision:
        to = decision.params.get("to")
        if not isinstance(to, str) or self.breaker_state(to) not in _BLOCKED:
            return decision
        target = self._alternative(failure.dependency)
        why = f"breaker of fallback {to} is {self.breaker_state(to).value}"
        if target is None:
            return _revised(decision, Action.FAIL_FAST, {}, f"{why}; no other alternative")
        new_to, chain = target
        return _revised(decision, Action.FALLBACK, {"to": new_to, "chain": chain}, why)

    def _alternative(self, dependency: str) -> tuple[str, tuple[str, ...]] | None:
        """The first alternative after ``dependency`` in its chain whose breaker is not open."""
        chain = self.policy.fallback_chain(dependency)
        if not chain:
            return None
        start = chain.index(dependency) + 1 if dependency in chain else 0
        for candidate in chain[start:]:
            if candidate != dependency and self.breaker_state(candidate) not in _BLOCKED:
                return candidate, chain
        return None


def _command_for(action: Action) -> str:
    return "switch_fallback" if action is Action.FALLBACK else "retry_step"


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
