"""uvicorn's HTTP protocol with a deadline on a request's headers.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but
waits forever for the headers of a request once its first byte arrived, and
for those of a new connection: a client sending a byte every few seconds
holds a connection, and its memory, as long as it likes. Here every request's
head must be complete within ``header_timeout_s`` of its first byte (or of
the connection): past it the connection is closed. The body has a deadline of
its own, where it is read (the OTLP/HTTP receiver answers 408).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["with_header_deadline"]


def with_header_deadline(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` closing slow heads."""

    class _HeaderDeadline(_HeaderDeadlineProtocol):
        timeout_s = header_timeout_s

    return _HeaderDeadline


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    timeout_s = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()
