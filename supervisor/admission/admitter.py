"""The answer to "may this call go now?" for a key, and what 429s teach it.

Order: a key paused by a Retry-After waits until then (this sidecar's
learner, and the fleet's pause in Redis); otherwise the fleet's bucket in
Redis takes the call or answers the wait, at the rate the learner allows;
with Redis away, this sidecar's own bucket does (counted in :meth:`stats`:
a fleet of N sidecars then admits up to N times the limit).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from supervisor.admission.bucket import LocalBucket
from supervisor.admission.key import AdmissionKey
from supervisor.admission.learner import Ceiling, Learner

if TYPE_CHECKING:  # needs the `fleet` extra
    from supervisor.admission.shared import RedisBucket

__all__ = ["PRIORITIES", "AdmissionStats", "Admitter", "Decision"]

PRIORITIES: Final = {"high": 0, "normal": 1, "low": 2}
#: Models whose learned limit a sidecar keeps (least recently used forgotten: back to 100%).
MAX_KEYS: Final = 10_000


@dataclass(frozen=True, slots=True)
class Decision:
    go: bool
    wait_ms: int = 0
    why: str = ""
    shared: bool = True  # False: answered by this sidecar's own bucket (Redis away)


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    admitted: int
    refused: int
    answered_locally: int
    throttles: int


class Admitter:
    """Admission for every key; see the module."""

    def __init__(
        self,
        default: Ceiling,
        overrides: Mapping[str, Ceiling] | None = None,
        *,
        shared: RedisBucket | None = None,
        clock: Callable[[], float] = time.time,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._default = default
        #: By ``provider:model`` or ``provider:model@credential`` (the longer wins).
        self._overrides = dict(overrides or {})
        self._shared = shared
        self._local = LocalBucket(clock=clock, max_keys=max_keys)
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        #: Per ``provider:model``: a 429 names a model, never a credential.
        self._learners: OrderedDict[str, Learner] = OrderedDict()
        self._admitted = self._refused = self._local_answers = self._throttles = 0

    def configure(self, default: Ceiling, overrides: Mapping[str, Ceiling] | None = None) -> None:
        """New ceilings (a policy reload); what each model learned is kept, as a share of them."""
        with self._lock:
            self._default, self._overrides = default, dict(overrides or {})
            for model, learner in self._learners.items():
                provider, _, name = model.partition(":")
                learner.ceiling = self._ceiling(AdmissionKey(provider, name))

    def ceiling(self, key: AdmissionKey) -> Ceiling:
        with self._lock:
            return self._ceiling(key)

    def _ceiling(self, key: AdmissionKey) -> Ceiling:
        by_model = f"{key.provider}:{key.model}"
        return self._overrides.get(str(key)) or self._overrides.get(by_model) or self._default

    def rpm(self, key: AdmissionKey) -> float:
        """``key``'s requests a minute now: its ceiling times what its model learned."""
        learner = self._learner(f"{key.provider}:{key.model}")
        with self._lock:
            return self._ceiling(key).rpm * learner.fraction()

    def admit(self, key: AdmissionKey, *, priority: str = "normal", tokens: int = 0) -> Decision:
        rank = PRIORITIES[priority]
        model = f"{key.provider}:{key.model}"
        learner = self._learner(model)
        with self._lock:  # a learner is not thread-safe: its reads and 429s go under the lock
            paused = learner.pause_left_s()
            ceiling, fraction = self._ceiling(key), learner.fraction()
        if paused > 0:
            return self._count(Decision(False, math.ceil(paused * 1000), "paused"))
        rpm = ceiling.rpm * fraction
        tpm = None if ceiling.tpm is None else ceiling.tpm * fraction
        name = str(key)
        if self._shared is not None:
            took = self._shared.take(name, model, rpm, tpm, n=1, t=tokens, priority=rank)
            if took is not None:
                return self._count(Decision(took.go, took.wait_ms, took.why))
        took = self._local.take(name, rpm, tpm, n=1, t=tokens, priority=rank)
        return self._count(Decision(took.go, took.wait_ms, took.why, shared=False))

    def throttled(self, dependency: str, retry_after_s: float | None = None) -> None:
        """A 429 from ``dependency`` (``provider:model``): the model's limit learns it.

        Spans do not say which credential was used: every key of the model
        (every credential) is lowered, and a Retry-After pauses them all, fleet-wide.
        """
        learner = self._learner(dependency)
        with self._lock:
            self._throttles += 1
            learner.throttled(retry_after_s)
        if retry_after_s and self._shared is not None:
            self._shared.pause(dependency, self._clock() + retry_after_s)

    def stats(self) -> AdmissionStats:
        with self._lock:
            return AdmissionStats(
                self._admitted, self._refused, self._local_answers, self._throttles
            )

    def _learner(self, model: str) -> Learner:
        """The learner of ``provider:model`` (its AIMD knobs: the model's entry or the default)."""
        with self._lock:
            learner = self._learners.get(model)
            if learner is None:
                provider, _, name = model.partition(":")
                ceiling = self._ceiling(AdmissionKey(provider, name))
                learner = self._learners[model] = Learner(ceiling, clock=self._clock)
                if len(self._learners) > self._max_keys:
                    self._learners.popitem(last=False)
            self._learners.move_to_end(model)
            return learner

    def _count(self, decision: Decision) -> Decision:
        with self._lock:
            if decision.go:
                self._admitted += 1
            else:
                self._refused += 1
            if not decision.shared:
                self._local_answers += 1
        return decision
