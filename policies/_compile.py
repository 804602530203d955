"""Turn validated rules and decision entries into the callables a Policy runs.

Runs once per load. Conditions are sorted by cost so each rule tries its
cheapest test first; every glob list becomes one :class:`GlobSet` and every
regex is compiled here, never per span.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies._actions import CompiledAction, compile_action
from policies._glob import GlobSet
from policies._match import (
    Attributes,
    Condition,
    ErrorType,
    ExceptionType,
    FinishReason,
    GrpcCodeIn,
    HttpStatusIn,
    InvalidToolCall,
    Message,
    ProviderCode,
    RecordGlob,
    RoleIn,
    Swallowed,
)
from policies._schema import (
    EscalateEntry,
    FallbackEntry,
    RemediateEntry,
    RetryEntry,
    Rule,
    RuleMatch,
    SimpleEntry,
)
from supervisor.records import Failure, FailureClass, Role, SpanRecord


@dataclass(frozen=True, slots=True)
class CompiledRule:
    """A classification rule ready to run: conditions in cost order, and its verdict."""

    name: str
    conditions: tuple[Condition, ...]
    failure_class: FailureClass
    kind: str
    #: A ``str.format`` template over the record's fields, or None to keep the record's own.
    dependency: str | None
    #: ``NEEDS_*`` bits of all conditions: skip the rule when the span lacks one.
    needs: int

    def dependency_for(self, record: SpanRecord) -> str:
        if self.dependency is None:
            return record.dependency
        return self.dependency.format_map(
            {
                "dependency": record.dependency,
                "service": record.service,
                "provider": record.provider,
                "model": record.model,
                "tool": record.tool_name,
            }
        )


def compile_rule(rule: Rule) -> CompiledRule:
    conditions = _conditions(rule.match, rule.name)
    needs = 0
    for condition in conditions:
        needs |= condition.needs
    return CompiledRule(
        name=rule.name,
        conditions=conditions,
        needs=needs,
        failure_class=FailureClass(rule.failure_class),
        kind=rule.kind,
        dependency=rule.dependency,
    )


def _conditions(match: RuleMatch, rule: str) -> tuple[Condition, ...]:
    found: list[Condition] = []
    if match.swallowed is not None:
        found.append(Swallowed(match.swallowed))
    if match.invalid_tool_call is not None:
        found.append(InvalidToolCall(match.invalid_tool_call))
    if match.http_status is not None:
        found.append(HttpStatusIn(match.http_status))
    if match.grpc_code is not None:
        found.append(GrpcCodeIn(match.grpc_code))
    if match.role is not None:
        found.append(RoleIn(list(match.role)))
    if match.provider_code is not None:
        found.append(ProviderCode(match.provider_code))
    if match.finish_reason is not None:
        found.append(FinishReason(match.finish_reason))
    if match.exception_type is not None:
        found.append(ExceptionType(match.exception_type))
    if match.error_type is not None:
        found.append(ErrorType(match.error_type))
    if match.service is not None:
        found.append(RecordGlob(_service, match.service))
    if match.dependency is not None:
        found.append(RecordGlob(_dependency, match.dependency))
    if match.span_name is not None:
        found.append(RecordGlob(_span_name, match.span_name))
    if match.attributes is not None:
        found.append(Attributes(match.attributes, rule))
    if match.message is not None:
        found.append(Message(match.message, rule))
    found.sort(key=lambda c: c.cost)
    return tuple(found)


def _service(record: SpanRecord) -> str:
    return record.service


def _dependency(record: SpanRecord) -> str:
    return record.dependency


def _span_name(record: SpanRecord) -> str:
    return record.name


@dataclass(frozen=True, slots=True)
class CompiledEntry:
    """A decision entry ready to run: what it matches and the action it takes."""

    name: str
    classes: frozenset[FailureClass] | None
    kinds: frozenset[str] | None
    roles: frozenset[Role] | None
    dependency: GlobSet | None
    service: GlobSet | None
    rule: GlobSet | None
    action: CompiledAction
    observe: bool
    #: Retry entries skip permanent failures unless their match names the class.
    skips_permanent: bool
    #: Only while the service's SLO burns fast (True) or does not (False); None: either.
    slo_burning: bool | None = None

    def matches(self, failure: Failure) -> bool:
        if self.skips_permanent and failure.failure_class is FailureClass.PERMANENT:
            return False
        if self.classes is not None and failure.failure_class not in self.classes:
            return False
        if self.kinds is not None and failure.kind not in self.kinds:
            return False
        if self.roles is not None and failure.role not in self.roles:
            return False
        if self.dependency is not None and not self.dependency(failure.dependency):
            return False
        if self.service is not None and not self.service(failure.service):
            return False
        if self.slo_burning is not None and failure.slo_burning is not self.slo_burning:
            return False
        return self.rule is None or self.rule(failure.rule)


def compile_entry(
    entry: RetryEntry | FallbackEntry | RemediateEntry | EscalateEntry | SimpleEntry,
    *,
    observe: bool,
) -> CompiledEntry:
    m = entry.match
    classes = (
        None if m.failure_class is None else frozenset(FailureClass(c) for c in m.failure_class)
    )
    return CompiledEntry(
        name=entry.name,
        classes=classes,
        kinds=None if m.kind is None else frozenset(m.kind),
        roles=None if m.role is None else frozenset(Role(r) for r in m.role),
        dependency=None if m.dependency is None else GlobSet(m.dependency),
        service=None if m.service is None else GlobSet(m.service),
        rule=None if m.rule is None else GlobSet(m.rule),
        action=compile_action(entry),
        observe=observe or entry.observe,
        skips_permanent=isinstance(entry, RetryEntry)
        and (classes is None or FailureClass.PERMANENT not in classes),
        slo_burning=m.slo_burning,
    )
