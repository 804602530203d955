"""The recent failures the control API lists, their structured log lines and their counts."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from supervisor.bounded import CappedCounts
from supervisor.judge.pipeline import Outcome

log = logging.getLogger("spanvisor.failures")

#: Distinct (class, kind) pairs counted apart; kinds come from the policy, which may add its own.
MAX_KINDS = 200
#: Where the failures of a kind past :data:`MAX_KINDS` are counted (with their class).
OTHER_KIND = "other"


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
    Every reported outcome passes here once, so this is also where they are
    counted: by class and kind (``/metrics``), and by action and whether it
    was only observed (``/metrics``; their sum is ``/v1/stats``' total).
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[Outcome] = deque(maxlen=capacity)
        #: Failures by (class, kind); a kind past :data:`MAX_KINDS` counts as ``other``.
        self.by_kind: CappedCounts[tuple[str, str]] = CappedCounts(MAX_KINDS)
        #: Decisions by (action, observe_only): actions are an enum, so this stays small.
        self.by_action: dict[tuple[str, bool], int] = {}

    @property
    def total(self) -> int:
        """Outcomes reported since start."""
        return sum(self.by_action.values())

    def add(self, outcome: Outcome) -> None:
        self._items.append(outcome)
        f, d = outcome.failure, outcome.decision
        cls = f.failure_class.value
        self.by_kind.add((cls, f.kind), (cls, OTHER_KIND))
        action = (d.action.value, d.observe_only)
        self.by_action[action] = self.by_action.get(action, 0) + 1
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
