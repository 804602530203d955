"""The test Redis at 127.0.0.1:6379: a client, a namespace of one's own, a proxy before it.

Each test uses keys under a namespace of its own (:func:`fresh_namespace`),
deleted after it: the server is shared. :class:`RedisProxy` stands between a
sidecar and Redis, and can forward, drop every connection (Redis away) or
accept and never answer (Redis hanging). Without a server the test is skipped.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.tcp_proxy import TcpProxy

REDIS = ("127.0.0.1", 6379)


class RedisProxy(TcpProxy):
    """A loopback TCP proxy to the test Redis: ``forward``, ``drop`` or ``hang``."""

    def __init__(self) -> None:
        super().__init__(REDIS)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextmanager
def redis_client() -> Iterator[Any]:
    """A client of the test Redis, straight (not through a proxy); skips without one."""
    redis = pytest.importorskip("redis")
    client = redis.Redis(*REDIS, socket_connect_timeout=0.5, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    try:
        yield client
    finally:
        client.close()


@contextmanager
def fresh_namespace(client: Any) -> Iterator[str]:
    """A key prefix no one else uses; its keys are deleted after."""
    name = f"spanvisor-test-{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        keys = list(client.scan_iter(match=f"{name}:*"))
        if keys:
            client.delete(*keys)
