"""Webhook signatures against the Standard Webhooks reference library, both ways.

spanvisor's own tests sign and verify with the same :func:`signing.sign`, so a
change to the signed string (``<id>.<timestamp>.<body>``), to the key or to
the ``v1,<base64>`` format would pass them all and break every agent that
verifies with a Standard Webhooks library. Here the other side is
``standardwebhooks`` (the specification's Python library) and the test vector
the specification's libraries publish (the same in Python and JavaScript):

* what the webhook actuator sends over a real socket is accepted by an agent
  that checks it with ``standardwebhooks.Webhook(secret).verify``;
* what that library signs is accepted by ``supervisor.client.verify_webhook``;
* a changed body, a changed timestamp or another secret is refused by both.
"""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import datetime, timezone

import pytest
import standardwebhooks
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.act import signing
from supervisor.act.actuators.webhook import WebhookActuator
from supervisor.client import SignatureError, verify_webhook
from tests.test_actuator_webhook import Receiver, make_command

# The published vector (libraries/python/tests and libraries/javascript/src of
# github.com/standard-webhooks/standard-webhooks, "sign function works").
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
# The same vector's "invalid signature": one base64 character off.
VECTOR_WRONG_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="

WHSEC = "whsec_" + base64.b64encode(b"a-32-byte-key-for-the-webhooks!!").decode()
# A secret that is not whsec_: spanvisor signs with its UTF-8 bytes, which the
# library takes as bytes (a str it would base64-decode).
PLAIN = "plain-secret-of-more-than-16-chars"


def _vector_headers(signature: str = VECTOR_SIGNATURE) -> dict[str, str]:
    return {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TIMESTAMP),
        "webhook-signature": signature,
    }


# -- the published vector ---------------------------------------------------------------


def test_sign_gives_the_published_signature() -> None:
    assert signing.sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY) == (
        VECTOR_SIGNATURE
    )
    # The prefix is optional in the libraries; the base64 after it is the key.
    reference = standardwebhooks.Webhook(VECTOR_SECRET.removeprefix("whsec_"))
    stamped = datetime.fromtimestamp(VECTOR_TIMESTAMP, tz=timezone.utc)
    assert reference.sign(VECTOR_ID, stamped, VECTOR_BODY) == VECTOR_SIGNATURE


def test_verify_accepts_the_published_signature_and_refuses_its_near_miss() -> None:
    headers = _vector_headers()
    assert signing.verify(VECTOR_SECRET, headers, VECTOR_BODY, now=VECTOR_TIMESTAMP) == VECTOR_ID
    # Several signatures (a sender rotating its secret), other versions among them.
    rotated = _vector_headers(
        "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= "
        f"v2,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= {VECTOR_SIGNATURE}"
    )
    assert signing.verify(VECTOR_SECRET, rotated, VECTOR_BODY, now=VECTOR_TIMESTAMP) == VECTOR_ID
    with pytest.raises(SignatureError, match="no signature matches"):
        signing.verify(
            VECTOR_SECRET,
            _vector_headers(VECTOR_WRONG_SIGNATURE),
            VECTOR_BODY,
            now=VECTOR_TIMESTAMP,
        )


# -- spanvisor sends, the reference library verifies ------------------------------------


def _deliver_to_a_reference_agent(secret: str, key: str | bytes) -> tuple[bool, list[object]]:
    """One command from the webhook actuator to an agent on 127.0.0.1 that checks it
    with ``standardwebhooks.Webhook(key)``: 204 if the library accepts it, else 401."""
    verified: list[object] = []

    async def respond(writer: asyncio.StreamWriter, receiver: Receiver) -> None:
        request = receiver.requests[-1]
        try:
            verified.append(standardwebhooks.Webhook(key).verify(request.body, request.headers))
            status = "204 No Content"
        except standardwebhooks.WebhookVerificationError:
            status = "401 Unauthorized"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()

    async def main() -> bool:
        async with Receiver(respond) as receiver:
            actuator = WebhookActuator(url=receiver.url, secret=secret)
            await actuator.start()
            try:
                result = await actuator.deliver(make_command())
            finally:
                await actuator.close()
        return result.delivered

    return asyncio.run(main()), verified


def test_a_whsec_secret_verifies_with_the_library_as_written() -> None:
    delivered, verified = _deliver_to_a_reference_agent(WHSEC, WHSEC)
    assert delivered
    assert verified == [json.loads(json.dumps(make_command().to_json()))]


def test_a_plain_secret_verifies_with_the_library_given_its_bytes() -> None:
    delivered, verified = _deliver_to_a_reference_agent(PLAIN, PLAIN.encode())
    assert delivered
    assert verified == [json.loads(json.dumps(make_command().to_json()))]


def test_the_library_refuses_what_another_secret_signed() -> None:
    other = "whsec_" + base64.b64encode(b"another-32-byte-key-for-webhooks").decode()
    delivered, verified = _deliver_to_a_reference_agent(WHSEC, other)
    assert not delivered
    assert verified == []


# -- the reference library signs, spanvisor verifies ------------------------------------


def _reference_signed(secret: str | bytes, body: bytes) -> dict[str, str]:
    now = datetime.now(tz=timezone.utc)
    signature = standardwebhooks.Webhook(secret).sign("cmd-1", now, body)
    return {
        "webhook-id": "cmd-1",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }


def test_verify_webhook_accepts_what_the_library_signs() -> None:
    body = json.dumps(make_command().to_json()).encode()
    for secret, key in ((WHSEC, WHSEC), (PLAIN, PLAIN.encode())):
        headers = _reference_signed(key, body)
        assert verify_webhook(secret, headers, body) == json.loads(body)


@pytest.mark.parametrize(
    "tamper",
    ["body", "timestamp", "id", "secret"],
)
def test_a_tampered_request_is_refused_by_both(tamper: str) -> None:
    body = json.dumps(make_command().to_json()).encode()
    headers = _reference_signed(WHSEC, body)
    secret = WHSEC
    if tamper == "body":
        body = body.replace(b"retry_step", b"abort_run")
    elif tamper == "timestamp":  # one second later: still fresh, no longer what was signed
        headers["webhook-timestamp"] = str(int(headers["webhook-timestamp"]) + 1)
    elif tamper == "id":
        headers["webhook-id"] = "cmd-2"
    else:
        secret = "whsec_" + base64.b64encode(b"another-32-byte-key-for-webhooks").decode()
    with pytest.raises(SignatureError, match="no signature matches"):
        verify_webhook(secret, headers, body)
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(secret).verify(body, headers)


# -- every input, both ways -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=64),
    message_id=st.text(
        st.characters(codec="ascii", categories=("L", "N", "P")), min_size=1, max_size=40
    ),
    timestamp=st.integers(min_value=0, max_value=2**33),
    body=st.binary(max_size=512),
)
def test_signatures_agree_with_the_library(
    key: bytes, message_id: str, timestamp: int, body: bytes
) -> None:
    stamped = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    whsec = "whsec_" + base64.b64encode(key).decode()
    expected = standardwebhooks.Webhook(key).sign(message_id, stamped, body)
    assert signing.sign(whsec, message_id, timestamp, body) == expected
    plain = key.hex()
    assert signing.sign(plain, message_id, timestamp, body) == (
        standardwebhooks.Webhook(plain.encode()).sign(message_id, stamped, body)
    )
