"""A state database with damaged pages: a clear error (exit 2), nothing changed, a way back."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.act.store import Store
from supervisor.act.store_schema import DamagedStore

ROWS = 2000
PAGE = 4096


def make_store(path: Path) -> None:
    """A real store with incidents and commands, checkpointed into the main file."""
    store = Store.open(path)
    db = store._db
    db.execute("BEGIN")
    for i in range(ROWS):
        db.execute(
            "INSERT INTO incidents (key, trace_id, span_id, rule, service, run_id, action, body,"
            " created_at) VALUES (?,?,?,?,?,?,?,?,?)",
            (f"k{i}", "t" * 32, "s" * 16, "rule", "svc", "run", "retry", "x" * 200, 0.0),
        )
        db.execute(
            "INSERT INTO commands (id, key, incident_key, service, type, channel, status, body,"
            " not_before, next_attempt_at, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (f"cmd_{i}", f"k{i}", f"k{i}", "svc", "retry", "pull", "pending", "{}", 0, 0, 0),
        )
    db.execute("COMMIT")
    store.close()
    plain = sqlite3.connect(path)
    plain.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    plain.close()


#: The first byte of a B-tree page that holds rows (a table's leaf), as SQLite writes it.
_TABLE_LEAF = 0x0D


def damage(path: Path, every: int = 7, *, leaves_only: bool = False) -> None:
    """Overwrite 64 bytes of a page header of every ``every``-th page after the first.

    ``leaves_only``: of those, only the pages holding rows. A damaged interior page
    hides its whole subtree from ``.dump``, so how much a recovery keeps would
    depend on where the tables' pages happen to fall (any column added moves them).
    """
    pages = path.stat().st_size // PAGE
    with path.open("r+b") as fh:
        for page in range(2, pages + 1, every):
            fh.seek((page - 1) * PAGE)
            if leaves_only and fh.read(1)[0] != _TABLE_LEAF:
                continue
            fh.seek((page - 1) * PAGE + 8)
            fh.write(bytes(range(64)))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_damaged_pages_are_a_clear_error_and_the_file_is_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    make_store(path)
    damage(path)
    before = digest(path)
    with pytest.raises(DamagedStore) as raised:
        Store.open(path)
    message = str(raised.value)
    assert f"the state database {path} is damaged" in message
    assert f"sqlite3 {path} 'PRAGMA integrity_check'" in message
    assert ".recover" in message
    assert digest(path) == before
    # The lock was released: once the file is moved aside, a new store opens at once.
    path.rename(tmp_path / "state.db.damaged")
    Store.open(path).close()


def test_random_bytes_are_the_same_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(os.urandom(3 * PAGE))
    with pytest.raises(DamagedStore, match="is damaged"):
        Store.open(path)


def test_spanvisor_run_on_a_damaged_store_exits_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    make_store(path)
    damage(path)
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "SPANVISOR_STATE_PATH": str(path),
        "SPANVISOR_TOKEN_FILE": str(tmp_path / "token"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            *("--grpc-port", "0", "--http-port", "0", "--api-port", "0"),
        ],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "is damaged" in done.stderr
    assert "docs/operations.md" in done.stderr


def recovery_script(damaged: Path) -> bytes:
    """What docs/operations.md says to feed a fresh file: ``.recover``, else ``.dump``.

    ``.recover`` needs a sqlite3 built with the dbpage table (sqlite.org's is;
    Debian's is not); ``.dump`` ends a damaged file's script with a ROLLBACK,
    which the documented ``sed`` turns into a COMMIT.
    """
    recover = subprocess.run(
        ["sqlite3", str(damaged), ".recover"], check=False, capture_output=True
    )
    if recover.returncode == 0:
        return recover.stdout
    dump = subprocess.run(
        ["sqlite3", str(damaged), ".dump"], check=False, capture_output=True
    ).stdout
    return dump.replace(b"ROLLBACK; -- due to errors", b"COMMIT;")


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="needs the sqlite3 command")
def test_the_documented_recovery_keeps_what_can_be_read(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    make_store(path)
    damage(path, every=23, leaves_only=True)
    damaged = tmp_path / "state.db.damaged"
    check = subprocess.run(
        ["sqlite3", str(path), "PRAGMA integrity_check"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() != "ok"
    path.rename(damaged)
    subprocess.run(
        ["sqlite3", str(path)], input=recovery_script(damaged), check=False, capture_output=True
    )
    store = Store.open(path)  # passes the check at open
    try:
        kept = store._db.execute(
            "SELECT (SELECT COUNT(*) FROM incidents) + (SELECT COUNT(*) FROM commands)"
        ).fetchone()[0]
    finally:
        store.close()
    assert kept >= ROWS // 2
