"""The fleet's shared tables in PostgreSQL, read directly, and the takeover watch on them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Any

import psycopg

WORKFLOW = "spanvisor.remediate"


class SharedStore:
    """The fleet's tables in PostgreSQL, read directly (as every sidecar's API reads them)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """The query's rows; a server too busy to connect is asked again, three times."""
        for attempt in range(3):
            try:
                with psycopg.connect(self.url, connect_timeout=3) as db:
                    return list(db.execute(sql, args).fetchall())
            except psycopg.errors.UndefinedTable:
                return []  # not created yet
            except psycopg.OperationalError:
                if attempt == 2:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def incident_spans(self) -> set[str]:
        return {str(r[0]) for r in self.rows("SELECT span_id FROM incidents")}

    def held_remediations(self, executor: str) -> set[str]:
        """Remediation workflows pending under ``executor`` (DBOS's ``workflow_status``).

        One that another executor took over (its id moves) or that ended is not.
        """
        return {
            str(r[0])
            for r in self.rows(
                "SELECT workflow_uuid FROM workflow_status"
                " WHERE name = %s AND status = 'PENDING' AND executor_id = %s",
                WORKFLOW,
                executor,
            )
        }

    def looping_runs(self) -> set[str]:
        """The runs a loop was detected in."""
        rows = self.rows(
            "SELECT DISTINCT run_id FROM incidents WHERE rule LIKE %s", "%reasoning_loop"
        )
        return {str(r[0]) for r in rows}

    def approvals_per_escalation(self) -> Counter[int]:
        """{approvals: how many escalations have that many} over every escalated incident."""
        rows = self.rows(
            "SELECT i.key, count(a.id) FROM incidents i LEFT JOIN approvals a"
            " ON a.incident_key = i.key WHERE i.action = 'escalate' GROUP BY i.key"
        )
        return Counter(int(r[1]) for r in rows)


class TakeoverWatch:
    """From the kill on, when the killed sidecar's remediations stop being held by it."""

    def __init__(self, store: SharedStore, executor: str, held: set[str], kill_at: float) -> None:
        self.store, self.executor, self.held, self.kill_at = store, executor, held, kill_at
        self.taken_after_s: float | None = None if held else 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-takeover", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while self.taken_after_s is None and not self._stop.wait(0.1):
            with contextlib.suppress(psycopg.Error):
                if not self.held & self.store.held_remediations(self.executor):
                    self.taken_after_s = time.time() - self.kill_at
