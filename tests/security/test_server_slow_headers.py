"""Slow headers (slowloris) cannot hold the server's connections: each request must finish its headers within
header_timeout, or its connection is closed. Before, 30 trickling connections on --max-connections 20 made
every other request, /health included, a 503 for as long as they lasted."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server

pytest.importorskip("uvicorn")


def _trickle(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
    return s


def test_slow_headers_are_cut_off_and_others_are_served(mlp_a):
    config = ServerConfig(mlp_a, model_name="mlp", max_connections=6, header_timeout=1.0)
    with live_server(config) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        slow = [_trickle(port) for _ in range(10)]  # more than max_connections
        try:
            time.sleep(0.3)
            blocked = httpx.get(f"{url}/health", timeout=5).status_code
            time.sleep(1.5)  # past header_timeout: the server has closed them
            for s in slow:
                s.settimeout(2)
                try:
                    s.sendall(b"X-Late: 1\r\n")
                    assert s.recv(1024) == b""  # closed by the server, no response
                except (BrokenPipeError, ConnectionResetError):
                    pass
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert time.perf_counter() - t0 < 1.0
        finally:
            for s in slow:
                s.close()
        assert blocked == 503  # the attack did hold every connection until the deadline
        # a normal keep-alive client is not cut off between requests
        with httpx.Client(timeout=5) as c:
            for _ in range(3):
                assert c.get(f"{url}/health").status_code == 200
                time.sleep(0.6)


def test_header_timeout_is_checked():
    from precast.errors import UsageError

    for bad in (0, -1, "5", True):
        with pytest.raises(UsageError, match="header_timeout"):
            ServerConfig("x", header_timeout=bad)
