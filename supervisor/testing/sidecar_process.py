"""A real ``spanvisor run`` process for end-to-end tests.

Why it exists: an end-to-end test wants the sidecar as it ships, a separate
process reading a settings file, not an app object in the test's process. Each
such test then needs the same steps: free ports, a config file, an environment
that cannot steer the child elsewhere, a wait until ``/healthz`` answers (and
the log tail when it never does), and a bounded stop. :class:`SidecarProcess`
does them once, for this project's tests and for users' own.

    with SidecarProcess({"agents": {...}}, tmp_path, policy=POLICY) as sidecar:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sidecar.otlp_endpoint
        ...
        assert sidecar.get("/v1/incidents")["incidents"]

Ports, token, token file and state file are filled in when the settings leave
them out; everything else is the caller's. A crash test calls :meth:`kill`
and starts a new :class:`SidecarProcess` (another ``name``) on the same
``state_path``. Everything listens on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx

__all__ = [
    "DROPPED_ENV_PREFIXES",
    "SidecarProcess",
    "free_port",
    "stop_process",
    "tail",
    "wait_until",
]

T = TypeVar("T")

#: Variables the child does not inherit: ``SPANVISOR_*`` would override the
#: settings file, ``OTEL_*`` would send its spans somewhere.
DROPPED_ENV_PREFIXES: tuple[str, ...] = ("SPANVISOR_", "OTEL_")

_LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on loopback right now (the OS's pick), for a server to bind next."""
    with socket.socket() as s:
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], T | None], timeout_s: float, what: str, *, interval_s: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Bounded, never a fixed sleep: raises AssertionError naming ``what`` after
    ``timeout_s``. An exception from ``predicate`` propagates at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, for a failure message; never raises for a missing file."""
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc.strerror})"


def stop_process(process: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM (a chance to flush and write what it keeps), SIGKILL after ``grace_s``; bounded.

    For any child of a test (the sidecar, an agent, a trace viewer). Returns the exit code.
    """
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    return process.returncode


class SidecarProcess:
    """One ``python -m supervisor.cli run --config <file>`` process; a context manager.

    ``settings`` are the settings file's keys (written as JSON, which is YAML)
    to ``directory/<name>.json``; the process logs to ``directory/<name>.log``.
    ``policy``, when given, is written to ``directory/<name>.policy.yaml`` and
    named by the settings. ``env`` is added to this process's environment
    without the variables starting with ``drop_env_prefixes``.
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        directory: Path,
        *,
        policy: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "spanvisor",
        startup_timeout_s: float = 20.0,
        drop_env_prefixes: Sequence[str] = DROPPED_ENV_PREFIXES,
    ) -> None:
        self.directory = directory
        self.name = name
        self.startup_timeout_s = startup_timeout_s
        self.policy = policy
        self.config_path = directory / f"{name}.json"
        self.log_path = directory / f"{name}.log"
        self.policy_path = directory / f"{name}.policy.yaml"
        filled: dict[str, Any] = {
            "otlp_grpc_port": free_port(),
            "otlp_http_port": free_port(),
            "api_port": free_port(),
            "api_token": secrets.token_urlsafe(16),
            "token_file": str(directory / f"{name}.token"),
            "state_path": str(directory / "state.db"),
            **settings,
        }
        if policy is not None:
            filled["policy"] = str(self.policy_path)
        self.settings = filled
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(tuple(drop_env_prefixes))},
            **(env or {}),
        }
        self._process: subprocess.Popen[bytes] | None = None

    # -- where it is -----------------------------------------------------------------

    @property
    def api_port(self) -> int:
        return int(self.settings["api_port"])

    @property
    def otlp_http_port(self) -> int:
        return int(self.settings["otlp_http_port"])

    @property
    def otlp_grpc_port(self) -> int:
        return int(self.settings["otlp_grpc_port"])

    @property
    def token(self) -> str:
        """The control API's bearer token."""
        return str(self.settings["api_token"])

    @property
    def api(self) -> str:
        """The control API's base URL, e.g. ``http://127.0.0.1:4320``."""
        return f"http://{_LOOPBACK}:{self.api_port}"

    @property
    def otlp_endpoint(self) -> str:
        """The OTLP/HTTP base URL, as an agent's ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://{_LOOPBACK}:{self.otlp_http_port}"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The child process; RuntimeError before :meth:`start`."""
        if self._process is None:
            raise RuntimeError(f"sidecar {self.name!r} was not started")
        return self._process

    # -- its life ----------------------------------------------------------------------

    def start(self) -> SidecarProcess:
        """Write the files, start the process, return once ``/healthz`` answers 200.

        Raises AssertionError with the log's tail if the process exits first or
        is not healthy within ``startup_timeout_s`` (and then kills it).
        """
        if self.policy is not None:
            self.policy_path.write_text(self.policy, encoding="utf-8")
        self.config_path.write_text(json.dumps(self.settings, default=str), encoding="utf-8")
        argv = [sys.executable, "-m", "supervisor.cli", "run", "--config", str(self.config_path)]
        with self.log_path.open("wb") as log_file:
            self._process = subprocess.Popen(  # noqa: S603 - our own CLI, a fixed argv
                argv, env=self.env, stdout=log_file, stderr=subprocess.STDOUT
            )
        try:
            wait_until(self._healthy, self.startup_timeout_s, f"the sidecar {self.name!r}")
        except AssertionError as exc:
            self.kill()
            raise AssertionError(f"{exc}\n--- sidecar log (tail)\n{tail(self.log_path)}") from None
        return self

    def _healthy(self) -> bool:
        process = self.process
        if process.poll() is not None:
            raise AssertionError(
                f"the sidecar {self.name!r} exited at start ({process.returncode})"
            )
        try:
            answer = httpx.get(f"{self.api}/healthz", timeout=1, trust_env=False)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (the sidecar drains and flushes its spans), SIGKILL after ``grace_s``.

        Returns the exit code; None if never started.
        """
        return None if self._process is None else stop_process(self._process, grace_s)

    def kill(self, timeout_s: float = 10.0) -> int | None:
        """SIGKILL, as a crash would: nothing is drained or flushed. Returns the exit code."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.kill()
        return self._process.wait(timeout_s)

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- talking to it -----------------------------------------------------------------

    def get(self, path: str, **params: Any) -> Any:
        """``GET`` on the control API with the token; the JSON answer, or HTTPStatusError."""
        response = httpx.get(
            f"{self.api}{path}",
            params=params,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=5,
            trust_env=False,
        )
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: Any = None) -> Any:
        """``POST`` JSON on the control API with the token; the JSON answer (None if empty)."""
        response = httpx.post(
            f"{self.api}{path}",
            json=body,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=5,
            trust_env=False,
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def log_events(self) -> list[dict[str, Any]]:
        """The sidecar's JSON log lines, parsed (other lines skipped)."""
        events: list[dict[str, Any]] = []
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
        return events
