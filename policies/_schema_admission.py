"""Policy-file model of admission control: how much a fleet may ask of each provider.

``admission`` in a policy file: a default limit and overrides per key
(``provider:model`` or ``provider:model@credential``, exact, not globs: a
provider's limits are per model and per API key), and the services' weights
when they share a key (exact names, default 1). Model only:
:mod:`supervisor.admission` runs it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from policies._schema_fields import _Strict

__all__ = ["AdmissionKeyName", "AdmissionLimitSpec", "AdmissionServiceSpec", "AdmissionSpec"]

MAX_PER_MINUTE = 1e9
MAX_WEIGHT = 1000

AdmissionKeyName = Annotated[
    str,
    Field(pattern=r"^[A-Za-z0-9._-]{1,64}:[^@\s]{1,128}(@[A-Za-z0-9._-]{1,128})?$"),
]


class AdmissionLimitSpec(_Strict):
    """A key's ceiling, and how the limit learned from 429s moves under it (AIMD)."""

    rpm: float = Field(default=600, gt=0, le=MAX_PER_MINUTE, description="Requests a minute.")
    tpm: float | None = Field(
        default=None, gt=0, le=MAX_PER_MINUTE, description="Tokens a minute; unset: not limited."
    )
    decrease: float = Field(
        default=0.7, gt=0, lt=1, description="A 429 multiplies the limit by this."
    )
    floor: float = Field(
        default=0.1, gt=0, le=1, description="The limit never goes below this share of rpm/tpm."
    )
    step: float = Field(
        default=0.05, gt=0, le=1, description="Share of rpm/tpm given back per window without 429."
    )
    window_s: float = Field(default=60.0, ge=1, le=3600)
    headroom: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Admit this share less than the limit: the provider counts on its own"
        " clock and with its own token estimate, so a fleet at exactly its limit meets 429s.",
    )


#: A service's name as its spans and ``POST /v1/admit`` give it (exact, not a glob).
AdmissionServiceName = Annotated[str, Field(min_length=1, max_length=256)]


class AdmissionServiceSpec(_Strict):
    """A service's share of a key it contends for with others, relative to theirs."""

    weight: float = Field(
        default=1,
        gt=0,
        le=MAX_WEIGHT,
        description="Share of a contended key relative to other services (default 1).",
    )


class AdmissionSpec(_Strict):
    """Admission control (``POST /v1/admit``): a fleet asks a provider for no more than it takes."""

    enabled: bool = True
    default: AdmissionLimitSpec = Field(default_factory=AdmissionLimitSpec)
    keys: Annotated[dict[AdmissionKeyName, AdmissionLimitSpec], Field(max_length=256)] = Field(
        default_factory=dict,
        description="Per 'provider:model' or 'provider:model@credential' (the longer wins).",
    )
    services: Annotated[dict[AdmissionServiceName, AdmissionServiceSpec], Field(max_length=256)] = (
        Field(
            default_factory=dict,
            description="Weights of services sharing a contended key (exact names; others: 1).",
        )
    )

    def weight(self, service: str) -> float:
        """``service``'s weight: its entry's, else 1."""
        found = self.services.get(service)
        return 1.0 if found is None else found.weight
