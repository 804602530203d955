"""The command actuator: run a configured program once per command, without a shell.

The argv comes from the settings; what comes from spans (a run id, a service
name) reaches the program only as whole arguments and environment variables,
never spliced into a string and never seen by a shell, so a run id such as
``"; rm -rf / #"`` is just an odd run id. Programs that parse options should
put ``--`` before placeholders, since a value may start with ``-``.

The child runs in its own session, with a minimal environment, stdin from
``/dev/null`` and a time limit; on timeout its whole process group is
terminated, then killed. Its output is captured as it arrives and only the
last ``max_output_bytes`` of each stream are kept. POSIX only (sessions,
process groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

import orjson

from supervisor.act.actuators import DeliveryResult, one_line
from supervisor.records import Command

__all__ = ["PLACEHOLDERS", "CommandActuator"]

log = logging.getLogger("spanvisor.actuators")

#: ``{name}`` argv elements and the command field each is replaced by.
PLACEHOLDERS: Final = ("id", "idempotency_key", "type", "service", "run_id", "trace_id", "span_id")
MAX_TIMEOUT_S: Final = 600.0
MAX_OUTPUT_LIMIT: Final = 16 * 1024 * 1024
#: Parent variables passed on; anything else (tokens, keys) stays with the sidecar.
INHERITED_ENV: Final = ("PATH", "HOME", "LANG")
#: How long a child may take to exit on SIGTERM before its group is killed.
TERM_GRACE_S: Final = 0.5
# After the child exits, how long its output may take to drain; longer means
# something it left behind holds the pipes, and they are closed on it.
_DRAIN_S: Final = 0.2
_SNIPPET_CHARS: Final = 200
_NO_ENV: Mapping[str, str] = MappingProxyType({})
# Anything that looks like a placeholder: only whole, known ones are allowed.
_PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# exec failures that will fail again on the next attempt.
_PERMANENT_ERRNOS: Final = frozenset(
    {
        errno.ENOENT,
        errno.EACCES,
        errno.EPERM,
        errno.ENOEXEC,
        errno.E2BIG,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ELOOP,
        errno.ENAMETOOLONG,
    }
)


class CommandActuator:
    """Runs ``argv`` once per command; see the module docstring."""

    kind = "command"

    def __init__(
        self,
        *,
        argv: Sequence[str],
        timeout_s: float = 10.0,
        env: Mapping[str, str] = _NO_ENV,
        cwd: str | None = None,
        max_output_bytes: int = 64 * 1024,
    ) -> None:
        self.argv = _check_argv(argv)
        self.timeout_s = _check_timeout(timeout_s)
        self._env = _check_env(env)
        if cwd is not None and (not isinstance(cwd, str) or not cwd or "\0" in cwd):
            raise ValueError(f"command cwd must be a non-empty path, not {cwd!r}")
        self.cwd = cwd
        if (
            isinstance(max_output_bytes, bool)
            or not isinstance(max_output_bytes, int)
            or not 0 < max_output_bytes <= MAX_OUTPUT_LIMIT
        ):
            raise ValueError(
                f"command max_output_bytes must be an integer in 1..{MAX_OUTPUT_LIMIT}, "
                f"not {max_output_bytes!r}"
            )
        self.max_output_bytes = max_output_bytes
        self._running: set[asyncio.SubprocessTransport] = set()
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Nothing to open; deliveries are refused before it and after :meth:`close`."""
        self._started = True

    async def close(self) -> None:
        """Stop accepting deliveries and end the children still running (whole groups)."""
        self._closed = True
        running = list(self._running)
        await asyncio.gather(*(_terminate(t) for t in running), return_exceptions=True)

    async def deliver(self, command: Command) -> DeliveryResult:
        """Run the program once; never raises (cancellation apart, which kills the child)."""
        try:
            return await self._deliver(command)
        except Exception as exc:
            log.exception(
                "command delivery failed unexpectedly",
                extra={"command_id": command.id, "argv0": self.argv[0]},
            )
            return DeliveryResult(False, False, _clean(f"{type(exc).__name__}: {exc}"))

    async def _deliver(self, command: Command) -> DeliveryResult:
        if self._closed or not self._started:
            state = "closed" if self._closed else "not started"
            return DeliveryResult(False, True, f"RuntimeError: command actuator {state}")
        argv = self._argv_for(command)
        try:
            env = self._env_for(command)
        except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
            return DeliveryResult(
                False, False, _clean(f"{type(exc).__name__}: command is not JSON: {exc}")
            )
        loop = asyncio.get_running_loop()
        limit = self.max_output_bytes
        try:
            transport, capture = await loop.subprocess_exec(
                lambda: _Capture(loop, limit),
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=self.cwd,
                # Its own group, so a timeout ends what it started too.
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:  # ValueError: a NUL or unencodable value
            return _spawn_failure(exc, argv[0])
        self._running.add(transport)
        try:
            if self._closed:  # close() ran while the child was being spawned
                await _terminate(transport)
            return await self._wait(transport, capture)
        finally:
            self._running.discard(transport)
            if transport.get_returncode() is None:  # cancelled, or close() lost the race
                _signal_group(transport.get_pid(), signal.SIGKILL)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(capture.exited), TERM_GRACE_S)
            transport.close()

    async def _wait(
        self, transport: asyncio.SubprocessTransport, capture: _Capture
    ) -> DeliveryResult:
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(capture.exited), self.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await _terminate(transport)
        # Output still in the pipes arrives after the exit; a process left
        # behind that holds them is not waited for.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(capture.finished), _DRAIN_S)
        code = transport.get_returncode()
        stderr = _tail_text(capture.stderr)
        if timed_out:
            detail = f"timeout after {self.timeout_s:g}s"
            # No status: the exit code would be our own signal.
            return DeliveryResult(False, True, f"{detail}: {stderr}" if stderr else detail)
        if code == 0:
            stdout = _tail_text(capture.stdout)
            return DeliveryResult(True, False, f"exit 0: {stdout}" if stdout else "exit 0", 0)
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit {code}"
        return DeliveryResult(False, True, f"{how}: {stderr}" if stderr else how, code)

    def _argv_for(self, command: Command) -> list[str]:
        values = {
            "id": command.id,
            "idempotency_key": command.idempotency_key,
            "type": command.type.value,
            "service": command.service,
            "run_id": command.run_id,
            "trace_id": command.trigger_trace_id,
            "span_id": command.trigger_span_id,
        }
        # Whole elements only (checked at construction): a value is one argument, as is.
        return [values[arg[1:-1]] if _PLACEHOLDER.fullmatch(arg) else arg for arg in self.argv]

    def _env_for(self, command: Command) -> dict[str, str]:
        env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
        env.update(self._env)
        env.update(
            SPANVISOR_COMMAND=orjson.dumps(command.to_json(), option=orjson.OPT_SORT_KEYS).decode(),
            SPANVISOR_COMMAND_ID=command.id,
            SPANVISOR_COMMAND_TYPE=command.type.value,
            SPANVISOR_RUN_ID=command.run_id,
            SPANVISOR_SERVICE=command.service,
            SPANVISOR_IDEMPOTENCY_KEY=command.idempotency_key,
        )
        return env


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the tail of each output stream and tells when the child exits.

    A protocol rather than ``create_subprocess_exec``'s streams: output is
    dropped as it arrives beyond the limit instead of queued, and the exit is
    known even while something the child left behind holds its pipes open
    (``Process.wait`` waits for the pipes too).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.limit = limit
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.exited: asyncio.Future[None] = loop.create_future()
        #: The child exited and both pipes are closed.
        self.finished: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buffer = self.stdout if fd == 1 else self.stderr
        buffer += data[-self.limit :]
        if len(buffer) > self.limit:
            del buffer[: len(buffer) - self.limit]

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.exited, self.finished):
            if not future.done():
                future.set_result(None)


async def _terminate(transport: asyncio.SubprocessTransport) -> None:
    """SIGTERM the child's group, SIGKILL it after a grace, and wait for the child to be reaped."""
    protocol = transport.get_protocol()
    assert isinstance(protocol, _Capture)
    pid = transport.get_pid()
    # Signalled while the leader is not reaped, its pid (the group id) cannot
    # have been reused for another group.
    _signal_group(pid, signal.SIGTERM)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(protocol.exited), TERM_GRACE_S)
    # Members that ignored SIGTERM, or the leader itself.
    _signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(protocol.exited), TERM_GRACE_S)


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _spawn_failure(exc: Exception, program: str) -> DeliveryResult:
    name = type(exc).__name__
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else program
        detail = _clean(f"{name}: {exc.strerror or exc}: {where!r}")
        return DeliveryResult(False, exc.errno not in _PERMANENT_ERRNOS, detail)
    # A value from the command (a NUL byte, a lone surrogate) that no exec can carry.
    return DeliveryResult(
        False, False, _clean(f"{name}: cannot pass the command to the program: {exc}")
    )


def _tail_text(data: bytearray) -> str:
    # Cleaned before cutting, so the tail holds text rather than control bytes.
    return _clean(bytes(data[-_SNIPPET_CHARS * 4 :]).decode("utf-8", "replace"), tail=True)


def _clean(text: str, *, tail: bool = False) -> str:
    return one_line(text, _SNIPPET_CHARS, tail=tail)


def _check_argv(argv: Sequence[str]) -> tuple[str, ...]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence):
        raise ValueError(
            "command argv must be a list of strings (it is never split or run by a shell)"
        )
    if not argv:
        raise ValueError("command argv must not be empty")
    for arg in argv:
        if not isinstance(arg, str) or "\0" in arg:
            raise ValueError(f"command argv elements must be strings without NUL, not {arg!r}")
    if not argv[0] or _PLACEHOLDER.search(argv[0]):
        raise ValueError(
            f"command argv[0] must name the program, not {argv[0]!r}: span values never choose it"
        )
    for arg in argv[1:]:
        whole = _PLACEHOLDER.fullmatch(arg)
        if whole and whole.group(1) in PLACEHOLDERS:
            continue
        found = _PLACEHOLDER.search(arg)
        if found:
            raise ValueError(
                f"command argv element {arg!r}: placeholders must be whole arguments, one of "
                + ", ".join("{" + name + "}" for name in PLACEHOLDERS)
                + f" (not {found.group(0)!r} inside a longer argument or an unknown name); "
                "span values are never spliced into a string"
            )
    return tuple(argv)


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"command timeout_s must be a number, not {timeout_s!r}")
    if not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"command timeout_s must be > 0 and <= {MAX_TIMEOUT_S:g}, not {timeout_s}")
    return float(timeout_s)


def _check_env(env: Mapping[str, str]) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ValueError(f"command env name {name!r} must be non-empty, without '=' or NUL")
        if name.startswith("SPANVISOR_"):
            raise ValueError(f"command env {name!r}: SPANVISOR_* variables are set by spanvisor")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"command env {name!r} must be a string without NUL")
        checked[name] = value
    return checked
