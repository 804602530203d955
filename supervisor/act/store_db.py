"""The store's two databases behind one interface: SQLite (one sidecar), PostgreSQL (a fleet).

The store's queries are written once, in the SQL both understand (``?``
placeholders, ``ON CONFLICT DO NOTHING``, a ``rowid`` column for insertion
order: SQLite's own, an identity column on PostgreSQL). What differs is here:
how a transaction starts, how placeholders are spelt, and whether rows read
for an update must be locked against other writers.

* :class:`SqliteDatabase`: one process holds the file (an ``flock``), and a
  transaction is ``BEGIN IMMEDIATE``: whatever a transaction read is still
  true when it writes. ``shared`` is False.
* :class:`PostgresDatabase`: several sidecars write at once. Every query that
  decides on what it read either writes conditionally (``UPDATE ... WHERE
  status = 'pending'``, ``INSERT ... ON CONFLICT DO NOTHING``) or locks the
  rows it read (``FOR UPDATE SKIP LOCKED``: :attr:`lock_rows`). ``shared`` is
  True. One connection, used under a lock by the loop and the API's threads,
  made again after the server dropped it. Losing the server (refused,
  cut off, dropped) raises :class:`~supervisor.errors.StoreUnavailable`,
  not the driver's error: callers answer "try again" (the control API's 503).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from supervisor.errors import StoreUnavailable

#: SQLSTATEs of a lost server: connection exceptions (class 08) and shutdowns.
_LOST_SERVER = ("08", "57P01", "57P02", "57P03")


class Row(Protocol):
    """A row read by name (``row["status"]``) or position (``row[0]``)."""

    def __getitem__(self, key: str | int, /) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Database(Protocol):
    #: Whether other processes write the same tables (PostgreSQL): see the module docstring.
    shared: bool
    #: Appended to a SELECT whose rows the transaction then updates ("" where one writer).
    lock_rows: str
    #: Where it is, for messages (never a password).
    where: str

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    def json_text(self, column: str, key: str) -> str:
        """SQL for the text of ``key`` in the JSON object in ``column`` (a constant key)."""
        ...

    def whole(self, expression: str) -> str:
        """SQL for the integer part of a non-negative ``expression`` (a bucket's number)."""
        ...

    def transaction(self) -> Any: ...

    def close(self) -> None: ...


class SqliteDatabase:
    """An SQLite connection (see :mod:`.store_schema` for how it is opened and locked)."""

    shared = False
    lock_rows = ""

    def __init__(self, db: sqlite3.Connection, where: str) -> None:
        self._db = db
        self.where = where

    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._db.executemany(sql, rows)

    def json_text(self, column: str, key: str) -> str:
        return f"json_extract({column}, '$.{key}')"

    def whole(self, expression: str) -> str:
        # CAST truncates, the floor of what is not negative; floor() may be compiled out.
        return f"CAST(({expression}) AS INTEGER)"

    @contextmanager
    def transaction(self) -> Iterator[None]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            # SQLite may have rolled back already (a full disk does): a ROLLBACK then
            # fails and would hide the error that matters. A COMMIT that failed leaves
            # the transaction open otherwise, and every later BEGIN would fail.
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()


class PgRow:
    """A PostgreSQL row, read by name or position like :class:`sqlite3.Row`."""

    __slots__ = ("_index", "_values")

    def __init__(self, values: Sequence[Any], index: dict[str, int]) -> None:
        self._values = values
        self._index = index

    def __getitem__(self, key: str | int, /) -> Any:
        return self._values[self._index[key] if isinstance(key, str) else key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _pg_rows(cursor: Any) -> Any:
    """psycopg's row factory making :class:`PgRow` (names looked up once per result)."""
    names = [column.name for column in cursor.description or ()]
    index = {name: n for n, name in enumerate(names)}

    def make(values: Sequence[Any]) -> PgRow:
        return PgRow(values, index)

    return make


class PostgresDatabase:
    """A psycopg connection to the shared store; see the module docstring."""

    shared = True
    lock_rows = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, where: str, name: str = "spanvisor") -> None:
        self._url = url
        #: What ``pg_stat_activity`` shows as its ``application_name``: which sidecar.
        self.name = name[:63]
        self.where = where
        self._conn: Any = None
        self._connect()

    def _connect(self) -> Any:
        import psycopg

        self._conn = psycopg.connect(
            self._url,
            autocommit=True,
            row_factory=_pg_rows,
            connect_timeout=10,
            application_name=self.name,
        )
        return self._conn

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            # The server restarted or the network dropped the connection: a new one. A
            # transaction cut short was rolled back by the server; its caller retries.
            if conn is not None:
                conn.close()
            conn = self._connect()
        return conn

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        """The driver's errors of a lost server as :class:`StoreUnavailable`; others as they are."""
        import psycopg

        try:
            yield
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            conn = self._conn
            lost = conn is None or conn.closed or conn.broken
            if not lost and not str(exc.sqlstate or "").startswith(_LOST_SERVER):
                raise  # the server answered: a conflict, a timeout it enforced
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreUnavailable(
                f"the shared store (PostgreSQL at {self.where}) is unreachable: {first}",
                self.where,
            ) from exc

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        with self._reaching():
            return self._connection().execute(_placeholders(sql), tuple(args))

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            with self._reaching(), self._connection().cursor() as cursor:
                cursor.executemany(_placeholders(sql), [tuple(row) for row in rows])

    def json_text(self, column: str, key: str) -> str:
        return f"(({column})::json ->> '{key}')"

    def whole(self, expression: str) -> str:
        # PostgreSQL's CAST rounds to the nearest integer: a bucket's number is the floor.
        return f"CAST(FLOOR({expression}) AS BIGINT)"

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._reaching(), self._connection().transaction():
            yield

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def _placeholders(sql: str) -> str:
    """The store's ``?`` placeholders as psycopg's ``%s`` (its SQL has no ``%`` nor ``?`` else)."""
    return sql.replace("?", "%s")
