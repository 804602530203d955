"""A shared store that stops answering does not hold the sidecar's event loop.

With ``database_url``, the dispatcher's reads of due commands, pull leases and
the control API's lists are network round trips; while PostgreSQL does not
answer, each waits up to its connect timeout. They run in worker threads
(:meth:`supervisor.act.store.Store.call`), so ``/healthz`` and ingest keep
answering: before, the dispatcher's read every second held the loop for the
whole connect timeout (10 s).
"""

from __future__ import annotations

import threading
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
            # An answer to an approval waits for the store, off the loop: meanwhile the
            # loop answers everything else.
            approving = threading.Thread(
                target=lambda: httpx.post(
                    f"http://127.0.0.1:{ports.api}/v1/approvals/apr_nowhere/approve",
                    headers={"Authorization": "Bearer tok"},
                    timeout=30,
                ),
                daemon=True,
            )
            approving.start()
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


@pytest.mark.slow
def test_the_control_api_answers_503_naming_the_store_while_postgresql_is_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with fresh_schema() as url:
        proxy = TcpProxy(("127.0.0.1", 5432))
        through_proxy = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        sidecar = BackgroundSidecar(
            build_sidecar(
                settings(
                    tmp_path,
                    state_path=str(tmp_path / "state.db"),
                    database_url=through_proxy,
                    remediation_database_url=url,  # remediations are not what is cut here
                ),
                load_policy(),
            )
        )
        ports = sidecar.start()
        auth = {"Authorization": "Bearer tok"}
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{ports.api}", headers=auth, timeout=30
            ) as client:
                assert client.get("/v1/incidents").status_code == 200
                assert client.get("/readyz").status_code == 200
                proxy.set("drop")  # the server is down: every connection refused
                caplog.clear()
                answers = [
                    client.get(path)
                    for path in ("/v1/incidents", "/v1/approvals", "/v1/commands/log") * 3
                ]
                ready = client.get("/readyz")
                stats = client.get("/v1/stats")  # what does not need the store still answers
                proxy.set("forward")
                again = client.get("/v1/incidents")
                ready_again = client.get("/readyz")
        finally:
            if proxy.mode != "forward":  # (switching cuts the store's live connection)
                proxy.set("forward")
            sidecar.stop()
            proxy.close()
    assert {a.status_code for a in answers} == {503}
    body = answers[0].json()
    assert f"127.0.0.1:{proxy.port}/test" in body["store"]
    assert "password" not in body["store"]
    assert "unreachable" in body["error"] and body["retry_after_s"] > 0
    assert int(answers[0].headers["Retry-After"]) == body["retry_after_s"]
    assert ready.status_code == 503
    assert stats.status_code == 200, stats.text
    assert any("store down since" in why for why in ready.json()["degraded"])
    said = [r for r in caplog.records if r.name == "spanvisor.api"]
    assert len(said) == 2, [r.getMessage() for r in said]  # down once, back once: not per request
    assert "unreachable" in said[0].getMessage() and "again" in said[1].getMessage()
    assert again.status_code == 200
    assert ready_again.status_code == 200
