"""What the store holds, as records, and how each is written to and read from its row.

Bodies are JSON (orjson: a batch's incidents are serialized on the pipeline's
thread); a command's row repeats what the queries select and order on
(service, type, channel, status, times) in columns of their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from supervisor.act.store_db import Row
from supervisor.records import Command, CommandType

CommandStatus = Literal["pending", "leased", "delivered", "dead"]
ApprovalStatus = Literal["pending", "approved", "denied", "expired"]
#: Every status an approval request can be in (``expired``: its deadline passed unanswered).
APPROVAL_STATUSES: tuple[ApprovalStatus, ...] = ("pending", "approved", "denied", "expired")


@dataclass(frozen=True, slots=True)
class NewIncident:
    """What one decision leads to, to be stored in one transaction."""

    key: str
    trace_id: str
    span_id: str
    rule: str
    service: str
    run_id: str
    action: str
    #: The failure and decision as JSON-ready data (the API's incident view).
    body: Mapping[str, Any]
    #: (command, channel) pairs; channel ``""`` means none is configured.
    commands: Sequence[tuple[Command, str]] = ()
    #: An approval request to open (escalations), as JSON-ready data.
    approval: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StoredCommand:
    command: Command
    channel: str
    status: CommandStatus
    attempts: int
    next_attempt_at: float
    last_error: str
    finished_at: float | None
    #: The instances that judged it and delivered it ("" before delivery).
    judged_by: str = ""
    delivered_by: str = ""
    #: How often a person put it back to pending from the dead letters, who last, and when.
    redeliveries: int = 0
    redelivered_by: str = ""
    redelivered_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.command.to_json(),
            "channel": self.channel,
            "status": self.status,
            "attempts": self.attempts,
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class Incident:
    key: str
    body: Mapping[str, Any]
    created_at: float
    #: The instance that judged it (``instance_id``).
    judged_by: str = ""


@dataclass(frozen=True, slots=True)
class KindCounts:
    """Incidents of one failure class and kind, counted per time bucket (oldest first)."""

    failure_class: str
    kind: str
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True, slots=True)
class IncidentCounts:
    """Incidents stored in ``[start, start + buckets * bucket_s)``, by class and kind.

    ``series`` holds the pairs with at least one incident, most incidents
    first. ``complete`` is False when the count was bounded (more incidents
    than one count reads, or more pairs than it returns): the counts are then
    those of the newest incidents.
    """

    start: float
    bucket_s: float
    buckets: int
    series: tuple[KindCounts, ...]
    complete: bool = True

    @property
    def end(self) -> float:
        return self.start + self.buckets * self.bucket_s

    @property
    def total(self) -> int:
        return sum(s.total for s in self.series)

    def bucket_totals(self) -> tuple[int, ...]:
        """Every class and kind together, per bucket."""
        return tuple(
            sum(column) for column in zip(*(s.counts for s in self.series), strict=True)
        ) or ((0,) * self.buckets)


@dataclass(frozen=True, slots=True)
class Approval:
    id: str
    incident_key: str
    service: str
    run_id: str
    status: ApprovalStatus
    body: Mapping[str, Any]
    created_at: float
    answered_at: float | None
    answered_by: str
    note: str
    #: When it expires unanswered (None: never), and what its run gets then.
    expires_at: float | None = None
    on_timeout: str = ""
    #: The instance that opened it, and the one whose API took the answer.
    judged_by: str = ""
    answered_on: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "incident": self.incident_key,
            "service": self.service,
            "run_id": self.run_id,
            "status": self.status,
            **dict(self.body),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "on_timeout": self.on_timeout or None,
            "answered_at": self.answered_at,
            "answered_by": self.answered_by,
            "note": self.note,
            "judged_by": self.judged_by,
            "answered_on": self.answered_on,
        }


def command_row(
    command: Command, incident_key: str, channel: str, status: str, error: str, *, judged_by: str
) -> tuple[object, ...]:
    return (
        command.id,
        command.idempotency_key,
        incident_key,
        command.service,
        command.type.value,
        channel,
        status,
        dumps_json(command.to_json()),
        command.not_before,
        command.not_before,
        error,
        command.created_at,
        command.created_at if status == "dead" else None,
        judged_by,
    )


def dumps_json(value: object) -> str:
    # orjson: a batch's incidents are serialized on the pipeline's thread.
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def command_from_row(row: Row) -> StoredCommand:
    data = orjson.loads(row["body"])
    trigger = data.get("trigger", {})
    command = Command(
        id=row["id"],
        idempotency_key=row["key"],
        type=CommandType(row["type"]),
        service=row["service"],
        run_id=data.get("run_id", ""),
        trigger_trace_id=trigger.get("trace_id", ""),
        trigger_span_id=trigger.get("span_id", ""),
        failure=data.get("failure", {}),
        params=data.get("params", {}),
        not_before=row["not_before"],
        created_at=row["created_at"],
    )
    return StoredCommand(
        command=command,
        channel=row["channel"],
        status=row["status"],
        attempts=row["attempts"],
        next_attempt_at=row["next_attempt_at"],
        last_error=row["last_error"],
        finished_at=row["finished_at"],
        judged_by=row["judged_by"],
        delivered_by=row["delivered_by"],
        redeliveries=row["redeliveries"],
        redelivered_by=row["redelivered_by"],
        redelivered_at=row["redelivered_at"],
    )


def approval_from_row(row: Row) -> Approval:
    return Approval(
        id=row["id"],
        incident_key=row["incident_key"],
        service=row["service"],
        run_id=row["run_id"],
        status=row["status"],
        body=orjson.loads(row["body"]),
        created_at=row["created_at"],
        answered_at=row["answered_at"],
        answered_by=row["answered_by"],
        note=row["note"],
        expires_at=row["expires_at"],
        on_timeout=row["on_timeout"],
        judged_by=row["judged_by"],
        answered_on=row["answered_on"],
    )


def approval_deadline(body: Mapping[str, Any], now: float) -> tuple[float | None, str]:
    """``(expires_at, on_timeout)`` of an approval request whose body names a ``timeout``."""
    timeout = body.get("timeout")
    if not isinstance(timeout, Mapping):
        return None, ""
    seconds = timeout.get("timeout_s")
    outcome = timeout.get("on_timeout")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        return None, ""
    return now + float(seconds), str(outcome or "")
