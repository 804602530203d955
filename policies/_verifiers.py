"""Semantic verifiers: checks on what a span returned, not on whether it raised.

A span can end OK and still be wrong: an empty answer, prose where JSON was
promised, a leaked key, a token count far over budget. A verifier that fails
makes the span fail as class ``semantic``, kind ``verification_failed``::

    verifiers:
      - name: answer-is-json
        match: {service: "billing-*", role: llm}      # all optional, all must hold
        output_json_schema: {type: object, required: [answer]}
      - name: no-keys-leaked
        output_regex: {pattern: "sk-[A-Za-z0-9]{20,}", must_match: false}
      - name: tokens-bounded
        match: {role: llm}
        attribute_range: {key: llm.token_count.total, max: 8000}
      - name: final-answer
        final_answer_empty: true

Each verifier has exactly one check: ``output_empty``, ``output_regex``,
``output_json``, ``output_json_schema``, ``attribute_range`` or
``final_answer_empty``. The last looks at LLM answers that call no tool (an
agent's loop ends on such an answer, so it is the run's final answer) and at
a run's root ``agent``/``chain`` span; the built-in policy has one
(``builtin.final_answer``), so an empty final answer is found with no policy
of the user's. The specs are :mod:`policies._schema_verifiers`; the checks,
:mod:`policies._verifier_checks`.

A span that recorded no output (content capture off, the default of the OTel
GenAI instrumentations; OpenInference's ``hide_outputs``) is not judged by a
check of its output, and an LLM turn that only calls tools is not an empty
answer: both are the record's facts (``output_recorded``, ``says_nothing``).

Span content is untrusted, so every check is bounded:

* regexes (``output_regex`` and a JSON Schema's ``pattern`` keywords) run on
  the ``regex`` engine under a time limit (:mod:`policies._regex`), on at most
  the first :data:`~policies._verifier_checks.MAX_REGEX_CHARS` characters of
  the output. A timeout leaves the span unjudged and is reported once, and a
  verifier that times out :data:`MAX_TIMEOUTS` times is switched off until the
  policy is reloaded.
* JSON is parsed with orjson up to
  :data:`~policies._verifier_checks.MAX_JSON_CHARS`; JSON Schemas are checked
  at load and run with an O(n) ``uniqueItems`` (:mod:`policies._json_schema`),
  and report one error per span.
* an output as long as the normalizer's cut may have been cut: a JSON document
  that ends early there, or a pattern that must match but is not found in it,
  leaves the span unjudged rather than failing it on text the agent never wrote.

A span that already failed is not verified: its failure is classified by the
rules, and a second verdict on the same span would report it twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from policies._glob import GlobSet
from policies._schema_verifiers import FINAL_ROLES, ROOT_FINAL_ROLES, VerifierSpec
from policies._text import short
from policies._verifier_checks import (
    EMPTINESS_CHECKS,
    NORMALIZED_OUTPUT_CHARS,
    Check,
    Unjudged,
    compile_check,
)
from supervisor.records import FailureClass, Role, SpanRecord

__all__ = [
    "MAX_TIMEOUTS",
    "VERIFICATION_CLASS",
    "VERIFICATION_KIND",
    "VerificationFailure",
    "VerifierError",
    "VerifierSet",
    "compile_verifiers",
]

log = logging.getLogger("spanvisor.verifiers")

#: What a failed verification is classified as.
VERIFICATION_CLASS: Final = FailureClass.SEMANTIC
VERIFICATION_KIND: Final = "verification_failed"
#: Timeouts after which a verifier stops running until the policy is reloaded.
MAX_TIMEOUTS: Final = 5


@dataclass(frozen=True, slots=True)
class VerificationFailure:
    """A verifier's verdict on one span: it failed, and why (one short line)."""

    verifier: str
    message: str


@dataclass(frozen=True, slots=True)
class VerifierError:
    """A verifier could not judge a span (timeout, oversized output...): reported once per cause."""

    verifier: str
    message: str


class _Verifier:
    """One compiled verifier: its selector, its check, and what it has already reported."""

    __slots__ = (
        "check",
        "name",
        "on_error",
        "reads_text",
        "reported",
        "roles",
        "root_only",
        "service",
        "span_name",
        "timeouts",
    )

    def __init__(
        self,
        spec: VerifierSpec,
        check: Check,
        on_error: Callable[[VerifierError], None],
    ) -> None:
        self.name = spec.name
        self.check = check
        self.on_error = on_error
        self.service = GlobSet(spec.match.service) if spec.match.service else None
        self.span_name = GlobSet(spec.match.span_name) if spec.match.span_name else None
        roles = frozenset(Role(r) for r in spec.match.role) if spec.match.role else frozenset(Role)
        final = spec.final_answer_empty is True
        #: Roles whose spans it judges only at the root of a run.
        self.root_only = ROOT_FINAL_ROLES if final else frozenset()
        self.roles = roles & FINAL_ROLES if final else roles
        #: Whether it reads more of an output than whether it is empty.
        self.reads_text = spec.check not in EMPTINESS_CHECKS
        self.reported: set[str] = set()
        self.timeouts = 0

    def report(self, key: str, message: str) -> None:
        if key not in self.reported:
            self.reported.add(key)
            self.on_error(VerifierError(self.name, message))

    def run(self, record: SpanRecord) -> str | None:
        try:
            return self.check(record)
        except Unjudged as unjudged:
            self.report(unjudged.key, unjudged.message)
            if unjudged.key == "timeout":
                self.timeouts += 1
                if self.timeouts >= MAX_TIMEOUTS:
                    self.report(
                        "disabled",
                        f"switched off after {MAX_TIMEOUTS} regex timeouts until the policy"
                        " is reloaded",
                    )
        except Exception as exc:  # a verifier must never take the pipeline down
            self.report(
                f"crash:{type(exc).__name__}",
                f"check failed with {type(exc).__name__}: {short(str(exc), 120)}",
            )
        return None

    @property
    def disabled(self) -> bool:
        return self.timeouts >= MAX_TIMEOUTS


_MAX_CACHED_SERVICES: Final = 1024
_NONE: Final[tuple[_Verifier, ...]] = ()


def _log_error(error: VerifierError) -> None:
    log.warning("verifier %s: %s", error.verifier, error.message)


class VerifierSet:
    """Compiled verifiers, indexed by service and role so unconcerned spans cost a lookup.

    ``check`` runs on every normalized span: the verifiers that apply to a
    (service, role) pair are resolved once and cached, so a span that no
    verifier selects costs two dict lookups.
    """

    __slots__ = ("_by_service", "_on_error", "_verifiers", "errors")

    def __init__(
        self,
        checks: Sequence[tuple[VerifierSpec, Check]] = (),
        on_error: Callable[[VerifierError], None] | None = None,
    ) -> None:
        self._on_error = on_error or _log_error
        self._verifiers = tuple(_Verifier(spec, check, self._report) for spec, check in checks)
        self._by_service: dict[str, Mapping[Role, tuple[_Verifier, ...]]] = {}
        #: Every error reported so far (bounded: once per verifier and cause).
        self.errors: list[VerifierError] = []

    def _report(self, error: VerifierError) -> None:
        self.errors.append(error)
        self._on_error(error)

    def __len__(self) -> int:
        return len(self._verifiers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self._verifiers)

    def _for(self, service: str, role: Role) -> tuple[_Verifier, ...]:
        by_role = self._by_service.get(service)
        if by_role is None:
            applicable = [v for v in self._verifiers if v.service is None or v.service(service)]
            by_role = {r: tuple(v for v in applicable if r in v.roles) for r in Role}
            if len(self._by_service) >= _MAX_CACHED_SERVICES:
                self._by_service.clear()
            self._by_service[service] = by_role
        return by_role.get(role, _NONE)

    def wants(self, service: str, role: Role, span_name: str) -> bool:
        """Whether any verifier may look at such a span (final-answer ones also need a root)."""
        if not self._verifiers:
            return False
        return any(v.span_name is None or v.span_name(span_name) for v in self._for(service, role))

    def wants_text(self, service: str, role: Role, span_name: str) -> bool:
        """Whether a verifier that reads more than an output's emptiness may look at such a span.

        When none does, only spans whose output may be empty need a record
        (:attr:`supervisor.normalize.Span.may_say_nothing`).
        """
        return any(
            v.reads_text and (v.span_name is None or v.span_name(span_name))
            for v in self._for(service, role)
        )

    def check(self, record: SpanRecord) -> list[VerificationFailure]:
        """The verifiers that fail on ``record``, in policy order; ``[]`` when all pass.

        Spans with error evidence are skipped (the rules classify them), and a
        check that cannot judge a span reports a :class:`VerifierError` once
        instead of raising.
        """
        if not self._verifiers or record.error is not None:
            return []
        candidates = self._for(record.service, record.role)
        if not candidates:
            return []
        failures: list[VerificationFailure] = []
        for verifier in candidates:
            if verifier.span_name is not None and not verifier.span_name(record.name):
                continue
            if record.parent_span_id and record.role in verifier.root_only:
                continue
            if verifier.timeouts >= MAX_TIMEOUTS:
                continue
            message = verifier.run(record)
            if message is not None:
                failures.append(VerificationFailure(verifier.name, message))
        return failures


def compile_verifiers(
    specs: Iterable[VerifierSpec],
    *,
    on_error: Callable[[VerifierError], None] | None = None,
    output_cut_at: int | None = NORMALIZED_OUTPUT_CHARS,
) -> VerifierSet:
    """Compile validated specs into a :class:`VerifierSet`.

    ``on_error`` receives each :class:`VerifierError` once (default: a log
    warning); the set also keeps them in ``errors``. ``output_cut_at`` is the
    length at which outputs may have been cut upstream (``None``: never).
    """
    checks = [(spec, compile_check(spec, output_cut_at)) for spec in specs]
    return VerifierSet(checks, on_error)
