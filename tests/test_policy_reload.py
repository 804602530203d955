"""Hot reload of the policy: on SIGHUP and when the file changes; a bad file changes nothing.

A real ``spanvisor run`` process (SIGHUP is the operator's signal), its
control API to read which policy is in effect.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_run_e2e import free_port

pytestmark = pytest.mark.slow

GOOD = "version: 1\npolicies:\n  - {name: first, match: {kind: auth}, action: escalate}\n"
BETTER = "version: 1\npolicies:\n  - {name: second, match: {kind: auth}, action: fail_fast}\n"
BAD = "version: 1\npolicies:\n  - {name: broken, action: retry, max_attempts: -1}\n"


def _wait(check: Any, what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(GOOD)
    api_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPANVISOR_"))}
    env.update(
        SPANVISOR_OTLP_GRPC_PORT=str(free_port()),
        SPANVISOR_OTLP_HTTP_PORT=str(free_port()),
        SPANVISOR_API_PORT=str(api_port),
        SPANVISOR_API_TOKEN="reload-token",
        SPANVISOR_STATE_PATH=str(tmp_path / "state.db"),
        SPANVISOR_POLICY=str(policy),
        SPANVISOR_POLICY_POLL_S="0.2",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    api = f"http://127.0.0.1:{api_port}"
    try:
        _wait(lambda: _up(api), "the sidecar to start")
        yield process, api, policy
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


def _up(api: str) -> bool:
    try:
        return httpx.get(f"{api}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _policy_state(api: str) -> dict[str, Any]:
    stats = httpx.get(
        f"{api}/v1/stats", headers={"Authorization": "Bearer reload-token"}, timeout=5
    ).json()
    return stats["policy"]  # type: ignore[no-any-return]


def _decision(api: str) -> str:
    answer = httpx.post(
        f"{api}/v1/decide",
        headers={"Authorization": "Bearer reload-token"},
        json={"dependency": "openai:gpt-4o", "status_code": 401, "message": "Incorrect API key"},
        timeout=5,
    ).json()
    return str(answer["policy"])


def test_a_changed_file_reloads_a_bad_one_is_rejected_and_sighup_reloads(
    sidecar: tuple[subprocess.Popen[str], str, Path],
) -> None:
    process, api, policy = sidecar
    assert _decision(api) == "first"

    policy.write_text(BAD)
    _wait(lambda: _policy_state(api)["reloads"]["rejected"] == 1, "the bad file to be rejected")
    assert _decision(api) == "first"  # the old policy is kept

    policy.write_text(BETTER)
    _wait(lambda: _decision(api) == "second", "the changed file to be loaded")

    # SIGHUP reloads even a file whose change the poll has not seen yet.
    stamp = policy.stat()
    policy.write_text(GOOD.replace("first", "third"))
    os.utime(policy, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # same size and mtime
    process.send_signal(signal.SIGHUP)
    _wait(lambda: _decision(api) == "third", "SIGHUP to reload")
    assert process.poll() is None  # SIGHUP does not stop the sidecar
