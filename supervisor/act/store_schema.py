"""The store's SQLite file: its tables and indexes, how it is opened, and its lock.

The schema is created with ``IF NOT EXISTS``, so opening an existing file
keeps its rows. The file is opened with a WAL journal and
``synchronous=NORMAL`` (a committed transaction survives the process being
killed; only a power cut may lose the last few), and locked for one process:
two sidecars on one store would both deliver its commands.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from pathlib import Path

from supervisor.act.store_tables import ADDED, TABLES, add_column, create_table
from supervisor.errors import ConfigError

#: The tables (:mod:`.store_tables`, written out for SQLite) and their indexes.
SCHEMA = (
    ";\n".join(create_table(table, "sqlite") for table in TABLES)
    + ";\n"
    + """
CREATE INDEX IF NOT EXISTS commands_due ON commands (status, channel, next_attempt_at);
CREATE INDEX IF NOT EXISTS commands_service ON commands (service, status);
-- A long poll of one service finds its next pull command in O(log n), however many
-- other services' commands wait. Partial: only live pull rows, so push commands pay
-- nothing. status/channel repeat in the columns because the planner does not count a
-- partial index's WHERE as equality terms and would otherwise pick commands_due.
CREATE INDEX IF NOT EXISTS commands_pull_pending
    ON commands (service, status, channel, next_attempt_at)
    WHERE status = 'pending' AND channel = 'pull';
CREATE INDEX IF NOT EXISTS commands_pull_leased
    ON commands (service, status, lease_until) WHERE status = 'leased';
"""
)

#: Indexes on columns added after the first release: made once :func:`add_columns` ran.
INDEXES = """
CREATE INDEX IF NOT EXISTS approvals_expiry ON approvals (status, expires_at)
    WHERE status = 'pending' AND expires_at IS NOT NULL;
"""


def connect(target: str) -> tuple[sqlite3.Connection, int | None]:
    """The store at ``target`` (created if needed; ``":memory:"``: a private one), and its lock.

    The lock is a file descriptor to close once the connection is (``None`` in memory).
    """
    lock: int | None = None
    if target != ":memory:":
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        lock = lock_exclusively(target)
    db: sqlite3.Connection | None = None
    try:
        db = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        if target != ":memory:":
            db.execute("PRAGMA journal_mode=WAL")
            check_pages(db, target)
        db.execute("PRAGMA synchronous=NORMAL")
        # Fewer, larger checkpoints: each one fsyncs, and pages written many times
        # between two of them are copied once (a failure burst writes the same pages).
        db.execute("PRAGMA wal_autocheckpoint=8192")
        db.execute("PRAGMA journal_size_limit=67108864")
        db.execute("PRAGMA cache_size=-16384")  # KiB: the hot index pages stay in memory
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(SCHEMA)
        add_columns(db)
        db.executescript(INDEXES)
    except (sqlite3.Error, DamagedStore) as exc:
        if db is not None:
            db.close()
        if lock is not None:
            os.close(lock)
        if isinstance(exc, DamagedStore):
            raise
        if is_damage(exc):
            raise DamagedStore(target, str(exc)) from exc
        raise ConfigError(f"cannot open the store at {target}: {exc}") from exc
    return db, lock


class DamagedStore(ConfigError):
    """The state database has damaged pages: what is wrong, and how to get back what is readable.

    Nothing is changed in the file: its readable rows (incidents, pending
    commands, approvals) are the operator's to recover, with SQLite's own tools.
    """

    def __init__(self, target: str, detail: str) -> None:
        self.target = target
        self.detail = detail
        super().__init__(damaged_store_advice(target, detail))


def damaged_store_advice(target: str, detail: str) -> str:
    """The message for a damaged store: the fault, and the recovery steps (docs/operations.md)."""
    return (
        f"the state database {target} is damaged ({detail}); spanvisor changed nothing in it."
        " To recover what can be read, with every spanvisor on it stopped:"
        f" check it: sqlite3 {target} 'PRAGMA integrity_check';"
        f" move it aside with its -wal and -shm files (mv {target} {target}.damaged;"
        f" mv {target}-wal {target}.damaged-wal; mv {target}-shm {target}.damaged-shm);"
        " rebuild it from what can be read:"
        f" sqlite3 {target}.damaged .recover | sqlite3 {target}"
        " (or start with no file, for an empty store). See 'A damaged state database' in"
        " docs/operations.md"
    )


#: SQLite's codes for a file whose pages are not what SQLite wrote (or not a database).
_DAMAGE_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB


def is_damage(exc: BaseException) -> bool:
    """Whether an SQLite error says the file is damaged, rather than busy, full or unreadable."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGE_CODES
    text = str(exc)
    return "malformed" in text or "not a database" in text


def check_pages(db: sqlite3.Connection, target: str) -> None:
    """``PRAGMA quick_check`` at open: damage found now is a clear error, not a crash later.

    It reads every page once (0.19 s for a 174 MB store, warm) and checks
    their structure, not the indexes against the tables (``integrity_check``
    does, four times slower).
    """
    found = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
    if found != ["ok"]:
        detail = "; ".join(str(line).replace("\n", "; ") for line in found)
        raise DamagedStore(target, detail[:500])


def add_columns(db: sqlite3.Connection) -> None:
    """Give a store made by an earlier release the columns it lacks (kept rows get defaults)."""
    for table, column in ADDED:
        present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column.name not in present:
            db.execute(add_column(table, column, "sqlite"))


def lock_exclusively(target: str) -> int:
    """Lock ``target`` for this process: two sidecars on one store would both deliver."""
    fd = os.open(target + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            f"another spanvisor is using the store at {target}; give each sidecar its own"
            " state_path"
        ) from None
    return fd
