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

Lifecycle: :meth:`StoreWriter.start` once with the running loop; :meth:`put`
from the pipeline's thread (it blocks when ``capacity`` batches wait: the
backlog then reaches ingest, which throttles, and nothing is dropped);
:meth:`close` once: stores what is queued, bounded by a timeout, and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence

from supervisor.act.actor import Actor
from supervisor.judge.pipeline import Outcome

log = logging.getLogger("spanvisor.store")

_STOP = object()
#: Queued batches stored in one transaction at most (bounds a transaction's size).
_MAX_BATCHES_PER_TRANSACTION = 16


class StoreWriter:
    """A thread that stores outcomes in order; see the module for the lifecycle."""

    def __init__(
        self,
        actor: Actor,
        *,
        capacity: int = 256,
        after_store: Callable[[Sequence[Outcome]], None] | None = None,
        min_commit_interval_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_commit_interval_s < 0:
            raise ValueError("min_commit_interval_s must be >= 0")
        self._actor = actor
        self._interval = min_commit_interval_s
        self._clock = clock
        #: Batches taken off the queue and not yet stored (they count in the backlog).
        self._held = 0
        #: Called with each stored batch (remediations start once their incident is stored).
        self._after_store = after_store
        self._queue: queue.Queue[object] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="spanvisor-store", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Batches that could not be stored (logged); their failures stay listed in memory.
        self.errors = 0
        self.stored = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def put(self, outcomes: Sequence[Outcome]) -> None:
        if outcomes:
            self._queue.put(list(outcomes))

    @property
    def backlog(self) -> int:
        """Batches not stored yet: queued, or waiting for their transaction."""
        return self._queue.qsize() + self._held

    def close(self, timeout_s: float) -> None:
        """Store what is queued (within ``timeout_s``) and stop the thread."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout_s
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
            outcomes = self._queue.get()
            if outcomes is _STOP:
                return
            assert isinstance(outcomes, list)
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
                outcomes.extend(more)
                self._held += 1
            last_commit = self._clock()
            self._store(outcomes)

    def _store(self, outcomes: list[Outcome]) -> None:
        try:
            created = self._actor.store_outcomes(outcomes)
        except Exception:  # a store error must not stop storing the next batches
            self._held = 0
            self.errors += 1
            log.exception("could not store incidents and commands for %d failures", len(outcomes))
            return
        self.stored += len(outcomes)
        self._held = 0
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
