"""Compiled actions: each turns a failure into a :class:`Decision`, purely.

An action is built once from its validated spec. ``retry`` and ``fallback``
hold the action to take when they run out (``on_exhausted``), so a decision
is always one of the vocabulary's actions and never "nothing matched".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Protocol

from policies._backoff import Backoff, jitter_fraction
from policies._glob import GlobSet
from policies._schema import (
    EscalateSpec,
    FallbackSpec,
    RemediateSpec,
    RetrySpec,
    SimpleSpec,
)
from supervisor.records import Action, AttrValue, Decision, Failure, remediation_ids


class CompiledAction(Protocol):
    """Turns a failure into a decision; pure, never raises."""

    action: Action

    def decide(
        self, failure: Failure, attempt: int, policy: str, observe: bool, why: str = ""
    ) -> Decision: ...


def _subject(failure: Failure) -> str:
    where = failure.dependency or failure.service or "?"
    return f"{failure.failure_class.value}/{failure.kind} on {where}"


def _reason(failure: Failure, why: str, what: str) -> str:
    return f"{_subject(failure)}: {why + '; ' if why else ''}{what}"


def _decision(
    action: Action, policy: str, params: dict[str, AttrValue], reason: str, observe: bool
) -> Decision:
    return Decision(
        action=action,
        policy=policy,
        params=MappingProxyType(params),
        reason=reason,
        observe_only=observe,
    )


class Simple:
    """``fail_fast`` or ``none``: no parameters."""

    __slots__ = ("action",)

    def __init__(self, action: Action) -> None:
        self.action = action

    def decide(
        self, failure: Failure, attempt: int, policy: str, observe: bool, why: str = ""
    ) -> Decision:
        reason = _reason(failure, why, self.action.value)
        return _decision(self.action, policy, {}, reason, observe)


class Escalate:
    """Pause the run and ask a person, for at most ``timeout_s``; then ``on_timeout``.

    The decision's ``pause_timeout_s`` and ``on_timeout`` are what the
    ``pause_run`` command carries as its deadline and what happens at it.
    """

    __slots__ = ("action", "on_timeout", "timeout_s")

    def __init__(self, timeout_s: float, on_timeout: str) -> None:
        self.action = Action.ESCALATE
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout

    def decide(
        self, failure: Failure, attempt: int, policy: str, observe: bool, why: str = ""
    ) -> Decision:
        reason = _reason(failure, why, self.action.value)
        return _decision(
            self.action, policy, pause_params(self.timeout_s, self.on_timeout), reason, observe
        )


def pause_params(timeout_s: float, on_timeout: str) -> dict[str, AttrValue]:
    """What a decision that pauses the run says of the pause: its deadline and what follows."""
    return {"pause_timeout_s": round(float(timeout_s), 3), "on_timeout": on_timeout}


class Remediate:
    """Dispatch the named remediator."""

    __slots__ = ("action", "remediator")

    def __init__(self, remediator: str) -> None:
        self.action = Action.REMEDIATE
        self.remediator = remediator

    def decide(
        self, failure: Failure, attempt: int, policy: str, observe: bool, why: str = ""
    ) -> Decision:
        reason = _reason(failure, why, f"remediate with {self.remediator}")
        workflow, trace = remediation_ids(failure.trace_id, failure.span_id, failure.rule)
        params: dict[str, AttrValue] = {
            "remediator": self.remediator,
            "remediation_id": workflow,
            "remediation_trace_id": trace,
        }
        return _decision(self.action, policy, params, reason, observe)


class Fallback:
    """Switch to the alternative after the failed dependency in its chain.

    A fallback with no chain of its own (``chain: {}``, as the built-in
    retries end in) follows the chain the policy gives for the dependency
    elsewhere (``shared``, set by the policy once compiled), so a chain is
    written once, not in every entry that may fall back.
    """

    __slots__ = ("action", "chains", "on_exhausted", "shared")

    def __init__(
        self, chains: list[tuple[GlobSet, tuple[str, ...]]], on_exhausted: CompiledAction
    ) -> None:
        self.action = Action.FALLBACK
        self.chains = tuple(chains)
        self.on_exhausted = on_exhausted
        #: The policy's chain for a dependency, for a fallback without chains.
        self.shared: Callable[[str], tuple[str, ...] | None] | None = None

    def next_in_chain(self, dependency: str) -> tuple[str, tuple[str, ...]] | None:
        """The alternative to ``dependency`` and its whole chain, or None when there is none."""
        chain: tuple[str, ...] | None = None
        for globs, candidate_chain in self.chains:
            if globs(dependency):
                chain = candidate_chain
                break
        if chain is None and not self.chains and self.shared is not None:
            chain = self.shared(dependency)
        if chain is None:
            return None
        start = chain.index(dependency) + 1 if dependency in chain else 0
        for candidate in chain[start:]:
            if candidate != dependency:
                return candidate, chain
        return None

    def decide(
        self, failure: Failure, attempt: int, policy: str, observe: bool, why: str = ""
    ) -> Decision:
        found = self.next_in_chain(failure.dependency)
        if found is None:
            note = f"no fallback left for {failure.dependency or '?'}"
            return self.on_exhausted.decide(
                failure, attempt, policy, observe, f"{why}; {note}" if why else note
            )
        to, chain = found
        reason = _reason(failure, why, f"fall back to {to}")
        params: dict[str, AttrValue] = {"to": to, "chain": chain}
        return _decision(self.action, policy, params, reason, observe)


class Retry:
    """Retry after a delay from the backoff, honouring the server's retry-after up to a cap."""

    __slots__ = ("action", "backoff", "honour_retry_after", "max_retry_after_s", "on_exhausted")

    def __init__(
        self,
        backoff: Backoff,
        honour_retry_after: bool,
        max_retry_after_s: float,
        on_exhausted: CompiledAction,
    ) -> None:
        self.action = Action.RETRY
        self.backoff = backoff
        self.honour_retry_after = honour_retry_after
        self.max_retry_after_s = max_retry_after_s
        self.on_exhausted = on_exhausted

    def decide(
        self, failure: Failure, attempt: int, policy: str, observe: bool, why: str = ""
    ) -> Decision:
        limit = self.backoff.max_attempts
        fraction = jitter_fraction(failure.trace_id, failure.span_id, policy)
        delay = self.backoff.delay(attempt, fraction)
        if delay is None:
            note = f"retries exhausted ({attempt}/{limit} attempts)"
            return self.on_exhausted.decide(
                failure, attempt, policy, observe, f"{why}; {note}" if why else note
            )
        params: dict[str, AttrValue] = {"attempt": attempt, "max_attempts": limit}
        retry_after = failure.evidence.retry_after_s
        if (
            self.honour_retry_after
            and retry_after is not None
            and math.isfinite(retry_after)
            and retry_after > 0
        ):
            # The server's word is a floor for the delay; our cap bounds how long we obey it.
            delay = max(delay, min(retry_after, self.max_retry_after_s))
            params["retry_after_s"] = round(retry_after, 3)
        delay_s = round(delay, 3)
        params["delay_s"] = delay_s
        what = f"retry in {delay_s}s (attempt {attempt}/{limit} failed)"
        return _decision(self.action, policy, params, _reason(failure, why, what), observe)


def compile_action(
    spec: RetrySpec | FallbackSpec | RemediateSpec | EscalateSpec | SimpleSpec,
) -> CompiledAction:
    """Build the callable action for a validated spec (recursively for ``on_exhausted``)."""
    if isinstance(spec, RetrySpec):
        return Retry(
            Backoff(spec.wait, spec.max_attempts),
            spec.honour_retry_after,
            spec.max_retry_after_s,
            compile_action(spec.on_exhausted),
        )
    if isinstance(spec, FallbackSpec):
        chains = [(GlobSet([glob]), tuple(chain)) for glob, chain in spec.chain.items()]
        return Fallback(chains, compile_action(spec.on_exhausted))
    if isinstance(spec, RemediateSpec):
        return Remediate(spec.remediator)
    if isinstance(spec, EscalateSpec):
        return Escalate(spec.timeout_s, spec.on_timeout)
    return Simple(Action(spec.action))
