"""Webhook signatures: HMAC-SHA256 as the Standard Webhooks specification writes them.

A signed request carries three headers::

    webhook-id: <the command's id>
    webhook-timestamp: <unix seconds>
    webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">

The Standard Webhooks scheme (standardwebhooks.com) rather than one of our
own, so an agent can verify with any of its libraries as well as with
:func:`verify`. A secret written ``whsec_<base64>`` is used decoded, as those
libraries do; any other secret is used as its UTF-8 bytes. The timestamp is
signed and checked against a tolerance, so a captured request cannot be
replayed later; the ``Idempotency-Key`` header (not signed: the id is) lets
the agent drop a command it has already acted on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping

__all__ = [
    "ID_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "SignatureError",
    "sign",
    "signature_headers",
    "verify",
]

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
#: How far a signed timestamp may be from the receiver's clock.
DEFAULT_TOLERANCE_S = 300.0


class SignatureError(ValueError):
    """A webhook whose signature is missing, malformed, wrong or too old."""


def _key(secret: str) -> bytes:
    if not secret:
        raise ValueError("a webhook secret must not be empty")
    if secret.startswith("whsec_"):
        try:
            return base64.b64decode(secret[len("whsec_") :], validate=True)
        except binascii.Error as exc:
            raise ValueError("a whsec_ secret must be base64 after the prefix") from exc
    return secret.encode("utf-8")


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one request."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signature_headers(
    secret: str, message_id: str, body: bytes, *, now: float | None = None
) -> dict[str, str]:
    """The three signature headers for ``body``, timestamped ``now`` (default: the clock)."""
    timestamp = int(time.time() if now is None else now)
    return {
        ID_HEADER: message_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, message_id, timestamp, body),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> str:
    """Check a signed request; return its message id, or raise :class:`SignatureError`.

    ``headers`` is looked up case-insensitively. Several space-separated
    signatures are accepted (a sender rotating its secret sends both).
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    message_id = lowered.get(ID_HEADER, "")
    raw_timestamp = lowered.get(TIMESTAMP_HEADER, "")
    given = lowered.get(SIGNATURE_HEADER, "")
    if not message_id or not raw_timestamp or not given:
        raise SignatureError(
            f"missing {ID_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header"
        )
    try:
        timestamp = int(raw_timestamp)
    except ValueError:
        raise SignatureError(f"{TIMESTAMP_HEADER} is not an integer") from None
    clock = time.time() if now is None else now
    if abs(clock - timestamp) > tolerance_s:
        raise SignatureError(f"{TIMESTAMP_HEADER} is more than {tolerance_s:g}s from now")
    expected = sign(secret, message_id, timestamp, body)
    for candidate in given.split():
        if hmac.compare_digest(candidate.encode(), expected.encode()):
            return message_id
    raise SignatureError("no signature matches the body and the secret")
