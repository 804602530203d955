"""The fleet's token buckets in Redis: :mod:`.bucket`'s arithmetic in one Lua script.

One round trip per question, atomic across the fleet (two sidecars asking at
once never both take the last request), on the sidecar's wall clock (as
:mod:`supervisor.shared_counts`: every sidecar's monotonic clock starts
elsewhere), through the breakers' :class:`~supervisor.shared_breakers.RedisLink`
(its timeout, its breaker). Redis away: ``None``, and the caller asks its
:class:`~supervisor.admission.bucket.LocalBucket`. Needs the ``fleet`` extra.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from supervisor.admission.bucket import Take
from supervisor.shared_breakers import RedisLink, Unreachable

__all__ = ["RedisBucket"]

#: A bucket's keys in Redis outlive its last use by this (a full refill is one minute).
TTL_MS: Final = 120_000


# KEYS[1] the bucket (hash r, t, ts, w0, w1), KEYS[2] the model's pause (ms, wall clock).
# ARGV: now ms, rpm, tpm (0: not limited), n, t, priority, ttl ms.
_TAKE_LUA = """
local now = tonumber(ARGV[1])
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local t = tonumber(ARGV[5])
local rank = tonumber(ARGV[6])
local ttl = tonumber(ARGV[7])
local pause = tonumber(redis.call('GET', KEYS[2]) or '0')
if pause > now then return {0, pause - now, 'paused'} end
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts', 'w0', 'w1')
local ts = tonumber(h[3]) or now
local gone = math.max(0, now - ts)
local r = math.min(rpm, (tonumber(h[1]) or rpm) + gone * rpm / 60000)
local tk = 0
if tpm > 0 then
  tk = math.min(tpm, (tonumber(h[2]) or tpm) + gone * tpm / 60000)
  t = math.min(t, tpm)
end
for i = 0, rank - 1 do
  local w = tonumber(h[4 + i])
  if w and w > now then return {0, w - now, 'priority'} end
end
local wait = 0
if r < n then wait = math.ceil((n - r) * 60000 / rpm) end
if tpm > 0 and tk < t then wait = math.max(wait, math.ceil((t - tk) * 60000 / tpm)) end
if wait > 0 then
  if rank < 2 then
    redis.call('HSET', KEYS[1], 'w' .. rank, now + wait)
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return {0, wait, 'limit'}
end
redis.call('HSET', KEYS[1], 'r', tostring(r - n), 't', tostring(tk - t), 'ts', now)
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, 0, ''}
"""


class RedisBucket:
    """The fleet's buckets under ``<namespace>:admit:``; see the module."""

    def __init__(
        self, link: RedisLink, namespace: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._link = link
        self._prefix = f"{namespace}:admit:"
        self._clock = clock
        self._script: Any = None

    def take(
        self,
        key: str,
        model: str,
        rpm: float,
        tpm: float | None,
        *,
        n: int,
        t: int,
        priority: int,
    ) -> Take | None:
        """Take ``n`` requests and ``t`` tokens from ``key``'s bucket, or the wait (``model``
        paused: the pause's); None: Redis is away."""
        now_ms = int(self._clock() * 1000)
        args = [now_ms, repr(float(rpm)), repr(float(tpm or 0)), n, t, priority, TTL_MS]
        keys = [f"{self._prefix}bucket:{key}", f"{self._prefix}pause:{model}"]

        def op(client: Any) -> list[Any]:
            if self._script is None:
                self._script = client.register_script(_TAKE_LUA)
            return list(self._script(keys=keys, args=args, client=client))

        try:
            found = self._link.run(op)
        except Unreachable:
            return None
        why = found[2].decode() if isinstance(found[2], bytes) else str(found[2])
        return Take(bool(found[0]), int(found[1]), why)

    def pause(self, model: str, until: float) -> bool:
        """Pause every key of ``model`` fleet-wide until the wall-clock ``until``;
        False: Redis is away."""
        until_ms = int(until * 1000)
        left = until_ms - int(self._clock() * 1000)
        if left <= 0:
            return True
        name = f"{self._prefix}pause:{model}"

        def op(client: Any) -> None:
            old = client.get(name)
            if old is None or int(old) < until_ms:
                client.set(name, until_ms, px=left)

        try:
            self._link.run(op)
        except Unreachable:
            return False
        return True
