"""Regexes from a policy file: compiled with ``regex``, every search bounded in time.

Operators write these patterns (a rule's ``message:`` and attribute
``{regex: ...}``, a verifier's ``output_regex``, the ``pattern`` keywords of
its JSON Schema), but they run on span content, which is untrusted. A pattern
that backtracks badly (``(a|a)*$``, ``(\\w+\\s?)*$``) lets one crafted message
hold the sidecar's loop for seconds or hours, and Python's ``re`` cannot be
stopped once a search has started. So every such pattern is compiled with the
``regex`` package in its ``re``-compatible mode (``VERSION0``: the syntax of
``re``, inline flags such as ``(?i)`` and named groups included) and each
search runs under :data:`REGEX_TIMEOUT_S`.

A time limit rather than a check of the pattern's shape: a static check only
approximates which shapes backtrack (it errs both ways, and rejects patterns
that would have been fine), while a limit bounds every pattern at a cost known
in advance. 50 ms is hundreds of times what a sane pattern needs on the few
thousand characters callers search (each caller caps its text: 8 Ki characters of a
message, 64 Ki of an output), and small enough that a span which hits it costs
the pipeline one slow span, not a stall.

Searches hold the GIL (``concurrent=False``): ``regex`` otherwise releases it
around each search of a ``str``, and in the sidecar, whose store writer and
remediation threads are busy, each search then became a hand-off between
threads that cost far more than the matching.

What a timeout means is the caller's to say: :meth:`PolicyRegex.search`
raises ``TimeoutError``; :meth:`PolicyRegex.matches` counts it as no match,
counts it in ``timeouts`` (and in the process-wide ``total_timeouts``) and
logs the first one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final, Literal

import regex

from policies._text import shown_pattern

__all__ = [
    "MAX_REGEX_LEN",
    "REGEX_TIMEOUT_S",
    "PolicyRegex",
    "RegexFlag",
    "check_regex",
    "regex_timeouts",
]

log = logging.getLogger("spanvisor.policies")

#: Time limit of one search, in seconds (see the module docstring).
REGEX_TIMEOUT_S: Final = 0.05
#: Longest pattern a policy file may hold.
MAX_REGEX_LEN: Final = 4096

#: Flags a verifier's ``output_regex`` may set by name (inline ``(?i)`` works everywhere).
RegexFlag = Literal["ignorecase", "multiline", "dotall", "verbose", "ascii"]
_FLAGS: Final[Mapping[str, int]] = {
    "ignorecase": regex.IGNORECASE,
    "multiline": regex.MULTILINE,
    "dotall": regex.DOTALL,
    "verbose": regex.VERBOSE,
    "ascii": regex.ASCII,
}


def _compile(pattern: str, flags: Iterable[str]) -> Any:
    """The compiled pattern, or ``ValueError`` saying what is wrong with it."""
    if len(pattern) > MAX_REGEX_LEN:
        raise ValueError(f"regex longer than {MAX_REGEX_LEN} characters")
    bits = regex.VERSION0
    for name in flags:
        bits |= _FLAGS[name]
    try:
        return regex.compile(pattern, bits)
    except Exception as exc:  # regex.error, RecursionError, a warning turned into an error...
        raise ValueError(f"bad regex {shown_pattern(pattern)!r}: {exc}") from None


def check_regex(pattern: str, flags: Iterable[str] = ()) -> str:
    """Return ``pattern`` if it is short enough and compiles, else raise ``ValueError``."""
    _compile(pattern, flags)
    return pattern


class PolicyRegex:
    """One compiled policy pattern, searched under :data:`REGEX_TIMEOUT_S`.

    ``label`` says where the pattern comes from in the one log line a first
    timeout writes (``rule my.rule message``); ``shown`` is the pattern as
    messages quote it (shortened).
    """

    __slots__ = ("_compiled", "label", "pattern", "shown", "timeouts")

    #: Timeouts of :meth:`matches` over every pattern of the process, reloaded
    #: policies' included (the sidecar's ``/v1/stats`` shows it).
    total_timeouts: ClassVar[int] = 0

    def __init__(
        self,
        pattern: str,
        flags: Iterable[str] = (),
        *,
        label: str = "policy",
    ) -> None:
        self._compiled: Any = _compile(pattern, flags)
        self.pattern = pattern
        self.label = label
        self.shown = shown_pattern(pattern)
        #: Searches :meth:`matches` stopped at the time limit.
        self.timeouts = 0

    def search(self, text: str, timeout: float = REGEX_TIMEOUT_S) -> bool:
        """Whether the pattern occurs in ``text``; ``TimeoutError`` after ``timeout`` seconds."""
        return self._compiled.search(text, concurrent=False, timeout=timeout) is not None

    def matches(self, text: str) -> bool:
        """:meth:`search`, with a timeout counted as no match (and logged the first time)."""
        try:
            return (
                self._compiled.search(text, concurrent=False, timeout=REGEX_TIMEOUT_S) is not None
            )
        except TimeoutError:
            self.timeouts += 1
            PolicyRegex.total_timeouts += 1
            if self.timeouts == 1:
                log.warning(
                    "%s regex /%s/ timed out after %.0f ms on a %d-character text and counts"
                    " as no match; later timeouts of this pattern are counted, not logged",
                    self.label,
                    self.shown,
                    REGEX_TIMEOUT_S * 1000,
                    len(text),
                )
            return False

    def __repr__(self) -> str:
        return f"PolicyRegex({self.pattern!r})"


def regex_timeouts() -> int:
    """Searches of rule regexes stopped at the time limit so far, in this process."""
    return PolicyRegex.total_timeouts
