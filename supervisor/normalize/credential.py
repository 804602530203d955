"""The credential a call used, as the agent names it: ``spanvisor.credential``.

Providers limit and revoke per API key, so a breaker is kept per provider,
model and credential when the span names one (:func:`supervisor.records.breaker_key`).
The value is the credential's *name* (``team-a``) or a hash, checked as
admission checks it (:func:`supervisor.admission.key.check_credential`, the
one place): a value that looks like a secret (``sk-…``) or is not a name is
ignored, neither stored nor logged, and counted (:func:`refused`).
"""

from __future__ import annotations

import threading
from typing import Final

from supervisor.admission.key import CredentialRefused, check_credential
from supervisor.records import AttrValue

__all__ = ["CREDENTIAL_KEY", "credential_of", "refused"]

#: The span attribute an agent sets to the name of the credential a call used.
CREDENTIAL_KEY: Final = "spanvisor.credential"

_lock = threading.Lock()
_refused = 0


def credential_of(value: AttrValue | None) -> str:
    """The credential's name in ``value``, or ``""`` (absent, or refused and counted)."""
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        try:
            return check_credential(value)
        except CredentialRefused:
            pass
    global _refused  # noqa: PLW0603 - a process-wide counter, like normalize's failures
    with _lock:
        _refused += 1
    return ""


def refused() -> int:
    """Credential attributes ignored since start (a secret, or not a name)."""
    return _refused
