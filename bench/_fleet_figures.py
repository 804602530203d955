"""What ``bench/fleet.py`` makes of what the agents saw: its figures, each against its goal.

Pure functions of the records (runs, failures sent, exports acknowledged,
deliveries, the store's rows). What *recoverable*, *duplicate* and *taken
over* mean is stated in ``bench/fleet.py``'s docstring and applied here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench._fleet_agents import Delivery, FailureSent, Ledger, Run

#: An answer written this long before the kill may not have been recorded by its sender.
ACK_GRACE_S = 0.5
#: A failing span not acknowledged this long after it was sent never will be.
EXPORT_GIVE_UP_S = 8.0


@dataclass(frozen=True)
class Figures:
    """What one fleet run measured (``bench/fleet.py``'s docstring says what each is)."""

    runs: int
    recoverable: int
    completed: int
    unrecoverable: Mapping[str, int]
    #: For each failure only in the killed sidecar's ingest log: how long before
    #: the kill it was acknowledged (seconds).
    unstored_before_kill_s: tuple[float, ...]
    stuck: tuple[str, ...]
    failures: int
    deliveries: int
    unsigned: int
    duplicates: int
    redelivered: int
    #: Escalated incidents in the store.
    escalations: int
    approvals_per_escalation: Mapping[int, int]
    answers_per_approval: Mapping[int, int]
    answer_conflicts: int
    outage_failures: int
    outage_lost: int
    killed: str
    kill_at_s: float
    held_remediations: int
    remediation_takeover_s: float | None
    held_deliveries: int
    delivery_takeover_s: float | None
    loops: int
    loops_caught: int
    fleet_stats: Any = None
    waited_s: float = 0.0

    def lines(self) -> list[str]:
        def took(value: float | None, held: int) -> str:
            if held == 0:
                return "n/a (none held)"
            return "not within the run" if value is None else f"{value:.1f} s"

        return [
            f"runs completed: {self.completed} of {self.recoverable} recoverable"
            f" ({self.runs} runs; not recoverable: {dict(self.unrecoverable) or 0})",
            *(
                [
                    "  acknowledged by the killed sidecar and not stored, this long before"
                    f" the kill: {', '.join(f'{s:.3f} s' for s in self.unstored_before_kill_s)}"
                ]
                if self.unstored_before_kill_s
                else []
            ),
            *(f"  stuck: {line}" for line in self.stuck),
            f"deliveries: {self.deliveries} ({self.unsigned} badly signed);"
            f" duplicates by Idempotency-Key: {self.duplicates};"
            f" redelivered after an attempt in flight at the kill: {self.redelivered}",
            f"escalations: {self.escalations}; approvals per escalation"
            f" {{count: escalations}}: {dict(self.approvals_per_escalation)};"
            f" answers per approval: {dict(self.answers_per_approval)};"
            f" answers refused (already answered): {self.answer_conflicts}",
            f"decisions lost while Redis was away: {self.outage_lost}"
            f" of {self.outage_failures} failures sent then",
            f"killed {self.killed} at {self.kill_at_s:.1f} s holding"
            f" {self.held_remediations} remediations and {self.held_deliveries}"
            " deliveries in flight",
            f"takeover of its remediations: "
            f"{took(self.remediation_takeover_s, self.held_remediations)};"
            f" of its deliveries: {took(self.delivery_takeover_s, self.held_deliveries)}",
            f"loops caught, each spread over the sidecars: {self.loops_caught} of {self.loops}",
            f"fleet stats: {self.fleet_stats if self.fleet_stats is not None else 'none'}",
            f"waited {self.waited_s:.0f} s for the runs after the last one started",
        ]


def recoverability(
    runs: Sequence[Run],
    failures: Sequence[FailureSent],
    ledger: Ledger,
    stored: set[str],
    killed: str,
    now: float,
) -> dict[int, str]:
    """Why each run cannot be recovered (see the module docstring); recoverable runs absent.

    A failure sent less than :data:`EXPORT_GIVE_UP_S` ago that no sidecar
    acknowledged yet may still be: it does not count against its run yet.
    """
    reasons: dict[int, str] = {}
    for failure in failures:
        by = ledger.acknowledged_by(failure.span_id)
        if by is None and now - failure.at > EXPORT_GIVE_UP_S:
            reasons[failure.run] = "a failure no sidecar acknowledged"
        elif by == killed and failure.span_id not in stored:
            reasons[failure.run] = "a failure only in the killed sidecar's ingest log"
    return {run.index: reasons[run.index] for run in runs if run.index in reasons}


def delivery_figures(
    deliveries: Sequence[Delivery], killed: str, kill_at: float
) -> tuple[int, int, int, float | None]:
    """(duplicates, redelivered, deliveries held by the killed sidecar, their takeover time).

    Held: an attempt from the killed sidecar that was not answered before the
    kill. Taken over: delivered after the kill by another sidecar.
    """
    by_key: dict[str, list[Delivery]] = defaultdict(list)
    for delivery in sorted(deliveries, key=lambda d: d.arrived):
        if delivery.signed:
            by_key[delivery.key].append(delivery)
    duplicates = redelivered = 0
    takeovers: list[float | None] = []
    for copies in by_key.values():
        for n in range(1, len(copies)):
            acknowledged = any(
                e.answered is not None
                and (e.instance != killed or e.answered < kill_at - ACK_GRACE_S)
                for e in copies[:n]
            )
            if acknowledged:
                duplicates += 1
            else:
                redelivered += 1
        held = any(
            d.instance == killed
            and d.arrived < kill_at
            and (d.answered is None or d.answered >= kill_at)
            for d in copies
        )
        if held:
            after = [d.arrived for d in copies if d.arrived >= kill_at and d.instance != killed]
            takeovers.append(min(after) - kill_at if after else None)
    if not takeovers:
        return duplicates, redelivered, 0, None
    slowest = None if None in takeovers else max(t for t in takeovers if t is not None)
    return duplicates, redelivered, len(takeovers), slowest
