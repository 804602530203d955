"""Relay the agent's spans, byte for byte, to the downstream OTLP endpoint.

The sidecar sits between the agent and its trace backend, so the backend must
still get every span; but a dead or slow backend must never slow ingest. The
:class:`Forwarder` therefore puts raw export requests on a bounded queue in
O(1) and sends them from one asyncio task, one batch in flight at a time,
retrying what the OTLP specification calls retryable with tenacity's backoff.
What cannot be queued or delivered is dropped and counted, never silently.
How a batch is sent, over OTLP/HTTP or gRPC, is :mod:`.senders`.

Lifecycle (all coroutine methods run in the event loop that called ``start``)::

    fwd = Forwarder(downstream)
    fwd.start()                      # creates the sending task in the running loop
    fwd.offer(raw, span_count)       # from anywhere, any thread: O(1), never blocks or raises
    await fwd.flush(timeout_s)       # True once everything offered so far is resolved
    await fwd.shutdown(timeout_s)    # flush, stop, close; what is left counts as dropped
    fwd.stats()                      # a frozen snapshot of the counters
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.wait import wait_base

from supervisor.errors import ConfigError, DeliveryError
from supervisor.forward.downstream import Downstream
from supervisor.forward.senders import GrpcSender, HttpSender, Retryable, Sender

log = logging.getLogger("spanvisor.forward")

MiB: Final = 1024 * 1024
# Room kept at the end of shutdown for cancelling the task and closing sockets.
_CLOSE_RESERVE_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class ForwardStats:
    """Counters since construction.

    ``failures`` counts batches given up on because the downstream refused
    them or stayed unreachable for ``max_attempts``; they are also in
    ``dropped_*``, which additionally counts queue-full and shutdown drops.
    ``retries`` counts re-sent attempts. ``queued`` is batches not yet
    resolved (waiting or in flight); ``queued_bytes`` their size.
    """

    forwarded_batches: int
    forwarded_spans: int
    dropped_batches: int
    dropped_spans: int
    retries: int
    failures: int
    queued: int
    queued_bytes: int


@dataclass(frozen=True, slots=True)
class _Batch:
    body: bytes
    spans: int


class _ServerHintOr(wait_base):
    """The downstream's own delay (Retry-After, RetryInfo) if any, else ``fallback``; capped."""

    def __init__(self, fallback: wait_base, cap_s: float) -> None:
        self._fallback = fallback
        self._cap_s = cap_s

    def __call__(self, retry_state: RetryCallState) -> float:
        outcome = retry_state.outcome
        if outcome is not None and outcome.failed:
            exc = outcome.exception()
            if isinstance(exc, Retryable) and exc.retry_after_s is not None:
                return min(max(0.0, exc.retry_after_s), self._cap_s)
        return min(float(self._fallback(retry_state)), self._cap_s)


class Forwarder:
    """Bounded, retrying, order-preserving relay of raw OTLP export requests.

    Not reusable: start once, shut down once. ``offer`` is safe from any
    thread; the other methods belong to the event loop that ran ``start``.
    """

    def __init__(
        self,
        downstream: Downstream,
        *,
        max_queue_batches: int = 1024,
        max_queue_bytes: int = 64 * MiB,
        max_attempts: int = 5,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if max_queue_batches < 1:
            raise ConfigError(f"max_queue_batches must be at least 1, got {max_queue_batches}")
        if max_queue_bytes < 1:
            raise ConfigError(f"max_queue_bytes must be at least 1, got {max_queue_bytes}")
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {max_attempts}")
        if not (0 < initial_backoff_s <= max_backoff_s and math.isfinite(max_backoff_s)):
            raise ConfigError(
                "backoff needs 0 < initial_backoff_s <= max_backoff_s (finite), got "
                f"{initial_backoff_s} and {max_backoff_s}"
            )
        self.downstream = downstream
        self._max_batches = max_queue_batches
        self._max_bytes = max_queue_bytes
        self._max_attempts = max_attempts
        self._sleep = sleep
        # Exponential from initial_backoff_s, doubled per attempt, plus jitter,
        # capped at max_backoff_s; a downstream's own hint replaces it.
        self._wait = _ServerHintOr(
            wait_exponential(multiplier=initial_backoff_s, max=max_backoff_s)
            + wait_random(0, initial_backoff_s),
            cap_s=max_backoff_s,
        )

        self._lock = threading.Lock()
        self._queue: deque[_Batch] = deque()
        self._queued_bytes = 0
        self._in_flight: _Batch | None = None
        self._closed = False
        self._full_logged = False
        self._failing_logged = False
        self._wake_scheduled = False

        self._forwarded_batches = 0
        self._forwarded_spans = 0
        self._dropped_batches = 0
        self._dropped_spans = 0
        self._retries = 0
        self._failures = 0

        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wakeup: asyncio.Event | None = None
        self._progress: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._sender: Sender | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Create the sender and the sending task in the running event loop."""
        if self._task is not None:
            raise RuntimeError("Forwarder.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wakeup = asyncio.Event()
        self._progress = asyncio.Event()
        self._sender = (
            GrpcSender(self.downstream)
            if self.downstream.protocol == "grpc"
            else HttpSender(self.downstream)
        )
        self._task = self._loop.create_task(self._run(), name="spanvisor-forwarder")
        if self._queue:
            self._wakeup.set()

    def offer(self, raw_protobuf: bytes, span_count: int) -> bool:
        """Queue one export request for the downstream; False when it was dropped.

        O(1), never blocks, never raises. A full queue (by batches or bytes) or
        a forwarder that is shutting down drops the request and counts it.
        """
        try:
            spans = max(0, int(span_count))
            size = len(raw_protobuf)
            log_full = False
            with self._lock:
                if self._closed:
                    self._count_drop_locked(spans)
                    return False
                accepted = (
                    len(self._queue) < self._max_batches
                    and self._queued_bytes + size <= self._max_bytes
                )
                if accepted:
                    self._queue.append(_Batch(bytes(raw_protobuf), spans))
                    self._queued_bytes += size
                    self._full_logged = False
                    wake = not self._wake_scheduled
                    self._wake_scheduled = True
                else:
                    self._count_drop_locked(spans)
                    log_full = not self._full_logged  # once per episode
                    self._full_logged = True
                    wake = False
                queued = (len(self._queue), self._queued_bytes)
            if wake:
                self._wake()
            if log_full:
                log.warning(
                    "forward queue full, dropping",
                    extra={
                        "queued_batches": queued[0],
                        "queued_bytes": queued[1],
                        "downstream": self.downstream.endpoint,
                    },
                )
            return accepted
        except Exception:  # the ingest path must never see an error from here
            with contextlib.suppress(Exception), self._lock:
                self._count_drop_locked(span_count if isinstance(span_count, int) else 0)
            with contextlib.suppress(Exception):
                log.exception("forwarder could not queue a batch; dropped")
            return False

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every batch offered so far is forwarded or given up; False at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while True:
            if self._pending() == 0:
                return True
            progress = self._progress
            if progress is None or self._task is None or self._task.done():
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(progress.wait(), remaining)
            except asyncio.TimeoutError:
                return self._pending() == 0

    async def shutdown(self, timeout_s: float) -> None:
        """Refuse new batches, flush for most of ``timeout_s``, then stop and close.

        Batches still queued or in flight at the end are counted as dropped.
        Returns within ``timeout_s`` (plus scheduling noise) even when the
        downstream is dead.
        """
        with self._lock:
            if self._closed and self._task is None:
                return
            self._closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        reserve = min(_CLOSE_RESERVE_S, max(0.0, timeout_s) / 4)
        flushed = await self.flush(max(0.0, deadline - loop.time() - reserve))
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=max(0.01, deadline - loop.time()))
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("forwarder task had failed", exc_info=task.exception())
        with self._lock:
            left = list(self._queue)
            if self._in_flight is not None:
                left.append(self._in_flight)
            self._queue.clear()
            self._queued_bytes = 0
            self._in_flight = None
            for batch in left:
                self._count_drop_locked(batch.spans)
        if left:
            log.warning(
                "forwarder stopped with batches undelivered; dropped",
                extra={
                    "dropped_batches": len(left),
                    "dropped_spans": sum(b.spans for b in left),
                    "flushed": flushed,
                },
            )
        sender, self._sender = self._sender, None
        if sender is not None:
            try:
                await asyncio.wait_for(sender.close(), max(0.01, deadline - loop.time()))
            except Exception:  # includes the timeout; nothing more to do at shutdown
                log.warning("forwarder connection did not close cleanly", exc_info=True)

    def stats(self) -> ForwardStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            in_flight = self._in_flight
            return ForwardStats(
                forwarded_batches=self._forwarded_batches,
                forwarded_spans=self._forwarded_spans,
                dropped_batches=self._dropped_batches,
                dropped_spans=self._dropped_spans,
                retries=self._retries,
                failures=self._failures,
                queued=len(self._queue) + (1 if in_flight is not None else 0),
                queued_bytes=self._queued_bytes + (len(in_flight.body) if in_flight else 0),
            )

    # -- internals -----------------------------------------------------------

    def _count_drop_locked(self, spans: int) -> None:
        self._dropped_batches += 1
        self._dropped_spans += spans

    def _pending(self) -> int:
        with self._lock:
            return len(self._queue) + (1 if self._in_flight is not None else 0)

    def _wake(self) -> None:
        """Wake the sending task, from its loop's thread or any other."""
        loop, wakeup = self._loop, self._wakeup
        if loop is None or wakeup is None:
            return  # not started yet: start() wakes the task for what is queued
        if threading.get_ident() == self._loop_thread:
            wakeup.set()
        else:
            loop.call_soon_threadsafe(wakeup.set)

    def _take(self) -> _Batch | None:
        with self._lock:
            self._wake_scheduled = False
            if not self._queue:
                return None
            batch = self._queue.popleft()
            self._queued_bytes -= len(batch.body)
            self._in_flight = batch
            return batch

    def _signal_progress(self) -> None:
        progress, self._progress = self._progress, asyncio.Event()
        if progress is not None:
            progress.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            batch = self._take()
            if batch is None:
                self._signal_progress()
                self._wakeup.clear()
                if self._pending() == 0:
                    await self._wakeup.wait()
                continue
            try:
                await self._deliver(batch)
            except asyncio.CancelledError:
                raise  # shutdown counts the batch in flight
            except Exception:  # a bug here must not stop forwarding
                with self._lock:
                    self._failures += 1
                    self._count_drop_locked(batch.spans)
                log.exception("forwarder failed on a batch; dropped")
            with self._lock:
                self._in_flight = None
            self._signal_progress()

    async def _deliver(self, batch: _Batch) -> None:
        sender = self._sender
        assert sender is not None
        body = await sender.prepare(batch.body)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._max_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(Retryable),
            sleep=self._sleep,
            before_sleep=self._before_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await sender.send(body)
        except DeliveryError as exc:
            with self._lock:
                self._failures += 1
                self._count_drop_locked(batch.spans)
                first = not self._failing_logged
                self._failing_logged = True
            if first:
                log.warning(
                    "forwarding failed, dropping (logged once until a batch gets through)",
                    extra={
                        "downstream": self.downstream.endpoint,
                        "reason": str(exc),
                        "retryable": isinstance(exc, Retryable),
                    },
                )
            return
        with self._lock:
            self._forwarded_batches += 1
            self._forwarded_spans += batch.spans
            recovered = self._failing_logged
            self._failing_logged = False
        if recovered:
            log.info("forwarding recovered", extra={"downstream": self.downstream.endpoint})

    def _before_retry(self, retry_state: RetryCallState) -> None:
        with self._lock:
            self._retries += 1
