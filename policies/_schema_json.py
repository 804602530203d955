"""The policy file's JSON Schema (``spanvisor schema``), for editors.

It should accept what ``spanvisor validate`` accepts, so each field type and
model says what it takes as input where it is declared (:mod:`policies._schema_fields`:
shorthands, patterns, enums). One thing is fixed here: pydantic turns the
``pattern`` of a mapping's key type into ``patternProperties`` and drops
``additionalProperties``, which leaves every key that does not match the pattern
unchecked (``fallbacks: {"[": 3}`` passed); keys that must match go to
``propertyNames`` instead, and their values to ``additionalProperties``.

What no JSON Schema can say is left to ``validate``: regexes that compile, names
used twice, kinds no rule produces, remediators not defined, a fallback chain that
lists its own key, and orderings between two values (``min`` above ``max``, a
status range ``599-500``, ``success_threshold`` above ``half_open_trials``, the
SLO's windows and burn rate), and whether a verifier's ``output_json_schema`` is
one.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from policies._schema import PolicyFile

__all__ = ["json_schema"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"


class _PolicySchema(GenerateJsonSchema):
    """pydantic's generator, with mapping keys checked by ``propertyNames``."""

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        json_schema = super().dict_schema(schema)
        patterns: dict[str, Any] | None = json_schema.pop("patternProperties", None)
        if patterns:
            ((pattern, values),) = patterns.items()
            names = json_schema.setdefault("propertyNames", {})
            names["pattern"] = pattern
            json_schema["additionalProperties"] = values
        return json_schema


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy file (what ``spanvisor schema`` prints)."""
    schema = PolicyFile.model_json_schema(by_alias=True, schema_generator=_PolicySchema)
    return {"$schema": DRAFT, **schema}
