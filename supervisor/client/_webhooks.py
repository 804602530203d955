"""Webhook commands, agent side: check a command's signature, and drop one seen before."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from supervisor.act.signing import DEFAULT_TOLERANCE_S, verify


def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> dict[str, Any]:
    """The command a signed webhook carries (see ``Command.to_json``), once its signature holds.

    Raises :class:`SignatureError` for a missing, wrong or stale signature and
    ``ValueError`` for a body that is not a JSON object. Pair it with
    :class:`SeenCommands` on ``idempotency_key`` to drop redeliveries.
    """
    verify(secret, headers, body, tolerance_s=tolerance_s)
    try:
        command = json.loads(body)
    except ValueError as exc:  # also UnicodeDecodeError
        raise ValueError(f"the webhook body is not JSON: {exc}") from exc
    if not isinstance(command, dict):
        raise ValueError("the webhook body is not a JSON object")
    return command


class SeenCommands:
    """The idempotency keys of the last ``capacity`` commands, to drop a redelivered one.

    Thread-safe; bounded (least recently seen keys are forgotten first).
    """

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, key: str) -> bool:
        """True the first time ``key`` is seen (remember it), False for a repeat."""
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return False
            self._keys[key] = None
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
