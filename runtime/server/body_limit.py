"""Request body limits, enforced before a body is read: one large upload must not exhaust the server.

    Content-Length over max_request_bytes            -> 413 at once; the body is never read
    a streamed (chunked) body passing it             -> 413 as soon as it does
    bodies held by all requests over max_inflight    -> 503 + Retry-After (this request's body unread)

A route may have its own limit instead of max_request_bytes (``path_limits``: path -> (bytes, the flag that
sets it)): the audio uploads of a speech artifact (seq2seq_api.py).

A pure ASGI middleware, not a FastAPI dependency or a BaseHTTPMiddleware: it must act before any
handler calls ``request.body()`` (which buffers the whole body), see each ``http.request`` message of a
chunked upload as it arrives, and leave streaming responses alone. A refused request's connection is
closed (``Connection: close``) so the rest of an oversized upload is not read either. Once the last
large request in flight is done, the memory it used is handed back to the OS (memory.py).
"""

from __future__ import annotations

from precast.runtime.server.bodies import error_body
from precast.runtime.server.memory import Trimmer

__all__ = ["BodyLimitMiddleware", "BodyTooLarge"]


class BodyTooLarge(Exception):
    """Raised from ``receive()`` when a streamed body passes a limit; the middleware answers it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class BodyLimitMiddleware:
    def __init__(
        self, app, max_request_bytes: int, max_inflight_bytes: int, path_limits: dict | None = None
    ):
        self.app = app
        self.limit = max_request_bytes
        self.path_limits = path_limits or {}  # path -> (limit, flag)
        self.budget = max_inflight_bytes
        self.inflight = 0  # body bytes held by requests in progress (one event loop: no lock needed)
        self.trimmer = Trimmer()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit, flag = self.path_limits.get(path, (self.limit, "--max-request-bytes"))
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await _refuse(send, path, 413, self._too_large(declared, limit, flag))
        if declared is not None and self.inflight + declared > self.budget:
            return await _refuse(send, path, 503, self._busy(), retry_after=True)
        state = {"received": 0, "reserved": declared or 0, "started": False, "large": False}
        self.inflight += state["reserved"]
        state["large"] = self.trimmer.started(state["reserved"])

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    raise BodyTooLarge(413, self._too_large(None, limit, flag))
                extra = state["received"] - state["reserved"]
                if extra > 0:  # a chunked body (no Content-Length): reserve what arrives
                    if self.inflight + extra > self.budget:
                        raise BodyTooLarge(503, self._busy())
                    self.inflight += extra
                    state["reserved"] += extra
                    if not state["large"]:
                        state["large"] = self.trimmer.started(state["reserved"])
            return message

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as e:
            if not state["started"]:
                await _refuse(send, path, e.status, e.message, retry_after=e.status == 503)
        finally:
            self.inflight -= state["reserved"]
            if state["large"]:
                self.trimmer.finished()

    def _too_large(self, declared: int | None, limit: int, flag: str) -> str:
        size = f"of {declared} bytes " if declared is not None else ""
        return (
            f"request body {size}is larger than this server's limit of {limit} bytes "
            f"({limit / (1 << 20):g} MiB, {flag})"
        )

    def _busy(self) -> str:
        return (
            f"server busy: request bodies in memory would pass {self.budget} bytes "
            "(max_inflight_bytes); retry after 1 s"
        )


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 refuses malformed lengths before the app sees them
                return None
    return None


async def _refuse(send, path: str, status: int, message: str, retry_after: bool = False) -> None:
    body = error_body(path, status, message)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
