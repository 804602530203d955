"""The fake provider's published limit per API key, as OpenAI enforces it.

Why it exists: admission control is proved against a provider that refuses
what it says it refuses. OpenAI publishes, per API key (organization and
model, really), requests and tokens a minute; each is a bucket that holds one
minute's worth, starts full and refills continuously. A request is counted at
arrival, as OpenAI counts it: one request, and its prompt's tokens (an
estimate) plus the ``max_tokens`` it asks for. A request either bucket cannot
pay is refused whole (nothing is taken) with a 429 ``rate_limit_exceeded``.

The estimate of a prompt's tokens is the characters of the messages' text
contents over four, rounded up (OpenAI's rule of thumb; OpenAI counts with
the model's tokenizer): :func:`request_tokens`. A request asking for more
tokens than a minute holds takes the full bucket (OpenAI refuses it as too
large; a bench would never get through).

Bounded: at most ``max_keys`` keys are tracked; a new key past that forgets
the one used least recently (which starts full again if it comes back).
Thread-safe; the clock is injectable.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KeyCounts", "Limited", "PublishedLimit", "RateLimiter", "go_duration", "request_tokens"]


@dataclass(frozen=True, slots=True)
class PublishedLimit:
    """Requests and tokens a minute, per API key (``tpm=None``: tokens not limited)."""

    rpm: int = 60
    tpm: int | None = 40_000
    #: The most API keys tracked at once.
    max_keys: int = 1024

    def __post_init__(self) -> None:
        if self.rpm < 1 or (self.tpm is not None and self.tpm < 1) or self.max_keys < 1:
            raise ValueError("rpm, tpm and max_keys must be at least 1")


@dataclass(frozen=True, slots=True)
class KeyCounts:
    """What one key asked for: requests accepted, and refused for requests or for tokens."""

    accepted: int = 0
    refused_requests: int = 0
    refused_tokens: int = 0
    tokens_accepted: int = 0

    @property
    def refused(self) -> int:
        return self.refused_requests + self.refused_tokens


@dataclass(frozen=True, slots=True)
class Limited:
    """The answer to one request: refused or not, and OpenAI's ``x-ratelimit-*`` headers."""

    refused: bool
    #: ``"requests"`` or ``"tokens"``: the bucket that refused.
    by: str
    headers: tuple[tuple[str, str], ...]
    retry_after_s: float = 0.0
    #: The refusing bucket's minute, what it had used and what the request asked.
    limit: int = 0
    used: int = 0
    requested: int = 0


def go_duration(seconds: float) -> str:
    """A duration as OpenAI writes its resets (Go's format): ``"20ms"``, ``"1s"``, ``"6m0s"``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{text}" if minutes else text


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def request_tokens(params: Mapping[str, Any]) -> int:
    """The tokens a chat completion request is counted for at arrival.

    The messages' text characters over four, rounded up, plus ``max_tokens``
    or ``max_completion_tokens`` (nothing when neither is given).
    """
    messages = params.get("messages")
    chars = (
        sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
        if isinstance(messages, list)
        else 0
    )
    out = params.get("max_completion_tokens") or params.get("max_tokens") or 0
    return math.ceil(chars / 4) + (out if isinstance(out, int) and out > 0 else 0)


class _Bucket:
    def __init__(self, size: float, now: float) -> None:
        self.size = size
        self.level = size
        self.at = now

    def refill(self, now: float) -> None:
        self.level = min(self.size, self.level + (now - self.at) * self.size / 60.0)
        self.at = now

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60.0 / self.size)

    def until_full(self) -> float:
        return (self.size - self.level) * 60.0 / self.size


class _Key:
    def __init__(self, limit: PublishedLimit, now: float) -> None:
        self.requests = _Bucket(limit.rpm, now)
        self.tokens = _Bucket(limit.tpm, now) if limit.tpm is not None else None
        self.counts = KeyCounts()


class RateLimiter:
    """One :class:`PublishedLimit` enforced per API key."""

    def __init__(
        self, limit: PublishedLimit, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, _Key] = OrderedDict()

    def take(self, api_key: str, tokens: int) -> Limited:
        """Count one request of ``tokens`` for ``api_key``, or refuse it whole."""
        with self._lock:
            now = self._clock()
            key = self._key(api_key, now)
            key.requests.refill(now)
            need_tokens = 0.0
            if key.tokens is not None:
                key.tokens.refill(now)
                need_tokens = min(float(tokens), key.tokens.size)
            wait_requests = key.requests.wait_for(1.0)
            wait_tokens = key.tokens.wait_for(need_tokens) if key.tokens is not None else 0.0
            refused = wait_requests > 0 or wait_tokens > 0
            counts = key.counts
            if refused:
                by = "requests" if wait_requests >= wait_tokens else "tokens"
                key.counts = KeyCounts(
                    counts.accepted,
                    counts.refused_requests + (by == "requests"),
                    counts.refused_tokens + (by == "tokens"),
                    counts.tokens_accepted,
                )
            else:
                by = ""
                key.requests.level -= 1.0
                if key.tokens is not None:
                    key.tokens.level -= need_tokens
                key.counts = KeyCounts(
                    counts.accepted + 1,
                    counts.refused_requests,
                    counts.refused_tokens,
                    counts.tokens_accepted + tokens,
                )
            used = (
                round(key.requests.size - key.requests.level)
                if by != "tokens" or key.tokens is None
                else round(key.tokens.size - key.tokens.level)
            )
            return Limited(
                refused,
                by,
                self._headers(key),
                max(wait_requests, wait_tokens),
                self.limit.tpm if by == "tokens" and self.limit.tpm else self.limit.rpm,
                used,
                1 if by != "tokens" else tokens,
            )

    def _key(self, api_key: str, now: float) -> _Key:
        key = self._keys.get(api_key)
        if key is None:
            if len(self._keys) >= self.limit.max_keys:
                self._keys.popitem(last=False)
            key = self._keys[api_key] = _Key(self.limit, now)
        else:
            self._keys.move_to_end(api_key)
        return key

    def _headers(self, key: _Key) -> tuple[tuple[str, str], ...]:
        requests = key.requests
        headers = [
            ("x-ratelimit-limit-requests", str(self.limit.rpm)),
            ("x-ratelimit-remaining-requests", str(max(0, math.floor(requests.level)))),
            ("x-ratelimit-reset-requests", go_duration(requests.until_full())),
        ]
        if key.tokens is not None:
            headers += [
                ("x-ratelimit-limit-tokens", str(self.limit.tpm)),
                ("x-ratelimit-remaining-tokens", str(max(0, math.floor(key.tokens.level)))),
                ("x-ratelimit-reset-tokens", go_duration(key.tokens.until_full())),
            ]
        return tuple(headers)

    def counts(self) -> dict[str, KeyCounts]:
        """Each tracked key's counts (the key as the request's bearer token gave it)."""
        with self._lock:
            return {name: key.counts for name, key in self._keys.items()}
