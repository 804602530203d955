"""A loopback TCP proxy to a real server (Redis, PostgreSQL) that can drop or hang.

``forward`` passes bytes both ways; ``drop`` closes every new connection (the
server is down); ``hang`` accepts and never answers (a server that stopped
responding). Switching mode cuts the connections already made.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """A loopback TCP proxy to ``upstream``: ``forward``, ``drop`` or ``hang``."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = "forward"
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str) -> None:
        """Switch mode; connections already made are cut (a pool must reconnect)."""
        self.mode = mode
        with self._lock:
            cut, self._open = self._open, []
        for sock in cut:
            _close(sock)

    def close(self) -> None:
        _close(self._server)
        self.set("drop")

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.mode == "drop":
                _close(client)
                continue
            with self._lock:
                self._open.append(client)
            if self.mode == "forward":
                upstream = socket.create_connection(self.upstream)
                with self._lock:
                    self._open.append(upstream)
                for src, dst in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pump, args=(src, dst), daemon=True).start()
            # hang: kept open, never read nor answered


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
