"""A shared store that stops answering does not hold the sidecar's event loop.

With ``database_url``, the dispatcher's reads of due commands, pull leases and
the control API's lists are network round trips; while PostgreSQL does not
answer, each waits up to its connect timeout. They run in worker threads
(:meth:`supervisor.act.store.Store.call`), so ``/healthz`` and ingest keep
answering: before, the dispatcher's read every second held the loop for the
whole connect timeout (10 s).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from policies import load_policy
from supervisor.app import BackgroundSidecar
from supervisor.wiring import build_sidecar
from tests.postgres import fresh_schema
from tests.tcp_proxy import TcpProxy
from tests.test_app import settings


@pytest.mark.slow
def test_healthz_answers_while_postgresql_hangs(tmp_path: Path) -> None:
    with fresh_schema() as url:
        proxy = TcpProxy(("127.0.0.1", 5432))
        through_proxy = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        assert through_proxy != url
        sidecar = BackgroundSidecar(
            build_sidecar(
                settings(
                    tmp_path, state_path=str(tmp_path / "state.db"), database_url=through_proxy
                ),
                load_policy(),
            )
        )
        ports = sidecar.start()
        try:
            proxy.set("hang")  # connections cut; new ones accepted and never answered
            slowest = 0.0
            with httpx.Client(base_url=f"http://127.0.0.1:{ports.api}", timeout=30) as client:
                deadline = time.monotonic() + 4  # the dispatcher reads every second
                while time.monotonic() < deadline:
                    started = time.monotonic()
                    assert client.get("/healthz").status_code == 200
                    slowest = max(slowest, time.monotonic() - started)
                    time.sleep(0.05)
            assert slowest < 1.0, slowest
        finally:
            proxy.set("forward")
            sidecar.stop()
            proxy.close()
