"""A fleet's runs in its shared store: one row per run id, so any sidecar lists them all.

Why: each sidecar tracks in memory only the runs whose spans reach it
(:mod:`supervisor.runs`); in a fleet (``database_url``) the control API and
the console would show a part of the fleet each. Every sidecar publishes the
runs it tracks (:mod:`supervisor.runs.publish`) into ``runs``
(:mod:`.store_pg`) and lists them from there.

A session's run may be tracked by two sidecars at once: its row is the last
publisher's, every column at once (``tracked_by`` says whose). Rows are kept
for the store's ``retention_s`` after the run's last span (:func:`prune_runs`,
from :meth:`Store.prune <supervisor.act.store.Store.prune>`). Blocking: call
these off the event loop (:meth:`Store.call <supervisor.act.store.Store.call>`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from supervisor.act.store import Store
from supervisor.act.store_db import Database

__all__ = ["PublishedRun", "StoredRuns", "prune_runs"]


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One run as a sidecar publishes it: what ``GET /v1/runs`` shows of it (``summary``)."""

    run_id: str
    service: str
    status: str
    last_seen: float
    summary: dict[str, Any]


class StoredRuns:
    """The fleet's ``runs`` table, read and written through ``store``; see the module."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def publish(self, runs: Sequence[PublishedRun], now: float) -> int:
        """Write ``runs`` as this sidecar's (``store.instance_id``); how many."""
        if not runs:
            return 0
        tracked_by = self.store.instance_id
        with self.store.transaction() as db:
            db.executemany(
                "INSERT INTO runs (run_id, service, status, last_seen, tracked_by, summary,"
                " published_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (run_id) DO UPDATE SET service = excluded.service,"
                " status = excluded.status, last_seen = excluded.last_seen,"
                " tracked_by = excluded.tracked_by, summary = excluded.summary,"
                " published_at = excluded.published_at",
                [
                    (
                        r.run_id,
                        r.service,
                        r.status,
                        r.last_seen,
                        tracked_by,
                        orjson.dumps(r.summary).decode(),
                        now,
                    )
                    for r in runs
                ],
            )
        return len(runs)

    def page(
        self,
        limit: int,
        now: float,
        *,
        before: tuple[float, str] | None = None,
        service: str | None = None,
        status: str | None = None,
    ) -> list[dict[str, Any]]:
        """The most recently active runs first, as the control API lists them, ``limit`` of
        them after ``before`` (last span time, run id): the in-memory list's order."""
        where: list[str] = []
        args: list[Any] = []
        if before is not None:
            where.append("(last_seen, run_id) < (?, ?)")
            args.extend(before)
        if service is not None:
            where.append("service = ?")
            args.append(service)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        sql = "SELECT * FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY last_seen DESC, run_id DESC LIMIT ?"
        args.append(limit)
        with self.store.transaction() as db:
            rows = db.execute(sql, args).fetchall()
        return [_listed(row, now) for row in rows]

    def find(self, run_id: str, now: float) -> dict[str, Any] | None:
        """One run's row as :meth:`page` lists it; None when no sidecar published it."""
        with self.store.transaction() as db:
            row = db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else _listed(row, now)


def prune_runs(db: Database, horizon: float) -> int:
    """Drop the runs whose last span is older than ``horizon``; how many."""
    return int(db.execute("DELETE FROM runs WHERE last_seen < ?", (horizon,)).rowcount)


def _listed(row: Any, now: float) -> dict[str, Any]:
    """A row as ``GET /v1/runs`` lists a run, its idle time as of ``now``, and whose it is."""
    summary: dict[str, Any] = orjson.loads(row["summary"])
    summary["status"] = row["status"]
    summary["idle_s"] = round(max(0.0, now - float(row["last_seen"])), 3)
    summary["tracked_by"] = row["tracked_by"]
    return summary
