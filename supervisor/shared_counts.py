"""Retry budgets, restart intensity and cascades counted by a fleet in the breakers' Redis.

A :class:`~policies._window_counter.WindowCounter` over the same
:class:`~supervisor.shared_breakers.RedisLink` as the breakers (one client,
one timeout, one breaker of its own, one "Redis up" metric per sidecar),
under ``<namespace>:count:``.

Layout: a window is a hash of time buckets (``window_s`` cut into 10 to 60,
as a local retry budget's), field = bucket index of the wall clock, value =
events in it; each question drops the buckets that left the window and
refreshes the key's TTL (the window), so an idle key disappears. The runs a
cascade hit are a sorted set (run id, last seen), trimmed to the window and
to ``MAX_RUNS`` members. Every question is one Lua script: one round trip,
atomic across the fleet (two sidecars asking at once never both take the
last retry).

The clock is the wall clock (every sidecar's monotonic clock starts
elsewhere): sidecars whose clocks disagree by a fraction of a window count
slightly off, never wrongly by more.

When Redis is unreachable (or skipped by the link's breaker) every question
answers ``None`` and the caller decides with its own, local, counts: nothing
raises into the pipeline. The local windows keep counting meanwhile; what
they counted while Redis was away is **not merged** into Redis when it comes
back (the fleet's windows restart from what Redis had, and the local events
age out of a window within ``window_s`` anyway). ``add``-ed events waiting to
be sent stay waiting, and go with the next question that Redis answers (a
question lost to a timeout may have been counted all the same: its calls may
then count twice, which loosens a budget by that many calls, no more).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from policies import Admission, CascadeTally, Limit, cascade_calls, window_buckets
from supervisor.shared_breakers import RedisLink, Unreachable

__all__ = ["RedisWindowCounter"]

#: Keys with ``add``-ed events waiting to be sent (least recently added dropped first:
#: a sidecar's calls not sent make a fleet's budget stricter, never looser).
MAX_PENDING_KEYS: Final = 10_000
#: Run ids a cascade's window keeps in Redis (the newest).
MAX_RUNS: Final = 1_000
#: Run ids read back when a sidecar reports a cascade.
RUNS_LISTED: Final = 50

# Shared by both scripts: ARGV[1] the bucket now, ARGV[2] buckets per window,
# ARGV[3] the TTL in ms; then, per hash, a count and as many (bucket, n) pairs.
_WINDOW_LUA = """
local now = tonumber(ARGV[1])
local horizon = now - tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local pos = 4
local function window(key)
  local pending = tonumber(ARGV[pos])
  for i = 1, pending do
    local bucket = ARGV[pos + 2 * i - 1]
    if tonumber(bucket) > horizon then
      redis.call('HINCRBY', key, bucket, ARGV[pos + 2 * i])
    end
  end
  pos = pos + 2 * pending + 1
  local total = 0
  local old = {}
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    if tonumber(fields[i]) <= horizon then
      old[#old + 1] = fields[i]
    else
      total = total + tonumber(fields[i + 1])
    end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  if total > 0 then redis.call('PEXPIRE', key, ttl) end
  return total
end
"""

# KEYS[1] the counted window, KEYS[2] (optional) the window the limit is a ratio of.
# ARGV after the shared part's: floor, ratio (read after both windows' pending).
_ADMIT_LUA = (
    _WINDOW_LUA
    + """
local counted = window(KEYS[1])
local of = 0
if #KEYS > 1 then of = window(KEYS[2]) end
local limit = math.max(tonumber(ARGV[pos]), tonumber(ARGV[pos + 1]) * of)
if counted < limit then
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {1, counted + 1, of}
end
return {0, counted, of}
"""
)

# KEYS: failures, calls, runs (sorted set), episode. ARGV after the windows':
# now in ms, window in ms, MAX_RUNS, end_below, the number of run ids, the run ids.
_TALLY_LUA = (
    _WINDOW_LUA
    + """
local failures = window(KEYS[1])
local calls = window(KEYS[2])
local stamp = tonumber(ARGV[pos])
local span = tonumber(ARGV[pos + 1])
local cap = tonumber(ARGV[pos + 2])
local end_below = tonumber(ARGV[pos + 3])
local count = tonumber(ARGV[pos + 4])
for i = 1, count do redis.call('ZADD', KEYS[3], stamp, ARGV[pos + 4 + i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (stamp - span))
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -(cap + 1))
local runs = redis.call('ZCARD', KEYS[3])
if runs > 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
local episode = redis.call('EXISTS', KEYS[4])
if episode == 1 then
  if failures < end_below then
    redis.call('DEL', KEYS[4])
    episode = 2
  else
    redis.call('PEXPIRE', KEYS[4], ttl)
  end
end
return {failures, calls, runs, episode}
"""
)


class RedisWindowCounter:
    """A fleet's window counts in Redis, through the breakers' link; see the module."""

    def __init__(
        self,
        link: RedisLink,
        namespace: str,
        *,
        clock: Callable[[], float] = time.time,
        max_pending_keys: int = MAX_PENDING_KEYS,
    ) -> None:
        self._link = link
        self._prefix = f"{namespace}:count:"
        self._clock = clock
        self._lock = threading.Lock()
        #: key -> {bucket index: events} not sent yet (bounded: keys, and buckets per window).
        self._pending: OrderedDict[str, dict[int, int]] = OrderedDict()
        self._max_pending_keys = max_pending_keys

    # -- the success path: no round trip -------------------------------------------------

    def add(self, key: str, window_s: float, n: int = 1) -> None:
        if n < 1:
            return
        count, width = window_buckets(window_s)
        index = self._index(width)
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = {}
                if len(self._pending) > self._max_pending_keys:
                    self._pending.popitem(last=False)
            else:
                self._pending.move_to_end(key)
            pending[index] = pending.get(index, 0) + n
            if len(pending) > count:  # buckets that left the window: never to be sent
                for old in [b for b in pending if b <= index - count]:
                    del pending[old]

    # -- the failure path: one round trip each -----------------------------------------

    def admit(self, key: str, window_s: float, limit: Limit) -> Admission | None:
        count, width = window_buckets(window_s)
        keys = [key] if limit.of is None else [key, limit.of]
        args, taken = self._window_args(keys, count, width, window_s)
        args += [limit.floor, repr(float(limit.ratio))]
        found = self._run(_ADMIT_LUA, [self._prefix + k for k in keys], args, taken)
        if found is None:
            return None
        return Admission(bool(found[0]), int(found[1]), int(found[2]))

    def tally(
        self,
        dependency: str,
        window_s: float,
        failures: int,
        runs: tuple[str, ...],
        end_below: float,
    ) -> CascadeTally | None:
        count, width = window_buckets(window_s)
        failed, calls = f"cascade:failures:{dependency}", cascade_calls(dependency)
        if failures > 0:
            # The failures are calls too: counted in both windows, now.
            self.add(failed, window_s, failures)
            self.add(calls, window_s, failures)
        args, taken = self._window_args([failed, calls], count, width, window_s)
        now_ms = int(self._clock() * 1000)
        args += [now_ms, int(window_s * 1000), MAX_RUNS, repr(float(end_below)), len(runs), *runs]
        keys = [self._prefix + k for k in (failed, calls)]
        keys += [f"{self._prefix}cascade:runs:{dependency}", self._episode(dependency)]
        found = self._run(_TALLY_LUA, keys, args, taken)
        if found is None:
            return None
        episode = int(found[3])
        return CascadeTally(
            int(found[0]), int(found[1]), int(found[2]), ongoing=episode == 1, ended=episode == 2
        )

    def claim(self, dependency: str, window_s: float) -> tuple[str, ...] | None:
        runs_key = f"{self._prefix}cascade:runs:{dependency}"
        ttl_ms = max(1, int(window_s * 1000))

        def op(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.set(self._episode(dependency), 1, nx=True, px=ttl_ms)
            pipe.zrevrange(runs_key, 0, RUNS_LISTED - 1)
            return list(pipe.execute())

        try:
            claimed, runs = self._link.run(op)
        except Unreachable:
            return ()
        if not claimed:
            return None
        return tuple(r.decode("utf-8", "replace") for r in runs)

    # -- internals ----------------------------------------------------------------------

    def _index(self, width: float) -> int:
        return math.floor(self._clock() / width)

    def _episode(self, dependency: str) -> str:
        return f"{self._prefix}cascade:episode:{dependency}"

    def _window_args(
        self, keys: list[str], count: int, width: float, window_s: float
    ) -> tuple[list[Any], dict[str, dict[int, int]]]:
        """The scripts' shared arguments; the pending events taken (put back if unsent)."""
        taken: dict[str, dict[int, int]] = {}
        with self._lock:
            for key in keys:
                pending = self._pending.pop(key, None)
                if pending:
                    taken[key] = pending
        args: list[Any] = [self._index(width), count, max(1, math.ceil(window_s * 1000))]
        for key in keys:
            pairs = taken.get(key, {})
            args.append(len(pairs))
            for bucket, n in pairs.items():
                args += [bucket, n]
        return args, taken

    def _run(
        self,
        source: str,
        keys: list[str],
        args: list[Any],
        taken: dict[str, dict[int, int]],
    ) -> list[Any] | None:
        try:
            return self._link.script(source, keys, args)
        except Unreachable:
            self._put_back(taken)
            return None

    def _put_back(self, taken: dict[str, dict[int, int]]) -> None:
        """Events not sent wait for the next question Redis answers (bounded as ``add``)."""
        with self._lock:
            for key, buckets in taken.items():
                pending = self._pending.setdefault(key, {})
                for bucket, n in buckets.items():
                    pending[bucket] = pending.get(bucket, 0) + n
                while len(self._pending) > self._max_pending_keys:
                    self._pending.popitem(last=False)
