"""A provider's rate-limit headers on a span: its published limits and an exhausted one.

Providers send them on every response, OK or 429: OpenAI's
``x-ratelimit-limit-requests`` / ``-tokens``, ``x-ratelimit-remaining-*`` and
``x-ratelimit-reset-*`` (Go durations: ``"1s"``, ``"6m0s"``); Anthropic's
``anthropic-ratelimit-requests-limit`` / ``-remaining`` / ``-reset`` and the
same for ``tokens``, ``input-tokens`` and ``output-tokens`` (resets as RFC 3339
times). A span carries them as an instrumentation captures response headers
(``http.response.header.<name>``, a string array; opentelemetry-util-http
writes ``x_ratelimit_limit_requests``) or as an agent records them (the plain
name): :func:`~.evidence.header_keys`. Span content is untrusted: a value is read only when
it is a plausible count or delay, anything else is absent.

Read from the few spans that carry one of :data:`RATE_LIMIT_KEYS` (the span
view knows which, once per set of keys): the others pay nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from supervisor.normalize.evidence import header_keys, header_text
from supervisor.records import AttrValue, RateLimitHeaders
from supervisor.retry_after import header_delay

__all__ = ["RATE_LIMIT_KEYS", "rate_limits_of"]

#: A limit larger than this is not a limit anyone publishes (garbage, or none).
_MAX_LIMIT: Final = 10**12

_REQUEST_LIMITS: Final = ("x-ratelimit-limit-requests", "anthropic-ratelimit-requests-limit")
#: Total tokens first; Anthropic's input tokens limit when no total is given.
_TOKEN_LIMITS: Final = (
    "x-ratelimit-limit-tokens",
    "anthropic-ratelimit-tokens-limit",
    "anthropic-ratelimit-input-tokens-limit",
)
#: Each limit's remaining count and the header saying when it resets.
_REMAINING: Final = (
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
    ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"),
    ("anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset"),
    ("anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"),
    ("anthropic-ratelimit-input-tokens-remaining", "anthropic-ratelimit-input-tokens-reset"),
    ("anthropic-ratelimit-output-tokens-remaining", "anthropic-ratelimit-output-tokens-reset"),
)
_NAMES: Final = (*_REQUEST_LIMITS, *_TOKEN_LIMITS, *(n for pair in _REMAINING for n in pair))
#: Every attribute key a rate-limit header may be recorded under.
RATE_LIMIT_KEYS: Final = frozenset(key for name in _NAMES for key in header_keys(name))


def rate_limits_of(attrs: Mapping[str, AttrValue], now_s: float) -> RateLimitHeaders | None:
    """What the span's rate-limit headers say (None: nothing readable); ``now_s``: the
    span's end, for an absolute reset time."""
    requests = _first_count(attrs, _REQUEST_LIMITS)
    tokens = _first_count(attrs, _TOKEN_LIMITS)
    exhausted: float | None = None
    for remaining, reset in _REMAINING:
        if _first_count(attrs, (remaining,), allow_zero=True) != 0:
            continue
        for text in _texts(attrs, reset):
            delay = header_delay(reset, text, now=now_s)
            if delay is not None:
                exhausted = delay if exhausted is None else max(exhausted, delay)
                break
    if requests is None and tokens is None and exhausted is None:
        return None
    return RateLimitHeaders(requests, tokens, exhausted)


def _texts(attrs: Mapping[str, AttrValue], name: str) -> list[str]:
    found = (attrs.get(key) for key in header_keys(name))
    return [header_text(value) for value in found if value is not None]


def _first_count(
    attrs: Mapping[str, AttrValue], names: tuple[str, ...], *, allow_zero: bool = False
) -> int | None:
    """The first plausible count among ``names`` (positive, or 0 when ``allow_zero``)."""
    for name in names:
        for found in _texts(attrs, name):
            text = found.strip()
            if text.isascii() and text.isdigit() and len(text) <= 13:
                count = int(text)
                if (allow_zero or count > 0) and count <= _MAX_LIMIT:
                    return count
    return None
