"""Which successful spans a verifier reads, and which answers are not answers."""

from __future__ import annotations

from typing import Final

from policies import VerifierSet
from supervisor.normalize import Span
from supervisor.records import Role, SpanRecord

__all__ = ["WantedBy", "only_calls_tools"]

#: Roles a span without a dependency may have, for choosing the verifiers that want it.
_UNNAMED_ROLES: Final[tuple[Role, ...]] = (Role.AGENT, Role.CHAIN, Role.OTHER)


class WantedBy:
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
            group = _TOOL
        elif dependency.startswith("http:"):
            group = _HTTP
        elif dependency:
            group = _LLM
        else:
            group = _UNNAMED
        if bits & group == 0:
            return False
        # Wanted only by checks of emptiness: most outputs are plainly not empty.
        return bits & (group << _TEXT) != 0 or span.may_say_nothing

    def _ask(self, service: str, name: str) -> int:
        verifiers = self.verifiers
        if verifiers is None:
            return 0
        bits = 0
        for group, roles in _GROUPS:
            if any(verifiers.wants(service, role, name) for role in roles):
                bits |= group
            if any(verifiers.wants_text(service, role, name) for role in roles):
                bits |= group << _TEXT
        return bits


_TOOL: Final = 1
_HTTP: Final = 2
_LLM: Final = 4
_UNNAMED: Final = 8
#: Each group's bit shifted by this: a verifier that reads the text wants it.
_TEXT: Final = 4
_GROUPS: Final = (
    (_TOOL, (Role.TOOL,)),
    (_HTTP, (Role.HTTP,)),
    (_LLM, (Role.LLM,)),
    (_UNNAMED, _UNNAMED_ROLES),
)
_WANTED_ENTRIES: Final = 4096


def only_calls_tools(record: SpanRecord) -> bool:
    """An LLM turn with no text that asked for tool calls: not an answer to verify."""
    return record.calls_tools and not record.output_text
