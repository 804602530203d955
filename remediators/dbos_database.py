"""DBOS's database, tuned for the sidecar, and its URL made safe to print.

SQLite in WAL mode, committing without a disk sync; a waiter woken as soon as
its message is committed; a URL without its password, for messages.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import types
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("spanvisor.remediate")


def wake_waiters(workflow_id: str, topic: str) -> None:
    """Wake a remediation waiting in ``recv`` for a message this process just committed.

    DBOS on SQLite has no notifications: a waiting ``recv`` is woken by a
    poller that queries the database for each waiter. The sidecar sends
    every message itself, so it wakes the waiter as Postgres's NOTIFY would.
    Best effort through DBOS's waiter map (not a public API): if that ever
    changes, the poller still delivers the message, within ``poll_interval_s``.
    """
    try:
        from dbos._dbos import _get_dbos_instance  # internal: imported here, guarded

        waiters = _get_dbos_instance()._sys_db.notifications_map.snapshot()
        for _key, components, signal in waiters:
            if components[0] == workflow_id and components[1] == topic:
                signal.set()  # the message is committed: recv reads it when it wakes
    except Exception:  # the poller is the fallback
        log.debug("could not wake %s's waiter; the poller will", workflow_id)


class _SqliteNormalSync(types.ModuleType):
    """``sqlite3`` whose connections commit without waiting for the disk (``synchronous=NORMAL``).

    Given to SQLAlchemy as the DBAPI module of DBOS's SQLite engine, so the
    URL is parsed, and DBOS's own connect hook runs, as with ``sqlite3``.
    SQLite's default (FULL) syncs the WAL at every commit, and a remediation
    commits several times, and NORMAL costs it markedly less CPU
    (``bench/remediation.py --only throughput --backends sqlite``). In WAL mode a
    commit still survives the process being killed, which is what recovery
    is for; only a power loss can take back the last commits, and then a
    step runs again, as DBOS steps may (tool calls carry idempotency keys).
    The span store makes the same choice (:mod:`supervisor.act.store_schema`).
    """

    def __init__(self) -> None:
        super().__init__("sqlite3")

    def __getattr__(self, name: str) -> Any:
        return getattr(sqlite3, name)

    @staticmethod
    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        db: sqlite3.Connection = sqlite3.connect(*args, **kwargs)
        db.execute("PRAGMA synchronous=NORMAL")
        return db


SQLITE_NORMAL_SYNC: Final = _SqliteNormalSync()


def use_wal(url: str) -> None:
    """Put a SQLite remediation database in WAL mode (it stays so) before DBOS opens it.

    DBOS leaves SQLite in rollback-journal mode, where every step's ownership
    check waits for the write lock; in WAL mode readers do not wait for the
    writer, and remediations per second rise accordingly (``bench/remediation.py
    --backends sqlite,sqlite-wal`` compares the two).
    """
    if not url.startswith("sqlite:///") or "mode=ro" in url:
        return
    path = url.removeprefix("sqlite:///").split("?", 1)[0].removeprefix("file:")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")


def redact_url(url: str) -> str:
    """A database URL without its password, for messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        credentials, host = rest.rsplit("@", 1)
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
    return url


def search_path_schema(url: str) -> str | None:
    """The schema a ``postgresql://`` URL puts first (``?options=-csearch_path%3Dname``), or None.

    DBOS keeps its tables in its own schema (``dbos``) whatever the search
    path: told this one, a fleet's remediations sit beside its store's tables.
    """
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgres"):
        return None
    for options in parse_qs(parts.query).get("options", []):
        found = re.search(r"-c\s*search_path\s*=\s*([^,\s]+)", options)
        if found:
            return found[1].strip('"')
    return None
