"""Acting on decisions: store each incident with its commands, then wake the deliverers.

The pipeline decides; this module makes the decision durable and deliverable:
one :class:`~supervisor.act.store.NewIncident` per outcome (its key is the
triggering span and rule, so a span seen twice adds nothing), its commands
(:func:`supervisor.act.commands.plan_commands`) routed to the channel configured
for the agent's service, and for escalations an approval request. Answering
an approval stores the ``approval_result`` command the same way.

Lifecycle: built by :func:`supervisor.wiring.build_sidecar` with the store and the
delivery settings, then told where answered approvals go (:attr:`Actor.on_answer`);
:meth:`Actor.record` per batch of outcomes from the pipeline's thread (a
short SQLite transaction); :meth:`Actor.answer` from the control API;
:meth:`Actor.expire_approvals` from the sidecar's timer, on the event loop:
a request nobody answered by its pause's deadline expires, and its run gets
the pause's stated outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from supervisor.act.commands import (
    approval_result,
    incident_key,
    pause_timed_out,
    plan_commands,
    proposal,
)
from supervisor.act.failure_log import outcome_json
from supervisor.act.store import Approval, NewIncident, Store, StoredCommand
from supervisor.errors import StoreUnavailable
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action, Command
from supervisor.settings import AgentDelivery

log = logging.getLogger("spanvisor.act")

#: Services warned about (once each) for having no delivery channel; beyond this, silence.
_MAX_UNROUTED: Final = 1000


class PullWaiters:
    """Wakes long-polling agents of a service when commands for it are stored."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def event(self, service: str) -> asyncio.Event:
        found = self._events.get(service)
        if found is None:
            if len(self._events) >= 10_000:  # bounded: stale services are forgotten
                self._events.clear()
            found = self._events[service] = asyncio.Event()
        return found

    def notify(self, service: str) -> None:
        found = self._events.get(service)
        if found is not None:
            found.set()
            del self._events[service]  # the waiters hold it; the next wait gets a fresh one


class Actor:
    """Turns outcomes into stored incidents, commands and approvals; see the module."""

    def __init__(
        self,
        store: Store,
        agents: Mapping[str, AgentDelivery],
        *,
        wake_push: Callable[[], None] = lambda: None,
        waiters: PullWaiters | None = None,
        clock: Callable[[], float] = time.time,
        on_answer: Callable[[Approval], None] | None = None,
        on_commands: Callable[[Sequence[StoredCommand]], None] | None = None,
    ) -> None:
        self.store = store
        #: Told of every command stored for an agent, whoever made it (the run tracker
        #: follows what each run was told). Must not block; may be called on any thread.
        self.on_commands = on_commands
        #: Told of every answered approval (a remediation may be waiting for it). Public:
        #: the remediations act through this actor, so they are connected to it after both
        #: exist (:func:`supervisor.wiring.build_sidecar`).
        self.on_answer = on_answer
        self.agents = dict(agents)
        self._wake_push = wake_push
        self.waiters = waiters or PullWaiters()
        self._clock = clock
        self._unrouted: set[str] = set()

    def channel_for(self, service: str) -> str:
        """The channel configured for ``service`` (``"*"`` as the default), or ``""``."""
        delivery = self.agents.get(service) or self.agents.get("*")
        return delivery.channel if delivery is not None else ""

    def record(self, outcomes: Sequence[Outcome]) -> list[StoredCommand]:
        """Store the outcomes' incidents and commands, then wake the deliverers."""
        created = self.store_outcomes(outcomes)
        self.announce(created)
        return created

    def store_outcomes(self, outcomes: Sequence[Outcome]) -> list[StoredCommand]:
        """Store the outcomes' incidents and commands; return the new commands.

        Safe from another thread (the sidecar's store writer); :meth:`announce`
        must then run on the event loop's.
        """
        if not outcomes:
            return []
        now = self._clock()
        incidents = [self._incident(outcome, now) for outcome in outcomes]
        return self.store.record(incidents, now)

    def _incident(self, outcome: Outcome, now: float) -> NewIncident:
        failure, decision = outcome.failure, outcome.decision
        commands = plan_commands(failure, decision, now)
        channel = self.channel_for(failure.service) if commands else ""
        if (
            commands
            and not channel
            and failure.service not in self._unrouted
            and len(self._unrouted) < _MAX_UNROUTED  # service names come from spans
        ):
            self._unrouted.add(failure.service)
            log.warning(
                "no delivery channel for this service: its commands are dead-lettered"
                " (configure agents in the settings)",
                extra={"service": failure.service},
            )
        escalated = decision.action is Action.ESCALATE and not decision.observe_only
        body = outcome_json(outcome)
        body["received_ns"] = failure.received_ns
        return NewIncident(
            key=incident_key(failure),
            trace_id=failure.trace_id,
            span_id=failure.span_id,
            rule=failure.rule,
            service=failure.service,
            run_id=failure.run_id,
            action=decision.action.value,
            body=body,
            commands=[(c, channel) for c in commands],
            approval=proposal(failure, decision) if escalated else None,
        )

    def announce(self, created: Sequence[StoredCommand]) -> None:
        """Wake the dispatcher and long-polling agents for new commands (event loop only)."""
        if created and self.on_commands is not None:
            self.on_commands(created)
        push = False
        for stored in created:
            if stored.status != "pending":
                continue
            if stored.channel == "pull":
                self.waiters.notify(stored.command.service)
            else:
                push = True
        if push:
            self._wake_push()

    def answer(self, approval_id: str, *, approved: bool, by: str, note: str) -> Approval:
        """Record a person's answer and send the agent its ``approval_result``.

        Event loop only (it announces the command); :meth:`answer_stored` and
        :meth:`announce_answer` are its two halves, the first for any thread.
        """
        answered, created = self.answer_stored(approval_id, approved=approved, by=by, note=note)
        return self.announce_answer(answered, created)

    def answer_stored(
        self, approval_id: str, *, approved: bool, by: str, note: str
    ) -> tuple[Approval, list[StoredCommand]]:
        """The store's half of :meth:`answer` (any thread): the answer and its command."""
        now = self._clock()
        answered = self.store.answer(approval_id, approved=approved, by=by, note=note, now=now)
        command = approval_result(
            answered.body.get("what", {}),
            approval_id=answered.id,
            incident=answered.incident_key,
            approved=approved,
            by=by,
            note=note,
            proposal_body=answered.body,
            now=now,
        )
        created = self.store.add_commands(
            answered.incident_key, [(command, self.channel_for(command.service))]
        )
        return answered, created

    def announce_answer(self, answered: Approval, created: list[StoredCommand]) -> Approval:
        """The event loop's half of :meth:`answer`: wake the deliverers, tell remediations."""
        self.announce(created)
        if self.on_answer is not None:
            self.on_answer(answered)
        log.info(
            "approval answered",
            extra={
                "approval": answered.id,
                "approved": answered.status == "approved",
                "by": answered.answered_by,
            },
        )
        return answered

    def expire_approvals(self, now: float | None = None) -> list[Approval]:
        """Expire the approval requests past their deadline; their runs get the pause's outcome.

        Each expired request's run gets ``resume_run`` or ``abort_run`` (what its
        pause said, :func:`~supervisor.act.commands.pause_timed_out`), once: the
        store changes a request's status once and keys the command by it.
        Event loop only (it wakes long polls); :meth:`expire_stored` and
        :meth:`announce_expired` are its two halves, the first for any thread.
        """
        return self.announce_expired(self.expire_stored(now))

    def expire_stored(
        self, now: float | None = None
    ) -> list[tuple[Approval, StoredCommand | None]]:
        """The store's half of :meth:`expire_approvals` (any thread)."""
        at = self._clock() if now is None else now
        if (due := self.store.next_expiry()) is None or due > at:
            return []  # the usual case: one indexed look, nothing else
        return self.store.expire_approvals(at, self._timed_out, self.channel_for)

    def announce_expired(
        self, expired: list[tuple[Approval, StoredCommand | None]]
    ) -> list[Approval]:
        """The event loop's half of :meth:`expire_approvals`: wake the agents, log each."""
        self.announce([stored for _, stored in expired if stored is not None])
        for approval, stored in expired:
            log.warning(
                "approval request expired unanswered",
                extra={
                    "approval": approval.id,
                    "service": approval.service,
                    "run_id": approval.run_id,
                    "on_timeout": approval.on_timeout,
                    "command": stored.command.id if stored is not None else None,
                },
            )
        return [approval for approval, _ in expired]

    @staticmethod
    def _timed_out(approval: Approval, now: float) -> Command:
        timeout = approval.body.get("timeout")
        seconds = timeout.get("timeout_s") if isinstance(timeout, Mapping) else None
        return pause_timed_out(
            approval.body.get("what", {}),
            approval_id=approval.id,
            incident=approval.incident_key,
            on_timeout=approval.on_timeout,
            timeout_s=float(seconds) if isinstance(seconds, (int, float)) else 0.0,
            proposal_body=approval.body,
            now=now,
        )

    def describe(self) -> dict[str, Any]:
        try:
            counts: dict[str, int] | None = self.store.counts()
        except StoreUnavailable:  # a fleet's store away: the other counters still answer
            counts = None
        return {
            "channels": {name: d.channel for name, d in sorted(self.agents.items())},
            "duplicate_incidents": self.store.duplicates,
            # None while a fleet's shared store is unreachable (`delivery.store` says why).
            "commands": counts,
            "overflowed": self.store.overflowed,
        }
