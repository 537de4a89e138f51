"""http_errors.py: the one mapping from exceptions to answers, in OpenAI's shape under /v1/ and KServe's elsewhere."""

import pytest

from precast.errors import InputError
from precast.runtime.server.batcher import QueueFullError
from precast.runtime.server.http_errors import HTTPError, install_error_handlers

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

RAISE = {
    "busy": lambda: QueueFullError(9, 2.0),
    "slow": lambda: TimeoutError(),
    "bad": lambda: InputError("'x' must be a number"),
    "gone": lambda: HTTPError(404, "unknown model 'm'", param="model"),
}


@pytest.fixture(scope="module")
def client():
    app = fastapi.FastAPI()
    install_error_handlers(app, request_timeout=1.5)

    @app.get("/v1/{what}")
    @app.get("/v2/{what}")
    async def fail(what: str):
        raise RAISE[what]()

    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize(
    "what, status, kind, param, message",
    [
        (
            "busy",
            429,
            "rate_limit_error",
            None,
            "server busy: 9 requests queued (the limit); retry after 2 s",
        ),
        ("slow", 504, "timeout", None, "request timed out after 1.5 s"),
        ("bad", 400, "invalid_request_error", None, "'x' must be a number"),
        ("gone", 404, "invalid_request_error", "model", "unknown model 'm'"),
    ],
)
def test_each_error_has_one_status_and_both_shapes(client, what, status, kind, param, message):
    r = client.get(f"/v1/{what}")
    assert r.status_code == status
    assert r.json() == {"error": {"message": message, "type": kind, "param": param, "code": status}}
    r2 = client.get(f"/v2/{what}")
    assert r2.status_code == status and r2.json() == {"error": message}
    if status == 429:
        assert r.headers["Retry-After"] == r2.headers["Retry-After"] == "2"
