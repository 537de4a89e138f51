"""A deadline for a request's headers: uvicorn's h11 protocol with a slowloris guard.

uvicorn has no timeout for reading a request line and headers, and its ``limit_concurrency`` counts the
connections still sending them: 30 connections trickling one header line every 10 s kept a server with
``--max-connections 20`` answering 503 to everything, ``/health`` included, for as long as they lasted (a
liveness probe would restart the pod). Here every request cycle must deliver its complete headers within
``header_timeout`` seconds of its first byte (of the connection, for the first one), or the connection is
closed. Bodies are bounded by ``--max-request-bytes`` and the request timeout; idle keep-alive connections by
uvicorn's own ``timeout_keep_alive``.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["header_timeout_protocol"]


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._header_timer is None:
                self._arm()  # a new request on a kept-alive connection starts its own deadline
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # its headers are in

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol
