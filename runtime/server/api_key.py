"""``--api-key``: the inference endpoints answer only requests carrying ``Authorization: Bearer <key>``.

Guarded: ``/v1/*`` (OpenAI routes: completions, chat, embeddings, models) and ``/v2/models/<name>[/versions/<v>]/infer``.
Open: ``/health``, ``/ready``, ``/metrics`` and the other KServe metadata routes (what probes and scrapers
call). ``/admin/*`` keeps its own rules (admin.py): the API key does not open it. The key is compared in
constant time; a wrong or missing one is a 401 in the route's error format, before the body is read.
"""

from __future__ import annotations

import hmac
import json
import re

from precast.runtime.server.bodies import error_body

__all__ = ["ApiKeyMiddleware", "needs_api_key"]

_INFER = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")


def needs_api_key(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or _INFER.fullmatch(path) is not None


class ApiKeyMiddleware:
    """Pure ASGI, outside the body limit: a request without the key costs no body read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not needs_api_key(scope.get("path", "")):
            return await self.app(scope, receive, send)
        auth = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                auth = value
                break
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if hmac.compare_digest(given, self._key):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        message = (
            "missing or wrong API key: send it as 'Authorization: Bearer <key>' (the server's --api-key)"
        )
        if path.startswith("/v1"):  # OpenAI's error body and code for this
            error = {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            body = json.dumps({"error": error}).encode()
        else:
            body = error_body(path, 401, message)
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="precast"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
