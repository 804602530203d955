"""Policy-file models of semantic verifiers (``verifiers:``): which spans, which one check.

Models only: each pattern and JSON Schema is checked here, where pydantic can
report its field path, and :mod:`policies._verifiers` compiles the validated
specs into the checks that run on spans (its docstring shows the YAML).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import WithJsonSchema

from policies._json_schema import check_json_schema
from policies._regex import RegexFlag, check_regex
from policies._schema_fields import Description, Globs, Name, Roles, _list_of, _set, _Strict
from supervisor.records import Role

__all__ = [
    "CHECKS",
    "FINAL_ROLES",
    "MAX_VERIFIERS",
    "ROOT_FINAL_ROLES",
    "AttributeRangeSpec",
    "Number",
    "OutputRegexSpec",
    "VerifierMatch",
    "VerifierSpec",
    "Verifiers",
]

MAX_VERIFIERS: Final = 256
#: The checks a verifier may have, exactly one per verifier.
CHECKS: Final = (
    "output_empty",
    "output_regex",
    "output_json",
    "output_json_schema",
    "attribute_range",
    "final_answer_empty",
)
#: The roles of the spans that carry a run's final answer: an LLM's answer that
#: calls no tool (an agent's loop ends on it), or a root agent/chain span's output.
FINAL_ROLES: Final = frozenset({Role.LLM, Role.AGENT, Role.CHAIN})
#: Of those, the roles whose spans carry it only at the root of the run.
ROOT_FINAL_ROLES: Final = frozenset({Role.AGENT, Role.CHAIN})


def _true_only(value: bool) -> bool:
    if value is not True:
        raise ValueError("set it to true or leave it out: false checks nothing")
    return value


def _check_key(value: str) -> str:
    if value.strip() != value:
        raise ValueError(f"attribute key {value!r} has surrounding spaces")
    return value


def _number(value: object) -> int | float:
    """A bound as written (``8000`` stays an int, so messages say 8000, not 8000.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a bound must be a number, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a bound must be a finite number")
    return value


TrueOnly = Annotated[
    bool, AfterValidator(_true_only), WithJsonSchema({"type": "boolean", "const": True})
]
Number = int | float
Bound = Annotated[Number, PlainValidator(_number, json_schema_input_type=float)]
JsonSchemaDict = Annotated[dict[str, Any], AfterValidator(check_json_schema)]


class VerifierMatch(_Strict):
    """Which spans a verifier looks at: all given conditions must hold; none means every span."""

    service: Globs | None = None
    role: Roles | None = None
    span_name: Globs | None = None


class OutputRegexSpec(_Strict):
    """A regex searched in the span's output."""

    # Declared before ``pattern`` so the pattern's validator can compile with them.
    flags: Annotated[list[RegexFlag], _list_of(RegexFlag), Field(max_length=5)] = Field(
        default_factory=list
    )
    pattern: Annotated[str, Field(min_length=1)]
    must_match: bool = Field(
        default=True, description="true: the output must match; false: it must not."
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str, info: ValidationInfo) -> str:
        flags: list[str] = info.data.get("flags", [])
        return check_regex(value, flags)


class AttributeRangeSpec(_Strict):
    """A numeric span attribute within [min, max] (either bound may be left out)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [_set("min"), _set("max")]})

    key: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_check_key)]
    min: Bound | None = None
    max: Bound | None = None
    required: bool = Field(default=False, description="A missing attribute fails the check.")

    @model_validator(mode="after")
    def _coherent(self) -> AttributeRangeSpec:
        if self.min is None and self.max is None:
            raise ValueError("attribute_range needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"attribute_range min ({self.min}) is above max ({self.max})")
        return self


def _one_check(schema: dict[str, Any]) -> None:
    """JSON Schema of ``_one_check`` below: one check set; final_answer_empty's roles."""
    finals = sorted(role.value for role in FINAL_ROLES)
    schema["oneOf"] = [_set(check) for check in CHECKS]
    schema["if"] = _set("final_answer_empty")
    schema["then"] = {
        "properties": {
            "match": {
                "properties": {
                    "role": {
                        "anyOf": [
                            {"type": "null"},
                            {"enum": finals},
                            {"type": "array", "contains": {"enum": finals}},
                        ]
                    }
                }
            }
        }
    }


class VerifierSpec(_Strict):
    """One semantic verifier: spans it looks at, and the one check their output must pass."""

    model_config = ConfigDict(json_schema_extra=_one_check)

    name: Name
    description: Description | None = None
    match: VerifierMatch = Field(default_factory=VerifierMatch)
    output_empty: TrueOnly | None = Field(
        default=None,
        description=(
            "Fails on an output that was recorded and is empty (an LLM turn that only"
            " calls tools is not empty; a span that recorded no output is not judged)."
        ),
    )
    output_regex: OutputRegexSpec | None = None
    output_json: TrueOnly | None = Field(
        default=None, description="Fails when the output is not JSON."
    )
    output_json_schema: JsonSchemaDict | None = Field(
        default=None, description="Fails when the output is not JSON valid under this schema."
    )
    attribute_range: AttributeRangeSpec | None = None
    final_answer_empty: TrueOnly | None = Field(
        default=None,
        description=(
            "Fails on an empty final answer: an LLM answer with neither text nor tool"
            " calls (the agent's loop ends on it), or a run's root agent/chain span whose"
            " recorded output is empty. Outputs that were not recorded are not judged."
        ),
    )

    @model_validator(mode="after")
    def _one_check(self) -> VerifierSpec:
        found = [name for name in CHECKS if getattr(self, name) is not None]
        if len(found) != 1:
            what = "none" if not found else " and ".join(found)
            raise ValueError(
                f"verifier {self.name!r} needs exactly one check among {', '.join(CHECKS)};"
                f" found {what}"
            )
        roles = self.match.role
        if self.final_answer_empty and roles and not FINAL_ROLES & {Role(r) for r in roles}:
            raise ValueError(
                f"final_answer_empty looks at llm spans and root agent or chain spans;"
                f" match.role {roles} leaves none"
            )
        return self

    @property
    def check(self) -> str:
        """The name of this verifier's check."""
        return next(name for name in CHECKS if getattr(self, name) is not None)


def _unique_names(specs: list[VerifierSpec]) -> list[VerifierSpec]:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two verifiers are named {spec.name!r}")
        seen.add(spec.name)
    return specs


#: A policy file's ``verifiers:`` list (names unique).
Verifiers = Annotated[
    list[VerifierSpec], Field(max_length=MAX_VERIFIERS), AfterValidator(_unique_names)
]
