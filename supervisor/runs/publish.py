"""A fleet's sidecars publish the runs they track, so that each lists the fleet's runs.

In a fleet (``database_url``), every ``runs_publish_s`` (2 s) the runs whose
state changed since the last round (a span, a change of phase, a stall) are
upserted into the shared store's ``runs`` table
(:mod:`supervisor.act.store_runs`), at most :data:`MAX_PER_ROUND` a round
(the rest go in the next ones). Which runs changed is read on the event loop
(the tracker is the loop's); the write is a worker thread's
(:meth:`Store.call <supervisor.act.store.Store.call>`). A write that fails
(the store is away) is logged once per outage, and its runs are given again
to the next round; it never raises into the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from supervisor.act.store_runs import PublishedRun, StoredRuns
from supervisor.runs.tracker import RunTracker

__all__ = ["MAX_PER_ROUND", "PUBLISH_S", "RunPublisher"]

log = logging.getLogger("spanvisor.runs")

#: Runs one round upserts at most: a few tens of milliseconds of PostgreSQL.
MAX_PER_ROUND: Final = 2_000
#: How often a sidecar publishes its changed runs: how stale a fleet's list may be.
PUBLISH_S: Final = 2.0


class RunPublisher:
    """Publishes ``tracker``'s changed runs into ``table``; see the module."""

    def __init__(
        self,
        tracker: RunTracker,
        table: StoredRuns,
        *,
        max_per_round: int = MAX_PER_ROUND,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tracker = tracker
        self.table = table
        self.max_per_round = max_per_round
        self._clock = clock
        tracker.publishing = True
        self.failing = False
        #: Runs written, and rounds whose write failed.
        self.published = 0
        self.failures = 0

    async def round(self) -> int:
        """Publish the changed runs (at most ``max_per_round``); how many. Never raises."""
        now = self._clock()
        views = self.tracker.publish_changes(self.max_per_round, now)
        if not views:
            return 0
        rows = [
            PublishedRun(v.run_id, v.service, v.status, v.last_seen_at, v.to_json()) for v in views
        ]
        try:
            written = await self.table.store.call(self.table.publish, rows, now)
        except Exception:
            self.failures += 1
            self.tracker.publish_again(r.run_id for r in rows)
            if not self.failing:  # once per outage, not every round
                log.exception("publishing runs to the fleet's store failed; trying again")
            self.failing = True
            return 0
        if self.failing:
            log.warning("runs are published to the fleet's store again")
        self.failing = False
        self.published += written
        return written

    def stats(self) -> dict[str, int]:
        return {"published": self.published, "failures": self.failures}
