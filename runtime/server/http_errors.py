"""The one place exceptions become HTTP answers, registered on the app by ``install_error_handlers``.

Routes and serving code raise; they never build error responses themselves:

    HTTPError(status, message)   -> that status (404 unknown model, 499 client gone, 500 NaN output, ...)
    QueueFullError               -> 429 with Retry-After
    TimeoutError                 -> 504 "request timed out after N s"
    TextTimeout                  -> 504 naming the chat template / tokenizer's limit
    TextUnavailable              -> 503 + Retry-After (the text sandbox's worker is restarting, or stopping)
    PrecastError (any other)     -> 400 with the one-line message (and ``param`` when it names one)

The body's shape follows the route: OpenAI's ``{"error": {message, type, param, code}}`` under /v1/,
KServe's ``{"error": message}`` elsewhere.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from precast.errors import PrecastError
from precast.runtime.server.batcher import QueueFullError
from precast.runtime.server.bodies import openai_error, v2_error
from precast.runtime.server.text_sandbox import TextTimeout, TextUnavailable

__all__ = ["HTTPError", "error_response", "install_error_handlers"]


class HTTPError(Exception):
    """An answer a route chose: status, one-line message; ``kind`` / ``param`` fill OpenAI's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers


def error_response(
    path: str,
    status: int,
    message: str,
    kind: str | None = None,
    param: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    if path.startswith("/v1/"):
        kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        return openai_error(status, message, kind, param=param, headers=headers)
    return v2_error(status, message, headers=headers)


def install_error_handlers(app, request_timeout: float) -> None:
    """Register ``answer`` (below) on the app for every exception a route may raise on purpose."""

    async def answer(request, e: Exception) -> JSONResponse:
        path = request.url.path
        if isinstance(e, HTTPError):
            return error_response(path, e.status, e.message, e.kind, e.param, e.headers)
        if isinstance(e, QueueFullError):
            headers = {"Retry-After": str(int(e.retry_after))}
            return error_response(path, 429, str(e), "rate_limit_error", headers=headers)
        if isinstance(e, TextTimeout):  # the artifact's template or tokenizer: say which limit
            return error_response(path, 504, str(e), "timeout")
        if isinstance(e, TextUnavailable):
            return error_response(path, 503, str(e), headers={"Retry-After": "1"})
        if isinstance(e, TimeoutError):
            return error_response(path, 504, f"request timed out after {request_timeout:g} s", "timeout")
        return error_response(path, 400, str(e), param=getattr(e, "param", None))  # a PrecastError

    for cls in (HTTPError, TimeoutError, PrecastError):
        app.add_exception_handler(cls, answer)
