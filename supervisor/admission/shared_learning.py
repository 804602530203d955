"""The fleet's learned limits in Redis: :mod:`.learner`'s arithmetic in one Lua script.

Each model's :class:`~supervisor.admission.learner.LearnedState` (its share of
the ceiling, the start of its window without a 429, its last decrease) is a
hash ``<namespace>:admit:learn:<provider:model>``, so a 429 seen by any
sidecar lowers the limit of every sidecar. One script per 429: it drops a
429 already counted (the same span seen twice: two sidecars, a redelivered
batch; ``SET NX`` on ``admit:seen:<trace>/<span>`` with a TTL), gives back the
windows without a 429 since the stored time, then decreases once per burst,
step for step as :func:`~supervisor.admission.learner.throttle` does (a test
runs both on one sequence). Times are the sidecars' wall clocks, in seconds,
and numbers travel as exact decimal text (``%.17g``) so both sides compute on
the same doubles.

A credential's key (``provider:model@credential``), when a 429's span named
it, has a state of its own, the same way. A sidecar reads a key's states (its
model's and its own: :meth:`RedisLearning.read_all`, one round trip) at most
about once a second (:class:`~supervisor.admission.admitter.Admitter` caches them),
and gives back the quiet windows itself (:func:`.learner.recover`). Redis
away: ``None``; the admitter uses its own learner. Needs the ``fleet`` extra.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from supervisor.admission.learner import Ceiling, LearnedState
from supervisor.shared_breakers import RedisLink, Unreachable

__all__ = ["Learned", "RedisLearning"]

#: How long a 429's span is remembered as counted (a redelivery comes within minutes).
SEEN_TTL_MS: Final = 600_000

# KEYS[1] the model's state (hash f, s, d), KEYS[2] the span's "counted" mark.
# ARGV: now (s), decrease, floor, step, window_s, decrease_gap_s, seen ttl ms,
# "1" to drop a span already counted.
# Returns f, s, d as text and "1" (decreased), "0" (the same burst) or "-1" (counted before).
_THROTTLE_LUA = """
local now = tonumber(ARGV[1])
local decrease, floor = tonumber(ARGV[2]), tonumber(ARGV[3])
local step, window, gap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local h = redis.call('HMGET', KEYS[1], 'f', 's', 'd')
local f = tonumber(h[1]) or 1.0
local s = tonumber(h[2]) or now
local d = tonumber(h[3]) or -math.huge
local function fmt(x) return string.format('%.17g', x) end
if ARGV[8] == '1' and not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[7]) then
  return {fmt(f), fmt(s), fmt(d), '-1'}
end
local windows = math.floor((now - s) / window)
if windows > 0 then
  if f < 1.0 then f = math.min(1.0, f + windows * step) end
  s = s + windows * window
end
local decreased = '0'
if now - d < gap then
  s = now
else
  f = math.max(floor, f * decrease)
  s = now
  d = now
  decreased = '1'
end
redis.call('HSET', KEYS[1], 'f', fmt(f), 's', fmt(s), 'd', fmt(d))
local back = math.ceil((1.0 - f) / step) + 1
redis.call('PEXPIRE', KEYS[1], math.ceil((back * window + gap) * 1000))
return {fmt(f), fmt(s), fmt(d), decreased}
"""


@dataclass(frozen=True, slots=True)
class Learned:
    """What one 429 did to the fleet's state."""

    state: LearnedState
    decreased: bool
    #: The span was counted before (by this sidecar or another): nothing changed.
    seen: bool = False


class RedisLearning:
    """The fleet's learned limits under ``<namespace>:admit:learn:``; see the module."""

    def __init__(
        self, link: RedisLink, namespace: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._link = link
        self._prefix = f"{namespace}:admit:"
        self._clock = clock

    def throttled(self, model: str, ceiling: Ceiling, span: str = "") -> Learned | None:
        """A 429 of ``model``; ``span``: ``trace/span`` ids, to count it once. None: Redis away."""
        c = ceiling
        args = [
            repr(float(self._clock())),
            repr(float(c.decrease)),
            repr(float(c.floor)),
            repr(float(c.step)),
            repr(float(c.window_s)),
            repr(float(c.decrease_gap_s)),
            SEEN_TTL_MS,
            "1" if span else "0",
        ]
        keys = [f"{self._prefix}learn:{model}", f"{self._prefix}seen:{span}"]

        try:
            found = self._link.script(_THROTTLE_LUA, keys, args)
        except Unreachable:
            return None
        f, s, d, outcome = (_text(v) for v in found)
        return Learned(LearnedState(float(f), float(s), float(d)), outcome == "1", outcome == "-1")

    def read(self, model: str) -> LearnedState | None:
        """The fleet's state of ``model`` as stored (a fresh one if none); None: Redis away."""
        found = self.read_all((model,))
        return None if found is None else found[0]

    def read_all(self, names: Sequence[str]) -> tuple[LearnedState, ...] | None:
        """The fleet's states of ``names`` (models, credentials' keys), in one round trip;
        None: Redis away."""
        keys = [f"{self._prefix}learn:{name}" for name in names]

        def op(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, "f", "s", "d")
            return list(pipe.execute())

        try:
            found = self._link.run(op)
        except Unreachable:
            return None
        return tuple(self._state(*fields) for fields in found)

    def _state(self, f: Any, s: Any, d: Any) -> LearnedState:
        if f is None or s is None:
            return LearnedState(1.0, self._clock())
        return LearnedState(
            float(_text(f)), float(_text(s)), -math.inf if d is None else float(_text(d))
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
