"""A loaded policy: classify a span, decide what to do about a failure.

Both methods are pure and deterministic (the same inputs give the same output
every time, jitter included) and never raise on any record; they run the
callables compiled at load, in order, first match wins. The last rule and the
last decision entry are catch-alls, so every failing span gets a class and
every failure gets a decision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from policies._actions import CompiledAction, Escalate, Fallback, Remediate
from policies._compile import CompiledEntry, CompiledRule
from policies._detectors import CompiledDetectors, compile_detectors
from policies._glob import GlobSet
from policies._match import Subject
from policies._schema import (
    BUILTIN_REMEDIATORS,
    DEFAULT_ESCALATION_TIMEOUT_S,
    BreakerSpec,
    RemediatorSpec,
    RestartIntensitySpec,
    RetryBudgetSpec,
)
from policies._schema_admission import AdmissionSpec
from policies._verifiers import VerifierSet, compile_verifiers
from supervisor.records import Action, Classification, Decision, Failure, SpanRecord


@dataclass(frozen=True, slots=True)
class RuntimeLimits:
    """The policy's knobs for state kept across failures: breakers, budget, intensity."""

    breakers_enabled: bool = True
    breaker_default: BreakerSpec = field(default_factory=BreakerSpec)
    #: (dependency globs, spec), first match wins; else ``breaker_default``.
    breaker_globs: tuple[tuple[GlobSet, BreakerSpec], ...] = ()
    retry_budget: RetryBudgetSpec = field(default_factory=RetryBudgetSpec)
    restart_intensity: RestartIntensitySpec = field(default_factory=RestartIntensitySpec)
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)

    #: Whether some breaker counts slow calls (``slow_call_s``): durations are then
    #: needed. Worked out once: the pipeline asks for each call.
    times_calls: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        specs = [self.breaker_default, *(spec for _, spec in self.breaker_globs)]
        timed = self.breakers_enabled and any(spec.slow_call_s is not None for spec in specs)
        object.__setattr__(self, "times_calls", timed)

    def breaker_for(self, dependency: str) -> BreakerSpec:
        """The settings of a breaker: the first glob matching its key or, for a key
        ``provider:model@credential``, its ``provider:model``; else the default."""
        model = dependency.rpartition("@")[0]
        for globs, spec in self.breaker_globs:
            if globs(dependency) or (model and globs(model)):
                return spec
        return self.breaker_default


class Policy:
    """Ordered classification rules and decision entries, compiled once."""

    __slots__ = (
        "_chains",
        "_entries",
        "_fallbacks",
        "_rules",
        "detectors",
        "limits",
        "policies",
        "remediators",
        "remediators_used",
        "rules",
        "source",
        "verifiers",
    )

    def __init__(
        self,
        rules: tuple[CompiledRule, ...],
        entries: tuple[CompiledEntry, ...],
        source: str,
        limits: RuntimeLimits | None = None,
        *,
        remediators: Mapping[str, RemediatorSpec] | None = None,
        detectors: CompiledDetectors | None = None,
        verifiers: VerifierSet | None = None,
        fallbacks: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        if not rules or rules[-1].conditions:
            raise ValueError("the last classification rule must be a catch-all")
        if not entries or not _is_catch_all(entries[-1]):
            raise ValueError("the last decision entry must be a catch-all")
        self._rules = rules
        self._entries = entries
        #: The policy's ``fallbacks:`` map, as (glob, chain): a literal key heads its chain.
        self._fallbacks: tuple[tuple[GlobSet, tuple[str, ...]], ...] = tuple(
            (GlobSet([glob]), _declared_chain(glob, alternatives))
            for glob, alternatives in (fallbacks or {}).items()
        )
        for entry in entries:  # fallbacks without a chain follow the policy's chains
            _share_chains(entry.action, self.fallback_chain)
        #: Rule names, in the order they are tried.
        self.rules: tuple[str, ...] = tuple(r.name for r in rules)
        #: Decision entry names, in the order they are tried.
        self.policies: tuple[str, ...] = tuple(e.name for e in entries)
        #: Where the policy came from (a path, ``<builtin>`` or the ``source`` given).
        self.source = source
        #: Breakers, retry budget and restart intensity settings.
        self.limits = limits if limits is not None else RuntimeLimits()
        #: Named remediators defined by the policy files (built-ins need no entry).
        self.remediators: Mapping[str, RemediatorSpec] = MappingProxyType(dict(remediators or {}))
        #: Semantic verifiers of outputs (empty: none).
        self.verifiers = verifiers if verifiers is not None else compile_verifiers(())
        #: Loop and stall detection settings, per service.
        self.detectors = detectors if detectors is not None else compile_detectors(None, None)
        #: dependency -> its fallback chain (see :meth:`fallback_chain`), bounded:
        #: dependencies are named by spans.
        self._chains: dict[str, tuple[str, ...] | None] = {}
        #: Remediator names that ``remediate`` actions name, nested ones included.
        self.remediators_used: tuple[str, ...] = tuple(
            dict.fromkeys(name for e in entries for name in _remediators_in(e.action))
        )

    def classify(self, record: SpanRecord) -> Classification | None:
        """The first matching rule's verdict; None only when the span shows no failure."""
        evidence = record.error
        if evidence is None:
            return None
        subject = Subject(record, evidence)
        missing = subject.missing
        for rule in self._rules:
            if rule.needs & missing:
                continue
            for condition in rule.conditions:
                if not condition(subject):
                    break
            else:
                return Classification(
                    failure_class=rule.failure_class,
                    kind=rule.kind,
                    dependency=rule.dependency_for(record),
                    rule=rule.name,
                )
        raise AssertionError("unreachable: the last rule is a catch-all")  # pragma: no cover

    def decide(self, failure: Failure, *, attempt: int) -> Decision:
        """What to do about ``failure``.

        ``attempt`` is the 1-based count of failures of this dependency in this
        run since its last success there (the step's attempts), this one
        included (values below 1 count as 1).
        """
        attempt = max(attempt, 1)
        for n, entry in enumerate(self._entries):
            if entry.matches(failure):
                decision = entry.action.decide(failure, attempt, entry.name, entry.observe)
                if decision.action is Action.FALLBACK and failure.evidence.stream_began:
                    return self._instead_of_fallback(failure, attempt, n)
                return decision
        raise AssertionError("unreachable: the last entry is a catch-all")  # pragma: no cover

    def _instead_of_fallback(self, failure: Failure, attempt: int, at: int) -> Decision:
        """What follows a fallback that cannot be taken: the answer had begun streaming.

        Chunks of it reached the agent; another model's answer cannot take
        them back. A retry of the step when a later entry that matches says
        so (and has attempts left), else a person decides.
        """
        why = "the streamed response had begun: no fallback to another model"
        entries = self._entries
        for entry in entries[at + 1 :]:
            if entry.action.action is not Action.FALLBACK and entry.matches(failure):
                found = entry.action.decide(failure, attempt, entry.name, entry.observe, why)
                if found.action is Action.RETRY:
                    return found
                break
        entry = entries[at]
        return _STREAM_BEGAN.decide(failure, attempt, entry.name, entry.observe, why)

    def decision_entries(self) -> tuple[tuple[str, str], ...]:
        """(name, action) of each decision entry, in the order they are tried."""
        return tuple((e.name, e.action.action.value) for e in self._entries)

    def remediator(self, name: str) -> RemediatorSpec | None:
        """The remediator ``name`` as the policy defines it; a built-in with its defaults."""
        found = self.remediators.get(name)
        if found is None and name in BUILTIN_REMEDIATORS:
            found = RemediatorSpec(use=name)
        return found

    def fallback_chain(self, dependency: str) -> tuple[str, ...] | None:
        """The fallback chain that covers ``dependency``, or None when there is none.

        The ``fallbacks:`` map first (its first glob that matches, else the
        first chain that lists ``dependency`` as an alternative, so that the
        alternative's own failure moves on along it), then, for policies that
        give chains in their entries, the first such chain in entry order.
        Every decision that wants a fallback asks here: fallback entries
        without a chain, an open breaker, a spent retry budget.

        Remembered per dependency: the governor asks for each failure while a
        breaker is open, and the answer walks every entry's actions and globs.
        """
        chains = self._chains
        if dependency in chains:
            return chains[dependency]
        found = _declared_for(self._fallbacks, dependency)
        if found is None:
            for entry in self._entries:
                found = _chain_in(entry.action, dependency)
                if found is not None:
                    break
        if len(chains) >= _MAX_REMEMBERED_CHAINS:
            chains.clear()
        chains[dependency] = found
        return found

    def __repr__(self) -> str:
        counts = f"rules={len(self.rules)}, policies={len(self.policies)}"
        return f"Policy(source={self.source!r}, {counts})"


_MAX_REMEMBERED_CHAINS = 4096
#: A fallback refused because the answer had begun streaming, with no retry left: asked.
_STREAM_BEGAN: Final = Escalate(DEFAULT_ESCALATION_TIMEOUT_S, "abort")


def _is_catch_all(entry: CompiledEntry) -> bool:
    return (
        not entry.skips_permanent
        and entry.classes is None
        and entry.kinds is None
        and entry.roles is None
        and entry.dependency is None
        and entry.service is None
        and entry.rule is None
    )


def _declared_chain(glob: str, alternatives: Sequence[str]) -> tuple[str, ...]:
    """A ``fallbacks:`` entry as a chain: a literal dependency first, then its alternatives."""
    literal = not any(char in glob for char in "*?[")
    return (glob, *alternatives) if literal else tuple(alternatives)


def _declared_for(
    declared: tuple[tuple[GlobSet, tuple[str, ...]], ...], dependency: str
) -> tuple[str, ...] | None:
    for globs, chain in declared:
        if globs(dependency):
            return chain
    for _, chain in declared:
        if dependency in chain:
            return chain
    return None


def _chain_in(action: CompiledAction, dependency: str) -> tuple[str, ...] | None:
    """A fallback chain for ``dependency`` in an action or what it does when exhausted."""
    seen = 0
    current: CompiledAction | None = action
    while current is not None and seen < 8:  # on_exhausted nests a few levels at most
        if isinstance(current, Fallback):
            for globs, chain in current.chains:
                if globs(dependency):
                    return chain
        current = getattr(current, "on_exhausted", None)
        seen += 1
    return None


def _share_chains(action: CompiledAction, lookup: Callable[[str], tuple[str, ...] | None]) -> None:
    current: CompiledAction | None = action
    for _ in range(8):  # on_exhausted nests a few levels at most
        if current is None:
            return
        if isinstance(current, Fallback) and not current.chains:
            current.shared = lookup
        current = getattr(current, "on_exhausted", None)


def _remediators_in(action: CompiledAction) -> list[str]:
    found = [action.remediator] if isinstance(action, Remediate) else []
    follow = getattr(action, "on_exhausted", None)
    if follow is not None:
        found.extend(_remediators_in(follow))
    return found
