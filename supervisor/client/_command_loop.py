"""Pulled commands: applied once per idempotency key, acknowledged once applied, polled.

What a command does is the caller's ``apply``; this is the delivery around
it. A redelivered command (a key seen before) is acknowledged again and not
applied. A command whose application raised is not acknowledged, so the
sidecar hands it out again after its lease and it is applied then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from tenacity import wait_exponential

from supervisor.client._backoff import wait_after
from supervisor.client._webhooks import SeenCommands
from supervisor.client.pull import Command, CommandPuller

Outcome = TypeVar("Outcome")


class CommandLoop(Generic[Outcome]):
    """Applies commands with ``apply`` once per key; keeps at most ``max_failed`` failed keys."""

    def __init__(
        self,
        apply: Callable[[Command], Outcome],
        *,
        seen: SeenCommands,
        max_failed: int,
        log: logging.Logger,
    ) -> None:
        self._apply = apply
        self._seen = seen
        self._max_failed = max_failed
        self._log = log
        self._lock = threading.Lock()
        #: Keys whose first application failed: their redelivery is applied again.
        self._failed_keys: OrderedDict[str, None] = OrderedDict()
        self._duplicates = 0

    @property
    def duplicates(self) -> int:
        """Redelivered commands dropped (acknowledged, not applied)."""
        with self._lock:
            return self._duplicates

    def handle(
        self, commands: Iterable[Command], ack: Callable[[Command], object] | None = None
    ) -> list[Outcome]:
        """Apply each new command and ``ack`` it; what each application returned."""
        log = self._log
        outcomes: list[Outcome] = []
        for command in commands:
            key = command.idempotency_key
            if not self._seen.first_time(key):
                with self._lock:
                    retry = key in self._failed_keys
                    self._failed_keys.pop(key, None)
                if not retry:
                    with self._lock:
                        self._duplicates += 1
                    log.info("spanvisor command %s (%s) again: dropped", command.id, command.type)
                    if ack is not None:
                        ack(command)
                    continue
            try:
                outcome = self._apply(command)
            except Exception:
                with self._lock:
                    self._failed_keys[key] = None
                    while len(self._failed_keys) > self._max_failed:
                        self._failed_keys.popitem(last=False)
                log.exception(
                    "applying spanvisor command %s (%s) to thread %s failed; not acknowledged,"
                    " so it comes again",
                    command.id,
                    command.type,
                    command.run_id,
                )
                continue
            if ack is not None:
                ack(command)
            outcomes.append(outcome)
        return outcomes

    def serve(
        self,
        puller: CommandPuller,
        on_outcome: Callable[[Outcome], object],
        *,
        stop: threading.Event,
        wait_s: float,
        tick: Callable[[], Iterable[Outcome]] | None = None,
    ) -> None:
        """Poll, :meth:`handle` and hand each outcome to ``on_outcome`` until ``stop``.

        A poll that comes back empty long before ``wait_s`` (the sidecar is
        down: a refused connection fails at once) is followed by a pause,
        doubling from 0.25 s up to ``wait_s``, so the loop never spins.
        ``tick`` runs after each poll, its outcomes handed on too (deadlines
        that passed: it runs at least every ``wait_s``, whether or not the
        sidecar answers).
        """
        pauses = wait_exponential(multiplier=0.25, max=wait_s)
        quick_polls = 0  # empty polls in a row that came back long before wait_s
        while not stop.is_set():
            started = time.monotonic()
            commands = puller.poll(wait_s)
            if stop.is_set() and not commands:
                return
            if commands or time.monotonic() - started >= wait_s / 2:
                quick_polls = 0
            else:
                quick_polls += 1
                stop.wait(wait_after(pauses, quick_polls))
            outcomes = self.handle(commands, puller.ack)
            if tick is not None:
                try:
                    outcomes.extend(tick())
                except Exception:
                    self._log.exception("checking deadlines failed; trying again next poll")
            for outcome in outcomes:
                try:
                    on_outcome(outcome)
                except Exception:
                    self._log.exception("on_directive failed for %s", outcome)
