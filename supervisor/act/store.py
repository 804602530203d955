"""Durable state: incidents, commands (with dead letters) and approvals, in SQLite or PostgreSQL.

Why it exists: a decision must reach its agent once, even when the sidecar is
killed mid-way or an exporter sends the same span twice. Every incident is
stored under its idempotency key (trace id, span id, rule), in the same
transaction as the commands it leads to, so

* a span judged twice finds its key taken and makes no second command;
* a command is ``pending`` until an attempt succeeds; after ``kill -9`` a
  restart finds it pending and delivers it, with the same ``Idempotency-Key``,
  so an agent that had already received it can drop it; delivered commands are
  never sent again.

Lifecycle: :meth:`Store.open` creates or migrates the file (WAL journal,
``synchronous=NORMAL``: a committed transaction survives the process being
killed; only a power cut may lose the last few), then the sidecar's event loop
is the only caller (the methods are short synchronous transactions), and
:meth:`Store.close` once at shutdown. ``":memory:"`` gives a private
in-memory store for tests and ``replay``.

Bounded: at most ``max_pending`` commands wait; past that a new command is
stored dead with the reason, never dropped silently. Finished rows older than
``retention_s`` are pruned by :meth:`prune`.

**A fleet** (``database_url``: PostgreSQL, :mod:`.store_pg`) shares one
store: the same span judged by two sidecars makes one incident (its key is
inserted once: ``ON CONFLICT DO NOTHING`` decides, not what was read before),
one command and one approval; a push command is claimed before it is sent
(:meth:`Store.due` moves its due time past the longest attempt, on the rows it
locked with ``SKIP LOCKED``), so one sidecar sends it; a pull lease and an
answer change only rows still pending. Every row names the instance that
judged it, and a command the one that delivered it.

The SQLite file itself (tables, pragmas, lock) is :mod:`.store_schema`, the
PostgreSQL tables :mod:`.store_pg`, what differs between the two
:mod:`.store_db`; the records and their rows are :mod:`.store_rows`; this
module is the queries, written once for both.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import orjson

from supervisor.act.store_db import Database, SqliteDatabase
from supervisor.act.store_rows import (
    Approval,
    CommandStatus,
    Incident,
    IncidentCounts,
    KindCounts,
    NewIncident,
    StoredCommand,
    approval_deadline,
    approval_from_row,
    command_from_row,
    command_row,
    dumps_json,
)
from supervisor.act.store_schema import connect
from supervisor.errors import SupervisorError
from supervisor.records import Command

__all__ = [
    "Approval",
    "ApprovalError",
    "Incident",
    "IncidentCounts",
    "KindCounts",
    "NewIncident",
    "Page",
    "RedeliveryError",
    "Store",
    "StoredCommand",
]

#: How long :meth:`Store.counts` reuses its last count of the table.
_COUNTS_TTL_S = 5.0
#: How long a push command claimed by one sidecar of a fleet is not due for the others:
#: past the longest attempt (an actuator's timeout is at most 60 s, plus a wait for a
#: slot). A sidecar killed mid-attempt leaves it to be sent again after this.
CLAIM_S = 120.0


class ApprovalError(SupervisorError):
    """An approval that cannot be answered: unknown, or answered already."""


class RedeliveryError(SupervisorError):
    """A dead letter that cannot be put back to pending; ``why`` says which case.

    ``unknown``: no such command; ``not_dead``: it is not a dead letter (pending,
    leased or delivered); ``no_channel``: its service has no delivery channel
    now either; ``full``: ``max_pending`` commands already wait.
    """

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


#: Incidents one count reads at most (the newest): a count is one scan of them.
MAX_COUNTED_INCIDENTS = 10_000
#: (class, kind, bucket) rows one count returns at most.
_MAX_COUNT_ROWS = 20_000


_INSERT_INCIDENT = (
    "INSERT INTO incidents (key, trace_id, span_id, rule, service, run_id, action, body,"
    " created_at, judged_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_INSERT_COMMAND = (
    "INSERT INTO commands (id, key, incident_key, service, type, channel, status,"
    " body, not_before, next_attempt_at, attempts, last_error, created_at, finished_at,"
    " judged_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_INSERT_APPROVAL = (
    "INSERT INTO approvals (id, incident_key, service, run_id, status, body,"
    " created_at, expires_at, on_timeout, judged_by)"
    " VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_SELECT_INCIDENTS = "SELECT key, body, created_at, judged_by FROM incidents"
#: What an expired approval request's run gets: the command, built from the request.
TimedOut = Callable[[Approval, float], Command]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list, newest stored first, and where the next one starts.

    Pages are keyed on the row id (insertion order): a row stored while
    someone pages is newer than every page's start, so it shifts none. (On
    PostgreSQL, ids are handed out at insert and rows become visible at
    commit: a row of a transaction that commits late can land behind a page
    already read.)
    """

    items: list[T]
    #: The row id to pass as ``before`` for the next page; None: this page is the last.
    next_before: int | None


class Store:
    """The sidecar's durable state; see the module docstring for the guarantees."""

    def __init__(
        self, db: Database, *, max_pending: int, retention_s: float, instance_id: str = ""
    ) -> None:
        self._db = db
        self._lock = threading.Lock()  # the API's thread pool and the loop may both read
        self.max_pending = max_pending
        self.retention_s = retention_s
        #: Written in every row this instance judges or delivers (a fleet's rows say whose).
        self.instance_id = instance_id
        #: Commands stored dead because ``max_pending`` were already waiting.
        self.overflowed = 0
        #: Incidents already stored when recorded again (the same span judged twice).
        self.duplicates = 0
        self._waiting: int = db.execute(
            "SELECT COUNT(*) FROM commands WHERE status IN ('pending', 'leased')"
        ).fetchone()[0]
        self._counts: dict[str, int] | None = None
        self._lock_fd: int | None = None
        self._counted_at = 0.0

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        max_pending: int = 100_000,
        retention_s: float = 7 * 86_400.0,
        instance_id: str = "",
    ) -> Store:
        """Open (creating if needed) the store at ``path``; ``":memory:"`` for a private one.

        A ``postgresql://`` URL opens a fleet's shared store (see the module docstring).
        """
        target = str(path)
        if is_database_url(target):
            from supervisor.act.store_pg import connect_postgres

            return cls(
                connect_postgres(target, instance_id),
                max_pending=max_pending,
                retention_s=retention_s,
                instance_id=instance_id,
            )
        connection, lock = connect(target)
        store = cls(
            SqliteDatabase(connection, target),
            max_pending=max_pending,
            retention_s=retention_s,
            instance_id=instance_id,
        )
        store._lock_fd = lock
        return store

    @property
    def shared(self) -> bool:
        """Whether other sidecars write this store too (PostgreSQL)."""
        return self._db.shared

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, a store method, for a caller on the event loop.

        Here on SQLite (a local file: microseconds). In a worker thread on
        PostgreSQL: each call is a network round trip, and while the server is
        unreachable a reconnect waits up to its connect timeout, which must not
        hold ingest and the control API.
        """
        if not self._db.shared:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def call_in_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker thread on SQLite too: for a read that is
        long even on a local file (a count over thousands of rows), not to hold the loop.

        Safe on SQLite: the connection is opened with ``check_same_thread=False``
        and every method uses it under the store's lock, as the store writer's
        thread does. The loop's own store calls wait for that lock meanwhile.
        """
        return await asyncio.to_thread(fn, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    @contextmanager
    def _transaction(self) -> Iterator[Database]:
        with self._lock, self._db.transaction():
            yield self._db

    def transaction(self) -> AbstractContextManager[Database]:
        """One transaction on the store's database, for a table kept beside the store's
        own (a fleet's heartbeats, :mod:`.fleet`)."""
        return self._transaction()

    # -- incidents and the commands they lead to ---------------------------

    def record(self, incidents: Iterable[NewIncident], now: float) -> list[StoredCommand]:
        """Store new incidents with their commands; return the commands that are new.

        An incident whose key is already stored is a duplicate (the same span
        judged twice): nothing of it is stored again and none of its commands
        are returned. One transaction and a few statements per batch: this runs
        on the pipeline's thread for every failure.
        """
        batch = list(incidents)
        created: list[StoredCommand] = []
        before = (self.duplicates, self.overflowed)
        try:
            self._record(batch, created, now)
        except BaseException:
            # Rolled back: nothing of the batch is stored, so it is counted nowhere, and
            # storing it again (the store writer does, after a full disk) counts it once.
            # Taken back as differences, under the lock: other threads count too.
            with self._lock:
                self._waiting -= sum(stored.status == "pending" for stored in created)
                self.duplicates, self.overflowed = before
            raise
        return created

    def _record(self, batch: list[NewIncident], created: list[StoredCommand], now: float) -> None:
        with self._transaction() as db:
            known = self._stored_keys(db, [incident.key for incident in batch])
            fresh: list[NewIncident] = []
            for incident in batch:
                if incident.key in known:
                    self.duplicates += 1
                    continue
                known.add(incident.key)
                fresh.append(incident)
            if db.shared:
                # Another sidecar may store the same key meanwhile: the insert decides
                # (it waits for that transaction, then does nothing), not what was read.
                # In key order: two batches sharing keys wait for each other, never
                # deadlock. What waits to be delivered is the whole fleet's.
                # (The batch's own order stays that of its commands: past max_pending,
                # the later ones are dead.)
                self._waiting = self._count_waiting(db)
                inserted = {
                    i.key
                    for i in sorted(fresh, key=lambda incident: incident.key)
                    if db.execute(_INSERT_INCIDENT, self._incident_row(i, now)).rowcount
                }
                self.duplicates += len(fresh) - len(inserted)
                fresh = [i for i in fresh if i.key in inserted]
            else:
                db.executemany(_INSERT_INCIDENT, [self._incident_row(i, now) for i in fresh])
            rows = []
            for incident in fresh:
                for command, channel in incident.commands:
                    status: CommandStatus = "pending"
                    error = ""
                    if not channel:
                        status = "dead"
                        error = f"no delivery channel is configured for service {command.service!r}"
                    elif self._waiting >= self.max_pending:
                        status = "dead"
                        error = f"{self.max_pending} commands were already waiting"
                        self.overflowed += 1
                    rows.append(
                        command_row(
                            command,
                            incident.key,
                            channel,
                            status,
                            error,
                            judged_by=self.instance_id,
                        )
                    )
                    finished = command.created_at if status == "dead" else None
                    created.append(
                        StoredCommand(
                            command,
                            channel,
                            status,
                            0,
                            command.not_before,
                            error,
                            finished,
                            judged_by=self.instance_id,
                        )
                    )
                    self._waiting += status == "pending"
            db.executemany(_INSERT_COMMAND, rows)
            db.executemany(
                _INSERT_APPROVAL,
                [
                    (
                        f"apr_{i.key[:24]}",
                        i.key,
                        i.service,
                        i.run_id,
                        dumps_json(i.approval),
                        now,
                        *approval_deadline(i.approval, now),
                        self.instance_id,
                    )
                    for i in fresh
                    if i.approval is not None
                ],
            )

    def _incident_row(self, i: NewIncident, now: float) -> tuple[object, ...]:
        return (
            i.key,
            i.trace_id,
            i.span_id,
            i.rule,
            i.service,
            i.run_id,
            i.action,
            dumps_json(i.body),
            now,
            self.instance_id,
        )

    @staticmethod
    def _count_waiting(db: Database) -> int:
        return int(
            db.execute(
                "SELECT COUNT(*) FROM commands WHERE status IN ('pending', 'leased')"
            ).fetchone()[0]
        )

    @staticmethod
    def _stored_keys(db: Database, keys: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(keys), 500):  # well under SQLite's bound on parameters
            chunk = keys[start : start + 500]
            marks = ",".join("?" for _ in chunk)
            found.update(
                row[0]
                for row in db.execute(
                    f"SELECT key FROM incidents WHERE key IN ({marks})",  # noqa: S608 - placeholders only
                    chunk,
                ).fetchall()
            )
        return found

    def _insert_command(
        self,
        db: Database,
        command: Command,
        *,
        incident_key: str,
        channel: str,
        status: CommandStatus,
        error: str,
    ) -> StoredCommand | None:
        row = command_row(command, incident_key, channel, status, error, judged_by=self.instance_id)
        if not db.execute(_INSERT_COMMAND, row).rowcount:
            return None
        self._waiting += status == "pending"
        finished = command.created_at if status == "dead" else None
        return StoredCommand(
            command,
            channel,
            status,
            0,
            command.not_before,
            error,
            finished,
            judged_by=self.instance_id,
        )

    def add_commands(
        self, incident_key: str, commands: Iterable[tuple[Command, str]]
    ) -> list[StoredCommand]:
        """Commands that follow an incident later (an approval's result); keys dedupe them."""
        created: list[StoredCommand] = []
        with self._transaction() as db:
            for command, channel in commands:
                status: CommandStatus = "pending" if channel else "dead"
                error = (
                    ""
                    if channel
                    else (f"no delivery channel is configured for service {command.service!r}")
                )
                stored = self._insert_command(
                    db,
                    command,
                    incident_key=incident_key,
                    channel=channel,
                    status=status,
                    error=error,
                )
                if stored is not None:
                    created.append(stored)
        return created

    def incidents(self, limit: int = 100) -> list[Incident]:
        return self.incident_page(limit).items

    def incident_page(self, limit: int = 100, before: int | None = None) -> Page[Incident]:
        """Incidents newest first (insertion order), from row ``before`` on when given."""
        # Insertion order: an index on created_at would cost every failure an insert.
        rows, more = self._page_rows(
            "SELECT rowid AS seq, key, body, created_at, judged_by FROM incidents",
            [],
            [],
            before,
            limit,
        )
        return Page([_incident(r) for r in rows], more)

    def _page_rows(
        self,
        select: str,
        clauses: list[str],
        args: list[Any],
        before: int | None,
        limit: int,
    ) -> tuple[list[Any], int | None]:
        """``limit`` rows of ``select`` (which names the rowid ``seq``), newest first.

        One more row is read than asked: whether there is a next page is known
        without a second query, and an exact last page answers no cursor.
        """
        if before is not None:
            clauses, args = [*clauses, "rowid < ?"], [*args, before]
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            rows = self._db.execute(
                f"{select}{where} ORDER BY rowid DESC LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        if len(rows) > limit:
            return rows[:limit], int(rows[limit - 1]["seq"])
        return rows, None

    def incident_counts(
        self,
        start: float,
        bucket_s: float,
        buckets: int,
        *,
        max_rows: int = MAX_COUNTED_INCIDENTS,
    ) -> IncidentCounts:
        """Incidents stored in ``buckets`` windows of ``bucket_s`` from ``start``, counted in
        SQL by failure class and kind.

        Bounded: the newest ``max_rows`` incidents are read (there is no index on
        ``created_at``: it would cost every failure stored an insert; rows are
        in about time order, so the newest rows are the window's). When the
        first row left unread is inside the window too, ``complete`` is False.
        """
        if buckets < 1 or not bucket_s > 0:
            raise ValueError("a count needs at least one bucket of a positive width")
        db = self._db
        end = start + buckets * bucket_s
        bucket = db.whole("(created_at - ?) / ?")
        sql = (
            f"SELECT COALESCE({db.json_text('body', 'class')}, '') AS cls,"  # noqa: S608 - constants
            f" COALESCE({db.json_text('body', 'kind')}, '') AS kind, {bucket} AS bucket,"
            " COUNT(*) AS n FROM (SELECT body, created_at FROM incidents"
            " ORDER BY rowid DESC LIMIT ?) AS newest WHERE created_at >= ? AND created_at < ?"
            " GROUP BY cls, kind, bucket ORDER BY cls, kind, bucket LIMIT ?"
        )
        with self._lock:
            rows = db.execute(
                sql, (start, bucket_s, max_rows, start, end, _MAX_COUNT_ROWS + 1)
            ).fetchall()
            past = db.execute(
                "SELECT created_at FROM incidents ORDER BY rowid DESC LIMIT 1 OFFSET ?",
                (max_rows,),
            ).fetchone()
        complete = len(rows) <= _MAX_COUNT_ROWS and (past is None or past[0] < start)
        counts: dict[tuple[str, str], list[int]] = {}
        for row in rows[:_MAX_COUNT_ROWS]:
            found = counts.setdefault((str(row[0]), str(row[1])), [0] * buckets)
            found[min(max(int(row[2]), 0), buckets - 1)] += int(row[3])
        series = sorted(
            (KindCounts(cls, kind, tuple(n)) for (cls, kind), n in counts.items()),
            key=lambda s: (-s.total, s.failure_class, s.kind),
        )
        return IncidentCounts(start, bucket_s, buckets, tuple(series), complete)

    def incident(self, key: str) -> Incident | None:
        with self._lock:
            row = self._db.execute(f"{_SELECT_INCIDENTS} WHERE key = ?", (key,)).fetchone()
        return None if row is None else _incident(row)

    # -- delivery ----------------------------------------------------------

    def due(self, channels: Sequence[str], now: float, limit: int) -> list[StoredCommand]:
        """Pending commands of ``channels`` whose time has come, oldest first.

        In a fleet they are claimed too: each is handed to one sidecar, and is
        not due for the others for :data:`CLAIM_S` (its attempt's outcome then
        sets the next due time, or ends it). The claim names the sidecar in
        ``delivered_by`` while the command is pending, so that a fleet can give
        a dead sidecar's claims back (:meth:`release_claims`). One sidecar holds
        an SQLite file: what it reads is its own.
        """
        marks = ",".join("?" for _ in channels)
        select = (
            f"SELECT * FROM commands WHERE status = 'pending' AND channel IN ({marks})"  # noqa: S608 - placeholders only
            " AND next_attempt_at <= ? ORDER BY next_attempt_at LIMIT ?"
        )
        if not self._db.shared:
            with self._lock:
                rows = self._db.execute(select, (*channels, now, limit)).fetchall()
            return [command_from_row(r) for r in rows]
        with self._transaction() as db:
            # RETURNING the locked rows as they were read: the due time that was reached.
            rows = db.execute(
                f"WITH picked AS ({select}{db.lock_rows}) UPDATE commands SET"  # noqa: S608 - constants
                " next_attempt_at = ?, delivered_by = ? FROM picked"
                " WHERE commands.id = picked.id RETURNING picked.*",
                (*channels, now, limit, now + CLAIM_S, self.instance_id),
            ).fetchall()
        claimed = [command_from_row(r) for r in rows]
        return sorted(claimed, key=lambda stored: stored.next_attempt_at)

    def next_due_at(self, channels: Sequence[str], excluding: Sequence[str] = ()) -> float | None:
        """When the earliest pending command of ``channels`` (not in ``excluding``) is due."""
        marks = ",".join("?" for _ in channels)
        skip = f" AND id NOT IN ({','.join('?' for _ in excluding)})" if excluding else ""
        with self._lock:
            row = self._db.execute(
                f"SELECT MIN(next_attempt_at) FROM commands WHERE status = 'pending'"  # noqa: S608 - placeholders only
                f" AND channel IN ({marks}){skip}",
                (*channels, *excluding),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def delivered(self, command_id: str, now: float) -> None:
        with self._transaction() as db:
            self._waiting -= db.execute(
                "UPDATE commands SET status = 'delivered', attempts = attempts + 1,"
                " finished_at = ?, lease_until = NULL, delivered_by = ? WHERE id = ?"
                " AND status IN ('pending', 'leased')",
                (now, self.instance_id, command_id),
            ).rowcount

    def attempt_failed(self, command_id: str, error: str, next_attempt_at: float) -> None:
        """An attempt failed; the next is due at ``next_attempt_at`` (a fleet's claim ends)."""
        with self._transaction() as db:
            db.execute(
                "UPDATE commands SET attempts = attempts + 1, last_error = ?,"
                " next_attempt_at = ?, delivered_by = '' WHERE id = ? AND status = 'pending'",
                (error, next_attempt_at, command_id),
            )

    def release_claims(self, instance_id: str, now: float) -> int:
        """Make the push commands ``instance_id`` claimed and never finished due at ``now``.

        For a fleet whose sidecar died mid-attempt (:mod:`.fleet`): its claims
        would otherwise hold the commands for the rest of :data:`CLAIM_S`.
        """
        with self._transaction() as db:
            released: int = db.execute(
                "UPDATE commands SET next_attempt_at = ?, delivered_by = '' WHERE"
                " status = 'pending' AND delivered_by = ? AND next_attempt_at > ?",
                (now, instance_id, now),
            ).rowcount
        return released

    def dead(self, command_id: str, error: str, now: float) -> None:
        """Dead-letter a command: its last attempt failed or it cannot be delivered."""
        with self._transaction() as db:
            self._waiting -= db.execute(
                "UPDATE commands SET status = 'dead', attempts = attempts + 1, last_error = ?,"
                " finished_at = ?, lease_until = NULL, delivered_by = '' WHERE id = ?"
                " AND status IN ('pending', 'leased')",
                (error, now, command_id),
            ).rowcount

    def redeliver(
        self, command_id: str, *, channel_for: Callable[[str], str], by: str, now: float
    ) -> StoredCommand:
        """Put a dead letter back to pending, due at ``now``, for a person who asked.

        The same row: its id and ``Idempotency-Key`` stay, so an agent that had
        received it after all can drop it. Its attempts start again from 0,
        on the channel its service has now (``channel_for``; one configured
        since it died counts). Who asked and when are kept with it
        (``redelivered_by``, ``redelivered_at``; ``redeliveries`` counts them);
        its last error stays until an attempt replaces it. Raises
        :class:`RedeliveryError` otherwise. In a fleet, two sidecars asked at
        once put it back once: the update is conditional on ``dead``.
        """
        with self._transaction() as db:
            row = db.execute(
                "SELECT status, service FROM commands WHERE id = ?", (command_id,)
            ).fetchone()
            if row is None:
                raise RedeliveryError(f"no command {command_id!r}", "unknown")
            if row["status"] != "dead":
                raise RedeliveryError(
                    f"command {command_id!r} is {row['status']}, not a dead letter", "not_dead"
                )
            channel = channel_for(row["service"])
            if not channel:
                raise RedeliveryError(
                    f"no delivery channel is configured for service {row['service']!r}:"
                    " configure agents in the settings first",
                    "no_channel",
                )
            if db.shared:
                self._waiting = self._count_waiting(db)
            if self._waiting >= self.max_pending:
                raise RedeliveryError(
                    f"{self.max_pending} commands are already waiting; try again later", "full"
                )
            changed = db.execute(
                "UPDATE commands SET status = 'pending', channel = ?, attempts = 0,"
                " next_attempt_at = ?, lease_until = NULL, finished_at = NULL,"
                " delivered_by = '', redeliveries = redeliveries + 1, redelivered_by = ?,"
                " redelivered_at = ? WHERE id = ? AND status = 'dead'",
                (channel, now, by[:200], now, command_id),
            ).rowcount
            if not changed:
                raise RedeliveryError(
                    f"command {command_id!r} was re-delivered meanwhile", "not_dead"
                )
            self._waiting += 1
            row = db.execute("SELECT * FROM commands WHERE id = ?", (command_id,)).fetchone()
        return command_from_row(row)

    def commands(
        self, *, status: str | None = None, service: str | None = None, limit: int = 100
    ) -> list[StoredCommand]:
        return self.command_page(status=status, service=service, limit=limit).items

    def command_page(
        self,
        *,
        status: str | None = None,
        service: str | None = None,
        limit: int = 100,
        before: int | None = None,
    ) -> Page[StoredCommand]:
        """Commands newest stored first, of ``status`` and ``service`` when given."""
        clauses: list[str] = []
        args: list[Any] = []
        if status is not None:
            clauses.append("status = ?")
            args.append(status)
        if service is not None:
            clauses.append("service = ?")
            args.append(service)
        rows, more = self._page_rows(
            "SELECT *, rowid AS seq FROM commands", clauses, args, before, limit
        )
        return Page([command_from_row(r) for r in rows], more)

    def command(self, command_id: str) -> StoredCommand | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM commands WHERE id = ?", (command_id,)).fetchone()
        return None if row is None else command_from_row(row)

    def counts(self) -> dict[str, int]:
        """Commands by status, counted at most every few seconds (a scan of the table)."""
        now = time.monotonic()
        if self._counts is None or now - self._counted_at >= _COUNTS_TTL_S:
            with self._lock:
                rows = self._db.execute(
                    "SELECT status, COUNT(*) AS n FROM commands GROUP BY status"
                ).fetchall()
            found = {r["status"]: r["n"] for r in rows}
            statuses = ("pending", "leased", "delivered", "dead")
            self._counts = {s: found.get(s, 0) for s in statuses}
            self._counted_at = now
        return dict(self._counts)

    @property
    def waiting(self) -> int:
        """Commands pending or leased (exact; what ``max_pending`` bounds; a fleet's: counted)."""
        if self._db.shared:
            with self._lock:
                self._waiting = self._count_waiting(self._db)
        return self._waiting

    # -- the pull channel --------------------------------------------------

    def lease(
        self, service: str, now: float, visibility_s: float, limit: int
    ) -> list[StoredCommand]:
        """Hand out due pull commands of ``service``; unacknowledged ones come back later."""
        with self._transaction() as db:
            # A lease that ran out without an ack makes the command pending again.
            db.execute(
                "UPDATE commands SET status = 'pending', lease_until = NULL WHERE"
                " status = 'leased' AND channel = 'pull' AND service = ? AND lease_until <= ?",
                (service, now),
            )
            # Locked in a fleet: two sidecars' long polls never hand out one command twice.
            rows = db.execute(
                "SELECT * FROM commands WHERE status = 'pending' AND channel = 'pull'"  # noqa: S608 - a constant
                " AND service = ? AND next_attempt_at <= ? ORDER BY next_attempt_at"
                f" LIMIT ?{db.lock_rows}",
                (service, now, limit),
            ).fetchall()
            ids = [r["id"] for r in rows]
            db.executemany(
                "UPDATE commands SET status = 'leased', lease_until = ?, attempts = attempts + 1"
                " WHERE id = ?",
                [(now + visibility_s, i) for i in ids],
            )
        return [command_from_row(r) for r in rows]

    def next_lease_at(self, service: str) -> float | None:
        """When :meth:`lease` can next hand out a pull command of ``service``, or None.

        The earliest of its pending commands' due times and its leases' ends:
        neither is announced, so a long poll sleeps until then. Other services'
        commands are left out, or one due command nobody fetches would wake
        every other service's long poll at once, over and over.
        """
        with self._lock:
            row = self._db.execute(
                "SELECT (SELECT MIN(next_attempt_at) FROM commands WHERE service = ?"
                " AND status = 'pending' AND channel = 'pull'),"
                " (SELECT MIN(lease_until) FROM commands WHERE service = ?"
                " AND status = 'leased' AND channel = 'pull')",
                (service, service),
            ).fetchone()
        found = [float(t) for t in row if t is not None]
        return min(found) if found else None

    def ack(self, command_id: str, service: str, now: float) -> bool:
        """Acknowledge a leased pull command; False when it is unknown or not leased to it."""
        with self._transaction() as db:
            changed = db.execute(
                "UPDATE commands SET status = 'delivered', finished_at = ?, lease_until = NULL,"
                " delivered_by = ? WHERE id = ? AND service = ? AND channel = 'pull'"
                " AND status IN ('leased', 'pending')",
                (now, self.instance_id, command_id, service),
            ).rowcount
            self._waiting -= changed
        return bool(changed)

    def expire_pull(self, now: float, ttl_s: float) -> int:
        """Dead-letter pull commands nobody fetched within ``ttl_s`` of becoming due."""
        with self._transaction() as db:
            # A lease that ran out unacknowledged counts as not fetched: its agent is gone.
            expired: int = db.execute(
                "UPDATE commands SET status = 'dead', finished_at = ?, lease_until = NULL,"
                " last_error = 'not fetched before it expired'"
                " WHERE channel = 'pull' AND next_attempt_at <= ? AND (status = 'pending'"
                " OR (status = 'leased' AND lease_until <= ?))",
                (now, now - ttl_s, now),
            ).rowcount
            self._waiting -= expired
        return expired

    # -- approvals ---------------------------------------------------------

    def open_approval(
        self,
        approval_id: str,
        *,
        incident_key: str,
        service: str,
        run_id: str,
        body: Mapping[str, Any],
        now: float,
    ) -> bool:
        """Open an approval request (a remediation's); False when ``approval_id`` exists."""
        with self._transaction() as db:
            return bool(
                db.execute(
                    _INSERT_APPROVAL,
                    (
                        approval_id,
                        incident_key,
                        service,
                        run_id,
                        dumps_json(body),
                        now,
                        *approval_deadline(body, now),
                        self.instance_id,
                    ),
                ).rowcount
            )

    def incidents_where(
        self,
        *,
        action: str | None = None,
        run_id: str | None = None,
        judged_by: str | None = None,
        limit: int = 100,
    ) -> list[Incident]:
        """The newest incidents with this action, run and/or judge (a scan: for tools and
        takeovers, not hot paths)."""
        sql = _SELECT_INCIDENTS
        clauses: list[str] = []
        args: list[Any] = []
        if judged_by is not None:
            clauses.append("judged_by = ?")
            args.append(judged_by)
        if action is not None:
            clauses.append("action = ?")
            args.append(action)
        if run_id is not None:
            clauses.append("run_id = ?")
            args.append(run_id)
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY rowid DESC LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_incident(r) for r in rows]

    def run_history(
        self, run_id: str, limit: int = 200
    ) -> tuple[list[Incident], list[StoredCommand], list[Approval]]:
        """A run's newest ``limit`` incidents, their commands and its approval requests.

        For the console's run page: scans (no index on a run's id; a page read
        by a person, not a hot path), each bounded by ``limit``.
        """
        incidents = self.incidents_where(run_id=run_id, limit=limit)
        keys = [i.key for i in incidents]
        commands: list[StoredCommand] = []
        with self._lock:
            if keys:
                marks = ", ".join("?" for _ in keys)
                rows = self._db.execute(
                    f"SELECT * FROM commands WHERE incident_key IN ({marks})"  # noqa: S608
                    " ORDER BY rowid DESC LIMIT ?",
                    (*keys, limit),
                ).fetchall()
                commands = [command_from_row(r) for r in rows]
            found = self._db.execute(
                "SELECT * FROM approvals WHERE run_id = ? ORDER BY rowid DESC LIMIT ?",
                (run_id, limit),
            ).fetchall()
        return incidents, commands, [approval_from_row(r) for r in found]

    def approvals(self, *, status: str | None = None, limit: int = 100) -> list[Approval]:
        return self.approval_page(status=status, limit=limit).items

    def approval_page(
        self, *, status: str | None = None, limit: int = 100, before: int | None = None
    ) -> Page[Approval]:
        """Approval requests newest first, of ``status`` when given."""
        clauses, args = (["status = ?"], [status]) if status is not None else ([], [])
        rows, more = self._page_rows(
            "SELECT *, rowid AS seq FROM approvals", clauses, list(args), before, limit
        )
        return Page([approval_from_row(r) for r in rows], more)

    def approval(self, approval_id: str) -> Approval | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM approvals WHERE id = ?", (approval_id,)
            ).fetchone()
        return None if row is None else approval_from_row(row)

    def answer(
        self, approval_id: str, *, approved: bool, by: str, note: str, now: float
    ) -> Approval:
        """Record the answer to a pending approval; :class:`ApprovalError` otherwise."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM approvals WHERE id = ?", (approval_id,)).fetchone()
            if row is None:
                raise ApprovalError(f"no approval request {approval_id!r}")
            if row["status"] == "expired" or (
                row["status"] == "pending"
                and row["expires_at"] is not None
                and row["expires_at"] <= now
            ):
                # Past its deadline the run was (or is about to be) given the pause's
                # outcome: an answer now would contradict it.
                raise ApprovalError(
                    f"approval request {approval_id!r} expired unanswered; its run gets"
                    f" {row['on_timeout'] or 'nothing'}"
                )
            if row["status"] != "pending":
                raise ApprovalError(
                    f"approval request {approval_id!r} was already answered: {row['status']}"
                )
            # Only while still pending: another sidecar of a fleet may answer it meanwhile.
            answered = db.execute(
                "UPDATE approvals SET status = ?, answered_at = ?, answered_by = ?, note = ?,"
                " answered_on = ? WHERE id = ? AND status = 'pending'",
                (
                    "approved" if approved else "denied",
                    now,
                    by[:200],
                    note[:2000],
                    self.instance_id,
                    approval_id,
                ),
            ).rowcount
            row = db.execute("SELECT * FROM approvals WHERE id = ?", (approval_id,)).fetchone()
        if not answered:
            raise ApprovalError(
                f"approval request {approval_id!r} was already answered: {row['status']}"
            )
        return approval_from_row(row)

    def pending_approvals(self) -> tuple[int, float | None]:
        """How many approval requests wait for an answer, and when the oldest was opened."""
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*), MIN(created_at) FROM approvals WHERE status = 'pending'"
            ).fetchone()
        return int(row[0]), None if row[1] is None else float(row[1])

    def next_expiry(self) -> float | None:
        """When the first pending approval request with a deadline expires, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT MIN(expires_at) FROM approvals WHERE status = 'pending'"
                " AND expires_at IS NOT NULL"
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def expire_approvals(
        self, now: float, timed_out: TimedOut, channel_for: Callable[[str], str], limit: int = 100
    ) -> list[tuple[Approval, StoredCommand | None]]:
        """Expire pending approval requests past their deadline, with their runs' outcomes.

        In one transaction per request: it becomes ``expired`` (``answered_at``
        the time, ``answered_by`` ``"timeout"``) and the command ``timed_out``
        builds is stored (none when the request names no outcome). The status
        change happens once, and the command's key is the request's, so a
        request is expired, and its run told, once however often this runs.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM approvals WHERE status = 'pending' AND expires_at IS NOT NULL"
                " AND expires_at <= ? ORDER BY expires_at LIMIT ?",
                (now, limit),
            ).fetchall()
        done: list[tuple[Approval, StoredCommand | None]] = []
        for found in (approval_from_row(r) for r in rows):
            with self._transaction() as db:
                changed = db.execute(
                    "UPDATE approvals SET status = 'expired', answered_at = ?,"
                    " answered_by = 'timeout', note = ? WHERE id = ? AND status = 'pending'",
                    (now, f"no answer by the deadline; the run gets: {found.on_timeout}", found.id),
                ).rowcount
                if not changed:  # answered meanwhile
                    continue
                stored: StoredCommand | None = None
                if found.on_timeout:
                    command = timed_out(found, now)
                    channel = channel_for(command.service)
                    stored = self._insert_command(
                        db,
                        command,
                        incident_key=found.incident_key,
                        channel=channel,
                        status="pending" if channel else "dead",
                        error=""
                        if channel
                        else f"no delivery channel is configured for service {command.service!r}",
                    )
                row = db.execute("SELECT * FROM approvals WHERE id = ?", (found.id,)).fetchone()
            done.append((approval_from_row(row), stored))
        return done

    # -- housekeeping ------------------------------------------------------

    def prune(self, now: float) -> int:
        """Drop finished commands, answered approvals and incidents older than the retention."""
        horizon = now - self.retention_s
        with self._transaction() as db:
            removed = db.execute(
                "DELETE FROM commands WHERE status IN ('delivered', 'dead') AND finished_at < ?",
                (horizon,),
            ).rowcount
            removed += db.execute(
                "DELETE FROM approvals WHERE status != 'pending' AND answered_at < ?", (horizon,)
            ).rowcount
            removed += db.execute(
                "DELETE FROM incidents WHERE created_at < ? AND key NOT IN"
                " (SELECT incident_key FROM commands) AND key NOT IN"
                " (SELECT incident_key FROM approvals WHERE status = 'pending')",
                (horizon,),
            ).rowcount
            if db.shared:  # a fleet's runs (:mod:`.store_runs`), silent for the retention
                from supervisor.act.store_runs import prune_runs

                removed += prune_runs(db, horizon)
        return removed


def is_database_url(target: str) -> bool:
    """Whether ``target`` names a PostgreSQL server rather than an SQLite file."""
    return target.startswith(("postgresql://", "postgresql+psycopg://", "postgres://"))


def _incident(row: Any) -> Incident:
    return Incident(row["key"], orjson.loads(row["body"]), row["created_at"], row["judged_by"])
