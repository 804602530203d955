"""A dependency's current rate, as admission knows it: what the governor paces by.

The governor (``policies``, which imports nothing of the supervisor) spaces
the resumes and retries it schedules for a dependency at its capacity
(:class:`policies.Capacity`); this answers it from the admitter: the key's
ceiling times the share learned from 429s. A breaker keyed
``provider:model@credential`` asks that credential's key (the lower of its
model's share and its own, as its admissions). Admission disabled,
or a dependency that is not ``provider:model`` (a tool): not known.
"""

from __future__ import annotations

from collections.abc import Callable

from supervisor.admission.admitter import Admitter
from supervisor.admission.key import admission_key

__all__ = ["AdmissionCapacity"]


class AdmissionCapacity:
    """Requests a minute for a dependency (a breaker's key), or None; see the module."""

    __slots__ = ("_admitter", "_enabled")

    def __init__(self, admitter: Admitter, enabled: Callable[[], bool]) -> None:
        self._admitter = admitter
        self._enabled = enabled  # read at each question: a reload may turn admission off

    def __call__(self, dependency: str, /) -> float | None:
        if not dependency or not self._enabled():
            return None
        model, _, credential = dependency.partition("@")
        try:
            key = admission_key(model, credential or None)
        except ValueError:  # not provider:model, or not a credential's name
            return None
        return self._admitter.rpm(key)
