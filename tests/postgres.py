"""A fresh PostgreSQL schema per test, on the server at 127.0.0.1:5432 (database ``test``).

The store's tables go in the schema through the URL's ``search_path``, as an
operator would place them; the schema is dropped after the test. Without a
server the test is skipped, saying why (``SPANVISOR_TEST_POSTGRES`` names
another server).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

SERVER = os.environ.get("SPANVISOR_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A ``postgresql://`` URL whose tables land in a new, empty schema (dropped after)."""
    psycopg = pytest.importorskip("psycopg")
    schema = f"t_{uuid.uuid4().hex[:16]}"
    try:
        admin = psycopg.connect(SERVER, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at {SERVER}: {exc}")
    try:
        admin.execute(f"CREATE SCHEMA {schema}")
        separator = "&" if "?" in SERVER else "?"
        yield f"{SERVER}{separator}options=-csearch_path%3D{schema}"
    finally:
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.close()
