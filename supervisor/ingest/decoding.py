"""Decoding of request bodies: small ones inline, big ones in a worker thread, one at a time.

A small body decodes in well under a millisecond, cheaper than the hand-off
to a thread. A big one would stall every other request on the shared event
loop, so it is decoded in a worker thread (big protobuf bodies a slice at a
time, :mod:`supervisor.ingest.slices`, so the thread lets go of the GIL
between slices).

One big body at a time, for both receivers: the loop competes for the GIL
with one decoding thread, not with one per request in flight. Eight senders
of 100,000-span requests otherwise held the loop for 170 ms at a time (each
poll waited for every thread's turn), and each decoded request in the making
is several times its encoded size. Bodies waiting for their turn are held as
received, counted in the queue's byte bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, TypeVar

__all__ = ["INLINE_DECODE_BYTES", "Decoder"]

T = TypeVar("T")

#: Bodies up to this size are decoded on the loop.
INLINE_DECODE_BYTES: Final = 64 * 1024


class Decoder:
    """Runs decoding work on the loop or, for big bodies, in a worker thread one at a time.

    Lifecycle: none to speak of; the semaphore binds to the loop that first
    waits on it, and ``asyncio.to_thread`` uses that loop's default executor.
    """

    def __init__(self, inline_bytes: int = INLINE_DECODE_BYTES) -> None:
        self._inline_bytes = inline_bytes
        self._one_at_a_time = asyncio.Semaphore(1)

    async def decode(self, size: int, work: Callable[[], T]) -> T:
        """``work()``'s result: run here when ``size`` is small, else off the loop in turn."""
        if size <= self._inline_bytes:
            return work()
        async with self._one_at_a_time:
            return await asyncio.to_thread(work)
