"""HTTP/1.1 over a plain socket, for what httpx will not send: a Content-Length it never delivers, a body
cut off by a reset, a chunked upload that keeps going. Loopback only; every read has a timeout."""

from __future__ import annotations

import json
import select
import socket
import struct
from urllib.parse import urlsplit

__all__ = ["head_only", "read_response", "reset_mid_upload", "stream_chunks"]


def _connect(url: str, timeout: float) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname in ("127.0.0.1", "localhost"), "loopback only"
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def _head(method: str, path: str, url: str, headers: dict) -> bytes:
    host = urlsplit(url).netloc
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the response on ``sock`` (the server closes or sends Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        None,
    )
    while length is None or len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, json.loads(rest[:length] if length is not None else rest)


def head_only(url: str, path: str, content_length: int, timeout: float = 5.0) -> tuple[int, dict]:
    """Announce a body of ``content_length`` bytes, send none of it, and read the answer."""
    with _connect(url, timeout) as sock:
        headers = {"Content-Type": "application/json", "Content-Length": str(content_length)}
        sock.sendall(_head("POST", path, url, headers))
        return read_response(sock)


def stream_chunks(
    url: str, path: str, chunk: bytes, max_bytes: int, timeout: float = 10.0
) -> tuple[int, dict, int]:
    """Send ``chunk`` again and again as a chunked body until the server answers or ``max_bytes`` went
    out (then end the body). Returns (status, body, bytes sent)."""
    with _connect(url, timeout) as sock:
        sock.sendall(
            _head("POST", path, url, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        )
        sent = 0
        framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        try:
            while sent < max_bytes:
                if select.select([sock], [], [], 0)[0]:  # the server answered (early)
                    break
                sock.sendall(framed)
                sent += len(chunk)
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed while we were still sending
        status, body = read_response(sock)
        return status, body, sent


def reset_mid_upload(url: str, path: str, timeout: float = 5.0) -> None:
    """Start a 100 kB upload, send 1 kB of it, then reset the connection (RST, not FIN)."""
    sock = _connect(url, timeout)
    sock.sendall(_head("POST", path, url, {"Content-Type": "application/json", "Content-Length": "100000"}))
    sock.sendall(b'{"input": "' + b"a" * 1000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
