"""The store's three shared tables, once: their columns, written out for SQLite or PostgreSQL.

The SQLite file (:mod:`.store_schema`) and the fleet's PostgreSQL store
(:mod:`.store_pg`) hold the same rows; only the types' names differ. Times
are ``REAL`` in SQLite and ``DOUBLE PRECISION`` in PostgreSQL (its ``REAL``
is four bytes), and PostgreSQL has no implicit ``rowid`` (the insertion
order pages are keyed on), so there it is an identity column. Indexes stay
each dialect's own: the two planners want different ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ADDED", "TABLES", "Column", "add_column", "create_table"]

Dialect = Literal["sqlite", "postgres"]
_TYPES = {
    "sqlite": {"text": "TEXT", "real": "REAL", "int": "INTEGER"},
    "postgres": {"text": "TEXT", "real": "DOUBLE PRECISION", "int": "INTEGER"},
}


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    kind: Literal["text", "real", "int"]
    #: What follows the type, the same in both dialects (``NOT NULL DEFAULT ''``).
    constraint: str = "NOT NULL"
    #: Added after the first release: a store made before gets it at open (kept rows: the default).
    added: bool = False

    def definition(self, dialect: Dialect) -> str:
        return f"{_TYPES[dialect][self.kind]} {self.constraint}".strip()


def _later(name: str, kind: Literal["text", "real", "int"], constraint: str = "") -> Column:
    return Column(name, kind, constraint, added=True)


_NOT_EMPTY = "NOT NULL DEFAULT ''"

TABLES: dict[str, tuple[Column, ...]] = {
    "incidents": (
        Column("key", "text", "PRIMARY KEY"),
        Column("trace_id", "text"),
        Column("span_id", "text"),
        Column("rule", "text"),
        Column("service", "text"),
        Column("run_id", "text"),
        Column("action", "text"),
        Column("body", "text"),
        Column("created_at", "real"),
        # The instance that judged it (instance_id), as in every table below.
        _later("judged_by", "text", _NOT_EMPTY),
    ),
    # A command's id is "cmd_" and the first 24 hex digits of its idempotency key, so the
    # primary key refuses a second command for the same key: no index of its own on key
    # (one B-tree fewer, with random keys, for every command stored).
    "commands": (
        Column("id", "text", "PRIMARY KEY"),
        Column("key", "text"),
        Column("incident_key", "text"),
        Column("service", "text"),
        Column("type", "text"),
        Column("channel", "text"),
        Column("status", "text"),
        Column("body", "text"),
        Column("not_before", "real"),
        Column("next_attempt_at", "real"),
        Column("attempts", "int", "NOT NULL DEFAULT 0"),
        Column("lease_until", "real", ""),
        Column("last_error", "text", _NOT_EMPTY),
        Column("created_at", "real"),
        Column("finished_at", "real", ""),
        _later("judged_by", "text", _NOT_EMPTY),
        # The instance that delivered it (a push attempt that succeeded, a pull ack).
        _later("delivered_by", "text", _NOT_EMPTY),
        # A dead letter put back to pending by a person: how often, who last, and when.
        _later("redeliveries", "int", "NOT NULL DEFAULT 0"),
        _later("redelivered_by", "text", _NOT_EMPTY),
        _later("redelivered_at", "real"),
    ),
    "approvals": (
        Column("id", "text", "PRIMARY KEY"),
        Column("incident_key", "text", "NOT NULL UNIQUE"),
        Column("service", "text"),
        Column("run_id", "text"),
        Column("status", "text"),
        Column("body", "text"),
        Column("created_at", "real"),
        Column("answered_at", "real", ""),
        Column("answered_by", "text", _NOT_EMPTY),
        Column("note", "text", _NOT_EMPTY),
        # When an unanswered request expires (NULL: never), and what its run gets then
        # ("resume" or "abort"; "" for none).
        _later("expires_at", "real"),
        _later("on_timeout", "text", _NOT_EMPTY),
        _later("judged_by", "text", _NOT_EMPTY),
        # The instance whose API took the answer (answered_by is who gave it).
        _later("answered_on", "text", _NOT_EMPTY),
    ),
}

#: (table, column) of every column added after the first release.
ADDED: tuple[tuple[str, Column], ...] = tuple(
    (table, column) for table, columns in TABLES.items() for column in columns if column.added
)


def create_table(table: str, dialect: Dialect) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for ``table``, with PostgreSQL's ``rowid`` column."""
    lines = [f"    {c.name} {c.definition(dialect)}" for c in TABLES[table]]
    if dialect == "postgres":
        lines.append("    rowid BIGINT GENERATED ALWAYS AS IDENTITY")
    body = ",\n".join(lines)
    return f"CREATE TABLE IF NOT EXISTS {table} (\n{body}\n)"


def add_column(table: str, column: Column, dialect: Dialect) -> str:
    """The ``ALTER TABLE`` that gives an older store ``column`` (PostgreSQL: if it lacks it)."""
    missing = " IF NOT EXISTS" if dialect == "postgres" else ""
    return f"ALTER TABLE {table} ADD COLUMN{missing} {column.name} {column.definition(dialect)}"
