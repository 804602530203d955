"""A key's token bucket: requests and tokens per minute, fleet-wide in Redis or local.

Each bucket holds at most one minute of each (``rpm`` requests, ``tpm``
tokens) and refills continuously; a call takes ``n`` requests and ``t``
tokens or is told how long to wait (the time the refill needs). A request
larger than a minute's tokens takes the full bucket.

Priorities (0 high, 1 normal, 2 low): a high or normal call refused marks
"waiting until" in the bucket; a call of a lower priority is refused while a
higher one is waiting, so that what refills goes to the higher first.

Services, within a priority, share by weight (start-time fair queueing): a
bucket keeps, per service and priority, a virtual *finish* tag and an
"asking until" mark. A call starts at ``max(its finish, the priority's
virtual time)`` and, taken, moves its finish on by its cost (its dominant
share of the minute: ``max(n / rpm, t / tpm)``) divided by its weight, and
the virtual time to its start. While a service that is asking (refused, told
when to come back, plus :data:`GRACE_MS`) starts earlier, a call is refused
(``share``) for about one request's refill per service ahead. A service
asking for less than its share starts at the virtual time, ahead of the busy
ones; a lone one is never behind anyone; a weight-2 service's finish moves
half as fast, so it takes twice as often. A service idle for a while starts
at the virtual time again: idleness is not saved up.

:class:`LocalBucket` is this sidecar's own, for when Redis is away;
:class:`~supervisor.admission.shared.RedisBucket` is the fleet's, the same
arithmetic in one Lua script (tests feed both one sequence and compare).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["GRACE_MS", "LOWEST", "MAX_SERVICES", "LocalBucket", "Take"]

#: Buckets a sidecar keeps locally (least recently used dropped: it then starts full).
MAX_LOCAL_KEYS: Final = 10_000
LOWEST: Final = 2
#: A bucket's state outlives its last use by this (a full refill is one minute); a
#: service not seen for as long is forgotten.
TTL_MS: Final = 120_000
#: (service, priority) pairs a bucket tracks; a new one evicts the least recently seen.
MAX_SERVICES: Final = 64
#: Characters of a service's name kept (the name is the agent's word: untrusted).
MAX_SERVICE_CHARS: Final = 256
#: A refused service counts as asking until the time it was told, and this long after.
GRACE_MS: Final = 250
#: The most a ``share`` refusal asks to wait beyond the call's own refill.
MAX_SHARE_WAIT_MS: Final = 60_000


@dataclass(frozen=True, slots=True)
class Take:
    go: bool
    wait_ms: int = 0
    why: str = ""  # "limit", "priority", "share" or "paused"


def _field(priority: int, service: str) -> str:
    """The field of a (priority, service) pair in a bucket's fair-share state."""
    return f"{priority}|{service[:MAX_SERVICE_CHARS]}"


@dataclass(slots=True)
class _Share:
    finish: float  # virtual finish tag (minutes of the bucket, over the weight)
    until: float  # asking until (ms): refused, told when to come back, + grace
    seen: float  # last asked (ms)


@dataclass(slots=True)
class _Level:
    r: float
    t: float
    ts: float
    waiting: list[float]
    virtual: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    shares: dict[str, _Share] = field(default_factory=dict)


class LocalBucket:
    """This sidecar's buckets, while Redis is away: the same arithmetic as the script."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, max_keys: int = MAX_LOCAL_KEYS
    ) -> None:
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._levels: OrderedDict[str, _Level] = OrderedDict()

    def take(
        self,
        key: str,
        rpm: float,
        tpm: float | None,
        *,
        n: int,
        t: int,
        priority: int,
        service: str = "",
        weight: float = 1.0,
    ) -> Take:
        now = float(round(self._clock() * 1000))  # whole ms, as the script's
        with self._lock:
            level = self._levels.get(key)
            if level is None:
                level = self._levels[key] = _Level(rpm, tpm or 0.0, now, [0.0, 0.0])
                if len(self._levels) > self._max_keys:
                    self._levels.popitem(last=False)
            self._levels.move_to_end(key)
            gone = max(0.0, now - level.ts)
            r = min(rpm, level.r + gone * rpm / 60000)
            tk = 0.0
            if tpm:
                tk = min(tpm, level.t + gone * tpm / 60000)
                t = min(t, math.floor(tpm))
            for w in level.waiting[:priority]:
                if w > now:
                    return Take(False, math.ceil(w - now), "priority")
            me = _field(priority, service)
            virtual = level.virtual[priority]
            mine = level.shares.get(me)
            start = max(mine.finish if mine else 0.0, virtual)
            ahead = sum(
                1
                for name, s in level.shares.items()
                if name != me
                and name[0] == me[0]
                and s.until >= now
                and max(s.finish, virtual) < start
            )
            wait = math.ceil((n - r) * 60000 / rpm) if r < n else 0
            if tpm and tk < t:
                wait = max(wait, math.ceil((t - tk) * 60000 / tpm))
            why = "limit"
            if ahead:
                why = "share"
                turn = max(
                    math.ceil(((ahead + 1) * n - r) * 60000 / rpm), math.ceil(n * 60000 / rpm)
                )
                wait = max(wait, min(turn, MAX_SHARE_WAIT_MS))
            if wait > 0:
                if priority < LOWEST:
                    level.waiting[priority] = max(level.waiting[priority], now + wait)
                share = _keep(level.shares, me, now)
                share.until = max(share.until, now + wait + GRACE_MS)
                return Take(False, wait, why)
            cost = n / rpm
            if tpm:
                cost = max(cost, t / tpm)
            level.r, level.t, level.ts = r - n, tk - t, now
            _keep(level.shares, me, now).finish = start + cost / weight
            level.virtual[priority] = start
            return Take(True)


def _keep(shares: dict[str, _Share], me: str, now: float) -> _Share:
    """``me``'s entry, seen ``now``: others unseen for :data:`TTL_MS` are dropped, and a
    new entry in a full table evicts the least recently seen (the script does the same)."""
    oldest: tuple[float, str] | None = None
    for name, s in list(shares.items()):
        if name == me:
            continue
        if s.seen + TTL_MS < now:
            del shares[name]
        elif oldest is None or (s.seen, name) < oldest:
            oldest = (s.seen, name)
    share = shares.get(me)
    if share is None:
        if oldest is not None and len(shares) >= MAX_SERVICES:
            del shares[oldest[1]]
        share = shares[me] = _Share(0.0, 0.0, now)
    share.seen = now
    return share
