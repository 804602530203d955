"""What a span is: its role, the dependency it called, and the session it names.

Worked out by the adapters, in one order, here only: the span view
(:mod:`.span`) and the record (:mod:`.record`) both ask this module, so every
stage sees one answer. The dependency is memoized by the encoded values the
adapters read, since agents make the same calls over and over.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Final, TypeVar

from supervisor.normalize import genai, http_rpc, openinference, openllmetry
from supervisor.normalize.attributes import MAX_NAME_CHARS, Draft, as_str
from supervisor.normalize.wire import RawAttributes, raw_value
from supervisor.records import AttrValue, Role, model_dependency

__all__ = [
    "RUN_ORDER",
    "SESSION_KEYS",
    "dependency_and_tool",
    "dependency_of",
    "identify",
    "may_have_dependency",
    "session_of",
]

_T = TypeVar("_T")

#: The conventions asked for what a run is made of, in order: the OTel GenAI
#: standard first, then OpenInference, then OpenLLMetry. For a span that two
#: instrumentations wrote, the first convention with a value wins, for the
#: record and for the run tracker alike.
RUN_ORDER: Final = (genai, openinference, openllmetry)
#: Where a span names its session (a run that spans traces), in the order read.
SESSION_KEYS: Final[tuple[str, ...]] = tuple(k for a in RUN_ORDER for k in a.SESSION_KEYS)
_UNNAMED_ROLES: Final[tuple[Role, ...]] = (Role.AGENT, Role.CHAIN, Role.OTHER)


def session_of(attrs: Mapping[str, AttrValue], keys: Collection[str] = SESSION_KEYS) -> str:
    """The session a span names: the first of ``keys`` (in :data:`SESSION_KEYS` order) with one.

    The record's ``session_id`` and the run tracker's run both come from here.
    A number is read as its text (some instrumentations write ids as ints).
    """
    for key in keys:
        session = as_str(attrs.get(key))
        if session:
            return session
    return ""


def identify(draft: Draft, keys: Collection[str], span_kind: int) -> None:
    """Every convention's idea of the span's role, provider, model, tool and host.

    The most specific convention first (OpenInference, then GenAI, then
    OpenLLMetry), each filling only what is still empty; HTTP/RPC last.
    """
    if openinference.MARKER in keys:
        openinference.identify(draft)
    if genai.applies(keys):
        genai.identify(draft)
    if openllmetry.applies(keys):
        openllmetry.identify(draft)
    http_rpc.identify(draft, span_kind)


def may_have_dependency(attrs: Mapping[str, AttrValue], present: Collection[str]) -> bool:
    """False when the first convention that names the span's role names one without one."""
    if openinference.MARKER in present:
        return openinference.kind_role(attrs.get(openinference.MARKER)) not in _UNNAMED_ROLES
    if genai.applies(present):
        role = genai.role_of(attrs)
        if role is not None:
            return role not in _UNNAMED_ROLES
    if openllmetry.applies(present):
        role = openllmetry.role_of(attrs)
        if role is not None:
            return role not in _UNNAMED_ROLES
    return True  # HTTP/RPC or nothing: identify decides


def dependency_and_tool(draft: Draft, role: Role, name: str) -> tuple[str, str]:
    """The tool name and the ``dependency`` key of an identified span."""
    tool_name = draft.tool_name
    if not tool_name and role is Role.TOOL:
        tool_name = name[:MAX_NAME_CHARS]  # a tool span without a tool name is named after it
    if role is Role.LLM:
        provider = draft.provider
        model = draft.response_model or draft.request_model
        dependency = model_dependency(provider, model)
    elif role is Role.TOOL:
        dependency = f"tool:{tool_name}" if tool_name else ""
    elif role is Role.HTTP:
        dependency = f"http:{draft.host}" if draft.host else ""
    else:
        dependency = ""
    return tool_name, dependency


def dependency_of(encoded: Any, present: frozenset[str], kind: int, name: str) -> str:
    """A span's dependency through the adapters, memoized by the values they read.

    What the adapters read to name a dependency is a pure function of the
    attribute values they read (and the span's kind and, for an unnamed tool,
    its name), so a span that gives the same encoded values to the same keys
    has the same dependency; agents make the same calls over and over.
    Never raises (``""`` for a span that cannot be read).
    """
    try:
        server = kind == http_rpc.SPAN_KIND_SERVER
        reads = _READS.get(present)
        if reads is not None:
            keys, uses_name = reads
            found = _IDENTITIES.get(
                (present, server, keys, _raw_values(encoded, keys), uses_name and name)
            )
            if found is not None:
                return found
        recorder = _Recorder(RawAttributes(encoded))
        dependency, uses_name = _identified(recorder, present, kind, name)
        keys = tuple(dict.fromkeys(recorder.read))
        if len(_READS) >= _MEMO_ENTRIES or len(_IDENTITIES) >= _MEMO_ENTRIES:
            _READS.clear()  # bounded; rebuilt from the next spans
            _IDENTITIES.clear()
        _READS[present] = (keys, uses_name)
        values = _raw_values(encoded, keys)
        _IDENTITIES[(present, server, keys, values, uses_name and name)] = dependency
        return dependency
    except Exception:  # boundary: an unreadable span counts for no dependency
        return ""


#: present keys -> (keys the adapters read last time, whether the span name was used)
_READS: Final[dict[frozenset[str], tuple[tuple[str, ...], bool]]] = {}
_IDENTITIES: Final[dict[tuple[object, ...], str]] = {}
_MEMO_ENTRIES: Final = 4096


def _raw_values(encoded: Any, keys: tuple[str, ...]) -> tuple[bytes | None, ...]:
    return tuple([raw_value(encoded, key) for key in keys])


class _Recorder(Mapping[str, AttrValue]):
    """The attributes as the adapters read them, remembering every key they look at."""

    __slots__ = ("_raw", "read")

    def __init__(self, raw: RawAttributes) -> None:
        self._raw = raw
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        return self._raw.get(key, default)

    def full(self, key: str) -> AttrValue:
        self.read.append(key)
        return self._raw.full(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.append(key)
        return key in self._raw

    def __getitem__(self, key: str) -> AttrValue:
        self.read.append(key)
        return self._raw[key]

    def __iter__(self) -> Iterator[str]:
        raise TypeError("identify must look attributes up by key (the dependency is memoized)")

    def __len__(self) -> int:
        return len(self._raw)


class _RecordingSource:
    """:class:`LazyConverted`'s interface over a :class:`_Recorder`."""

    __slots__ = ("full", "values")

    def __init__(self, recorder: _Recorder) -> None:
        self.values = recorder
        self.full = recorder.full

    def read(self, key: str, parse: Callable[[AttrValue], _T]) -> _T:
        return parse(self.full(key))


def _identified(
    attrs: _Recorder, present: Collection[str], span_kind: int, name: str
) -> tuple[str, bool]:
    """The dependency, and whether the span's name went into it."""
    if not may_have_dependency(attrs, present):
        return "", False  # an agent, chain or unlabelled span: most of a trace, read cheaply
    draft = Draft(_RecordingSource(attrs))
    identify(draft, present, span_kind)
    role = draft.role
    if role is None or role in _UNNAMED_ROLES:
        return "", False
    uses_name = role is Role.TOOL and not draft.tool_name
    return dependency_and_tool(draft, role, name)[1], uses_name
