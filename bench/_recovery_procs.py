"""The recovery benchmark's processes: agent workers and the ``spanvisor run`` sidecar.

Every child is started by this module and registered, so that one call to
:meth:`Children.stop_all` ends them all (SIGTERM, then SIGKILL after a bounded
wait), whatever way the benchmark leaves: done, an exception, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness import LOOPBACK, BenchError, free_port

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This environment without OTLP or spanvisor settings: each child gets its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPANVISOR_"))}


@dataclass
class Children:
    """Every process the benchmark started, to stop them all on any exit."""

    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add(self, process: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.processes.append(process)
        return process

    def stop_all(self, timeout_s: float = 10.0) -> None:
        live = [p for p in self.processes if p.poll() is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in live:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)
        self.processes = [p for p in self.processes if p.poll() is None]


def kill_now(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL, as a crash: nothing flushed, nothing closed."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


@dataclass
class SidecarProcess:
    """``spanvisor run`` with a settings file, restartable on the same ports and state."""

    folder: Path
    policy_path: Path
    children: Children
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    #: ``SPANVISOR_*`` settings given with ``--env`` (over the settings file)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.api_port}"

    @property
    def otlp_http(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "sidecar.log"

    def settings(self) -> dict[str, Any]:
        return {
            "otlp_grpc_port": self.grpc_port,
            "otlp_http_port": self.http_port,
            "api_port": self.api_port,
            "api_token": self.token,
            "token_file": str(self.folder / "api-token"),
            "state_path": str(self.folder / "state.db"),
            "policy": str(self.policy_path),
            "policy_poll_s": 0,
            "drain_timeout_s": 5,
            "log_level": "INFO",
            # Every worker's service pulls its commands; a command not acknowledged
            # (its worker died holding it) is handed out again after 5 s.
            "agents": {"*": {"pull": {"visibility_s": 5}}},
        }

    def launch(self) -> None:
        """Start (or restart) the process; :meth:`healthy` says when it serves."""
        config = self.folder / "spanvisor.json"
        config.write_text(json.dumps(self.settings(), indent=1), encoding="utf-8")  # JSON is YAML
        with self.log_path.open("ab") as sink:
            self.process = self.children.add(
                subprocess.Popen(
                    [sys.executable, "-m", "supervisor.cli", "run", "--config", str(config)],
                    env=child_env() | self.extra_env,
                    cwd=ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
        self.starts += 1

    def healthy(self) -> bool:
        """Whether it answers ``/healthz``; BenchError if it exited."""
        if self.process is None:
            return False
        if self.process.poll() is not None:
            raise BenchError(f"the sidecar exited with {self.process.returncode}:\n{self.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.get(f"{self.api_url}/healthz", timeout=1, trust_env=False)
            return answer.status_code == 200
        return False

    def start(self, timeout_s: float = 60.0) -> float:
        """Start and wait until healthy; returns the time it became healthy."""
        self.launch()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return time.time()
            time.sleep(0.05)
        raise BenchError(f"the sidecar was not healthy within {timeout_s:g} s:\n{self.tail()}")

    def kill(self) -> None:
        if self.process is not None:
            kill_now(self.process)

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            kill_now(process)

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(
            f"{self.api_url}{path}",
            params=params,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
            trust_env=False,
        )
        response.raise_for_status()
        return response.json()

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_events(self) -> list[dict[str, Any]]:
        """The sidecar's JSON log lines (every start's), parsed."""
        found: list[dict[str, Any]] = []
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return found
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    found.append(record)
        return found


def start_worker(
    children: Children,
    *,
    arm: str,
    index: int,
    incarnation: int,
    folder: Path,
    provider_url: str,
    sidecar: SidecarProcess | None,
    export_delay_ms: int = 100,
) -> subprocess.Popen[bytes]:
    """One agent worker process (``bench._recovery_worker``)."""
    argv = [
        sys.executable,
        "-m",
        "bench._recovery_worker",
        f"--arm={arm}",
        f"--worker={index}",
        f"--incarnation={incarnation}",
        f"--scenario={folder / 'scenario.json'}",
        f"--dir={folder}",
        f"--provider-url={provider_url}",
        f"--service=recovery-w{index}",
    ]
    if sidecar is not None:
        argv += [
            f"--otlp-endpoint={sidecar.otlp_http}",
            f"--api-url={sidecar.api_url}",
            f"--api-token={sidecar.token}",
            f"--export-delay-ms={export_delay_ms}",
        ]
    with (folder / f"worker-w{index}.log").open("ab") as sink:
        return children.add(
            subprocess.Popen(
                argv,
                env=child_env(),
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        )
