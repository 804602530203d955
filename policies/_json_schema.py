"""A verifier's JSON Schema (``output_json_schema``), checked at load and safe to run on outputs.

At load the schema must be plain, bounded JSON (:data:`MAX_SCHEMA_NODES`,
:data:`MAX_SCHEMA_DEPTH`) that needs nothing from outside (local ``$ref``
only: the sidecar never fetches a schema), valid under its declared draft
(2020-12 when none is declared), without a ``$ref`` loop, and its regexes
must compile.

At run time jsonschema checks the output, with three keywords replaced:

* ``pattern``, ``patternProperties`` and ``additionalProperties`` search with
  :class:`policies._regex.PolicyRegex` instead of jsonschema's ``re`` (which
  cannot be stopped), and all the searches of one output share one
  :data:`policies._regex.REGEX_TIMEOUT_S` budget: an output of ten thousand
  strings cannot spend the limit ten thousand times. A spent budget raises
  ``TimeoutError`` out of :meth:`OutputSchema.problem`.
* ``uniqueItems`` is O(n): jsonschema's compares every pair of unhashable items.

jsonschema also matches ``patternProperties`` with ``re`` when it works out
which properties ``unevaluatedProperties`` has not seen, code that cannot be
given a limit; a schema using both keywords is refused at load. ``format`` is
an annotation, as jsonschema does by default.
"""

from __future__ import annotations

import importlib
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any, Final

from policies._regex import MAX_REGEX_LEN, REGEX_TIMEOUT_S, PolicyRegex, check_regex
from policies._text import short

__all__ = ["MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES", "OutputSchema", "check_json_schema"]

#: Bounds of a JSON Schema in a policy file.
MAX_SCHEMA_NODES: Final = 10_000
MAX_SCHEMA_DEPTH: Final = 32
#: Errors a check looks at to pick the most relevant one.
_ERRORS_CONSIDERED: Final = 8
#: Keywords whose value is data (an instance), not schema: their keys are not keywords.
_DATA_KEYWORDS: Final = frozenset({"const", "enum", "examples", "default"})
_PROBES: Final[tuple[object, ...]] = (None, True, 0, 0.5, "", [], {})


def _jsonschema() -> Any:
    """The ``jsonschema`` package, imported on first use (only JSON Schema checks need it)."""
    return importlib.import_module("jsonschema")


# --------------------------------------------------------------------------- load-time checks


def _schema_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][\w$]*", key) else f"{path}[{key!r}]"


def _walk_schema(schema: Mapping[str, Any]) -> None:
    """Check that a schema is plain, bounded JSON that needs nothing from outside."""
    stack: list[tuple[object, str, int, bool]] = [(schema, "$", 0, False)]
    nodes = 0
    keywords: set[str] = set()
    while stack:
        value, path, depth, data = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"JSON Schema has more than {MAX_SCHEMA_NODES} values")
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} at {path}")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"JSON Schema key {key!r} at {path} is not a string")
                here = _schema_path(path, key)
                if not data:
                    _check_keyword(key, item, here)
                    keywords.add(key)
                stack.append((item, here, depth + 1, data or key in _DATA_KEYWORDS))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                stack.append((item, _schema_path(path, index), depth + 1, data))
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"JSON Schema value at {path} is not a finite number")
        elif not (value is None or isinstance(value, (str, int, bool))):
            raise ValueError(
                f"JSON Schema value at {path} is a {type(value).__name__}, not JSON"
                " (quote dates and times)"
            )
    if {"patternProperties", "unevaluatedProperties"} <= keywords:
        raise ValueError(
            "JSON Schema uses unevaluatedProperties with patternProperties: jsonschema"
            " matches those patterns there without a time limit; use additionalProperties"
        )


def _check_keyword(key: str, item: object, path: str) -> None:
    if key in ("$ref", "$dynamicRef") and isinstance(item, str) and not item.startswith("#"):
        raise ValueError(
            f"JSON Schema {key} {item!r} at {path} is not local: only references"
            " inside the schema ('#/$defs/...') are allowed"
        )
    patterns: list[str] = []
    if key == "pattern" and isinstance(item, str):
        patterns.append(item)
    elif key == "patternProperties" and isinstance(item, dict):
        patterns.extend(k for k in item if isinstance(k, str))
    for pattern in patterns:
        if len(pattern) > MAX_REGEX_LEN:
            raise ValueError(f"JSON Schema regex at {path} is longer than {MAX_REGEX_LEN}")
        try:
            check_regex(pattern)
        except ValueError as exc:
            raise ValueError(f"JSON Schema at {path}: {exc}") from None


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Return ``schema`` if a verifier can use it, else raise ``ValueError`` saying why."""
    _walk_schema(schema)
    _validator(schema, _RegexBudget())
    return schema


# --------------------------------------------------------------------------- the validator


class _RegexBudget:
    """The regex time one output's check may spend, over all its searches."""

    __slots__ = ("compiled", "deadline")

    def __init__(self) -> None:
        self.compiled: dict[str, PolicyRegex] = {}
        self.deadline = math.inf

    def start(self) -> None:
        self.deadline = time.monotonic() + REGEX_TIMEOUT_S

    def search(self, pattern: str, text: str) -> bool:
        """Whether ``pattern`` occurs in ``text``; ``TimeoutError`` once the budget is spent."""
        compiled = self.compiled.get(pattern)
        if compiled is None:
            compiled = self.compiled[pattern] = PolicyRegex(pattern)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("regex time budget spent")
        return compiled.search(text, timeout=min(left, REGEX_TIMEOUT_S))


Keyword = Callable[[Any, Any, Any, Any], Iterator[Any]]


def _bounded_keywords(budget: _RegexBudget) -> dict[str, Keyword]:
    """jsonschema's regex keywords, searching with ``budget`` (same errors as jsonschema's)."""
    error: Any = _jsonschema().ValidationError

    def pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not budget.search(patrn, instance):
            yield error(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(
        validator: Any, patterns: Any, instance: Any, schema: Any
    ) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for key, value in instance.items():
                if budget.search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def additional_properties(
        validator: Any, extra: Any, instance: Any, schema: Any
    ) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        properties = schema.get("properties", {})
        patterns = list(schema.get("patternProperties", {}))
        extras = [
            key
            for key in instance
            if key not in properties and not any(budget.search(p, key) for p in patterns)
        ]
        if validator.is_type(extra, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra, path=key)
        elif not extra and extras:
            joined = ", ".join(repr(key) for key in sorted(extras))
            if patterns:
                verb = "does" if len(extras) == 1 else "do"
                listed = ", ".join(repr(p) for p in sorted(patterns))
                yield error(f"{joined} {verb} not match any of the regexes: {listed}")
            else:
                verb = "was" if len(extras) == 1 else "were"
                yield error(f"Additional properties are not allowed ({joined} {verb} unexpected)")

    return {
        "pattern": pattern,
        "patternProperties": pattern_properties,
        "additionalProperties": additional_properties,
        "uniqueItems": _unique_items,
    }


def _validator(schema: Mapping[str, Any], budget: _RegexBudget) -> Any:
    """A validator for ``schema`` (its declared draft, else 2020-12), or raise ``ValueError``."""
    jsonschema = _jsonschema()
    validators: Any = jsonschema.validators
    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        raise ValueError("JSON Schema $schema must be a string")
    cls: Any = validators.validator_for(schema, default=None)
    if cls is None:
        if declared is not None:
            raise ValueError(f"JSON Schema $schema {short(declared, 80)!r} is not a known draft")
        cls = jsonschema.Draft202012Validator
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(
            f"invalid JSON Schema at {exc.json_path}: {short(str(exc.message))}"
        ) from None
    try:  # a schema that refers to itself without end fails on anything: say so now
        validator: Any = validators.extend(cls, _bounded_keywords(budget))(schema)
        for probe in _PROBES:
            for _ in islice(validator.iter_errors(probe), 1):
                pass
    except RecursionError:
        raise ValueError("JSON Schema refers to itself without end ($ref loop)") from None
    except Exception as exc:
        raise ValueError(f"JSON Schema cannot be used: {short(str(exc))}") from None
    return validator


def _equality_key(value: object) -> object:
    """A hashable key equal for JSON values JSON Schema calls equal (``1`` and ``1.0``)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, (int, float)):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("l", tuple(_equality_key(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, _equality_key(v)) for k, v in value.items()))
    return ("z", None)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """``uniqueItems`` in O(n): jsonschema's own compares every pair of unhashable items."""
    if unique is True and isinstance(instance, list) and len(instance) > 1:
        keys = {_equality_key(item) for item in instance}
        if len(keys) != len(instance):
            error: Any = _jsonschema().ValidationError
            yield error(f"{short(repr(instance), 80)} has non-unique elements")


class OutputSchema:
    """A checked schema, ready to judge parsed outputs."""

    __slots__ = ("_budget", "_validator")

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self._budget = _RegexBudget()
        self._validator: Any = _validator(schema, self._budget)

    def problem(self, document: object) -> str | None:
        """Why ``document`` fails the schema (the most relevant error), or None.

        Raises ``TimeoutError`` when the schema's regexes spent their budget,
        ``RecursionError`` on a document nested too deeply to check.
        """
        self._budget.start()
        errors = list(islice(self._validator.iter_errors(document), _ERRORS_CONSIDERED))
        if not errors:
            return None
        best: Any = _jsonschema().exceptions.best_match(errors)
        return f"output fails the JSON Schema at {best.json_path}: {short(str(best.message), 120)}"
