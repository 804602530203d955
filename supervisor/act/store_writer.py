"""Stores a batch's incidents on a thread of its own, so the pipeline goes on judging.

SQLite commits take a millisecond or more per batch (the sqlite3 module
releases the GIL while it writes), and on the pipeline's thread they delayed
the next batch's decisions. The writer takes batches of outcomes from a
bounded queue, stores them (:meth:`supervisor.act.actor.Actor.store_outcomes`) and
hands the new commands back to the event loop, which wakes the deliverers.

Under load, commits are spaced (``min_commit_interval_s``, 10 ms): a batch
that arrives sooner after the last commit waits, with those that follow it,
for one transaction. A commit writes every page its inserts touched, and the
incidents' and commands' keys are random, so each batch touched ~60 pages
for ~27 failures; batches committed together share the table and index pages
they both touch. At a rate below one batch per interval nothing waits.

**Storage faults degrade, they do not drop.** A batch the store refuses (a
full disk, an I/O error) is kept, with every batch after it, in arrival order,
and tried again with a growing delay (:class:`Backoff`) until the store takes
it; the queue is still emptied meanwhile, so the pipeline never waits on a
failing disk. A retry is safe: a failed transaction is rolled back whole, and
an incident's key is its span and rule, so one stored already is recognised
and stored once (:meth:`supervisor.act.store.Store.record`). What is kept is
bounded by ``max_retained_failures`` and ``max_retained_bytes``; past that,
new outcomes are dropped, counted per failure and logged. Before that, from
``throttle_fraction`` of either bound, :meth:`pressure` names the reason, and
ingest throttles (:meth:`supervisor.ingest.queue.IngestQueue.hold_while`) so
that what it acknowledges is not what gets dropped. :meth:`health` says since
when the store fails and how many failures wait (readiness, stats).

Lifecycle: :meth:`StoreWriter.start` once with the running loop; :meth:`put`
from the pipeline's thread (it blocks when ``capacity`` batches wait: the
backlog then reaches ingest, which throttles); :meth:`close` once: stores
what is queued and kept, bounded by a timeout, and stops; what it could not
store is logged, counted per failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from supervisor.act.actor import Actor
from supervisor.act.failure_log import outcome_json
from supervisor.judge.pipeline import Outcome

log = logging.getLogger("spanvisor.store")

_STOP = object()
#: Queued batches stored in one transaction at most (bounds a transaction's size).
_MAX_BATCHES_PER_TRANSACTION = 16
#: Seconds between two log lines about failures dropped while the store fails.
_DROP_LOG_INTERVAL_S = 10.0


class Backoff:
    """Delays between tries of a failing store: doubling from ``first_s`` up to ``max_s``."""

    def __init__(self, first_s: float = 0.1, max_s: float = 5.0) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError("backoff needs 0 < first_s <= max_s")
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self.max_s, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.first_s


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """What the writer knows of the store: whether it takes writes, and what waits."""

    #: ``clock()`` of the first refused write of the current outage (None: storing).
    failing_since: float | None
    #: Wall-clock time of the same (for people: logs, readiness).
    failing_since_unix: float | None
    #: Judged failures refused by the store and kept, to be stored when it takes them.
    waiting_failures: int
    waiting_bytes: int
    #: Judged failures dropped because the kept ones were at their bound, since start.
    dropped_failures: int
    #: Failures whose store attempt failed, counted once per attempt, since start.
    failed_attempts: int
    last_error: str


class StoreWriter:
    """A thread that stores outcomes in order; see the module for the lifecycle."""

    def __init__(
        self,
        actor: Actor,
        *,
        capacity: int = 256,
        after_store: Callable[[Sequence[Outcome]], None] | None = None,
        on_drop: Callable[[Sequence[Outcome]], None] | None = None,
        min_commit_interval_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_retained_failures: int = 100_000,
        max_retained_bytes: int = 256 * 1024 * 1024,
        throttle_fraction: float = 0.5,
        backoff: Backoff | None = None,
    ) -> None:
        if min_commit_interval_s < 0:
            raise ValueError("min_commit_interval_s must be >= 0")
        if max_retained_failures < 1 or max_retained_bytes < 1:
            raise ValueError("the retained bounds must be >= 1")
        if not 0 < throttle_fraction <= 1:
            raise ValueError("throttle_fraction must be in (0, 1]")
        self._actor = actor
        self._interval = min_commit_interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        #: Batches taken off the queue and not yet stored (they count in the backlog).
        self._held = 0
        #: Called with each stored batch (remediations start once their incident is stored).
        self._after_store = after_store
        #: Called with each batch dropped at the bound (its requests stay in the ingest log).
        self._on_drop = on_drop
        self._queue: queue.Queue[object] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="spanvisor-store", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Kept while the store refuses writes, oldest first: (outcomes, their bytes).
        self._retained: deque[tuple[list[Outcome], int]] = deque()
        self._retained_failures = 0
        self._retained_bytes = 0
        self._max_failures = max_retained_failures
        self._max_bytes = max_retained_bytes
        self._throttle_failures = max(1, int(max_retained_failures * throttle_fraction))
        self._throttle_bytes = max(1, int(max_retained_bytes * throttle_fraction))
        self._backoff = backoff or Backoff()
        self._next_try = -math.inf
        self._failing_since: float | None = None
        self._failing_since_unix: float | None = None
        self._last_error = ""
        self._dropped_logged_at = -math.inf
        self._dropped_unlogged = 0
        self._close_by = math.inf
        self._retry_batches = _MAX_BATCHES_PER_TRANSACTION
        #: Failures whose store attempt failed (per failure and attempt), or whose
        #: hand-on after storing failed (logged).
        self.errors = 0
        self.stored = 0
        #: Judged failures dropped because what the writer keeps was at its bound.
        self.dropped = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def put(self, outcomes: Sequence[Outcome]) -> None:
        if outcomes:
            self._queue.put(list(outcomes))

    @property
    def backlog(self) -> int:
        """Batches not stored yet: queued, waiting for their transaction, or kept."""
        return self._queue.qsize() + self._held + len(self._retained)

    def health(self) -> StoreHealth:
        return StoreHealth(
            failing_since=self._failing_since,
            failing_since_unix=self._failing_since_unix,
            waiting_failures=self._retained_failures,
            waiting_bytes=self._retained_bytes,
            dropped_failures=self.dropped,
            failed_attempts=self.errors,
            last_error=self._last_error,
        )

    def degraded(self) -> str | None:
        """Why the store degrades the sidecar (readiness), or None when it stores."""
        since = self._failing_since_unix
        if since is None:
            return None
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
        return (
            f"store failing since {at} ({self._last_error}): {self._retained_failures}"
            f" judged failures wait to be stored, {self.dropped} dropped"
        )

    def pressure(self) -> str | None:
        """Why ingest should throttle now (what is kept nears its bound), or None."""
        if (
            self._retained_failures < self._throttle_failures
            and self._retained_bytes < self._throttle_bytes
        ):
            return None
        return (
            f"the store is failing and {self._retained_failures} judged failures"
            f" ({self._retained_bytes} bytes) wait to be stored"
        )

    def close(self, timeout_s: float) -> None:
        """Store what is queued and kept (within ``timeout_s``) and stop the thread."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout_s
        self._close_by = deadline  # the thread's last tries end there
        try:
            self._queue.put(_STOP, timeout=max(0.01, timeout_s))
        except queue.Full:
            log.error("the store writer is stuck; outcomes still queued are not stored")
            return
        self._thread.join(max(0.01, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.error("the store writer did not finish in time; outcomes may be unstored")

    def _run(self) -> None:
        stopping = False
        last_commit = -math.inf
        while not stopping:
            if self._retained:
                stopping = self._retry_or_keep()
                continue
            outcomes = self._queue.get()
            if outcomes is _STOP:
                return
            assert isinstance(outcomes, list)
            batches = [outcomes]
            self._held = 1
            # Batches that queue meanwhile, or arrive before the interval since the
            # last commit is over, share one transaction (see the module docstring).
            deadline = last_commit + self._interval
            while self._held < _MAX_BATCHES_PER_TRANSACTION:
                wait = deadline - self._clock()
                try:
                    more = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stopping = True
                    break
                assert isinstance(more, list)
                batches.append(more)
                self._held += 1
            last_commit = self._clock()
            if not self._store(batches):
                for batch in batches:
                    self._keep(batch)
            self._held = 0
        self._last_tries()

    def _retry_or_keep(self) -> bool:
        """While the store fails: keep what arrives, and retry when the delay is over.

        Returns True once told to stop.
        """
        wait = self._next_try - self._clock()
        if wait > 0:
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                return False
            if item is _STOP:
                return True
            assert isinstance(item, list)
            self._keep(item)  # after those kept already: the order stays
            return False
        self._retry()
        return False

    def _retry(self) -> bool:
        """One try at the oldest kept batches; True when the store took them."""
        count = min(len(self._retained), self._retry_batches)
        batches = [self._retained[n][0] for n in range(count)]
        if not self._store(batches):
            # Smaller transactions next time: a disk with a little room again may
            # take one batch where it would refuse sixteen.
            self._retry_batches = max(1, count // 2)
            return False
        self._retry_batches = _MAX_BATCHES_PER_TRANSACTION
        for _ in range(count):
            outcomes, size = self._retained.popleft()
            self._retained_failures -= len(outcomes)
            self._retained_bytes -= size
        if not self._retained:
            log.warning(
                "the store takes writes again; every kept failure is stored",
                extra={"failing_s": round(self._clock() - (self._failing_since or 0.0), 3)},
            )
            self._failing_since = self._failing_since_unix = None
            self._last_error = ""
            self._backoff.reset()
        return True

    def _last_tries(self) -> None:
        """At close: drain the queue into what is kept, then try until the deadline."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, list):
                self._keep(item)
        while self._retained and time.monotonic() < self._close_by:
            if not self._retry():
                wait = min(self._backoff.next_delay(), self._close_by - time.monotonic())
                if wait > 0:
                    time.sleep(wait)  # the thread is closing: nothing else to wait for
        if self._retained:
            log.error(
                "closing with judged failures the store did not take; they are not stored",
                extra={"failures": self._retained_failures, "error": self._last_error},
            )

    def _keep(self, outcomes: list[Outcome]) -> None:
        """Keep a batch the store did not take, within the bounds; count what is dropped."""
        size = sum(_size(outcome) for outcome in outcomes)
        if (
            self._retained_failures + len(outcomes) > self._max_failures
            or self._retained_bytes + size > self._max_bytes
        ):
            self.dropped += len(outcomes)
            self._dropped_unlogged += len(outcomes)
            if self._on_drop is not None:
                self._on_drop(outcomes)
            now = self._clock()
            if now - self._dropped_logged_at >= _DROP_LOG_INTERVAL_S:
                self._dropped_logged_at = now
                log.error(
                    "the store is failing and the failures kept for it are at their bound:"
                    " judged failures dropped",
                    extra={
                        "dropped": self._dropped_unlogged,
                        "dropped_total": self.dropped,
                        "waiting": self._retained_failures,
                        "waiting_bytes": self._retained_bytes,
                    },
                )
                self._dropped_unlogged = 0
            return
        self._retained.append((outcomes, size))
        self._retained_failures += len(outcomes)
        self._retained_bytes += size

    def _store(self, batches: list[list[Outcome]]) -> bool:
        """Store ``batches`` in one transaction; False (and logged) when the store refused."""
        outcomes = [outcome for batch in batches for outcome in batch]
        try:
            created = self._actor.store_outcomes(outcomes)
        except Exception as exc:  # a full disk or an I/O error: keep, retry later
            self.errors += len(outcomes)
            first = self._failing_since is None
            if first:
                self._failing_since = self._clock()
                self._failing_since_unix = self._wall_clock()
            self._last_error = f"{type(exc).__name__}: {exc}"[:300]
            self._next_try = self._clock() + self._backoff.next_delay()
            if first:
                log.exception(
                    "the store refused %d judged failures; they are kept and tried again",
                    len(outcomes),
                )
            else:
                log.debug("the store still refuses writes", extra={"error": self._last_error})
            return False
        self.stored += len(outcomes)
        self._held = 0  # stored: no longer waiting, before anyone is told they are
        if self._after_store is not None:
            try:
                self._after_store(outcomes)
            except Exception:  # the incidents are stored; a restart dispatches what is missing
                self.errors += 1
                log.exception("could not hand stored outcomes on")
        loop = self._loop
        if created and loop is not None and not loop.is_closed():
            # The loop may close meanwhile: the commands are stored; the next start delivers.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._actor.announce, created)
        return True


def _size(outcome: Outcome) -> int:
    """About what a kept outcome holds in memory: its incident's JSON, in bytes."""
    return len(orjson.dumps(outcome_json(outcome), default=str))
