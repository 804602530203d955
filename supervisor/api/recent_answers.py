"""Answers kept for a few seconds, so that a page refreshed by many browsers is read once.

For reads that cost the store real work (counting a day of incidents takes
tens of milliseconds at 10,000 rows) and whose answer a few seconds late is
as good. Callers that ask while the first read runs wait for it rather than
starting their own. Bounded: at most ``max_entries`` keys are kept (the
oldest go first), and a read that fails is not kept.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["RecentAnswers"]

T = TypeVar("T")


class RecentAnswers(Generic[T]):
    """``read()``'s answer per key, kept ``ttl_s`` seconds (on the event loop only)."""

    def __init__(
        self,
        ttl_s: float = 10.0,
        *,
        max_entries: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._kept: OrderedDict[Hashable, tuple[float, T]] = OrderedDict()
        self._running: dict[Hashable, asyncio.Future[T]] = {}
        #: Reads done (misses), for tests and stats.
        self.reads = 0

    async def get(self, key: Hashable, read: Callable[[], Awaitable[T]]) -> T:
        now = self._clock()
        kept = self._kept.get(key)
        if kept is not None and now - kept[0] < self.ttl_s:
            return kept[1]
        running = self._running.get(key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        self.reads += 1
        try:
            answer = await read()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" warning without waiters
            else:
                future.cancel()
            raise
        else:
            future.set_result(answer)
            self._kept[key] = (self._clock(), answer)
            self._kept.move_to_end(key)
            while len(self._kept) > self.max_entries:
                self._kept.popitem(last=False)
            return answer
        finally:
            del self._running[key]
