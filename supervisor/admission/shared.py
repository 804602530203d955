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
from typing import Any

from supervisor.admission.bucket import (
    GRACE_MS,
    MAX_SERVICE_CHARS,
    MAX_SERVICES,
    MAX_SHARE_WAIT_MS,
    TTL_MS,
    Take,
)
from supervisor.shared_breakers import RedisLink, Unreachable

__all__ = ["RedisBucket"]

# KEYS[1] the bucket (hash r, t, ts, w0, w1), KEYS[2] the model's pause (ms, wall clock),
# KEYS[3] the bucket's fair shares (hash: V<priority> the virtual time; "<priority>|<service>"
# "finish until seen"), KEYS[4] the key's own pause (a credential's; else the model's again).
# ARGV: now ms, rpm, tpm (0: not limited), n, t, priority, ttl ms, service,
# weight, services tracked at most, grace ms, longest share wait ms.
# Numbers are written with %.17g, so that they read back exactly (as LocalBucket keeps them).
_TAKE_LUA = """
local now = tonumber(ARGV[1])
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local t = tonumber(ARGV[5])
local rank = tonumber(ARGV[6])
local ttl = tonumber(ARGV[7])
local me = ARGV[6] .. '|' .. ARGV[8]
local weight = tonumber(ARGV[9])
local most = tonumber(ARGV[10])
local grace = tonumber(ARGV[11])
local longest = tonumber(ARGV[12])
local function num(x) return string.format('%.17g', x) end
local pause = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'),
  tonumber(redis.call('GET', KEYS[4]) or '0'))
if pause > now then return {0, pause - now, 'paused'} end
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts', 'w0', 'w1')
local ts = tonumber(h[3]) or now
local gone = math.max(0, now - ts)
local r = math.min(rpm, (tonumber(h[1]) or rpm) + gone * rpm / 60000)
local tk = 0
if tpm > 0 then
  tk = math.min(tpm, (tonumber(h[2]) or tpm) + gone * tpm / 60000)
  t = math.min(t, math.floor(tpm))
end
for i = 0, rank - 1 do
  local w = tonumber(h[4 + i])
  if w and w > now then return {0, w - now, 'priority'} end
end
local vname = 'V' .. ARGV[6]
local virtual = 0
local shares = {}
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 2 do
  local f = flat[i]
  if f == vname then
    virtual = tonumber(flat[i + 1])
  elseif string.sub(f, 1, 1) ~= 'V' then
    local a, b, c = string.match(flat[i + 1], '^(%S+) (%S+) (%S+)$')
    shares[f] = {tonumber(a), tonumber(b), tonumber(c)}
  end
end
local mine = shares[me]
local start = virtual
if mine then start = math.max(mine[1], virtual) end
local ahead = 0
local same = ARGV[6] .. '|'
for f, s in pairs(shares) do
  if f ~= me and string.sub(f, 1, #same) == same and s[2] >= now
    and math.max(s[1], virtual) < start then
    ahead = ahead + 1
  end
end
local function keep()
  local count, oldest, oldest_seen = 0, nil, nil
  for f, s in pairs(shares) do
    if f ~= me then
      if s[3] + ttl < now then
        redis.call('HDEL', KEYS[3], f)
        shares[f] = nil
      else
        count = count + 1
        if oldest == nil or s[3] < oldest_seen or (s[3] == oldest_seen and f < oldest) then
          oldest, oldest_seen = f, s[3]
        end
      end
    end
  end
  if shares[me] == nil then
    if oldest ~= nil and count >= most then redis.call('HDEL', KEYS[3], oldest) end
    shares[me] = {0, 0, now}
  end
  shares[me][3] = now
  return shares[me]
end
local wait = 0
if r < n then wait = math.ceil((n - r) * 60000 / rpm) end
if tpm > 0 and tk < t then wait = math.max(wait, math.ceil((t - tk) * 60000 / tpm)) end
local why = 'limit'
if ahead > 0 then
  why = 'share'
  local turn = math.max(math.ceil(((ahead + 1) * n - r) * 60000 / rpm), math.ceil(n * 60000 / rpm))
  wait = math.max(wait, math.min(turn, longest))
end
if wait > 0 then
  if rank < 2 then
    local w = tonumber(h[4 + rank]) or 0
    redis.call('HSET', KEYS[1], 'w' .. rank, num(math.max(w, now + wait)))
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  local s = keep()
  s[2] = math.max(s[2], now + wait + grace)
  redis.call('HSET', KEYS[3], me, num(s[1]) .. ' ' .. num(s[2]) .. ' ' .. num(s[3]))
  redis.call('PEXPIRE', KEYS[3], ttl)
  return {0, wait, why}
end
local cost = n / rpm
if tpm > 0 then cost = math.max(cost, t / tpm) end
redis.call('HSET', KEYS[1], 'r', num(r - n), 't', num(tk - t), 'ts', num(now))
redis.call('PEXPIRE', KEYS[1], ttl)
local s = keep()
s[1] = start + cost / weight
local entry = num(s[1]) .. ' ' .. num(s[2]) .. ' ' .. num(s[3])
redis.call('HSET', KEYS[3], me, entry, vname, num(start))
redis.call('PEXPIRE', KEYS[3], ttl)
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
        service: str = "",
        weight: float = 1.0,
    ) -> Take | None:
        """Take ``n`` requests and ``t`` tokens from ``key``'s bucket for ``service``, or the
        wait (``model`` or ``key`` paused: the later pause's); None: Redis is away."""
        now_ms = round(self._clock() * 1000)
        args = [
            now_ms,
            repr(float(rpm)),
            repr(float(tpm or 0)),
            n,
            t,
            priority,
            TTL_MS,
            service[:MAX_SERVICE_CHARS],
            repr(float(weight)),
            MAX_SERVICES,
            GRACE_MS,
            MAX_SHARE_WAIT_MS,
        ]
        keys = [
            f"{self._prefix}bucket:{key}",
            f"{self._prefix}pause:{model}",
            f"{self._prefix}fair:{key}",
            f"{self._prefix}pause:{key}",
        ]

        try:
            found = self._link.script(_TAKE_LUA, keys, args)
        except Unreachable:
            return None
        why = found[2].decode() if isinstance(found[2], bytes) else str(found[2])
        return Take(bool(found[0]), int(found[1]), why)

    def pause(self, model: str, until: float) -> bool:
        """Pause ``model`` fleet-wide until the wall-clock ``until``: every key of it, for
        ``provider:model``; that credential's key only, for ``provider:model@credential``.
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
