"""The recent failures the control API lists, and their structured log lines."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from supervisor.pipeline import Outcome

log = logging.getLogger("spanvisor.failures")


def outcome_json(outcome: Outcome) -> dict[str, Any]:
    """The ``replay`` schema of one failure: stable keys, lowercase hex ids."""
    f, d = outcome.failure, outcome.decision
    return {
        "trace_id": f.trace_id,
        "span_id": f.span_id,
        "service": f.service,
        "span_name": f.span_name,
        "run_id": f.run_id,
        "role": f.role.value,
        "class": f.failure_class.value,
        "kind": f.kind,
        "dependency": f.dependency,
        "rule": f.rule,
        "action": d.action.value,
        "policy": d.policy,
        "params": dict(d.params),
        "observe_only": d.observe_only,
        "reason": d.reason,
        "message": f.message,
        "attributed": list(f.attributed),
    }


class RecentFailures:
    """The last ``capacity`` outcomes, newest last; older ones are counted out."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.total = 0

    def add(self, outcome: Outcome, received_ns: int) -> None:
        entry = outcome_json(outcome)
        entry["received_ns"] = received_ns
        self._items.append(entry)
        self.total += 1
        # Nested: span content must not collide with LogRecord's own attributes.
        log.info("failure classified", extra={"event": "failure", "failure": entry})

    def latest(self, limit: int) -> list[dict[str, Any]]:
        items = list(self._items)
        return items[-limit:] if limit > 0 else []

    @property
    def dropped(self) -> int:
        return self.total - len(self._items)
