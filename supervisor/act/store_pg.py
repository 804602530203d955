"""The store's tables on PostgreSQL, shared by a fleet of sidecars (``database_url``).

The same tables and columns as the SQLite file (:mod:`.store_tables` writes
both), with indexes of PostgreSQL's own. Two tables are a fleet's alone:
``instances``, the sidecars' heartbeats (:mod:`.fleet`), and ``runs``, the
runs each sidecar tracks (:mod:`.store_runs`). Created with ``IF NOT EXISTS`` under an
advisory lock, so sidecars starting together do not race on the catalog.
The tables go in the connection's schema: ``?options=-csearch_path%3Dname``
in the URL puts them in ``name``.
"""

from __future__ import annotations

from remediators.dbos_database import redact_url
from supervisor.act.store_db import PostgresDatabase
from supervisor.act.store_tables import ADDED, TABLES, add_column, create_table
from supervisor.errors import ConfigError, StoreUnavailable

SCHEMA = (
    *(create_table(table, "postgres") for table in TABLES),
    # A store made before a column was added gets it here.
    *(add_column(table, column, "postgres") for table, column in ADDED),
    "CREATE INDEX IF NOT EXISTS incidents_rowid ON incidents (rowid)",
    "CREATE INDEX IF NOT EXISTS commands_rowid ON commands (rowid)",
    "CREATE INDEX IF NOT EXISTS commands_due ON commands (status, channel, next_attempt_at)",
    "CREATE INDEX IF NOT EXISTS commands_service ON commands (service, status)",
    "CREATE INDEX IF NOT EXISTS commands_incident ON commands (incident_key)",
    "CREATE INDEX IF NOT EXISTS commands_pull_pending"
    " ON commands (service, next_attempt_at) WHERE status = 'pending' AND channel = 'pull'",
    "CREATE INDEX IF NOT EXISTS commands_pull_leased"
    " ON commands (service, lease_until) WHERE status = 'leased'",
    "CREATE INDEX IF NOT EXISTS approvals_rowid ON approvals (rowid)",
    "CREATE INDEX IF NOT EXISTS approvals_expiry ON approvals (expires_at)"
    " WHERE status = 'pending' AND expires_at IS NOT NULL",
    # The fleet's members and their heartbeats (:mod:`.fleet`); a fleet's only.
    """
CREATE TABLE IF NOT EXISTS instances (
    id TEXT PRIMARY KEY,
    executor_id TEXT NOT NULL,
    beat_at DOUBLE PRECISION NOT NULL,
    taken_over_by TEXT,
    taken_over_at DOUBLE PRECISION
)""",
    # The fleet's runs, each as the sidecar tracking it last published it
    # (:mod:`.store_runs`); a fleet's only.
    """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    service TEXT NOT NULL,
    status TEXT NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL,
    tracked_by TEXT NOT NULL,
    summary TEXT NOT NULL,
    published_at DOUBLE PRECISION NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS runs_recent ON runs (last_seen, run_id)",
)

#: Any constant: the advisory lock that serialises the sidecars creating the tables.
_SCHEMA_LOCK = 0x5350414E  # "SPAN"


def connect_postgres(url: str, instance_id: str = "") -> PostgresDatabase:
    """The shared store at ``url`` (``postgresql://``), its tables created if missing."""
    where = redact_url(url)
    try:
        import psycopg
    except ImportError:
        raise ConfigError(
            f"database_url {where} needs psycopg: pip install 'spanvisor[fleet]'"
        ) from None
    try:
        db = PostgresDatabase(
            url.replace("postgresql+psycopg://", "postgresql://", 1),
            where,
            f"spanvisor {instance_id}".strip(),
        )
    except psycopg.Error as exc:
        raise ConfigError(f"cannot connect to the store at database_url {where}: {exc}") from exc
    try:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
            for statement in SCHEMA:
                db.execute(statement)
    except (psycopg.Error, StoreUnavailable) as exc:
        db.close()
        raise ConfigError(f"cannot create the store's tables at {where}: {exc}") from exc
    return db
