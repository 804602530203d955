"""``Retry-After`` as HTTP servers write it: delta-seconds or an HTTP date (RFC 9110)."""

from __future__ import annotations

import email.utils
import time

__all__ = ["MAX_RETRY_AFTER_S", "parse_retry_after"]

#: The longest wait a receiver may ask for; more is read as this much.
MAX_RETRY_AFTER_S = 3600.0


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait (capped), or None for an absent or malformed value.

    Only ASCII digits count as delta-seconds (``str.isdigit`` also accepts "²"),
    and a date without a time zone is refused: HTTP dates are GMT.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        return None
    current = time.time() if now is None else now
    return min(max(0.0, when.timestamp() - current), MAX_RETRY_AFTER_S)
