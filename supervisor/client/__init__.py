"""The agent side of spanvisor: ask the sidecar, inline, what to do about a failure.

An agent that catches an exception asks :meth:`SupervisorClient.decide` and
gets an :class:`Advice` (retry after N seconds, fall back to another
dependency, fail fast, escalate...). :func:`guard` wraps a call in that loop.
Webhook commands are checked with :func:`verify_webhook` and deduplicated
with :class:`SeenCommands`.

The client must never be what breaks the agent: when the sidecar is down,
slow or answers nonsense, it answers from a conservative :class:`LocalPolicy`
(``source="local"``) and logs one warning per unreachable period. Only a
refused token (401/403) raises, because that is a configuration error that
no amount of waiting fixes.

This package imports nothing heavy (httpx, tenacity and the standard
library), so an agent pays little for importing it. Its modules:
``_advice`` (the ``/v1/decide`` exchange), ``_http`` (:class:`SupervisorClient`),
``_local`` (:class:`LocalPolicy`), ``_evidence`` (what a caught exception
says), ``_guard`` (:func:`guard` on tenacity), ``_webhooks``.
"""

from supervisor.act.signing import SignatureError
from supervisor.api_access import TOKEN_ENV as TOKEN_ENV
from supervisor.client._advice import Advice
from supervisor.client._evidence import exception_type_name
from supervisor.client._guard import BreakerOpen, FallbackAdvised, Guard, GuardedAttempt, guard
from supervisor.client._http import DEFAULT_BASE_URL as DEFAULT_BASE_URL
from supervisor.client._http import SupervisorClient, SupervisorClientError
from supervisor.client._local import LocalPolicy
from supervisor.client._webhooks import SeenCommands, verify_webhook

__all__ = [
    "Advice",
    "BreakerOpen",
    "FallbackAdvised",
    "Guard",
    "GuardedAttempt",
    "LocalPolicy",
    "SeenCommands",
    "SignatureError",
    "SupervisorClient",
    "SupervisorClientError",
    "exception_type_name",
    "guard",
    "verify_webhook",
]
