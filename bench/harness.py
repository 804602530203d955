"""What every benchmark shares: the sidecar as a subprocess, its counters, two OTLP senders.

The sidecar is driven as a black box, as an operator would run it: a child
process started with ``SPANVISOR_*`` variables, ready when ``/healthz`` says
so, read through ``/v1/stats`` and ``/proc``, stopped with SIGTERM (then
SIGKILL if it does not exit in time). CPU time comes from ``/proc/<pid>/stat``
(utime + stime of the sidecar and any children it started), which stays
honest on a shared two-core machine where wall time does not.

Only loopback addresses are used; every loop has a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import httpx

LOOPBACK = "127.0.0.1"
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_THROTTLE_HTTP = (429, 503)
_THROTTLE_GRPC = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
MAX_SEND_ATTEMPTS = 200


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (sidecar down, timeout, rejection)."""


def command_line() -> str:
    """The exact command that is running, to print above its results."""
    return "python " + shlex.join(sys.argv)


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the sidecar."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _tree(pid: int) -> list[int]:
    pids: list[int] = []
    todo = [pid]
    while todo and len(pids) < 1000:
        current = todo.pop()
        pids.append(current)
        todo.extend(_children(current))
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    total = 0
    for member in _tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its live descendants (VmRSS)."""
    total = 0
    for member in _tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@dataclass
class Sidecar:
    """``spanvisor run`` in a child process on free loopback ports."""

    extra_env: dict[str, str] = field(default_factory=dict)
    command: Sequence[str] = (sys.executable, "-m", "supervisor.cli", "run")
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 20.0
    grpc_port: int = 0
    http_port: int = 0
    api_port: int = 0
    token: str = ""
    process: subprocess.Popen[bytes] | None = None
    _workdir: tempfile.TemporaryDirectory[str] | None = None
    _client: httpx.Client | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise BenchError("the sidecar is not running")
        return self.process.pid

    def start(self) -> None:
        self.grpc_port, self.http_port, self.api_port = free_port(), free_port(), free_port()
        self.token = secrets.token_urlsafe(24)
        self._workdir = tempfile.TemporaryDirectory(prefix="spanvisor-bench-")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPANVISOR_"))}
        env.update(
            {
                "SPANVISOR_OTLP_GRPC_PORT": str(self.grpc_port),
                "SPANVISOR_OTLP_HTTP_PORT": str(self.http_port),
                "SPANVISOR_API_PORT": str(self.api_port),
                "SPANVISOR_API_TOKEN": self.token,
                "SPANVISOR_TOKEN_FILE": str(Path(self._workdir.name) / "api-token"),
                # A fresh store per run: incidents of earlier runs must not be measured.
                "SPANVISOR_STATE_PATH": str(Path(self._workdir.name) / "state.db"),
                "SPANVISOR_LOG_LEVEL": "WARNING",
            }
        )
        env.update(self.extra_env)
        log = Path(self._workdir.name) / "sidecar.log"
        with log.open("wb") as sink:
            self.process = subprocess.Popen(
                list(self.command),
                env=env,
                cwd=self._workdir.name,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        self._client = httpx.Client(
            base_url=f"http://{LOOPBACK}:{self.api_port}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10.0,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(
                    f"the sidecar exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if self._client.get("/healthz").status_code == 200:
                    return
            time.sleep(0.05)
        raise BenchError(
            f"the sidecar was not ready within {self.start_timeout_s} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        if self._workdir is None:
            return ""
        try:
            text = (Path(self._workdir.name) / "sidecar.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        code: int | None = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=self.stop_timeout_s)
            code = self.process.returncode
        if self._client is not None:
            self._client.close()
        if self._workdir is not None:
            self._workdir.cleanup()
        return code

    def __enter__(self) -> Sidecar:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _get(self, path: str) -> dict[str, Any]:
        if self._client is None:
            raise BenchError("the sidecar is not running")
        response = self._client.get(path)
        if response.status_code != 200:
            raise BenchError(f"{path} answered {response.status_code}: {response.text[:200]}")
        data: dict[str, Any] = response.json()
        return data

    def stats(self) -> dict[str, Any]:
        return self._get("/v1/stats")

    def threads(self) -> dict[str, Any]:
        """``GET /v1/threads``: the CPU seconds of each of the sidecar's threads."""
        return self._get("/v1/threads")

    def processed(self) -> int:
        return int(self.stats()["pipeline"]["processed_spans"])

    def settled(self, target: int) -> bool:
        """Every span judged and every incident stored (the store writer's queue empty)."""
        stats = self.stats()
        backlog = (stats.get("delivery") or {}).get("store_backlog", 0)
        return int(stats["pipeline"]["processed_spans"]) >= target and not backlog

    def wait_processed(self, target: int, timeout_s: float) -> float:
        """Poll until the spans are judged and their incidents stored; returns when they were.

        Waiting for the store too keeps its work inside the measured CPU time:
        the writer stores a batch after the pipeline judged it.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.settled(target):
                return time.monotonic()
            if self.process is not None and self.process.poll() is not None:
                raise BenchError(f"the sidecar died:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                stats = self.stats()
                raise BenchError(
                    f"processed_spans stayed at {stats['pipeline']['processed_spans']} "
                    f"< {target} for {timeout_s} s; stats: {stats}"
                )
            time.sleep(0.01)


@dataclass
class SendResult:
    """What one sender saw: requests, throttles, and each request's round trip."""

    requests: int = 0
    throttled: int = 0
    latencies_s: list[float] = field(default_factory=list)


def _backoff(attempt: int) -> None:
    time.sleep(min(0.005 * 2**attempt, 0.5))


class HttpSender:
    """OTLP/HTTP protobuf with one keep-alive client per thread."""

    name = "http"

    def __init__(self, port: int) -> None:
        self.url = f"http://{LOOPBACK}:{port}/v1/traces"
        self._local = threading.local()

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(headers={"Content-Type": "application/x-protobuf"}, timeout=30.0)
            self._local.client = client
        return client

    def send(self, payload: bytes, result: SendResult) -> None:
        client = self._client()
        for attempt in range(MAX_SEND_ATTEMPTS):
            started = time.perf_counter()
            response = client.post(self.url, content=payload)
            if response.status_code == 200:
                result.latencies_s.append(time.perf_counter() - started)
                result.requests += 1
                return
            if response.status_code not in _THROTTLE_HTTP:
                raise BenchError(
                    f"POST /v1/traces answered {response.status_code}: {response.text[:200]}"
                )
            result.throttled += 1
            _backoff(attempt)
        raise BenchError(f"still throttled after {MAX_SEND_ATTEMPTS} attempts")

    def close(self) -> None:
        """Per-thread clients close with their threads' garbage; nothing shared to close."""


class GrpcSender:
    """OTLP/gRPC with the payload bytes sent as they are (identity serializer)."""

    name = "grpc"

    def __init__(self, port: int) -> None:
        self._channel = grpc.insecure_channel(
            f"{LOOPBACK}:{port}",
            options=[("grpc.max_send_message_length", 64 * 1024 * 1024)],
        )
        self._export: Callable[..., bytes] = self._channel.unary_unary(EXPORT_METHOD)

    def send(self, payload: bytes, result: SendResult) -> None:
        for attempt in range(MAX_SEND_ATTEMPTS):
            started = time.perf_counter()
            try:
                self._export(payload, timeout=30.0)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in _THROTTLE_GRPC:
                    raise BenchError(f"Export failed with {code}: {exc.details()}") from exc
                result.throttled += 1
                _backoff(attempt)
                continue
            result.latencies_s.append(time.perf_counter() - started)
            result.requests += 1
            return
        raise BenchError(f"still throttled after {MAX_SEND_ATTEMPTS} attempts")

    def close(self) -> None:
        self._channel.close()


Sender = HttpSender | GrpcSender


def make_sender(transport: str, sidecar: Sidecar) -> Sender:
    if transport == "http":
        return HttpSender(sidecar.http_port)
    if transport == "grpc":
        return GrpcSender(sidecar.grpc_port)
    raise ValueError(f"unknown transport {transport!r}; use http or grpc")


def send_all(sender: Sender, payloads: Sequence[bytes], concurrency: int) -> SendResult:
    """Send every payload once (throttled ones resent) from ``concurrency`` threads."""
    results = [SendResult() for _ in range(concurrency)]
    errors: list[BaseException] = []
    lock = threading.Lock()
    position = iter(range(len(payloads)))

    def worker(result: SendResult) -> None:
        try:
            while not errors:
                with lock:
                    index = next(position, None)
                if index is None:
                    return
                sender.send(payloads[index], result)
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    if errors:
        raise errors[0]
    total = SendResult()
    for result in results:
        total.requests += result.requests
        total.throttled += result.throttled
        total.latencies_s.extend(result.latencies_s)
    return total


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 1]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain, aligned text table."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(cell).rjust(width) for cell, width in zip(row, widths, strict=False))
        for row in (header, *rows)
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


@contextlib.contextmanager
def running_sidecar(extra_env: dict[str, str] | None = None) -> Iterator[Sidecar]:
    """A started sidecar, stopped on any exit (including SIGTERM to this script)."""
    exit_cleanly_on_sigterm()
    sidecar = Sidecar(extra_env=dict(extra_env or {}))
    with sidecar:
        yield sidecar


def add_sidecar_arguments(parser: argparse.ArgumentParser) -> None:
    """``--queue-spans`` and ``--env KEY=VALUE``: settings of the sidecar under test."""
    parser.add_argument(
        "--queue-spans", type=int, help="sets SPANVISOR_INGEST_QUEUE_SPANS (default: its own)"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="SPANVISOR_KEY=VALUE",
        help="extra SPANVISOR_* setting for the sidecar, repeatable "
        "(e.g. SPANVISOR_SEEN_FAILURE_SPANS=20000)",
    )


def sidecar_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """The extra environment the arguments of :func:`add_sidecar_arguments` ask for."""
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("SPANVISOR_"):
            parser.error(f"--env takes SPANVISOR_KEY=VALUE, got {item!r}")
        env[key] = value
    if args.queue_spans is not None:
        env["SPANVISOR_INGEST_QUEUE_SPANS"] = str(args.queue_spans)
    return env


_NUMBER = re.compile(r"\d+")


def thread_groups(snapshot: dict[str, Any]) -> dict[str, float]:
    """CPU seconds by thread name, numbers folded (``dbos-executor-_3`` -> ``dbos-executor-_N``)."""
    groups: dict[str, float] = {}
    for thread in snapshot.get("threads", []):
        name = _NUMBER.sub("N", str(thread.get("name", "?")))
        groups[name] = groups.get(name, 0.0) + float(thread.get("cpu_s", 0.0))
    return groups


def cpu_split(before: dict[str, Any], after: dict[str, Any], spans: int, top: int = 8) -> str:
    """Where the sidecar's CPU went between two ``/v1/threads`` snapshots, per span.

    Threads are grouped by name (numbers folded); a thread that ended in
    between is missing from ``after``, so the rows may sum to less than the
    process's total, which is printed beside them.
    """
    if not after.get("supported") or spans <= 0:
        return "CPU by thread: not available (no /proc)"
    start, end = thread_groups(before), thread_groups(after)
    used = {name: end[name] - start.get(name, 0.0) for name in end}
    total = float(after["process_cpu_s"]) - float(before.get("process_cpu_s") or 0.0)
    rows = [
        [name, f"{cpu:.2f}", f"{cpu / spans * 1e6:.1f}", f"{cpu / total:.0%}" if total > 0 else "-"]
        for name, cpu in sorted(used.items(), key=lambda item: -item[1])[:top]
        if cpu > 0
    ]
    rows.append(["(process)", f"{total:.2f}", f"{total / spans * 1e6:.1f}", "100%"])
    return "CPU by thread over the measured spans:\n" + table(
        ["thread", "CPU s", "us/span", "share"], rows
    )
