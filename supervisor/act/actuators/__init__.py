"""Actuators: how a command reaches an agent (webhook, pull, a local command).

An actuator makes **one** delivery attempt. Retrying, backoff, delays
(``not_before``), persistence and dead-lettering belong to the dispatcher,
which records every attempt in the store, so that a sidecar killed mid-way
delivers, after a restart, what had not been delivered and nothing else.

Lifecycle of an actuator: built from the settings; :meth:`Actuator.start`
once before the first delivery; :meth:`Actuator.deliver` any number of times,
possibly concurrently; :meth:`Actuator.close` once at shutdown. ``deliver``
never raises: every outcome, the agent's refusal and our own bugs included,
is a :class:`DeliveryResult`.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Protocol

from supervisor.records import Command

#: Attempts the dispatcher makes at once through one actuator; the webhook
#: actuator keeps as many connections, so no attempt waits for one inside its
#: own timeout.
MAX_CONCURRENT_ATTEMPTS = 8


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """The outcome of one delivery attempt."""

    delivered: bool
    #: When not delivered: whether a later attempt may succeed (a 503, a
    #: timeout) or not (a 400, a missing executable): the latter is
    #: dead-lettered at once.
    retryable: bool
    #: One line for logs and the dead-letter list (status, error, output tail).
    detail: str
    #: HTTP status or exit code, when there was one.
    status: int | None = None
    #: A delay the receiver asked for (``Retry-After``), in seconds.
    retry_after_s: float | None = None


class Actuator(Protocol):
    """Delivers one command to one agent service; see the module's lifecycle."""

    #: ``webhook`` | ``command`` | ``pull``: names the channel in logs and the API.
    kind: str

    async def start(self) -> None: ...

    async def deliver(self, command: Command) -> DeliveryResult: ...

    async def close(self) -> None: ...


def one_line(text: str, limit: int, *, tail: bool = False) -> str:
    """At most ``limit`` characters on one line, control characters removed.

    What an agent answers or prints may be hostile and ends up in logs and on
    terminals; ``tail`` keeps the end (where errors are) instead of the start.
    """
    kept = []
    for char in text:
        category = unicodedata.category(char)
        if char in "\t\n\r\v\f" or category in {"Zl", "Zp"}:
            kept.append(" ")
        elif not category.startswith("C"):
            kept.append(char)
    line = " ".join("".join(kept).split())
    if len(line) <= limit:
        return line
    return "…" + line[-limit + 1 :] if tail else line[: limit - 1] + "…"
