"""The recent failures the control API lists, and their structured log lines."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from supervisor.judge.pipeline import Outcome

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
        **({"details": dict(f.details)} if f.details else {}),
    }


class RecentFailures:
    """The last ``capacity`` outcomes, newest last; older ones are counted out.

    Outcomes are kept as the frozen records they are and turned into JSON
    only when the API asks, so a burst of failures costs no serialization.
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[Outcome] = deque(maxlen=capacity)
        self.total = 0

    def add(self, outcome: Outcome) -> None:
        self._items.append(outcome)
        self.total += 1
        if log.isEnabledFor(logging.INFO):
            # Nested: span content must not collide with LogRecord's own attributes.
            log.info(
                "failure classified", extra={"event": "failure", "failure": outcome_json(outcome)}
            )

    def latest(self, limit: int) -> list[dict[str, Any]]:
        return self.page(limit)[0]

    def page(
        self, limit: int, before: int | None = None
    ) -> tuple[list[dict[str, Any]], int | None]:
        """The newest ``limit`` failures numbered below ``before`` (newest last), and the
        number to pass as ``before`` for the older ones (None: none are kept).

        Failure n is the n-th added since start, so a number stays the same
        failure while new ones arrive: a page never shifts under a reader.
        """
        items = list(self._items)
        first = self.total - len(items) + 1  # the number of items[0]
        end = len(items) if before is None else max(0, min(len(items), before - first))
        start = max(0, end - limit) if limit > 0 else end
        chosen = items[start:end]
        more = first + start if start > 0 else None
        return [{**outcome_json(o), "received_ns": o.failure.received_ns} for o in chosen], more

    @property
    def dropped(self) -> int:
        return self.total - len(self._items)
