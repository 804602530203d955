"""Each circuit breaker change, told three ways: a log line, a span and a metric; and kept.

The governor calls a :class:`BreakerReport` on every change (from whichever
thread moved the breaker); the sidecar's stats read :attr:`BreakerReport.changes`,
its ``/metrics`` :attr:`BreakerReport.transitions`, the operator console
:attr:`BreakerReport.history` (the last changes of each breaker, bounded).
"""

from __future__ import annotations

import logging

from policies import BreakerChange
from supervisor.forward.breaker_history import BreakerHistory
from supervisor.forward.metrics import SidecarMetrics
from supervisor.forward.telemetry import DecisionTracer

# The sidecar's logger, which operators' filters on "circuit breaker changed state" know.
log = logging.getLogger("spanvisor.app")


class BreakerReport:
    """Logs, traces (``spanvisor.breaker``) and counts (a metric) each breaker change."""

    def __init__(
        self,
        tracer: DecisionTracer,
        metrics: SidecarMetrics,
        history: BreakerHistory | None = None,
    ) -> None:
        self._tracer = tracer
        self._metrics = metrics
        #: Each breaker's recent changes, on the wall clock (the console's strips).
        self.history = history if history is not None else BreakerHistory()
        #: Changes reported since start, by (from, to) state: a few states, so a few keys.
        self.transitions: dict[tuple[str, str], int] = {}

    @property
    def changes(self) -> int:
        """Changes reported since start."""
        return sum(self.transitions.values())

    def __call__(self, change: BreakerChange) -> None:
        key = (change.old.value, change.new.value)
        self.transitions[key] = self.transitions.get(key, 0) + 1
        self.history(change)
        log.warning(
            "circuit breaker changed state",
            extra={
                "event": "breaker",
                "dependency": change.dependency,
                "from": change.old.value,
                "to": change.new.value,
                "reason": change.reason,
                "failures": change.failures,
            },
        )
        self._tracer.emit_breaker_change(
            change.dependency, change.old.value, change.new.value, change.reason, change.failures
        )
        self._metrics.breaker_changed(
            change.dependency, change.old.value, change.new.value, change.reason
        )
