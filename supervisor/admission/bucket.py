"""A key's token bucket: requests and tokens per minute, fleet-wide in Redis or local.

Each bucket holds at most one minute of each (``rpm`` requests, ``tpm``
tokens) and refills continuously; a call takes ``n`` requests and ``t``
tokens or is told how long to wait (the time the refill needs). A request
larger than a minute's tokens takes the full bucket.

Priorities (0 high, 1 normal, 2 low): a high or normal call refused marks
"waiting until" in the bucket; a call of a lower priority is refused while a
higher one is waiting, so that what refills goes to the higher first.

:class:`LocalBucket` is this sidecar's own, for when Redis is away;
:class:`~supervisor.admission.shared.RedisBucket` is the fleet's, the same
arithmetic in one Lua script.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["LOWEST", "LocalBucket", "Take"]

#: Buckets a sidecar keeps locally (least recently used dropped: it then starts full).
MAX_LOCAL_KEYS: Final = 10_000
LOWEST: Final = 2


@dataclass(frozen=True, slots=True)
class Take:
    go: bool
    wait_ms: int = 0
    why: str = ""  # "limit", "priority" or "paused"


@dataclass(slots=True)
class _Level:
    r: float
    t: float
    ts: float
    waiting: list[float]


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
        self, key: str, rpm: float, tpm: float | None, *, n: int, t: int, priority: int
    ) -> Take:
        now = self._clock() * 1000
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
            wait = math.ceil((n - r) * 60000 / rpm) if r < n else 0
            if tpm and tk < t:
                wait = max(wait, math.ceil((t - tk) * 60000 / tpm))
            if wait > 0:
                if priority < LOWEST:
                    level.waiting[priority] = now + wait
                return Take(False, wait, "limit")
            level.r, level.t, level.ts = r - n, tk - t, now
            return Take(True)
