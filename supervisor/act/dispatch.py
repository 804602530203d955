"""Delivers stored commands over the push channels (webhook, command) when they are due.

The store is the queue: a command stays ``pending`` until an attempt
succeeds, so nothing is held only in memory and a restart resumes where the
last process stopped. Each attempt's outcome is written before the next is
planned: retryable failures wait a backoff (tenacity's exponential wait with
full jitter, at least the receiver's ``Retry-After``); a refusal that cannot
succeed, or the last attempt, dead-letters the command with the reason.

Lifecycle: :meth:`Dispatcher.start` once in the sidecar's event loop;
:meth:`Dispatcher.wake` whenever new commands were stored (cheap; the loop
also wakes on its own when the next delayed command falls due);
:meth:`Dispatcher.shutdown` once: stops taking new work and waits, bounded, for
attempts in flight. An attempt cut short by a crash is simply still pending:
it is sent again with the same ``Idempotency-Key``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, wait_random_exponential

from supervisor.act.actuators import MAX_CONCURRENT_ATTEMPTS, Actuator, DeliveryResult
from supervisor.act.store import Store, StoredCommand
from supervisor.bounded import LatencyWindow
from supervisor.retry_after import MAX_RETRY_AFTER_S

log = logging.getLogger("spanvisor.dispatch")

PUSH_CHANNELS = ("webhook", "command")
_RETRYING = Retrying()  # only a carrier for RetryCallState


@dataclass(frozen=True, slots=True)
class DispatchStats:
    delivered: int
    failed_attempts: int
    dead_lettered: int
    in_flight: int


class Dispatcher:
    """Push delivery of due commands; see the module docstring for the lifecycle."""

    def __init__(
        self,
        store: Store,
        actuators: Callable[[str], Actuator | None],
        *,
        max_attempts: Callable[[str], int],
        backoff_max_s: float = 60.0,
        concurrency: int = 16,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self._actuator_for = actuators
        self._max_attempts = max_attempts
        self._wait = wait_random_exponential(multiplier=0.5, max=backoff_max_s)
        self._clock = clock
        # Per actuator: a slow agent holds its own slots, not every agent's.
        self._slots: dict[int, asyncio.Semaphore] = {}
        self._concurrency = concurrency
        self._wakeup = asyncio.Event()
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._delivered = 0
        self._failed = 0
        self._dead = 0
        #: Since when reading due commands fails (None: it works), and how often it did.
        self._store_failing_since: float | None = None
        self._store_errors = 0
        #: Milliseconds from a command's due time to its delivery, last 10,000.
        self.latency = LatencyWindow()
        #: Called after each delivery with the command (for metrics and traces).
        self.on_delivered: Callable[[StoredCommand, float], None] | None = None
        #: Called with each command dead-lettered (the run will not do what it said).
        self.on_dead: Callable[[StoredCommand], None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="spanvisor-dispatch")

    def wake(self) -> None:
        self._wakeup.set()

    async def shutdown(self, timeout_s: float) -> None:
        """Stop planning attempts; give those in flight ``timeout_s`` to finish."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._in_flight:
            _, pending = await asyncio.wait(set(self._in_flight.values()), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "deliveries still in flight at shutdown were cut short; they stay pending"
                    " and are sent again on the next start",
                    extra={"cut_short": len(pending)},
                )

    def stats(self) -> DispatchStats:
        return DispatchStats(self._delivered, self._failed, self._dead, len(self._in_flight))

    async def _run(self) -> None:
        while not self._stopping:
            self._wakeup.clear()
            try:
                await self._launch_due()
            except Exception:  # a store error must not end delivery for good
                # Said once per outage (a database down for minutes fails every pass),
                # with what failed; the next pass that reads says it is over.
                self._store_errors += 1
                if self._store_failing_since is None:
                    self._store_failing_since = time.monotonic()
                    log.exception("could not read due commands; trying again every second")
            else:
                if self._store_failing_since is not None:
                    log.warning(
                        "due commands are read again",
                        extra={
                            "failing_s": round(time.monotonic() - self._store_failing_since, 3),
                            "failed_reads": self._store_errors,
                        },
                    )
                    self._store_failing_since = None
                    self._store_errors = 0
            next_due = await self._safe_next_due()
            timeout = 1.0 if next_due is None else min(max(next_due - self._clock(), 0.0), 1.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=max(timeout, 0.001))

    async def _safe_next_due(self) -> float | None:
        try:
            # Attempts in flight are still pending: without excluding them, the loop
            # would find them due and spin until they finish.
            store = self.store
            return await store.call(store.next_due_at, PUSH_CHANNELS, tuple(self._in_flight))
        except Exception:  # reported by _launch_due's next pass
            return None

    async def _launch_due(self) -> None:
        room = self._concurrency * 2 - len(self._in_flight)
        if room <= 0:
            return
        store = self.store
        due = await store.call(store.due, PUSH_CHANNELS, self._clock(), room + len(self._in_flight))
        for stored in due:
            command_id = stored.command.id
            if command_id in self._in_flight:
                continue
            task = asyncio.create_task(self._attempt(stored), name=f"deliver-{command_id}")
            self._in_flight[command_id] = task
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        for command_id, running in list(self._in_flight.items()):
            if running is task:
                del self._in_flight[command_id]
        self._wakeup.set()  # its next attempt (or a slot for another) may be due now

    async def _attempt(self, stored: StoredCommand) -> None:
        command = stored.command
        actuator = self._actuator_for(command.service)
        now = self._clock()
        if actuator is None:
            await self._dead_letter(
                stored, f"no delivery channel is configured for service {command.service!r}", now
            )
            return
        slots = self._slots.get(id(actuator))
        if slots is None:
            slots = self._slots[id(actuator)] = asyncio.Semaphore(MAX_CONCURRENT_ATTEMPTS)
        async with slots:
            try:
                result = await actuator.deliver(command)
            except Exception as exc:  # actuators must not raise; contain one that does
                log.exception("actuator raised instead of returning a result")
                result = DeliveryResult(False, True, f"actuator error: {type(exc).__name__}")
        now = self._clock()
        if result.delivered:
            await self.store.call(self.store.delivered, command.id, now)
            self._delivered += 1
            due = max(command.not_before, stored.next_attempt_at)
            self.latency.add(max(0.0, now - due) * 1000.0)
            log.info(
                "command delivered",
                extra={
                    "command": command.id,
                    "type": command.type.value,
                    "service": command.service,
                    "channel": actuator.kind,
                    "attempt": stored.attempts + 1,
                },
            )
            if self.on_delivered is not None:
                self.on_delivered(stored, now)
            return
        attempt = stored.attempts + 1
        limit = self._max_attempts(command.service)
        if not result.retryable or attempt >= limit:
            why = result.detail if not result.retryable else f"{attempt} attempts: {result.detail}"
            await self._dead_letter(stored, why, now)
            return
        state = RetryCallState(retry_object=_RETRYING, fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        delay = float(self._wait(state))
        if result.retry_after_s is not None:
            delay = max(delay, min(result.retry_after_s, MAX_RETRY_AFTER_S))
        await self.store.call(self.store.attempt_failed, command.id, result.detail, now + delay)
        self._failed += 1
        log.warning(
            "command delivery failed; will retry",
            extra={
                "command": command.id,
                "service": command.service,
                "attempt": attempt,
                "retry_in_s": round(delay, 3),
                "detail": result.detail,
            },
        )

    async def _dead_letter(self, stored: StoredCommand, why: str, now: float) -> None:
        await self.store.call(self.store.dead, stored.command.id, why, now)
        self._dead += 1
        if self.on_dead is not None:
            self.on_dead(stored)
        log.error(
            "command dead-lettered",
            extra={
                "command": stored.command.id,
                "type": stored.command.type.value,
                "service": stored.command.service,
                "reason": why,
            },
        )


def actuator_table(actuators: Mapping[str, Actuator]) -> Callable[[str], Actuator | None]:
    """Look up a service's actuator, with ``"*"`` as the default for unlisted services."""

    def lookup(service: str) -> Actuator | None:
        return actuators.get(service) or actuators.get("*")

    return lookup
