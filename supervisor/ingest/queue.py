"""The bounded hand-off between the receivers and everything downstream.

Receivers must never wait on the pipeline, so :meth:`IngestQueue.offer` never
blocks: when a bound would be exceeded it says no, the receiver answers with
OTLP's throttling response, and the exporter retries later. Everything that is
turned away is counted.

The queue belongs to one asyncio event loop (the one running the receivers)
and is not thread-safe; call it only from that loop.

Three bounds apply. ``max_batches`` bounds the batches waiting to be taken;
``max_spans`` bounds the spans offered and not yet released with
Three bounds apply. ``max_batches`` bounds the batches waiting to be taken;
``max_spans`` bounds the spans offered and not yet released with
:meth:`IngestQueue.task_done`, so it also covers batches being processed;
``max_bytes`` bounds the bytes ingest holds: the encoded size of those
batches plus the bodies being decoded (:meth:`IngestQueue.reserve`), which is
what memory grows with. A single batch larger than ``max_spans`` or
``max_bytes`` is admitted only when nothing else is outstanding; otherwise a
big request would be throttled forever, and memory stays bounded by the
bounds plus one request.

A stage downstream may also ask ingest to hold back (:meth:`IngestQueue.hold_while`):
the store writer does while a failing store keeps judged failures near its bound,
so that what ingest acknowledges is not what gets dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from supervisor.errors import ConfigError, SupervisorError
from supervisor.ingest.decoding import Decoder

__all__ = [
    "TRANSPORTS",
    "Batch",
    "HoldBack",
    "IngestQueue",
    "IngestStats",
    "QueueClosed",
    "Transport",
    "TransportSpans",
]

#: Why ingest should throttle now (said in the log), or None to accept; called on
#: every offer, so it must be cheap and never block.
HoldBack = Callable[[], "str | None"]

_log = logging.getLogger(__name__)

Transport = Literal["grpc", "http/protobuf", "http/json"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)


class QueueClosed(SupervisorError):
    """:meth:`IngestQueue.get` on a queue that is closed and drained."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One accepted export request, as it goes downstream."""

    #: The request as ingest decoded it, once (:func:`supervisor.ingest.codec.decode_spans`):
    #: what the pipeline reads.
    request: Any
    #: What is forwarded: the bytes as received when they were protobuf and
    #: nothing was rejected, else ``request.SerializeToString()``.
    raw_protobuf: bytes
    #: ``time.time_ns()`` when the receiver got the request.
    received_ns: int
    transport: Transport
    span_count: int


@dataclass(frozen=True, slots=True)
class IngestStats:
    """A snapshot of what ingest accepted and turned away since start."""

    accepted_batches: int
    accepted_spans: int
    throttled_batches: int
    throttled_spans: int
    #: Requests turned away because ``max_bytes`` was reached (also in throttled_batches).
    throttled_for_bytes: int
    #: Spans dropped by validation (bad ids), answered as partial success.
    rejected_spans: int
    #: Requests that could not be decoded (400 / INVALID_ARGUMENT).
    decode_errors: int
    #: Requests over the size limit (413 / RESOURCE_EXHAUSTED).
    too_large: int
    #: Requests that failed for a reason of ours (500 / INTERNAL).
    internal_errors: int
    #: Requests whose body was not received within the read timeout (408).
    read_timeouts: int
    queued_batches: int
    queued_spans: int
    #: Bytes held: encoded size of the outstanding batches plus bodies being decoded.
    queued_bytes: int


@dataclass(frozen=True, slots=True)
class TransportSpans:
    """The spans that came over one transport since start (``/metrics``)."""

    #: Spans acknowledged and queued.
    accepted: int
    #: Spans dropped by validation (bad ids), answered as partial success.
    rejected: int


class IngestQueue:
    """A bounded, never-blocking-on-put queue of :class:`Batch` for one event loop."""

    def __init__(self, max_batches: int, max_spans: int, max_bytes: int = 256 * 1024**2) -> None:
        if max_batches < 1 or max_spans < 1 or max_bytes < 1:
            raise ConfigError(
                f"ingest queue bounds must be >= 1, got max_batches={max_batches}, "
                f"max_spans={max_spans}, max_bytes={max_bytes}"
            )
        self._max_batches = max_batches
        self._max_spans = max_spans
        self._max_bytes = max_bytes
        # Encoded bytes of the outstanding batches, and of bodies being decoded.
        self._bytes = 0
        self._reserved = 0
        self._throttled_for_bytes = 0
        self._items: deque[Batch] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        # Offered but not yet task_done, keyed by id (the value keeps the id unique).
        self._outstanding: dict[int, Batch] = {}
        self._spans = 0
        self._closed = False
        self._hold_back: list[HoldBack] = []
        #: Decodes the bodies of both receivers: big ones off the loop, one at a time.
        self.decoder = Decoder()
        self._throttling = False
        self._episode_throttled = 0
        self._accepted_batches = 0
        # By transport; the totals in stats() are their sums.
        self._accepted_spans: dict[Transport, int] = dict.fromkeys(TRANSPORTS, 0)
        self._throttled_batches = 0
        self._throttled_spans = 0
        self._rejected_spans: dict[Transport, int] = dict.fromkeys(TRANSPORTS, 0)
        self._decode_errors = 0
        self._too_large = 0
        self._internal_errors = 0
        self._read_timeouts = 0

    # ------------------------------------------------------------ producers

    def offer(self, batch: Batch) -> bool:
        """Enqueue ``batch`` if both bounds allow it; never blocks.

        Returns False (and counts the batch as throttled) when the queue is
        full or closed.
        """
        size = len(batch.raw_protobuf)
        held = self._held_back()
        if self._closed or held is not None or not self._has_room(batch.span_count, size):
            self._throttle(batch.span_count, held)
            return False
        if self._throttling:
            _log.info(
                "ingest queue accepting again after throttling %d batches",
                self._episode_throttled,
            )
            self._throttling = False
            self._episode_throttled = 0
        self._items.append(batch)
        self._outstanding[id(batch)] = batch
        self._spans += batch.span_count
        self._bytes += size
        self._accepted_batches += 1
        self._accepted_spans[batch.transport] += batch.span_count
        self._wake_one()
        return True

    def reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` for a body about to be decoded, if ``max_bytes`` allows.

        Called before decoding, so a request that would not fit costs nothing
        but its read; False counts it as throttled. Release with :meth:`release`
        once the batch is offered (or refused): :meth:`offer` counts its own bytes.
        """
        held = self._held_back()
        if self._closed or held is not None or not self._bytes_room(nbytes):
            self._throttle(0, held)
            return False
        self._reserved += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` held."""
        self._reserved -= nbytes

    def hold_while(self, hold_back: HoldBack) -> None:
        """Throttle every offer while ``hold_back`` gives a reason (see the module)."""
        self._hold_back.append(hold_back)

    def _held_back(self) -> str | None:
        for hold_back in self._hold_back:
            reason = hold_back()
            if reason is not None:
                return f"held back: {reason}"
        return None

    def _has_room(self, span_count: int, nbytes: int) -> bool:
        if len(self._items) >= self._max_batches:
            return False
        if not self._outstanding:
            return True
        return self._spans + span_count <= self._max_spans and self._bytes_room(nbytes)

    def _bytes_room(self, nbytes: int) -> bool:
        held = self._bytes + self._reserved
        if held and held + nbytes > self._max_bytes:
            self._throttled_for_bytes += 1
            return False
        return True

    def _throttle(self, span_count: int, held: str | None = None) -> None:
        self._throttled_batches += 1
        self._throttled_spans += span_count
        self._episode_throttled += 1
        if not self._throttling:
            self._throttling = True
            _log.warning(
                "ingest queue %s, throttling (%d batches, %d spans, %d bytes held; "
                "bounds %d batches, %d spans, %d bytes)",
                "closed" if self._closed else held or "full",
                len(self._items),
                self._spans,
                self._bytes + self._reserved,
                self._max_batches,
                self._max_spans,
                self._max_bytes,
            )

    def record_rejected(self, spans: int, transport: Transport) -> None:
        """Count spans that came over ``transport`` and were dropped by validation."""
        self._rejected_spans[transport] += spans

    def record_decode_error(self) -> None:
        """Count a request that could not be decoded."""
        self._decode_errors += 1

    def record_too_large(self) -> None:
        """Count a request over the size limit."""
        self._too_large += 1

    def record_read_timeout(self) -> None:
        """Count a request whose body did not arrive in time (408)."""
        self._read_timeouts += 1

    def record_internal_error(self) -> None:
        """Count a request that failed because of a bug of ours."""
        self._internal_errors += 1

    # ------------------------------------------------------------ consumers

    async def get(self) -> Batch:
        """Wait for the next batch; raises :class:`QueueClosed` once closed and empty."""
        while not self._items:
            if self._closed:
                raise QueueClosed("ingest queue is closed")
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._getters:
                    self._getters.remove(waiter)
                elif self._items:
                    # We were woken for an item we will not take: pass it on.
                    self._wake_one()
                raise
        return self._items.popleft()

    def get_nowait(self) -> Batch | None:
        """The next batch, or None when there is none waiting."""
        return self._items.popleft() if self._items else None

    def task_done(self, batch: Batch) -> None:
        """Release the span budget of a batch taken with :meth:`get`."""
        if self._outstanding.pop(id(batch), None) is None:
            raise ValueError("task_done() for a batch that is not outstanding in this queue")
        self._spans -= batch.span_count
        self._bytes -= len(batch.raw_protobuf)

    def close(self) -> None:
        """Refuse new batches; getters drain what is left, then get :class:`QueueClosed`."""
        self._closed = True
        while self._getters:
            waiter = self._getters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake_one(self) -> None:
        while self._getters:
            waiter = self._getters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    # ---------------------------------------------------------------- state

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def qsize(self) -> int:
        """Batches waiting to be taken."""
        return len(self._items)

    @property
    def max_bytes(self) -> int:
        """The bound on the bytes ingest holds."""
        return self._max_bytes

    @property
    def queued_spans(self) -> int:
        """Spans offered and not yet released with :meth:`task_done`."""
        return self._spans

    def stats(self) -> IngestStats:
        """A consistent snapshot of the counters."""
        return IngestStats(
            accepted_batches=self._accepted_batches,
            accepted_spans=sum(self._accepted_spans.values()),
            throttled_batches=self._throttled_batches,
            throttled_spans=self._throttled_spans,
            throttled_for_bytes=self._throttled_for_bytes,
            rejected_spans=sum(self._rejected_spans.values()),
            decode_errors=self._decode_errors,
            too_large=self._too_large,
            internal_errors=self._internal_errors,
            read_timeouts=self._read_timeouts,
            queued_batches=len(self._items),
            queued_spans=self._spans,
            queued_bytes=self._bytes + self._reserved,
        )

    def spans_by_transport(self) -> dict[Transport, TransportSpans]:
        """The span counters of :meth:`stats`, for each transport (every one, even unused)."""
        return {
            t: TransportSpans(self._accepted_spans[t], self._rejected_spans[t]) for t in TRANSPORTS
        }
