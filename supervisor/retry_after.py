"""How long a server asks its client to wait, in every form servers write it.

* HTTP ``Retry-After`` (RFC 9110): delta-seconds or an HTTP date
  (:func:`parse_retry_after`), read by what spanvisor itself sends (webhooks,
  forwarded spans) and capped at :data:`MAX_RETRY_AFTER_S`.
* Provider durations (:func:`parse_duration`): ``"1.5"``, ``"20ms"``,
  ``"20 seconds"``, and Go's ``time.Duration`` as OpenAI's
  ``x-ratelimit-reset-*`` headers write it (``"1s"``, ``"6m0s"``, ``"1h2m3.5s"``,
  ``"250µs"``).
* Provider wording in an error message (:func:`retry_after_from_text`):
  OpenAI's "Please try again in 1.5s" / "in 20ms" / "in 1m3s", Azure's "Please
  retry after 20 seconds", "Retry-After: 3".
* A response's headers as a whole (:func:`retry_after_from_headers`):
  ``retry-after-ms``, ``retry-after``, OpenAI's ``x-ratelimit-reset-*`` and
  Anthropic's ``anthropic-ratelimit-*-reset`` (RFC 3339 times).

The sidecar reads these from spans (:mod:`supervisor.normalize.evidence`)
and the agent-side client from a caught exception's response, so both see
the same delay. Standard library only: agents import the client.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Final, Literal

__all__ = [
    "MAX_PROVIDER_DELAY_S",
    "MAX_RETRY_AFTER_S",
    "RETRY_HEADERS",
    "header_delay",
    "parse_duration",
    "parse_retry_after",
    "retry_after_from_headers",
    "retry_after_from_text",
]

#: The longest wait a server may ask spanvisor itself for (``Retry-After`` of a
#: webhook receiver or a downstream collector); more is read as this much.
MAX_RETRY_AFTER_S: Final = 3600.0
#: The longest delay a provider's hint is believed to ask for (a day); a longer
#: duration is not a hint at all. A policy caps what it obeys far lower.
MAX_PROVIDER_DELAY_S: Final = 86_400.0
#: Characters of a message searched for a hint (providers put it in the first lines).
HINT_SCAN_CHARS: Final = 8 * 1024
#: Characters of a value read as a duration: a duration is short; garbage may not be.
_DURATION_CHARS: Final = 64


# -- dates ---------------------------------------------------------------------


def _seconds_until(text: str, now: float, cap: float) -> float | None:
    """Seconds from ``now`` until an HTTP date or an RFC 3339 time, within [0, cap].

    A time without a zone is read as UTC: HTTP dates are GMT by definition,
    and the obsolete asctime form carries no zone at all.
    """
    try:
        if text[:4].isdigit():
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        else:
            when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return min(max(when.timestamp() - now, 0.0), cap)


# -- HTTP Retry-After ------------------------------------------------------------


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds an HTTP ``Retry-After`` asks for (capped), or None for an absent or malformed one.

    Only ASCII digits count as delta-seconds (``str.isdigit`` also accepts
    "²", and "1.5" or "-5" are not delta-seconds); anything else must be a
    date, and a date in the past means now.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    current = time.time() if now is None else now
    return _seconds_until(value, current, MAX_RETRY_AFTER_S)


# -- durations -------------------------------------------------------------------

_DURATION_PART: Final = re.compile(
    r"\s*(\d{1,9}(?:\.\d{1,9})?)\s*"
    r"(ms|milliseconds?|msecs?|us|µs|μs|microseconds?|ns|nanoseconds?"
    r"|h|hours?|hrs?|m(?!s)|mins?|minutes?|s|secs?|seconds?)?"
    r"(?![A-Za-z])",
    re.IGNORECASE,
)
_UNIT_SECONDS: Final = {"h": 3600.0, "m": 60.0, "s": 1.0}


def _unit_seconds(unit: str) -> float:
    """Seconds in one ``unit`` as :data:`_DURATION_PART` captures it (lower case)."""
    if unit.startswith(("ms", "mil")):
        return 0.001
    if unit.startswith(("us", "µ", "μ", "micro")):
        return 1e-6
    if unit.startswith("n"):
        return 1e-9
    return _UNIT_SECONDS[unit[0]]


def parse_duration(text: str) -> float | None:
    """Seconds in ``"1.5"``, ``"20ms"``, ``"1m3s"``, ``"6m0s"``, ``"20 seconds"``; else None.

    Reads parts from the start of ``text`` (at most 64 characters) while each
    has a unit; a bare number ends the duration. None when no part is found or
    the total is over :data:`MAX_PROVIDER_DELAY_S`.
    """
    total = 0.0
    pos = 0
    found = False
    limit = min(len(text), _DURATION_CHARS)
    while pos < limit:
        match = _DURATION_PART.match(text, pos, limit)
        if match is None or match.end() == pos:
            break
        unit = match.group(2)
        total += float(match.group(1)) * (1.0 if unit is None else _unit_seconds(unit.lower()))
        found = True
        pos = match.end()
        if unit is None:
            break
    if not found or not 0.0 <= total <= MAX_PROVIDER_DELAY_S:
        return None
    return total


# -- hints in a message ------------------------------------------------------------

#: A hint's words, as they read in the lower-cased message. Every hint holds "try"
#: and the pattern starts with it, so a search skips from one "try" to the next;
#: the lookbehinds then check for the "re" of "retry".
_RETRY_HINT: Final = re.compile(
    r"""
    try
    (?:
        (?:\ again | (?<=retry) (?:ing)?) \s+ (?:in|after) \s* :? \s*  # try again in, retry after
      | (?<=\bretry) [-_\ ] after \s* [:=]? \s*                         # retry-after:, retry_after=
    )
    """,
    re.VERBOSE,
)


def retry_after_from_text(text: str) -> float | None:
    """A delay the provider asks for in its own words ("Please try again in 1.5s"), in seconds.

    The message is searched in lower case rather than with ``re.IGNORECASE``:
    ``re`` skips ahead to a pattern's leading word only in a case-sensitive search.
    """
    lowered = text[:HINT_SCAN_CHARS].lower()
    for match in _RETRY_HINT.finditer(lowered):
        delay = parse_duration(lowered[match.end() : match.end() + _DURATION_CHARS])
        if delay is not None:
            return delay
    return None


# -- response headers ----------------------------------------------------------------

#: How a header says its delay. ``ms``: milliseconds; ``s``: seconds, a duration
#: or an HTTP date; ``reset``: an absolute time (Anthropic writes RFC 3339).
HeaderForm = Literal["ms", "s", "reset"]
#: Headers that say how long to wait, as providers name them (lower case), and their form.
RETRY_HEADERS: Final[tuple[tuple[str, HeaderForm], ...]] = (
    ("retry-after-ms", "ms"),
    ("retry-after", "s"),
    ("x-ratelimit-reset-requests", "s"),
    ("x-ratelimit-reset-tokens", "s"),
    ("anthropic-ratelimit-requests-reset", "reset"),
    ("anthropic-ratelimit-tokens-reset", "reset"),
    ("anthropic-ratelimit-input-tokens-reset", "reset"),
    ("anthropic-ratelimit-output-tokens-reset", "reset"),
)


def _header_delay(form: HeaderForm, text: str, now: float) -> float | None:
    if form == "ms":
        millis = parse_duration(text)
        return None if millis is None else millis / 1000.0
    if form == "reset":
        return _seconds_until(text, now, MAX_PROVIDER_DELAY_S)
    delay = parse_duration(text)
    if delay is None and not text[:1].isdigit():
        delay = _seconds_until(text, now, MAX_PROVIDER_DELAY_S)
    return delay


def header_delay(name: str, text: str, *, now: float | None = None) -> float | None:
    """The delay one header of :data:`RETRY_HEADERS` (``name``, lower case) says; else None."""
    form = _FORMS.get(name)
    text = text.strip()
    if form is None or not text:
        return None
    return _header_delay(form, text, time.time() if now is None else now)


_FORMS: Final[dict[str, HeaderForm]] = dict(RETRY_HEADERS)


def retry_after_from_headers(
    values: Callable[[str], Iterable[str]], *, now: float | None = None
) -> float | None:
    """The delay a provider's response headers ask for, in seconds; None when none does.

    ``values(name)`` gives the texts recorded for one header of
    :data:`RETRY_HEADERS` (none, or several where one response was recorded
    under several names); the first that reads as a delay counts.
    ``retry-after-ms`` wins over ``retry-after``; without either, the longest
    of the rate-limit reset headers: which limit was hit is not known, so
    waiting for the longest never retries too early.
    """
    current = time.time() if now is None else now
    resets: list[float] = []
    for name, form in RETRY_HEADERS:
        for value in values(name):
            text = value.strip()
            delay = _header_delay(form, text, current) if text else None
            if delay is not None:
                break
        else:
            continue
        if name.startswith("retry-after"):
            return delay
        resets.append(delay)
    return max(resets) if resets else None
