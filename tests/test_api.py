"""The control API: token handling and input checks, in process."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from supervisor.api import build_control_app, ensure_token


def app(token: str = "t0k3n") -> TestClient:
    items: list[dict[str, Any]] = [{"n": i} for i in range(5)]
    return TestClient(
        build_control_app(
            token=token,
            failures=lambda limit: items[-limit:],
            stats=lambda: {"pipeline": {"processed_spans": 7}},
            ready=lambda: True,
        )
    )


def test_generated_token_is_written_for_the_user_only(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "token"

    token = ensure_token(None, path)

    assert len(token) >= 32
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_configured_token_is_used_and_nothing_is_written(tmp_path: Path) -> None:
    assert ensure_token("given", tmp_path / "token") == "given"
    assert not (tmp_path / "token").exists()


def test_routes_need_the_bearer_token() -> None:
    client = app()

    assert client.get("/v1/stats").status_code == 401
    assert client.get("/v1/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.get("/v1/stats", headers={"Authorization": "Bearer t0k3n"})
    assert (ok.status_code, ok.json()) == (200, {"pipeline": {"processed_spans": 7}})
    assert client.get("/healthz").json() == {"status": "ok"}


def test_failures_limit_is_checked() -> None:
    client = app()
    auth = {"Authorization": "Bearer t0k3n"}

    assert client.get("/v1/failures?limit=2", headers=auth).json() == {
        "failures": [{"n": 3}, {"n": 4}]
    }
    assert client.get("/v1/failures?limit=abc", headers=auth).status_code == 400
    assert client.get("/v1/failures?limit=0", headers=auth).status_code == 400
