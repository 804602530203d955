"""What a restart must not forget about runs: the open ones, journaled to the state database.

A sidecar killed and started again would otherwise know no run: an agent
whose worker died around the restart would never be found stalled, and a
run paused for a person would forget its deadline. Every second the tracker
hands over the runs that changed (:meth:`RunTracker.journal_changes`); runs
that are open, waiting or paused are written, runs that ended or left are
deleted. At start the tracker takes them back (:meth:`RunTracker.restore`):
their silence goes on counting from their last span, so a stall that began
before or during the restart is found. What changed in the last second
before a ``kill -9`` is lost; the rest is not.

Lifecycle: :meth:`RunJournal.open` at start (in the state database, beside
the store's tables, under the store's lock), :meth:`load` once, :meth:`save`
off the event loop (a thread), :meth:`close` at stop.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

__all__ = ["RunJournal", "SavedRun"]

log = logging.getLogger("spanvisor.runs")

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS open_runs (
    run_id TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    last_seen REAL NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class SavedRun:
    """One run as journaled: enough to find its stall, or end its pause, after a restart."""

    run_id: str
    service: str
    trace_id: str
    started: float
    last_seen: float
    last_span: str
    last_dependency: str
    step: str
    #: spans, LLM calls, tool calls, errors
    counts: tuple[int, int, int, int]
    phase: str
    go_on_at: float
    paused_until: float
    on_timeout: str
    paused_for: str
    stalled: bool
    gap: float
    unverified: tuple[str, ...]

    def to_json(self) -> str:
        """The row's body: every field but the run id (the row's key)."""
        body = asdict(self)
        del body["run_id"]
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, run_id: str, text: str) -> SavedRun:
        """Raises ValueError (or KeyError, TypeError) on a row it cannot read."""
        body = json.loads(text)
        counts = tuple(int(n) for n in body["counts"])
        if len(counts) != 4:
            raise ValueError("counts must have 4 numbers")
        phase = str(body["phase"])
        if phase not in ("open", "waiting", "paused"):
            raise ValueError(f"not a phase to restore: {phase!r}")
        return cls(
            run_id=run_id,
            service=str(body["service"]),
            trace_id=str(body["trace_id"]),
            started=float(body["started"]),
            last_seen=float(body["last_seen"]),
            last_span=str(body["last_span"]),
            last_dependency=str(body["last_dependency"]),
            step=str(body["step"]),
            counts=(counts[0], counts[1], counts[2], counts[3]),
            phase=phase,
            go_on_at=float(body["go_on_at"]),
            paused_until=float(body["paused_until"]),
            on_timeout=str(body["on_timeout"]),
            paused_for=str(body["paused_for"]),
            stalled=bool(body["stalled"]),
            gap=float(body["gap"]),
            unverified=tuple(str(call) for call in body["unverified"])[:64],
        )


class RunJournal:
    """The ``open_runs`` table of the state database (see the module)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self._lock = threading.Lock()
        self.errors = 0
        self.unreadable = 0

    @classmethod
    def open(cls, path: str | Path) -> RunJournal:
        """The journal in the database at ``path`` (``":memory:"``: a private one)."""
        db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA busy_timeout=5000")
        db.execute(_SCHEMA)
        return cls(db)

    def load(self, limit: int) -> list[SavedRun]:
        """The journaled runs, most recently active first (at most ``limit``).

        A row that cannot be read is skipped and counted, never fatal.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, body FROM open_runs ORDER BY last_seen DESC LIMIT ?", (limit,)
            ).fetchall()
        saved: list[SavedRun] = []
        for run_id, body in rows:
            try:
                saved.append(SavedRun.from_json(str(run_id), str(body)))
            except (ValueError, KeyError, TypeError):
                self.unreadable += 1
        if self.unreadable:
            log.warning("skipped unreadable journaled runs", extra={"count": self.unreadable})
        return saved

    def save(self, changed: Sequence[SavedRun], gone: Sequence[str]) -> None:
        """Write the runs that changed and delete those that ended, in one transaction.

        A database error is logged and counted: the next save writes the
        runs that change again, and the sidecar goes on either way.
        """
        if not changed and not gone:
            return
        try:
            with self._lock:
                db = self._db
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany(
                        "DELETE FROM open_runs WHERE run_id = ?", [(run_id,) for run_id in gone]
                    )
                    db.executemany(
                        "INSERT INTO open_runs (run_id, body, last_seen) VALUES (?, ?, ?)"
                        " ON CONFLICT (run_id) DO UPDATE SET body = excluded.body,"
                        " last_seen = excluded.last_seen",
                        [(run.run_id, run.to_json(), run.last_seen) for run in changed],
                    )
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
        except sqlite3.Error:
            self.errors += 1
            log.exception("could not journal the open runs; trying again at the next save")

    def close(self) -> None:
        with self._lock:
            self._db.close()
