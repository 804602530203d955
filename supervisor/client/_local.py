"""The advice the client gives on its own when the sidecar cannot be asked.

Why the classification here is the client's own and not the sidecar's: the
sidecar classifies with the rules of its policy (``policies/default_policy.yaml``
and the user's file), and loading them imports pydantic, PyYAML and pybreaker
(with redis) and compiles a few hundred rules: about a third of a second, paid
by an agent at the moment it is already failing, for a process that imports
the client to stay light. So the client keeps a small table of what the
built-in rules class as transient (HTTP statuses, exception type names,
message phrases) and retries only that; ``tests/test_client_local_policy.py``
checks the table against the built-in rules, so the two cannot drift apart
unnoticed. What both read the same way is shared: a server's delay, in headers
or in words, comes from :mod:`supervisor.retry_after` on either side, and the
backoff from tenacity's schedule, as the built-in ``builtin.transient`` entry
has it (three attempts, exponential from 1 s to 30 s, full jitter).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from tenacity import wait_exponential

from supervisor.client._advice import Advice
from supervisor.client._backoff import wait_after
from supervisor.records import Action, FailureClass
from supervisor.retry_after import retry_after_from_text

#: Longest message read: the sidecar scans only the head, and so does the client.
MAX_MESSAGE_CHARS: Final = 4096

_TRANSIENT: Final = FailureClass.TRANSIENT.value

#: Quota and billing errors come as 429 too, but waiting does not refill an account (the
#: built-in rules ``builtin.provider.quota_message``, ``builtin.openai.insufficient_quota``).
_QUOTA: Final = re.compile(
    r"exceeded your current quota|credit balance is too low|insufficient[_ ]quota"
    r"|billing[_ ](?:hard[_ ]limit|not[_ ]active)",
    re.IGNORECASE,
)
#: HTTP statuses the built-in rules class as transient, other than 5xx (``builtin.http.*``).
_TRANSIENT_STATUS: Final[Mapping[int, str]] = MappingProxyType(
    {
        429: "rate_limit",
        408: "timeout",
        504: "timeout",
        524: "timeout",
        409: "unavailable",  # a concurrent change won the race
        425: "unavailable",
    }
)
#: 5xx statuses that say the request can never work (``builtin.http.not_implemented``).
_PERMANENT_5XX: Final = frozenset({501, 505})
#: Parts of an exception's class name (lower case) that mark it transient
#: (``builtin.sdk.*``; a part covers a family: ``connect`` is ConnectError,
#: ConnectionResetError, APIConnectionError...). Timeouts come first: a
#: ConnectTimeout is a timeout.
_TRANSIENT_NAME_PARTS: Final[tuple[tuple[str, str], ...]] = (
    ("ratelimit", "rate_limit"),
    ("toomanyrequests", "rate_limit"),
    ("throttl", "rate_limit"),
    ("resourceexhausted", "rate_limit"),
    ("timeout", "timeout"),
    ("timedout", "timeout"),
    ("deadlineexceeded", "timeout"),
    ("connect", "connection"),
    ("brokenpipe", "connection"),
    ("protocolerror", "connection"),
    ("serverdisconnected", "connection"),
    ("serviceunavailable", "unavailable"),
    ("internalserver", "unavailable"),
    ("overloaded", "unavailable"),
    ("badgateway", "unavailable"),
)
#: Transient class names too short or too common to match by a part ("ReadError"
#: is in "ThreadError"): matched whole.
_TRANSIENT_NAMES: Final[Mapping[str, str]] = MappingProxyType(
    dict.fromkeys(
        (
            "ReadError",
            "WriteError",
            "NetworkError",
            "ClientOSError",
            "ClientPayloadError",
            "gaierror",
            "MaxRetryError",
            "ChunkedEncodingError",
            "IncompleteRead",
            "ProxyError",
        ),
        "connection",
    )
    | dict.fromkeys(
        ("ServerError", "ModelNotReadyException", "ConflictError", "Aborted"), "unavailable"
    )
)
#: Transient classes named with their package, where the bare name is too common to
#: match alone (``builtin.openai.stream_error``: openai-python's bare ``APIError`` is
#: a mid-stream SSE ``error`` event; another SDK's ``APIError`` says nothing).
_TRANSIENT_QUALIFIED: Final[Mapping[str, str]] = MappingProxyType(
    {"openai.APIError": "unavailable"}
)
#: Words in the message, for errors without a useful status or type (``builtin.text.*``).
_TRANSIENT_TEXT: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    (re.compile(r"rate[ _-]?limit|too many requests|throttl", re.IGNORECASE), "rate_limit"),
    (re.compile(r"timed? ?out|deadline exceeded", re.IGNORECASE), "timeout"),
    (
        re.compile(
            r"connection (?:refused|reset|aborted|error|closed)"
            r"|failed to (?:establish a new )?connect"
            r"|name or service not known|temporary failure in name resolution"
            r"|nodename nor servname|network is unreachable|no route to host|broken pipe"
            r"|server disconnected|remote end closed|max retries exceeded",
            re.IGNORECASE,
        ),
        "connection",
    ),
    (
        re.compile(
            r"service unavailable|temporarily unavailable|overloaded|bad gateway"
            r"|internal server error",
            re.IGNORECASE,
        ),
        "unavailable",
    ),
)


def transient_kind(exception_type: str, message: str, status_code: int | None) -> str:
    """The kind of a failure the built-in rules class as transient, or ``""`` for any other.

    As in the built-in rules, an HTTP status decides before the exception's
    type, and the type before the words of its message.
    """
    if status_code is not None:
        if status_code in _TRANSIENT_STATUS:
            return _TRANSIENT_STATUS[status_code]
        if 500 <= status_code <= 599 and status_code not in _PERMANENT_5XX:
            return "unavailable"
        if 400 <= status_code <= 599:
            return ""  # the request itself is wrong: the same request fails again
    if exception_type in _TRANSIENT_QUALIFIED:  # matched whole, as the rule does
        return _TRANSIENT_QUALIFIED[exception_type]
    name = exception_type.rpartition(".")[2]
    if name in _TRANSIENT_NAMES:
        return _TRANSIENT_NAMES[name]
    lowered = name.lower()
    for part, kind in _TRANSIENT_NAME_PARTS:
        if part in lowered:
            return kind
    head = message[:MAX_MESSAGE_CHARS]
    for pattern, kind in _TRANSIENT_TEXT:
        if pattern.search(head):
            return kind
    return ""


def quota_exhausted(message: str) -> bool:
    """Whether the message says an account's quota or credit is spent."""
    return _QUOTA.search(message[:MAX_MESSAGE_CHARS]) is not None


@dataclass(frozen=True, slots=True)
class LocalPolicy:
    """What the client advises on its own when the sidecar cannot be asked.

    Conservative on purpose: it retries only what the built-in rules class as
    transient (429, 408, 5xx, timeouts, connection errors...) with
    exponential backoff and full jitter, a few times; everything else fails
    fast. It knows no fallback chains, no breakers and no user rules: those
    live in the sidecar. See the module's docstring for why the
    classification is a local table.
    """

    base_s: float = 1.0
    cap_s: float = 30.0
    #: Attempts in all, the first included: attempt ``max_attempts`` failing is the last.
    max_attempts: int = 3
    #: A server-requested delay is a floor for the wait, obeyed up to this cap.
    max_hint_s: float = 60.0
    #: Uniform [0, 1) source for the jitter; injectable so tests are exact.
    rng: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def advise(
        self,
        dependency: str,
        *,
        exception_type: str = "",
        message: str = "",
        status_code: int | None = None,
        attempt: int = 1,
        retry_after_s: float | None = None,
    ) -> Advice:
        """Advice for failed ``attempt`` (1-based) of a call to ``dependency``."""
        local = functools.partial(Advice, dependency=dependency, source="local")
        if quota_exhausted(message):
            return local(
                Action.FAIL_FAST,
                reason=f"permanent/quota_exhausted on {dependency}: fail fast (local policy)",
                policy="local.fail_fast",
                failure_class=FailureClass.PERMANENT.value,
                kind="quota_exhausted",
                rule="local.quota",
            )
        kind = transient_kind(exception_type, message, status_code)
        if not kind:
            return local(
                Action.FAIL_FAST,
                reason=f"not transient-looking on {dependency}: fail fast (local policy)",
                policy="local.fail_fast",
            )
        if attempt >= self.max_attempts:
            return local(
                Action.FAIL_FAST,
                reason=(
                    f"transient/{kind} on {dependency}: attempts exhausted "
                    f"({attempt}/{self.max_attempts} failed, local policy)"
                ),
                policy="local.retry_transient",
                failure_class=_TRANSIENT,
                kind=kind,
                rule=f"local.{kind}",
            )
        delay = self._delay_s(attempt, retry_after_s, message)
        return local(
            Action.RETRY,
            delay_s=delay,
            reason=(
                f"transient/{kind} on {dependency}: retry in {delay:.3g}s "
                f"(attempt {attempt}/{self.max_attempts} failed, local policy)"
            ),
            policy="local.retry_transient",
            failure_class=_TRANSIENT,
            kind=kind,
            rule=f"local.{kind}",
            params=MappingProxyType(
                {"attempt": attempt, "max_attempts": self.max_attempts, "delay_s": delay}
            ),
        )

    def _delay_s(self, attempt: int, retry_after_s: float | None, message: str) -> float:
        """Full jitter under tenacity's exponential ceiling; at least the server's delay."""
        schedule = wait_exponential(multiplier=self.base_s, max=self.cap_s)
        ceiling = wait_after(schedule, max(attempt, 1))
        delay = self.rng() * ceiling
        hint = retry_after_s if retry_after_s is not None else retry_after_from_text(message)
        if hint is not None and hint >= 0:
            delay = max(delay, min(hint, self.max_hint_s))
        return delay
