"""The demo's agents: processes of the LangGraph example agent, their environment and logs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.cli.demo_text import Event

ROOT = Path(__file__).resolve().parent.parent.parent
AGENT = ROOT / "examples" / "langgraph_agent.py"


@dataclass
class AgentProcess:
    """One process of the example agent: its argv, its log, its JSON summary."""

    service: str
    label: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    summary_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log_offset: int = 0
    _partial: bytes = b""

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log_file:
            # A session of its own: Ctrl-C reaches the demo, which stops the agent itself.
            self.process = subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def terminate(self) -> None:
        """SIGTERM: the agent stops its threads and writes its summary."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the agent to exit, then SIGKILL it; bounded."""
        process = self.process
        if process is None:
            return
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)

    def new_lines(self) -> list[str]:
        """Complete lines the agent logged since the last call (bounded per call)."""
        try:
            with self.log_path.open("rb") as log_file:
                log_file.seek(self._log_offset)
                chunk = log_file.read(256 * 1024)
        except OSError:
            return []
        self._log_offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > 64 * 1024:
            self._partial = b""
        return [line.decode("utf-8", "replace") for line in lines]

    def summary(self) -> dict[str, Any]:
        try:
            found = json.loads(self.summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


#: Lines of the agents' own logs worth showing, and the word for them.
_AGENT_LINES = (
    (re.compile(r"unverified after a restart; the ledger says"), "ledger"),
    (re.compile(r"thread \S+: (completed|aborted) in"), "agent"),
    (re.compile(r"fault injection: killed"), "agent"),
    (re.compile(r"waiting for a person's approval"), "agent"),
)


def agent_events(agent: AgentProcess, at: float) -> list[Event]:
    """Events for the lines worth showing that ``agent`` logged since the last call."""
    events = []
    for line in agent.new_lines():
        text = line.removeprefix("langgraph-agent: ").strip()
        for pattern, kind in _AGENT_LINES:
            if pattern.search(text):
                run = (
                    text.split("thread ", 1)[1].split(" ", 1)[0].rstrip(":")
                    if "thread " in text
                    else ""
                )
                if kind == "ledger":
                    run = text.split("/", 1)[0]
                events.append(Event(at, kind, run, f"{agent.service}: {text}"))
                break
    return events


def _clean_env() -> dict[str, str]:
    """This environment without what would steer a child elsewhere (the user's own OTLP...)."""
    prefixes = ("OTEL_", "SPANVISOR_", "OPENAI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    if "OTEL_RESOURCE_ATTRIBUTES" in os.environ:  # e.g. Phoenix's project name: kept
        env["OTEL_RESOURCE_ATTRIBUTES"] = os.environ["OTEL_RESOURCE_ATTRIBUTES"]
    return env


def agent_env(base_url: str, http_port: int, token: str) -> dict[str, str]:
    """An agent's environment: the fake provider, the sidecar's OTLP/HTTP port, its token."""
    env = _clean_env()
    loopback = "127.0.0.1,localhost"
    path = env.get("PYTHONPATH")
    return {
        **env,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        "NO_PROXY": f"{loopback},{env['NO_PROXY']}" if env.get("NO_PROXY") else loopback,
        "no_proxy": f"{loopback},{env['no_proxy']}" if env.get("no_proxy") else loopback,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "sk-demo",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "SPANVISOR_API_TOKEN": token,
    }


def missing_modules() -> list[str]:
    """What the example agent needs that is not installed (the ``demo`` extra)."""
    import importlib.util

    needed = (
        "langgraph",
        "langgraph.checkpoint.sqlite",
        "langchain_openai",
        "openinference.instrumentation.langchain",
    )
    missing = []
    for name in needed:
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            missing.append(name)
    return missing
