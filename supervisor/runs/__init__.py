"""Runs: each run's progress from its spans, and the detectors that need a run's history.

* :mod:`.tracker`: :class:`RunTracker`, which run each span belongs to, and its state;
* :mod:`.state`: one run's state and its view (``GET /v1/runs``);
* :mod:`.loops`: reasoning loops, from a run's recent calls;
* :mod:`.spend`: context pressure and budgets, from token counts;
* :mod:`.fleet`: a session's loops and budget counted by a fleet of sidecars, in Redis;
* :mod:`.detection`: what the detectors report.
"""

from supervisor.runs.detection import (
    BUDGET_RULE,
    CASCADE_RULE,
    LOOP_RULE,
    PRESSURE_RULE,
    REANCHOR_RULE,
    STALL_RULE,
    Detection,
)
from supervisor.runs.loops import MAX_LOOP_REPORTS
from supervisor.runs.state import RunView
from supervisor.runs.tracker import RunTracker

__all__ = [
    "BUDGET_RULE",
    "CASCADE_RULE",
    "LOOP_RULE",
    "MAX_LOOP_REPORTS",
    "PRESSURE_RULE",
    "REANCHOR_RULE",
    "STALL_RULE",
    "Detection",
    "RunTracker",
    "RunView",
]
