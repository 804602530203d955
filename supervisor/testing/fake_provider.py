"""A fake OpenAI- and Anthropic-compatible LLM provider on loopback.

Why it exists: the demo and the tests drive the *real* ``openai`` and
``anthropic`` SDKs (and the real instrumentations wrapped around them), so the
spans we normalize are the spans agents really emit. The fake answers with the
providers' documented success and error shapes, so each SDK raises exactly the
exception it raises in production (``RateLimitError``, ``APITimeoutError``,
``APIConnectionError``, ``InternalServerError`` for Anthropic's 529...).

Standard library only: a :class:`~supervisor.testing.loopback.LoopbackServer`.

    with FakeProvider() as provider:
        provider.script(Reply.rate_limited(retry_after_s=1.5), Reply.text("hi"))
        client = openai.OpenAI(base_url=provider.base_url, api_key="sk-fake", max_retries=0)

Endpoints: ``POST /v1/chat/completions`` (plain and ``stream: true`` SSE),
``POST /v1/messages`` (Anthropic Messages API, plain and streaming),
``GET /v1/models``. Scripted replies are consumed in order, then an optional
seeded :class:`FaultPlan` may inject faults, then the default reply answers.
Everything the server holds is bounded: the script queue, the request log.

``limit=PublishedLimit(rpm=60, tpm=40_000)`` makes ``/v1/chat/completions``
enforce OpenAI's published limit per API key (the bearer token): a request
over it gets OpenAI's 429 ``rate_limit_exceeded`` whatever is scripted, and
every answer carries the ``x-ratelimit-*`` headers; see
:mod:`.provider_limits` (``clock`` is its clock). :meth:`limit_counts` says
what each key had accepted and refused.

The replies are :mod:`.provider_replies`'; how each is written on the wire,
OpenAI's way or Anthropic's, is :mod:`.provider_http`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from supervisor.testing.loopback import LOOPBACK, LoopbackServer
from supervisor.testing.provider_http import ProviderHandler, ProviderState, RecordedRequest
from supervisor.testing.provider_limits import KeyCounts, PublishedLimit, RateLimiter
from supervisor.testing.provider_replies import FaultPlan, Reply, ToolCall

__all__ = [
    "FakeProvider",
    "FaultPlan",
    "KeyCounts",
    "PublishedLimit",
    "RecordedRequest",
    "Reply",
    "ToolCall",
]


class FakeProvider(LoopbackServer[ProviderState]):
    """An OpenAI/Anthropic-compatible server on loopback, scripted by the test.

    Thread-safe: the server answers each request on its own daemon thread, and
    the test may :meth:`script` replies at any time. Lifecycle (``start``,
    ``stop``, ``with``, ``port``, ``url``) as :class:`LoopbackServer`'s.
    """

    def __init__(
        self,
        host: str = LOOPBACK,
        port: int = 0,
        *,
        default: Reply | None = None,
        fault_plan: FaultPlan | None = None,
        max_script: int = 1024,
        max_requests: int = 1024,
        limit: PublishedLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = ProviderState(
            default if default is not None else Reply.text("Hello from the fake provider."),
            fault_plan,
            max_script,
            max_requests,
            RateLimiter(limit, clock=clock) if limit is not None else None,
        )
        super().__init__(ProviderHandler, self._state, host=host, port=port, name="FakeProvider")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, cutting short any delayed reply; see :meth:`LoopbackServer.stop`."""
        self._state.stopping.set()
        try:
            super().stop(timeout)
        finally:
            self._state.stopping.clear()  # a restarted provider delays its replies again

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, the openai SDK's ``base_url`` (``url``: the anthropic SDK's)."""
        return f"{self.url}/v1"

    # -- scripting ---------------------------------------------------------

    def script(self, *replies: Reply) -> None:
        """Queue replies, answered in order before the fault plan and the default."""
        with self._state.lock:
            if len(self._state.script) + len(replies) > self._state.max_script:
                msg = f"FakeProvider script is bounded to {self._state.max_script} replies"
                raise ValueError(msg)
            self._state.script.extend(replies)

    def reset(self) -> None:
        """Forget scripted replies not yet consumed and the request log."""
        with self._state.lock:
            self._state.script.clear()
            self._state.requests.clear()
            self._state.requests_dropped = 0

    def set_default(self, reply: Reply) -> None:
        """Change the reply given when the script is empty."""
        with self._state.lock:
            self._state.default = reply

    @property
    def pending(self) -> int:
        """Scripted replies not yet consumed."""
        with self._state.lock:
            return len(self._state.script)

    @property
    def requests(self) -> list[RecordedRequest]:
        """The most recent requests received (bounded; see :attr:`requests_dropped`)."""
        with self._state.lock:
            return list(self._state.requests)

    def limit_counts(self) -> dict[str, KeyCounts]:
        """Per API key, the requests the published limit accepted and refused (``{}``: no limit)."""
        limiter = self._state.limiter
        return limiter.counts() if limiter is not None else {}

    @property
    def requests_dropped(self) -> int:
        """How many old requests fell out of the bounded log."""
        with self._state.lock:
            return self._state.requests_dropped
