"""A dependency's current rate, as admission knows it: what the governor paces by.

The governor (``policies``, which imports nothing of the supervisor) spaces
the resumes and retries it schedules for a dependency at its capacity
(:class:`policies.Capacity`); this answers it from the admitter: the key's
ceiling times the share learned from 429s. A breaker keyed
``provider:model@credential`` asks that credential's key (the lower of its
model's share and its own, as its admissions). Admission disabled,
or a dependency that is not ``provider:model`` (a tool): not known.

Each dependency's answer is remembered until the admitter learns something
(:attr:`~supervisor.admission.admitter.Admitter.changes`) or for a second
(what the quiet windows give back, and other sidecars' 429s, come with
time): the governor asks for every retry and resume it paces, and working
the rate out takes a key's parse and the admitter's lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from supervisor.admission.admitter import Admitter
from supervisor.admission.key import admission_key

__all__ = ["AdmissionCapacity"]

#: How long an answer is remembered, at most (seconds), and for how many dependencies.
MEMO_S: Final = 1.0
MAX_MEMO: Final = 10_000


class AdmissionCapacity:
    """Requests a minute for a dependency (a breaker's key), or None; see the module."""

    __slots__ = ("_admitter", "_clock", "_enabled", "_memo")

    def __init__(
        self,
        admitter: Admitter,
        enabled: Callable[[], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admitter = admitter
        self._enabled = enabled  # read at each question: a reload may turn admission off
        self._clock = clock
        #: dependency -> (the admitter's changes, when, the answer).
        self._memo: OrderedDict[str, tuple[int, float, float | None]] = OrderedDict()

    def __call__(self, dependency: str, /) -> float | None:
        if not dependency or not self._enabled():
            return None
        now, changes = self._clock(), self._admitter.changes
        memo = self._memo.get(dependency)
        if memo is not None and memo[0] == changes and now - memo[1] < MEMO_S:
            return memo[2]
        model, _, credential = dependency.partition("@")
        try:
            rpm = self._admitter.rpm(admission_key(model, credential or None))
        except ValueError:  # not provider:model, or not a credential's name
            rpm = None
        self._memo[dependency] = (changes, now, rpm)
        self._memo.move_to_end(dependency)
        if len(self._memo) > MAX_MEMO:
            self._memo.popitem(last=False)
        return rpm
