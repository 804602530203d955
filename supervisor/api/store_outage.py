"""The shared store as the control API last found it: reachable, or down since when.

While a fleet's PostgreSQL does not answer, every request that needs it is
answered 503 with the store named and a ``Retry-After``
(:mod:`supervisor.api.server`), readiness says the store is down, and the log
says so once when the outage is first met and once when a request reaches
the store again, not once a request: an operator's dashboard polling every
second would otherwise fill the log.

Lifecycle: one per control API; called on the event loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.errors import StoreUnavailable

log = logging.getLogger("spanvisor.api")

#: What a refused request is told to wait: a few of the store's reconnect attempts.
RETRY_AFTER_S = 5


@dataclass
class StoreOutage:
    """See the module."""

    clock: Callable[[], float] = time.time
    #: When the current outage was first met (None: the store answered last).
    since: float | None = None
    where: str = ""
    error: str = ""
    #: Requests refused in the current outage.
    refused: int = 0
    #: Outages met since start.
    outages: int = field(default=0)

    def failed(self, exc: StoreUnavailable) -> None:
        """A request found the store unreachable."""
        self.refused += 1
        self.error = str(exc)
        if self.since is not None:
            return
        self.since, self.where = self.clock(), exc.where
        self.outages += 1
        log.warning("%s; the control API answers 503 to what needs it until it answers again", exc)

    def reached(self) -> None:
        """A request reached the store: an outage, if any, is over."""
        if self.since is None:
            return
        log.warning(
            "the shared store (%s) answers the control API again after %.1fs (%d requests"
            " refused meanwhile)",
            self.where,
            max(0.0, self.clock() - self.since),
            self.refused,
        )
        self.since, self.refused = None, 0

    def degraded(self) -> str | None:
        """Why readiness fails, or None while the store answers."""
        if self.since is None:
            return None
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return f"store down since {at}: {self.error}"
