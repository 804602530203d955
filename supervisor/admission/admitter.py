"""The answer to "may this call go now?" for a key, and what 429s teach it.

Order: a key paused by a Retry-After waits until then (this sidecar's
learner, and the fleet's pause in Redis); otherwise the fleet's bucket in
Redis takes the call or answers the wait, at the rate the learner allows and
the call's service's share of it (its weight, among the services asking);
with Redis away, this sidecar's own bucket does (counted in :meth:`stats`:
a fleet of N sidecars then admits up to N times the limit).

What is learned, per model, and per credential when a span names the one its
call used (``provider:model@credential``: providers limit per API key): the
share of the ceiling, by AIMD from 429s, fleet-wide in Redis when there is
one (:mod:`.shared_learning`, read at most every ``refresh_s``; this
sidecar's :class:`Learner` when Redis is away); the provider's own limits,
from the rate-limit headers of its responses (a ceiling lower than the
configured one; never higher); and the usual size of a call in tokens, for
an admission that gives none (:meth:`llm_call`). What a span without a
credential teaches is the model's: it applies to every key of the model. A
key with a credential is held to the lower of the model's share and its own,
and waits for either's pause.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, TypeVar

from supervisor.admission.bucket import LocalBucket
from supervisor.admission.key import AdmissionKey
from supervisor.admission.learner import Ceiling, LearnedState, Learner, recover
from supervisor.records import RateLimitHeaders

if TYPE_CHECKING:  # needs the `fleet` extra
    from supervisor.admission.shared import RedisBucket
    from supervisor.admission.shared_learning import RedisLearning

__all__ = ["PRIORITIES", "WHY", "AdmissionStats", "Admitter", "Decision", "ModelLimit"]

_T = TypeVar("_T")

PRIORITIES: Final = {"high": 0, "normal": 1, "low": 2}
#: Why a call is refused (the ``why`` of an answer).
WHY: Final = ("limit", "priority", "share", "paused")
#: Keys (models, and credentials of them) whose learned limit a sidecar keeps (least
#: recently used forgotten: back to 100%).
MAX_KEYS: Final = 10_000
#: How often a model's fleet-wide share is read from Redis, at most (seconds).
REFRESH_S: Final = 1.0
#: Weight of a call's tokens in its model's average (an EWMA).
TOKENS_WEIGHT: Final = 0.1
#: Keys listed in the stats (the most recently used).
STATS_MODELS: Final = 20


@dataclass(frozen=True, slots=True)
class Decision:
    go: bool
    wait_ms: int = 0
    why: str = ""
    shared: bool = True  # False: answered by this sidecar's own bucket (Redis away)


@dataclass(frozen=True, slots=True)
class ModelLimit:
    """A key's limit as this sidecar applies it now: a model's (``provider:model``), or a
    credential's of it (``provider:model@credential``: held to the model's share too)."""

    model: str
    rpm: float
    tpm: float | None
    fraction: float  # learned share of the ceiling
    fleetwide: bool  # the share is the fleet's (read from Redis), not this sidecar's
    provider_rpm: int | None  # what the provider's headers published
    provider_tpm: int | None
    avg_tokens: float | None  # a call's usual tokens, for admissions that give none


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    admitted: int
    refused: int
    answered_locally: int
    throttles: int
    #: Refusals by why: ``limit``, ``priority``, ``share``, ``paused``.
    refused_by: dict[str, int]
    #: 429s that cut a limit (one per burst; the others were the same congestion event).
    decreases: int = 0
    #: 429 spans seen before (a redelivery, or another sidecar): not counted again.
    repeated: int = 0
    #: 429s Redis did not take (learned by this sidecar only).
    learned_locally: int = 0
    #: Whether learned limits are the fleet's (in Redis).
    learned_fleetwide: bool = False
    models: tuple[ModelLimit, ...] = ()


class Admitter:
    """Admission for every key; see the module."""

    def __init__(
        self,
        default: Ceiling,
        overrides: Mapping[str, Ceiling] | None = None,
        *,
        shared: RedisBucket | None = None,
        learning: RedisLearning | None = None,
        clock: Callable[[], float] = time.time,
        max_keys: int = MAX_KEYS,
        refresh_s: float = REFRESH_S,
        default_given: bool = True,
    ) -> None:
        self._default = default
        #: Whether ``default`` is the operator's (False: the built-in one, a guess).
        self._default_given = default_given
        #: By ``provider:model`` or ``provider:model@credential`` (the longer wins).
        self._overrides = dict(overrides or {})
        self._shared = shared
        self._local = LocalBucket(clock=clock, max_keys=max_keys)
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        #: Per ``provider:model``, and ``provider:model@credential`` for a 429 that named it.
        self._learners: OrderedDict[str, Learner] = OrderedDict()
        self._admitted = self._refused = self._local_answers = self._throttles = 0
        self._refused_by = dict.fromkeys(WHY, 0)
        #: Bumped by whatever changes a learned rate here (a 429, a published limit, a
        #: reload): who remembers a rate knows when to ask again.
        self.changes = 0
        self._learning = learning
        self._refresh_s = refresh_s
        #: Per key learned (as the learners): when the fleet's state was read, and it
        #: (None: Redis was away).
        self._fleet: OrderedDict[str, tuple[float, LearnedState | None]] = OrderedDict()
        #: Per model, or key with a credential: the provider's published (rpm, tpm), and a
        #: call's usual tokens.
        self._published: OrderedDict[str, tuple[int | None, int | None]] = OrderedDict()
        #: A plain dict: the pipeline's thread updates a model's average without the lock.
        self._tokens: dict[str, float] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._decreases = self._repeated = self._learned_locally = 0

    def configure(
        self,
        default: Ceiling,
        overrides: Mapping[str, Ceiling] | None = None,
        *,
        default_given: bool = True,
    ) -> None:
        """New ceilings (a policy reload); what each model learned is kept, as a share of them."""
        with self._lock:
            self.changes += 1
            self._default, self._overrides = default, dict(overrides or {})
            self._default_given = default_given
            for name, learner in self._learners.items():
                learner.ceiling = self._ceiling(_key_of(name))

    def ceiling(self, key: AdmissionKey) -> Ceiling:
        with self._lock:
            return self._ceiling(key)

    def _ceiling(self, key: AdmissionKey) -> Ceiling:
        by_model = f"{key.provider}:{key.model}"
        return self._overrides.get(str(key)) or self._overrides.get(by_model) or self._default

    def rpm(self, key: AdmissionKey) -> float | None:
        """``key``'s requests a minute now, as far as this sidecar knows them: the ceiling
        (lowered to what the provider published) times the share learned from 429s
        (with a credential: the lower of the model's and the credential's).

        None while nothing is known of the model but the built-in default (no ceiling
        of its own in the policy, no published limit, no 429): the governor then
        paces nothing, rather than at a rate nobody measured. Reads the fleet's
        learned share only as last cached (no Redis round trip: the governor asks
        on the judging path).
        """
        names = _names(key)
        learners = [self._learner(name) for name in names]
        with self._lock:
            fraction = min(
                self._fraction(learner, _state(self._fleet.get(name)))
                for name, learner in zip(names, learners, strict=True)
            )
            told = self._default_given or any(
                name in self._overrides or name in self._published for name in names
            )
            rpm = self._effective(key).rpm
        if not told and fraction >= 1.0:
            return None
        return rpm * fraction

    def admit(
        self,
        key: AdmissionKey,
        *,
        priority: str = "normal",
        tokens: int = 0,
        service: str = "",
        weight: float = 1.0,
    ) -> Decision:
        """May a call go now? ``service`` shares the key with the others asking, by ``weight``
        (the policy's ``admission.services``), among the calls of its priority."""
        rank = PRIORITIES[priority]
        if not weight > 0:
            raise ValueError("a service's weight must be above 0")
        names = _names(key)
        learners = [self._learner(name) for name in names]
        fleets = self._fleet_states(names)
        with self._lock:  # a learner is not thread-safe: its reads and 429s go under the lock
            paused = max(learner.pause_left_s() for learner in learners)
            ceiling = self._effective(key)
            fraction = min(
                self._fraction(learner, fleet)
                for learner, fleet in zip(learners, fleets, strict=True)
            )
            if not tokens and ceiling.tpm is not None:
                usual = self._tokens.get(names[-1], self._tokens.get(names[0], 0.0))
                tokens = round(usual)
        if paused > 0:
            return self._count(Decision(False, math.ceil(paused * 1000), "paused"))
        rpm = ceiling.rpm * fraction
        tpm = None if ceiling.tpm is None else ceiling.tpm * fraction
        name = str(key)
        if self._shared is not None:
            model = names[0]
            took = self._shared.take(
                name, model, rpm, tpm, n=1, t=tokens, priority=rank, service=service, weight=weight
            )
            if took is not None:
                return self._count(Decision(took.go, took.wait_ms, took.why))
        took = self._local.take(
            name, rpm, tpm, n=1, t=tokens, priority=rank, service=service, weight=weight
        )
        return self._count(Decision(took.go, took.wait_ms, took.why, shared=False))

    def throttled(
        self, dependency: str, retry_after_s: float | None = None, *, span: str = ""
    ) -> None:
        """A 429 from ``dependency``: ``provider:model``, or ``provider:model@credential``
        when its span named the credential (a failure's breaker key).

        With a credential, that key alone learns it: its share is lowered and a
        Retry-After pauses it, fleet-wide; the model's other credentials keep
        their rate. Without, the call's key is unknown: the model learns it, so
        every key of it is lowered, and paused. ``span`` (``trace/span`` ids)
        counts a 429 once however often it is seen.
        """
        learner = self._learner(dependency)
        with self._lock:
            if span and not self._first_sight(span):
                self._repeated += 1
                return
            self._throttles += 1
            self.changes += 1
            decreased = learner.throttled(retry_after_s)
            ceiling = learner.ceiling
        learned = None
        if self._learning is not None:
            learned = self._learning.throttled(dependency, ceiling, span)
        with self._lock:
            if learned is None:
                self._learned_locally += self._learning is not None
            elif learned.seen:
                self._repeated += 1
                self._throttles -= 1
                decreased = False
            else:
                decreased = learned.decreased
                self._remember(self._fleet, dependency, (self._clock(), learned.state))
            self._decreases += decreased
        if retry_after_s and self._shared is not None:
            self._shared.pause(dependency, self._clock() + retry_after_s)

    def llm_call(self, dependency: str, tokens: int, limits: RateLimitHeaders | None) -> None:
        """An LLM call of ``dependency`` seen in a span (OK or not): its tokens (input and
        output) and what the provider's rate-limit headers said. ``dependency`` is
        ``provider:model@credential`` when the span named its credential: the limits a
        provider publishes are its API key's, so they are that key's (without: the
        model's, every key's). From one thread (the pipeline's): called for every LLM
        span, its usual path takes no lock."""
        averages = self._tokens
        usual = averages.get(dependency)
        if limits is None and usual is not None:  # most calls: one update, no lock
            if tokens > 0:  # only this thread writes a value; a read sees the old or new
                averages[dependency] = usual + TOKENS_WEIGHT * (tokens - usual)
            return
        if tokens <= 0 and limits is None:
            return
        pause = 0.0
        with self._lock:
            if tokens > 0:
                if usual is not None:
                    averages[dependency] = usual + TOKENS_WEIGHT * (tokens - usual)
                else:
                    averages[dependency] = float(tokens)
                    if len(averages) > self._max_keys:  # the oldest key first
                        del averages[next(iter(averages))]
            if limits is not None:
                if limits.limit_requests is not None or limits.limit_tokens is not None:
                    self.changes += 1
                    rpm, tpm = self._published.get(dependency, (None, None))
                    published = (limits.limit_requests or rpm, limits.limit_tokens or tpm)
                    self._remember(self._published, dependency, published)
                if limits.exhausted_for_s:
                    pause = limits.exhausted_for_s
        if pause > 0:
            learner = self._learner(dependency)
            with self._lock:  # spans of one burst all say it: Redis is told once
                told = learner.pause_left_s() >= pause - 1.0
                learner.pause(pause)
            if not told and self._shared is not None:
                self._shared.pause(dependency, self._clock() + pause)

    def stats(self) -> AdmissionStats:
        with self._lock:
            named: dict[str, None] = {}  # the most recently used of each table, in order
            for table in (self._learners, self._published, self._tokens):
                for name in reversed(table):
                    if len(named) >= STATS_MODELS:
                        break
                    named[name] = None
            models = tuple(self._model_limit(name) for name in named)
            return AdmissionStats(
                self._admitted,
                self._refused,
                self._local_answers,
                self._throttles,
                dict(self._refused_by),
                self._decreases,
                self._repeated,
                self._learned_locally,
                self._learning is not None,
                models,
            )

    def _model_limit(self, name: str) -> ModelLimit:
        """``name``'s limit as applied now (a credential's: held to its model's share too)."""
        key = _key_of(name)
        ceiling = self._effective(key)
        fraction, fleetwide = 1.0, True
        for each in _names(key):
            state = _state(self._fleet.get(each))
            learner = self._learners.get(each)
            if state is not None:
                share = recover(state, self._ceiling(_key_of(each)), self._clock()).fraction
            else:
                share = 1.0 if learner is None else learner.fraction()
                fleetwide = False
            fraction = min(fraction, share)
        rpm, tpm = self._published.get(name, (None, None))
        usual = self._tokens.get(name)
        return ModelLimit(
            name,
            round(ceiling.rpm * fraction, 3),
            None if ceiling.tpm is None else round(ceiling.tpm * fraction, 3),
            round(fraction, 6),
            fleetwide and self._learning is not None,
            rpm,
            tpm,
            None if usual is None else round(usual, 1),
        )

    def _fleet_states(self, names: tuple[str, ...]) -> list[LearnedState | None]:
        """The fleet's learned states of ``names`` (a model, and a credential's key of it),
        read at most every ``refresh_s``, together (None: not a fleet, or Redis away)."""
        if self._learning is None:
            return [None] * len(names)
        now = self._clock()
        with self._lock:
            known = [self._fleet.get(name) for name in names]
        if all(k is not None and now - k[0] < self._refresh_s for k in known):
            return [_state(k) for k in known]
        found = self._learning.read_all(names)
        states: list[LearnedState | None] = [None] * len(names) if found is None else [*found]
        with self._lock:
            for name, state in zip(names, states, strict=True):
                self._remember(self._fleet, name, (now, state))
        return states

    def _fraction(self, learner: Learner, fleet: LearnedState | None) -> float:
        """The learned share: the fleet's when Redis answered, else this sidecar's."""
        if fleet is None:
            return learner.fraction()
        return recover(fleet, learner.ceiling, self._clock()).fraction

    def _effective(self, key: AdmissionKey) -> Ceiling:
        """``key``'s ceiling, lowered to what the provider published for its model (spans
        without a credential) and for it (spans naming its credential), less its headroom:
        the rates admission applies before what 429s taught."""
        ceiling = self._ceiling(key)
        for name in _names(key):
            rpm, tpm = self._published.get(name, (None, None))
            if rpm is not None and rpm < ceiling.rpm:
                ceiling = replace(ceiling, rpm=float(rpm))
            if tpm is not None and (ceiling.tpm is None or tpm < ceiling.tpm):
                ceiling = replace(ceiling, tpm=float(tpm))
        room = 1.0 - ceiling.headroom
        if room < 1.0:
            lowered = None if ceiling.tpm is None else ceiling.tpm * room
            ceiling = replace(ceiling, rpm=ceiling.rpm * room, tpm=lowered)
        return ceiling

    def _first_sight(self, span: str) -> bool:
        if span in self._seen:
            return False
        self._remember(self._seen, span, None)
        return True

    def _remember(self, table: OrderedDict[str, _T], key: str, value: _T) -> None:
        """``table[key] = value``, the least recently set forgotten past ``max_keys``."""
        table[key] = value
        table.move_to_end(key)
        if len(table) > self._max_keys:
            table.popitem(last=False)

    def _learner(self, name: str) -> Learner:
        """The learner of ``provider:model`` or ``provider:model@credential`` (its AIMD
        knobs: the key's entry, else the model's, else the default)."""
        with self._lock:
            learner = self._learners.get(name)
            if learner is None:
                ceiling = self._ceiling(_key_of(name))
                learner = self._learners[name] = Learner(ceiling, clock=self._clock)
                if len(self._learners) > self._max_keys:
                    self._learners.popitem(last=False)
            self._learners.move_to_end(name)
            return learner

    def _count(self, decision: Decision) -> Decision:
        with self._lock:
            if decision.go:
                self._admitted += 1
            else:
                self._refused += 1
                self._refused_by[decision.why] = self._refused_by.get(decision.why, 0) + 1
            if not decision.shared:
                self._local_answers += 1
        return decision


def _names(key: AdmissionKey) -> tuple[str, ...]:
    """What ``key`` learns from: its model, and itself when it names a credential."""
    model = f"{key.provider}:{key.model}"
    return (model,) if key.credential is None else (model, str(key))


def _key_of(name: str) -> AdmissionKey:
    """The key a learned name stands for (``provider:model[@credential]``; not checked
    again: a span's credential is checked when read, an admission's when asked)."""
    model, _, credential = name.partition("@")
    provider, _, model = model.partition(":")
    return AdmissionKey(provider, model, credential or None)


def _state(known: tuple[float, LearnedState | None] | None) -> LearnedState | None:
    return None if known is None else known[1]
