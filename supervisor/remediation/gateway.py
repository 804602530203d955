"""The sidecar's :class:`~remediators.gateway.Gateway`: the only way remediators act and read.

They act through commands (stored, then delivered by the deliverers),
approvals (stored, and posted as notices), worker restarts (a command
actuator of their own); they read the run's recent failures, its incident
history and the breakers' states.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policies import Governor, Policy
from remediators.base import Trigger
from remediators.gateway import WorkerRestart
from supervisor.act.actor import Actor
from supervisor.act.actuators import DeliveryResult
from supervisor.act.actuators.command import CommandActuator
from supervisor.act.store import StoredCommand
from supervisor.records import Command, CommandType, command_key
from supervisor.remediation.notices import EscalationNotices
from supervisor.remediation.recovery import RecoveryWatch

log = logging.getLogger("spanvisor.remediate")


class SidecarGateway:
    """The runner's :class:`~remediators.gateway.Gateway` over the sidecar's parts."""

    def __init__(
        self,
        actor: Actor,
        governor: Governor,
        policy: Callable[[], Policy],
        watch: RecoveryWatch,
        loop: asyncio.AbstractEventLoop,
        *,
        notify_url: str | None = None,
        notify_secret: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._actor = actor
        self._governor = governor
        self._policy = policy
        self._watch = watch
        self._loop = loop
        self._notices = EscalationNotices(notify_url, notify_secret)
        self._clock = clock

    @property
    def notify_errors(self) -> int:
        """Notifications that could not be posted (the approval is stored all the same)."""
        return self._notices.errors

    def _announce(self, created: list[StoredCommand]) -> None:
        if created and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._actor.announce, created)

    def _command(
        self, trigger: Trigger, command: CommandType, params: Mapping[str, Any], key: str
    ) -> Command:
        """The command a remediation's call makes; its idempotency key derives from ``key``."""
        now = self._clock()
        digest = command_key(trigger.trace_id, trigger.span_id, trigger.rule, key)
        delay = params.get("delay_s", 0)
        wait = float(delay) if isinstance(delay, (int, float)) and delay > 0 else 0.0
        return Command(
            id=f"cmd_{digest[:24]}",
            idempotency_key=digest,
            type=command,
            service=trigger.service,
            run_id=trigger.run_id,
            trigger_trace_id=trigger.trace_id,
            trigger_span_id=trigger.span_id,
            failure=_summary(trigger),
            params=dict(params),
            not_before=now + wait,
            created_at=now,
        )

    def send_command(
        self, trigger: Trigger, command: str, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        built = self._command(trigger, CommandType(command), params, key)
        channel = self._actor.channel_for(trigger.service)
        created = self._actor.store.add_commands(_incident_of(trigger), [(built, channel)])
        self._announce(created)
        status = created[0].status if created else "duplicate"
        return {"command_id": built.id, "type": command, "status": status, "channel": channel}

    def open_approval(
        self, trigger: Trigger, body: Mapping[str, Any], *, key: str, remediation_id: str
    ) -> dict[str, Any]:
        digest = command_key(trigger.trace_id, trigger.span_id, trigger.rule, key)
        approval_id = f"apr_{digest[:24]}"
        request = {
            "what": _summary(trigger),
            "where": {
                "service": trigger.service,
                "run_id": trigger.run_id,
                "trace_id": trigger.trace_id,
                "span_id": trigger.span_id,
                "span_name": trigger.span_name,
            },
            "proposal": {
                "command": str(body.get("proposal") or "retry_step"),
                "params": {"remediation_id": remediation_id},
            },
            "why": str(body.get("question", ""))[:2000],
            "on_approve": str(body.get("on_approve") or "the proposed command is sent")[:2000],
            "on_deny": str(body.get("on_deny") or "the run should abort")[:2000],
            "remediation_id": remediation_id,
        }
        fresh = self._actor.store.open_approval(
            approval_id,
            incident_key=f"{_incident_of(trigger)}#{digest[:12]}",
            service=trigger.service,
            run_id=trigger.run_id,
            body=request,
            now=self._clock(),
        )
        if fresh:
            log.warning(
                "approval requested by a remediation",
                extra={"approval": approval_id, "remediation": remediation_id},
            )
            self._notices.post(approval_id, request)
        return {"approval_id": approval_id, "status": "pending"}

    def recent_spans(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        found = self._actor.store.incidents_where(run_id=trigger.run_id, limit=limit)
        return [_public(incident.body) for incident in found]

    def incident_history(self, trigger: Trigger, limit: int) -> list[dict[str, Any]]:
        found = self._actor.store.incidents_where(run_id=trigger.run_id, limit=limit)
        return [{"created_at": incident.created_at, **_public(incident.body)} for incident in found]

    def breaker_states(self) -> list[dict[str, Any]]:
        return [
            {"dependency": b.dependency, "state": b.state.value, "failures": b.failures}
            for b in self._governor.board.snapshot()
        ]

    def fallback_chain(self, dependency: str) -> Sequence[str] | None:
        return self._policy().fallback_chain(dependency)

    def restart_allowed(self, trigger: Trigger) -> tuple[bool, str]:
        if self._governor.intensity.allow(trigger.run_id or trigger.trace_id):
            return True, ""
        return False, "the run's restart intensity is spent"

    def restart_worker(
        self, trigger: Trigger, restart: WorkerRestart, params: Mapping[str, Any], *, key: str
    ) -> dict[str, Any]:
        """Run the restart program once, through a command actuator of its own, on this thread.

        A ``resume_run`` command is what the program gets (``SPANVISOR_COMMAND``
        and the placeholders); it is not stored or delivered to the agent. A
        sidecar killed while the program runs runs it again when the
        remediation resumes (the step was not recorded), with the same
        idempotency key, so the program can tell.
        """
        command = self._command(trigger, CommandType.RESUME_RUN, params, key)
        result = asyncio.run(_run_once(restart.actuator(), command))
        log.info(
            "worker restart ran",
            extra={
                "remediation": params.get("remediation_id"),
                "run_id": trigger.run_id,
                "delivered": result.delivered,
                "detail": result.detail,
            },
        )
        return {
            "ok": result.delivered,
            "detail": result.detail,
            "status": result.status,
            "command_id": command.id,
        }

    def watch_recovery(self, trigger: Trigger, remediation_id: str) -> None:
        self._watch.watch([trigger.run_id, trigger.trace_id], trigger.dependency, remediation_id)

    def unwatch(self, remediation_id: str) -> None:
        self._watch.unwatch(remediation_id)


async def _run_once(actuator: CommandActuator, command: Command) -> DeliveryResult:
    await actuator.start()
    try:
        return await actuator.deliver(command)
    finally:
        await actuator.close()


def _summary(trigger: Trigger) -> dict[str, Any]:
    return {
        "class": trigger.failure_class,
        "kind": trigger.kind,
        "dependency": trigger.dependency,
        "rule": trigger.rule,
        "message": trigger.message,
        "span_name": trigger.span_name,
    }


def _incident_of(trigger: Trigger) -> str:
    return command_key(trigger.trace_id, trigger.span_id, trigger.rule)


def _public(body: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("trace_id", "span_id", "span_name", "class", "kind", "dependency", "rule", "message")
    return {k: body.get(k) for k in keep if k in body}
