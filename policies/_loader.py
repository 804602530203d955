"""Load a policy file: parse, validate, check, compile, layer on the built-in one.

Every problem found is reported at once, as ``PolicyIssue(source, path, line,
message)`` in one :class:`PolicyError`, so an operator fixes a file in one
pass. pydantic's locations are cleaned to the file's own shape (union tags
dropped, ``rules[2].match.message``) and looked up in the YAML node tree for
their line.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from policies._compile import CompiledEntry, CompiledRule, compile_entry, compile_rule
from policies._detectors import compile_detectors
from policies._glob import GlobSet
from policies._policy import Policy, RuntimeLimits
from policies._schema import (
    BUILTIN_REMEDIATORS,
    KNOWN_KEYS,
    BreakersSpec,
    DecisionMatch,
    EscalateEntry,
    PolicyFile,
    RestartIntensitySpec,
    RetryBudgetSpec,
    SimpleEntry,
)
from policies._schema_admission import AdmissionSpec
from policies._schema_budgets import ServiceBudgets
from policies._schema_fields import BUILTIN_PREFIX
from policies._service_spend import SERVICE_BUDGET_RULE
from policies._verifiers import compile_verifiers
from policies._yamldoc import MAX_TEXT_CHARS, PathElem, YamlDoc, join_path, parse
from supervisor.errors import PolicyError, PolicyIssue
from supervisor.records import BUILTIN_KINDS

BUILTIN_SOURCE = "<builtin>"
CATCH_ALL_RULE = "builtin.unknown"
CATCH_ALL_ENTRY = "builtin.default"
MAX_ISSUES = 100

#: Discriminator values pydantic puts in an error's location; not keys of the file.
_UNION_TAGS = frozenset(
    {
        "retry",
        "fallback",
        "remediate",
        "fail_fast",
        "escalate",
        "none",
        "fixed",
        "exponential",
        "random_exponential",
    }
)


def load_policy(
    path: str | os.PathLike[str] | None = None,
    *,
    text: str | None = None,
    source: str = "<string>",
) -> Policy:
    """Load a policy; with neither ``path`` nor ``text``, the built-in default policy.

    A user policy is layered on top of the built-in one: its rules and decision
    entries are tried first, then the built-in ones (``builtin: false`` drops
    them but keeps the final catch-alls). Raises ``PolicyError`` listing every
    issue found.
    """
    if text is None:
        if path is None:
            return _builtin_policy()
        source = os.fspath(path)
        text = _read(Path(path), source)
    elif path is not None:
        raise ValueError("load_policy takes a path or text, not both")
    doc = parse(text, source)
    return _layer(_validate(doc, user=True), doc)


def _read(path: Path, source: str) -> str:
    try:
        if path.stat().st_size > MAX_TEXT_CHARS * 4:
            raise PolicyError([PolicyIssue(source, "", None, "policy file too large")])
        return path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise PolicyError([PolicyIssue(source, "", None, f"cannot read: {reason}")]) from None
    except UnicodeDecodeError as exc:
        raise PolicyError(
            [PolicyIssue(source, "", None, f"not UTF-8 text: {exc.reason} at byte {exc.start}")]
        ) from None


def _validate(doc: YamlDoc, *, user: bool) -> PolicyFile:
    """Validate the schema and what the schema cannot see; raise every issue at once."""
    if user and _copies_builtin(doc.data):
        raise PolicyError([PolicyIssue(doc.source, "", None, COPY_OF_BUILTIN)])
    issues = _semantic_issues(doc, user=user)
    try:
        spec = PolicyFile.model_validate(doc.data)
    except ValidationError as exc:
        issues.extend(_issue(doc, err) for err in exc.errors(include_url=False))
    if issues:
        raise PolicyError(_finish(issues, doc.source))
    return spec


COPY_OF_BUILTIN = (
    "this is a copy of the built-in policy (its rules and decisions are named 'builtin.*',"
    " which only the built-in file may use). A policy file is layered on top of the"
    " built-in one, so it holds only what differs: start from `spanvisor init`, which"
    " writes the knobs worth changing, with comments"
)


#: Reserved names in a user file from which it is taken for a copy of the built-in one.
_COPY_NAMES = 5


def _copies_builtin(data: object) -> bool:
    """A user file that holds the built-in policy's catch-alls, or many of its names.

    Reported as one issue rather than one per reserved name: a copy layered
    on the built-in policy would run every rule twice and hide later fixes to
    the built-in ones, so the way out is a file that holds only the changes.
    """
    if not isinstance(data, dict):
        return False
    names = {
        name
        for section in ("rules", "policies")
        for _, item in _items(data.get(section))
        if isinstance(name := item.get("name"), str)
    }
    reserved = sum(1 for name in names if name.startswith(BUILTIN_PREFIX))
    return (CATCH_ALL_RULE in names and CATCH_ALL_ENTRY in names) or reserved >= _COPY_NAMES


def _finish(issues: list[PolicyIssue], source: str) -> list[PolicyIssue]:
    unique = sorted(set(issues), key=lambda i: (i.line or 0, i.path, i.message))
    if len(unique) > MAX_ISSUES:
        more = len(unique) - MAX_ISSUES
        unique = [*unique[:MAX_ISSUES], PolicyIssue(source, "", None, f"... and {more} more")]
    return unique


def _issue(doc: YamlDoc, err: ErrorDetails) -> PolicyIssue:
    loc = _clean_loc(err["loc"], doc.data)
    path = ""
    for elem in loc:
        path = join_path(path, elem)
    return PolicyIssue(doc.source, path, doc.line_of(loc), _message(err, loc))


def _clean_loc(loc: Sequence[str | int], data: object) -> list[PathElem]:
    """pydantic's location, walked along the data: union tags and internals dropped."""
    out: list[PathElem] = []
    node = data
    for elem in loc:
        if isinstance(node, dict):
            if elem in node:
                out.append(elem)
                node = node[elem]
                continue
            if isinstance(elem, str) and elem in _UNION_TAGS:
                continue
            out.append(elem)  # a missing key
            break
        if isinstance(node, list) and isinstance(elem, int) and 0 <= elem < len(node):
            out.append(elem)
            node = node[elem]
            continue
        break  # inside a scalar: what is left names pydantic's internals
    return out


def _message(err: ErrorDetails, loc: list[PathElem]) -> str:
    kind = err["type"]
    ctx = err.get("ctx", {})
    if kind == "extra_forbidden":
        key = str(loc[-1]) if loc else "?"
        hint = difflib.get_close_matches(key, KNOWN_KEYS, n=1) if len(key) <= 64 else []
        return f"unknown key {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
    if kind == "missing":
        return f"missing required key {str(loc[-1]) if loc else '?'!r}"
    if kind == "union_tag_invalid":
        field = str(ctx.get("discriminator", "")).strip("'")
        return f"unknown {field} {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
    if kind == "union_tag_not_found":
        return f"missing {str(ctx.get('discriminator', '')).strip(chr(39))!r}"
    if kind == "literal_error":
        return f"unknown value {err.get('input')!r}; expected {ctx.get('expected')}"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    if kind == "too_short" and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind == "finite_number":
        return "must be a finite number"
    if kind in ("model_type", "dict_type") and not loc:
        return "a policy file is a mapping with version: 1, rules: and policies:"
    if kind.endswith("_type"):
        got = err.get("input")
        shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
        return f"{err['msg']}, got {type(got).__name__} {shown}"
    return str(err["msg"])


def _semantic_issues(doc: YamlDoc, *, user: bool) -> list[PolicyIssue]:
    """Duplicate names, reserved names and unknown kinds, read from the raw data.

    Read defensively (the data may not fit the schema) so these issues are
    reported together with the schema's own.
    """
    issues: list[PolicyIssue] = []

    def add(path: list[PathElem], message: str) -> None:
        text = ""
        for elem in path:
            text = join_path(text, elem)
        issues.append(PolicyIssue(doc.source, text, doc.line_of(path), message))

    data = doc.data if isinstance(doc.data, dict) else {}
    sections = {key: _items(data.get(key)) for key in ("rules", "policies", "verifiers")}
    for section, items in sections.items():
        seen: dict[str, int] = {}
        for index, item in items:
            name = item.get("name")
            if not isinstance(name, str):
                continue
            if user and name.startswith(BUILTIN_PREFIX):
                add([section, index, "name"], f"names starting {BUILTIN_PREFIX!r} are reserved")
            if name in seen:
                first = seen[name]
                add([section, index, "name"], f"duplicate name {name!r} (first at index {first})")
            seen.setdefault(name, index)
    known = set(BUILTIN_KINDS)
    known.update(k for _, rule in sections["rules"] if isinstance(k := rule.get("kind"), str))
    for index, entry in sections["policies"]:
        match = entry.get("match")
        kinds = match.get("kind") if isinstance(match, dict) else None
        where: list[PathElem] = ["policies", index, "match", "kind"]
        listed = list(enumerate(kinds)) if isinstance(kinds, list) else [(None, kinds)]
        for position, kind in listed:
            if isinstance(kind, str) and kind not in known:
                path = where if position is None else [*where, position]
                add(path, f"unknown kind {kind!r}: no rule produces it and it is not built in")
    fallbacks = data.get("fallbacks")
    if isinstance(fallbacks, dict):
        for glob, alternatives in fallbacks.items():
            if not isinstance(alternatives, list):
                continue
            for position, alternative in enumerate(alternatives):
                where = ["fallbacks", glob, position]
                if alternative == glob:
                    add(where, f"{glob!r} is its own fallback: list only its alternatives")
                elif alternative in alternatives[:position]:
                    add(where, f"{alternative!r} is listed twice")
    defined = set(BUILTIN_REMEDIATORS)
    remediators = data.get("remediators")
    if isinstance(remediators, dict):
        defined.update(name for name in remediators if isinstance(name, str))
    for path, name in _remediator_references(data.get("policies"), ["policies"]):
        if isinstance(name, str) and name not in defined:
            add(
                path,
                f"unknown remediator {name!r}: define it under 'remediators' or use a built-in"
                f" ({', '.join(BUILTIN_REMEDIATORS)})",
            )
    return issues


def _remediator_references(
    value: object, path: list[PathElem]
) -> list[tuple[list[PathElem], object]]:
    """Every ``remediator:`` named by a ``remediate`` action, nested fallbacks included."""
    found: list[tuple[list[PathElem], object]] = []
    if isinstance(value, dict):
        if value.get("action") == "remediate" and "remediator" in value:
            found.append(([*path, "remediator"], value["remediator"]))
        for key, child in value.items():
            if isinstance(key, str):
                found.extend(_remediator_references(child, [*path, key]))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found.extend(_remediator_references(child, [*path, index]))
    return found


def _items(value: object) -> list[tuple[int, dict[Any, Any]]]:
    if not isinstance(value, list):
        return []
    return [(i, item) for i, item in enumerate(value) if isinstance(item, dict)]


@functools.cache
def _builtin() -> tuple[PolicyFile, tuple[CompiledRule, ...]]:
    text = resources.files("policies").joinpath("default_policy.yaml").read_text(encoding="utf-8")
    doc = parse(text, BUILTIN_SOURCE)
    spec = _validate(doc, user=False)
    if not spec.rules or spec.rules[-1].name != CATCH_ALL_RULE:
        raise PolicyError([PolicyIssue(BUILTIN_SOURCE, "rules", None, "no final catch-all")])
    if not spec.policies or spec.policies[-1].name != CATCH_ALL_ENTRY:
        raise PolicyError([PolicyIssue(BUILTIN_SOURCE, "policies", None, "no final catch-all")])
    return spec, tuple(compile_rule(r) for r in spec.rules)


def _builtin_entries(observe: bool) -> tuple[CompiledEntry, ...]:
    spec, _ = _builtin()
    return tuple(compile_entry(e, observe=observe) for e in spec.policies)


@functools.cache
def _builtin_policy() -> Policy:
    spec, rules = _builtin()
    return Policy(
        rules,
        _builtin_entries(observe=False),
        BUILTIN_SOURCE,
        _limits(spec, None),
        remediators=spec.remediators,
        fallbacks=spec.fallbacks,
        verifiers=compile_verifiers(spec.verifiers),
        detectors=compile_detectors(
            spec.detectors,
            None,
            pressure=spec.context_pressure,
            budget=spec.run_budget,
            slo=spec.slo,
        ),
    )


def _layer(spec: PolicyFile, doc: YamlDoc) -> Policy:
    _, builtin_rules = _builtin()
    base_rules = builtin_rules if spec.builtin else builtin_rules[-1:]
    own_rules = tuple(compile_rule(r) for r in spec.rules)
    rules = own_rules + base_rules
    base_entries = _builtin_entries(spec.observe)
    if not spec.builtin:
        base_entries = base_entries[-1:]
    own_entries = tuple(compile_entry(e, observe=spec.observe) for e in spec.policies)
    builtin_spec, _ = _builtin()
    budget = spec.run_budget or builtin_spec.run_budget
    if budget is not None and budget.action == "abort_run":
        # The budget's own action comes before the built-in escalation.
        abort = SimpleEntry(
            name="builtin.run_budget_abort",
            match=DecisionMatch(kind=["budget_exceeded", "budget_forecast"]),
            action="fail_fast",
        )
        base_entries = (compile_entry(abort, observe=spec.observe), *base_entries)
    service_budgets = spec.service_budgets or builtin_spec.service_budgets
    # Each service budget's own action, before the run budget's (first glob first).
    base_entries = (
        *(
            compile_entry(entry, observe=spec.observe)
            for entry in _service_budget_entries(service_budgets)
        ),
        *base_entries,
    )
    remediators = {**builtin_spec.remediators, **spec.remediators}
    return Policy(
        rules,
        own_entries + base_entries,
        doc.source,
        _limits(spec, builtin_spec),
        remediators=remediators,
        fallbacks={**spec.fallbacks, **builtin_spec.fallbacks, **spec.fallbacks},
        verifiers=compile_verifiers(
            [*spec.verifiers, *(builtin_spec.verifiers if spec.builtin else ())]
        ),
        detectors=compile_detectors(
            spec.detectors,
            builtin_spec.detectors,
            pressure=spec.context_pressure or builtin_spec.context_pressure,
            budget=spec.run_budget or builtin_spec.run_budget,
            slo=spec.slo or builtin_spec.slo,
            service_budgets=service_budgets,
        ),
    )


def _service_budget_entries(budgets: ServiceBudgets) -> list[SimpleEntry | EscalateEntry]:
    """A decision entry per service budget: its action for its services' reports."""
    entries: list[SimpleEntry | EscalateEntry] = []
    for glob, budget in budgets.items():
        match = DecisionMatch(rule=[SERVICE_BUDGET_RULE], service=[glob])
        name = "builtin.service_budget"
        if budget.action == "abort_run":
            entries.append(SimpleEntry(name=name, match=match, action="fail_fast"))
        else:
            entries.append(EscalateEntry(name=name, match=match, action="escalate"))
    return entries


def _limits(spec: PolicyFile, base: PolicyFile | None) -> RuntimeLimits:
    """The file's breaker, budget and intensity settings, else the base's, else defaults."""
    breakers = spec.breakers or (base.breakers if base is not None else None) or BreakersSpec()
    budget = spec.retry_budget or (base.retry_budget if base is not None else None)
    intensity = spec.restart_intensity or (base.restart_intensity if base is not None else None)
    admission = spec.admission or (base.admission if base is not None else None)
    return RuntimeLimits(
        breakers_enabled=breakers.enabled,
        breaker_default=breakers.default,
        breaker_globs=tuple((GlobSet([g]), b) for g, b in breakers.dependencies.items()),
        retry_budget=budget or RetryBudgetSpec(),
        restart_intensity=intensity or RestartIntensitySpec(),
        admission=admission or AdmissionSpec(),
    )
