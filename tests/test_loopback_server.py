"""The fakes' shared server lifecycle: bind, serve, stop within a bound, nothing left behind."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from supervisor.testing.loopback import LoopbackHTTPServer, LoopbackServer


class Gate:
    """What the handler answers with, and an event that holds it when ``hold`` is set."""

    def __init__(self) -> None:
        self.hold = False
        self.release = threading.Event()
        self.arrived = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    server: LoopbackHTTPServer[Gate]
    protocol_version = "HTTP/1.1"  # keep-alive: the connection stays open between requests

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        gate = self.server.context
        gate.arrived.set()
        if gate.hold:
            gate.release.wait(30)
        try:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        except OSError:
            pass  # released after the stop ended its connection


def _get(port: int) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("GET", "/")
    answer = connection.getresponse()
    assert (answer.status, answer.read()) == (200, b"ok")
    return connection


def test_it_serves_once_started_and_stop_is_idempotent_and_start_rebinds() -> None:
    server = LoopbackServer(_Handler, Gate(), name="plain")
    with pytest.raises(RuntimeError, match="plain is not started"):
        _ = server.url
    with server:
        assert server.running and server.url == f"http://127.0.0.1:{server.port}"
        assert server.start() is server  # idempotent
        _get(server.port).close()
    assert not server.running
    server.stop()  # again: nothing to do
    with server:
        _get(server.port).close()


def test_a_busy_port_is_a_clear_error() -> None:
    with LoopbackServer(_Handler, Gate()) as first:
        taken = LoopbackServer(_Handler, Gate(), port=first.port, name="second")
        with pytest.raises(OSError, match=rf"second cannot listen on 127\.0\.0\.1:{first.port}"):
            taken.start()
        assert not taken.running


def test_stop_ends_an_idle_keep_alive_connection_and_its_handler_thread() -> None:
    server = LoopbackServer(_Handler, Gate(), name="keepalive").start()
    kept = _get(server.port)  # the handler thread now waits for the next request
    started = time.monotonic()
    server.stop(timeout=5)
    assert time.monotonic() - started < 2  # not the handler's idle wait (it raised otherwise)
    assert kept.sock is not None
    kept.sock.settimeout(5)
    assert kept.sock.recv(1) == b""  # the server hung up
    kept.close()


def test_stop_is_bounded_when_a_handler_is_held_and_says_so() -> None:
    gate = Gate()
    gate.hold = True
    server = LoopbackServer(_Handler, gate, name="held").start()
    client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert gate.arrived.wait(5)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"held: 1 request handler\(s\) still running"):
            server.stop(timeout=0.3)
        assert time.monotonic() - started < 2
        assert not server.running
        server.stop()  # already stopped: returns at once
    finally:
        gate.release.set()
        client.close()
