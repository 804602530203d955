"""The pull channel, agent side: lease the sidecar's commands for a service, act, ack.

An agent that cannot take webhooks (no inbound port, a notebook, a batch job)
asks ``GET /v1/commands?service=NAME&wait=S`` in a loop. Each command handed
out is leased: unless it is acknowledged (``POST /v1/commands/{id}/ack``) within
the service's visibility timeout, the sidecar hands it out again. So an agent
that crashes between lease and ack gets the command again after restarting,
and :class:`~supervisor.client.SeenCommands` (or the command's
``idempotency_key``) is how it drops one it already acted on.

    with CommandPuller("my-agent") as puller:
        for command in puller.poll(wait_s=20):
            act_on(command)          # the agent's own mapping of command types
            puller.ack(command)

The sidecar being down or slow is not an error for the agent: :meth:`poll`
returns no commands (logging once per unreachable period) and the caller
polls again. Only a refused token raises, as in the rest of the client.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

import httpx

from supervisor.act.commands import PAUSE_OUTCOMES, PauseTimeout
from supervisor.client._auth import SidecarAuth
from supervisor.client._http import client_access, refused

__all__ = ["Command", "CommandPuller", "MalformedCommand", "PauseTimeout"]

log = logging.getLogger("spanvisor.client")

#: Longest long poll the sidecar accepts (its API bounds ``wait`` to 30 s).
MAX_WAIT_S = 30.0

#: Acks that could not reach the sidecar, kept to send again before the next lease.
MAX_UNSENT_ACKS = 1024

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class MalformedCommand(ValueError):
    """A command whose JSON lacks what the command schema promises (``Command.to_json``)."""


def _text(payload: Mapping[str, Any], key: str, *, required: bool = True) -> str:
    value = payload.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise MalformedCommand(f"command field {key!r} must be a non-empty string")
    return value


def _mapping(payload: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = payload.get(key)
    if value is None:
        return _EMPTY
    if not isinstance(value, Mapping):
        raise MalformedCommand(f"command field {key!r} must be an object")
    return MappingProxyType(dict(value))


def _moment(text: str) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise MalformedCommand(f"not an RFC 3339 time: {text!r}") from None


@dataclass(frozen=True, slots=True)
class Command:
    """One command from the sidecar, as ``supervisor.records.Command.to_json`` writes it.

    ``failure`` and ``params`` stay as the read-only JSON objects they came as:
    what a command type carries (``params.to`` of a ``switch_fallback``,
    ``params.unverified`` of a ``resume_run``...) is the agent's to read.
    """

    id: str
    idempotency_key: str
    type: str
    service: str
    run_id: str
    trigger_trace_id: str
    trigger_span_id: str
    failure: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    params: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    #: Unix seconds before which the command must not be acted on (the sidecar
    #: already waits for it before handing it out; a clock skew may remain).
    not_before: float | None = None
    created_at: float | None = None

    @property
    def pause(self) -> PauseTimeout | None:
        """A ``pause_run``'s deadline and outcome (``params.timeout_s``, ``params.on_timeout``).

        ``None`` for another type, or a pause that states none (a sidecar
        older than this contract): such a pause waits for the next command.
        An agent that hears nothing more within ``timeout_s`` of applying the
        pause does what ``on_timeout`` says (``resume`` or ``abort``) itself;
        the sidecar sends the same as a command at its deadline.
        """
        if self.type != "pause_run":
            return None
        seconds = self.params.get("timeout_s")
        outcome = self.params.get("on_timeout")
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds < 0
            or outcome not in PAUSE_OUTCOMES
        ):
            return None
        return PauseTimeout(float(seconds), outcome)

    @classmethod
    def from_json(cls, payload: object) -> Command:
        """Parse one command object; raises :class:`MalformedCommand` with the field."""
        if not isinstance(payload, Mapping):
            raise MalformedCommand("a command must be a JSON object")
        trigger = _mapping(payload, "trigger")
        return cls(
            id=_text(payload, "id"),
            idempotency_key=_text(payload, "idempotency_key"),
            type=_text(payload, "type"),
            service=_text(payload, "service"),
            run_id=_text(payload, "run_id", required=False),
            trigger_trace_id=str(trigger.get("trace_id") or ""),
            trigger_span_id=str(trigger.get("span_id") or ""),
            failure=_mapping(payload, "failure"),
            params=_mapping(payload, "params"),
            not_before=_moment(_text(payload, "not_before", required=False)),
            created_at=_moment(_text(payload, "created_at", required=False)),
        )


class CommandPuller:
    """Leases one service's commands from the control API and acknowledges them.

    ``base_url`` and ``token``, when not given, are found as the CLI and
    :class:`~supervisor.client.SupervisorClient` find them
    (:mod:`supervisor.api_access`); :attr:`access` says where from.

    Lifecycle: construct, call :meth:`poll` and :meth:`ack` from one thread or
    several (the connection pool is thread-safe), :meth:`close` when done (or
    use it as a context manager). Commands that fail to parse are logged,
    counted in :attr:`malformed` and acknowledged, so a command the agent can
    never read does not come back forever.

    An ack that cannot reach the sidecar (it is down or restarting) is kept,
    up to :data:`MAX_UNSENT_ACKS`, and sent again before the next lease: the
    command is not handed out again only because its ack was lost on the way.
    Acks dropped past that bound are counted in :attr:`acks_dropped`.
    """

    def __init__(
        self,
        service: str,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 5.0,
        limit: int = 10,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not service:
            raise ValueError("service is required: the name the agent's spans carry")
        if not 1 <= limit <= 100:
            raise ValueError("limit must be between 1 and 100")
        self.service = service
        #: The address and token, and where each came from (:mod:`supervisor.api_access`).
        self.access = client_access(base_url, token)
        self.base_url = self.access.url
        self.limit = limit
        self.timeout_s = timeout_s
        self.malformed = 0
        self.acks_dropped = 0
        self._down = False
        self._unsent_acks: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Accept": "application/json", "User-Agent": "spanvisor-client"},
            auth=SidecarAuth(self.access),
            trust_env=False,
            follow_redirects=False,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CommandPuller:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def poll(self, wait_s: float = 20.0) -> list[Command]:
        """Lease the service's due commands, waiting up to ``wait_s`` for the first.

        Returns ``[]`` when none came, or when the sidecar cannot be reached (the
        caller just polls again). Raises :class:`SupervisorClientError` only when
        the sidecar refuses the token.
        """
        # NaN passes min/max unchanged and would reach the socket as its timeout.
        wait_s = 0.0 if math.isnan(wait_s) else min(max(wait_s, 0.0), MAX_WAIT_S)
        if not self._send_unsent_acks():
            return []  # the sidecar is still unreachable: the lease would fail as well
        try:
            response = self._http.get(
                "/v1/commands",
                params={"service": self.service, "wait": f"{wait_s:g}", "limit": self.limit},
                timeout=httpx.Timeout(self.timeout_s, read=wait_s + self.timeout_s),
            )
        except httpx.HTTPError as exc:
            self._unreachable(f"{type(exc).__name__}: {exc}")
            return []
        if response.status_code in (401, 403):
            raise refused(self.access, response)
        if response.status_code != 200:
            self._unreachable(f"HTTP {response.status_code}: {response.text[:200]}")
            return []
        self._reachable()
        try:
            items = response.json().get("commands", [])
        except (ValueError, AttributeError):
            self._unreachable("the answer was not a JSON object")
            return []
        commands: list[Command] = []
        for item in items if isinstance(items, list) else []:
            try:
                commands.append(Command.from_json(item))
            except MalformedCommand as exc:
                self._drop(item, exc)
        return commands

    def ack(self, command: Command | str) -> bool:
        """Acknowledge a command, so the sidecar does not hand it out again.

        The sidecar takes an ack while the command is leased or pending, even
        after its lease ran out (it may have been handed out again meanwhile;
        once acknowledged, it is not handed out after). Returns False when the
        sidecar no longer waits for this ack (acknowledged already, by this or
        another poller, or dead-lettered), does not know the command for this
        service, or cannot be reached. An ack that could not reach the sidecar
        is sent again before the next :meth:`poll` leases anything; if this
        process ends first, the command comes again after its lease, and the
        agent's idempotency check is what drops it.
        """
        command_id = command if isinstance(command, str) else command.id
        sent = self._post_ack(command_id)
        if sent is None:
            self._keep_unsent(command_id)
            return False
        return sent

    def _post_ack(self, command_id: str) -> bool | None:
        """True if the sidecar took the ack, False if it refused it, None if unreachable."""
        try:
            response = self._http.post(
                f"/v1/commands/{quote(command_id, safe='')}/ack",
                json={"service": self.service},
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            self._unreachable(f"{type(exc).__name__}: {exc}")
            return None
        if response.status_code in (401, 403):
            raise refused(self.access, response)
        if response.status_code != 200:
            log.info("ack of %s not taken: HTTP %s", command_id, response.status_code)
            return False
        return True

    def _keep_unsent(self, command_id: str) -> None:
        with self._lock:
            self._unsent_acks[command_id] = None
            while len(self._unsent_acks) > MAX_UNSENT_ACKS:
                self._unsent_acks.popitem(last=False)
                self.acks_dropped += 1

    def _send_unsent_acks(self) -> bool:
        """Send the acks kept while the sidecar was unreachable; False if it still is."""
        while True:
            with self._lock:
                if not self._unsent_acks:
                    return True
                command_id = next(iter(self._unsent_acks))
            if self._post_ack(command_id) is None:
                return False
            with self._lock:
                self._unsent_acks.pop(command_id, None)

    def _drop(self, item: object, why: MalformedCommand) -> None:
        with self._lock:
            self.malformed += 1
        command_id = item.get("id") if isinstance(item, Mapping) else None
        log.warning("dropping a malformed command from spanvisor (%s): %s", command_id, why)
        if isinstance(command_id, str) and command_id:
            self.ack(command_id)

    def _unreachable(self, why: str) -> None:
        with self._lock:
            first, self._down = not self._down, True
        if first:
            log.warning(
                "cannot pull commands from spanvisor at %s (%s): %s",
                self.base_url,
                self.access.url_from,
                why,
            )

    def _reachable(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            log.info("pulling commands from spanvisor at %s again", self.base_url)
