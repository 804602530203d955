"""The one exception tree of spanvisor.

    SupervisorError
    ├── ConfigError        settings that cannot be used
    ├── PolicyError        a policy file that cannot be loaded (carries every issue)
    ├── IngestError        an OTLP payload that cannot be decoded
    │   └── PayloadTooLarge
    ├── DeliveryError      a downstream that could not be reached
    └── StoreUnavailable   the fleet's shared store (PostgreSQL) does not answer

Foreign errors (protobuf, gRPC, httpx, YAML) are translated once, at the
adapter that meets them, with ``raise Mapped(...) from exc``.
"""

from __future__ import annotations

from dataclasses import dataclass


class SupervisorError(Exception):
    """Base of every error spanvisor raises on purpose."""


class ConfigError(SupervisorError):
    """Settings that cannot be used."""


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    """One problem in a policy file: where it is and what is wrong."""

    source: str
    #: Dotted field path, e.g. ``rules[2].match.message``; "" for the file itself.
    path: str
    #: 1-based line in the file, when known.
    line: int | None
    message: str

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        at = f" at {self.path}" if self.path else ""
        return f"{where}{at}: {self.message}"


class PolicyError(SupervisorError):
    """A policy file that cannot be loaded; ``issues`` lists every problem."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = tuple(issues)
        super().__init__("\n".join(str(i) for i in issues) or "invalid policy")


class IngestError(SupervisorError):
    """An OTLP payload that cannot be decoded; the message says why."""


class PayloadTooLarge(IngestError):
    """A payload over the configured size limit (after decompression)."""


class DeliveryError(SupervisorError):
    """A downstream that could not be reached or refused what was sent."""


class StoreUnavailable(SupervisorError):
    """The fleet's shared store cannot be reached (down, cut off, or it dropped us).

    Raised instead of the driver's connection errors, so that callers tell an
    outage (try again later) from a mistake; ``where`` names the store, its
    password left out.
    """

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where
