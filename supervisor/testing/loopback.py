"""One lifecycle for the fakes' HTTP servers on loopback.

Why it exists: every HTTP fake here (:class:`~supervisor.testing.fake_provider.FakeProvider`,
:class:`~supervisor.testing.fault_schedule.FaultSchedule`, the HTTP side of
:class:`~supervisor.testing.otlp_recorder.OtlpRecorder`, the tests' webhook
receivers) needs the same few steps, and each step has a way to go wrong:
bind ``127.0.0.1`` on a free or given port (and say which address failed),
serve from a background thread, and stop within a bound, with no handler
thread left behind to touch the next test (an idle keep-alive connection
holds one until the client hangs up, so :meth:`LoopbackServer.stop` ends the
connections still open).

    with LoopbackServer(Handler, context) as server:
        httpx.get(f"{server.url}/path")

A handler reaches ``context`` (the fake's state) as ``self.server.context``;
declare ``server: LoopbackHTTPServer[State]`` on the handler class to type it.
Standard library only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from _socket import _RetAddress
    from socketserver import _RequestType

__all__ = ["LOOPBACK", "LoopbackHTTPServer", "LoopbackServer"]

LOOPBACK = "127.0.0.1"

C = TypeVar("C")
S = TypeVar("S", bound="LoopbackServer[Any]")


class LoopbackHTTPServer(ThreadingHTTPServer, Generic[C]):
    """A threading HTTP server that carries its fake's ``context`` and knows its open connections.

    Handler threads are daemons, so one stuck past :meth:`LoopbackServer.stop`'s
    bound never blocks the interpreter's exit; ``stop`` waits for them itself.
    """

    daemon_threads = True
    block_on_close = False  # server_close never waits; stop() waits, within its bound
    # socketserver's default backlog of 5 drops the SYNs of a burst of concurrent
    # clients; the kernel retries them after 1 s, which looks like a slow server.
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], context: C
    ) -> None:
        self.context = context
        self._open: set[_RequestType] = set()
        self._changed = threading.Condition()
        super().__init__(address, handler)

    # Counted on the serving thread, before the handler's thread starts, so a
    # connection accepted just before stop() is never missed.
    def process_request(self, request: _RequestType, client_address: _RetAddress) -> None:
        with self._changed:
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: _RequestType, client_address: _RetAddress) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: _RequestType) -> None:
        with self._changed:
            self._open.discard(request)
            self._changed.notify_all()

    def end_connections(self, timeout: float) -> int:
        """Shut down the open connections, then wait for their handlers; how many are left.

        A handler blocked reading its connection (an idle keep-alive) or writing
        to it returns at once; one blocked elsewhere is the fake's to release
        first (its stopping event).
        """
        with self._changed:
            open_now = list(self._open)
        for connection in open_now:
            if isinstance(connection, socket.socket):
                with contextlib.suppress(OSError):  # already closed by the peer
                    connection.shutdown(socket.SHUT_RDWR)
        with self._changed:
            self._changed.wait_for(lambda: not self._open, timeout)
            return len(self._open)


class LoopbackServer(Generic[C]):
    """An HTTP server on loopback serving from a background thread; a context manager.

    Lifecycle: :meth:`start` binds and serves (idempotent); :attr:`port` and
    :attr:`url` are known once started; :meth:`stop` ends it within a bound
    (idempotent); :meth:`start` may bind again after a stop. Subclasses add
    their own steps around ``super().start()`` and ``super().stop()``.
    """

    def __init__(
        self,
        handler: type[BaseHTTPRequestHandler],
        context: C,
        *,
        host: str = LOOPBACK,
        port: int = 0,
        name: str | None = None,
        poll_interval_s: float = 0.02,
    ) -> None:
        self._handler = handler
        self._context = context
        self._host = host
        self._port = port
        #: Names the server in thread names and errors.
        self.name = name or type(self).__name__
        #: How long shutting down may wait for the serving loop to notice.
        self._poll_interval_s = poll_interval_s
        self._server: LoopbackHTTPServer[C] | None = None
        self._thread: threading.Thread | None = None

    def start(self: S, timeout: float = 5.0) -> S:
        """Bind (``port``, or a free one for 0) and serve; return once the serving loop runs.

        Connections made from then on are answered (they wait in the listen
        backlog for the loop's next turn). Raises OSError naming the address
        when it cannot bind, TimeoutError when the serving thread does not run
        within ``timeout`` seconds (the socket is closed then).
        """
        if self._server is not None:
            return self
        address = f"{self._host}:{self._port}"
        try:
            server = LoopbackHTTPServer((self._host, self._port), self._handler, self._context)
        except OSError as exc:
            raise OSError(
                exc.errno, f"{self.name} cannot listen on {address}: {exc.strerror or exc}"
            ) from exc
        port = int(server.server_address[1])
        serving = threading.Event()
        gate = threading.Lock()  # serving starts, or is called off, never both

        def serve() -> None:
            with gate:
                if serving.is_set():  # called off: start() gave up waiting
                    return
                serving.set()
            server.serve_forever(poll_interval=self._poll_interval_s)

        thread = threading.Thread(target=serve, name=f"{self.name}:{port}", daemon=True)
        thread.start()
        if not serving.wait(timeout):
            with gate:
                called_off = not serving.is_set()
                serving.set()
            if called_off:
                server.server_close()
                raise TimeoutError(f"{self.name} did not start serving within {timeout:g} s")
        self._server, self._thread = server, thread
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, end open connections, close the socket; bounded and idempotent.

        Raises TimeoutError when a request handler is still running ``timeout``
        seconds on (something it waits for was not released); the socket is
        closed all the same.
        """
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self._server = self._thread = None
        deadline = time.monotonic() + timeout
        try:
            server.shutdown()  # the loop runs (start saw it): back within a poll interval
            left = server.end_connections(max(0.0, deadline - time.monotonic()))
        finally:
            server.server_close()
        thread.join(max(0.0, deadline - time.monotonic()))
        if left or thread.is_alive():
            raise TimeoutError(
                f"{self.name}: {left} request handler(s) still running {timeout:g} s after stop"
            )

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def http_server(self) -> LoopbackHTTPServer[C]:
        """The underlying server (after :meth:`start`), e.g. to change its ``handle_error``."""
        if self._server is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._server

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        return int(self.http_server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` (after :meth:`start`)."""
        return f"http://{self._host}:{self.port}"
