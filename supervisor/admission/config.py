"""The policy's ``admission`` section as the admitter's ceilings."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from policies import AdmissionLimitSpec, AdmissionSpec
from supervisor.admission.admitter import Admitter
from supervisor.admission.learner import Ceiling

if TYPE_CHECKING:  # needs the `fleet` extra
    from supervisor.admission.shared import RedisBucket
    from supervisor.admission.shared_learning import RedisLearning

__all__ = ["admitter_for", "ceiling_of", "configure"]


def ceiling_of(spec: AdmissionLimitSpec) -> Ceiling:
    return Ceiling(
        rpm=spec.rpm,
        tpm=spec.tpm,
        decrease=spec.decrease,
        floor=spec.floor,
        step=spec.step,
        window_s=spec.window_s,
        headroom=spec.headroom,
    )


def admitter_for(
    spec: AdmissionSpec,
    shared: RedisBucket | None = None,
    *,
    learning: RedisLearning | None = None,
    clock: Callable[[], float] = time.time,
) -> Admitter:
    overrides = {key: ceiling_of(limit) for key, limit in spec.keys.items()}
    return Admitter(
        ceiling_of(spec.default),
        overrides,
        shared=shared,
        learning=learning,
        clock=clock,
        default_given=_default_given(spec),
    )


def configure(admitter: Admitter, spec: AdmissionSpec) -> None:
    """A reloaded policy's ceilings (what was learned is kept, as a share of them)."""
    overrides = {key: ceiling_of(limit) for key, limit in spec.keys.items()}
    admitter.configure(ceiling_of(spec.default), overrides, default_given=_default_given(spec))


def _default_given(spec: AdmissionSpec) -> bool:
    """Whether the policy set ``admission.default`` (else it is the built-in guess)."""
    return "default" in spec.model_fields_set
