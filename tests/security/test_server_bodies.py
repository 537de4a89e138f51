"""Request bodies an attacker controls: too large (announced or streamed), hostile JSON, resets mid-upload.

Each is refused with one line naming the limit or the culprit, and the server goes on serving.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from precast.errors import UsageError
from precast.runtime.server import ServerConfig
from tests.security.raw_http import head_only, reset_mid_upload, stream_chunks
from tests.server.conftest import live_server, metric_value

MiB = 1 << 20


def _message(body: dict) -> str:
    err = body["error"]
    return err["message"] if isinstance(err, dict) else err


def test_announced_oversized_body_is_413_before_it_is_read(tiny_encoder):
    with live_server(ServerConfig(tiny_encoder, model_name="enc")) as (url, _):
        t0 = time.monotonic()
        status, body = head_only(url, "/v1/embeddings", 100 * MiB)  # not one byte of it is sent
        assert status == 413, body
        msg = _message(body)
        assert "104857600 bytes" in msg and "8388608 bytes" in msg and "--max-request-bytes" in msg, msg
        assert "\n" not in msg and time.monotonic() - t0 < 2
        status, body = head_only(url, "/v2/models/enc/infer", 9 * MiB)
        assert status == 413 and "8388608" in body["error"]  # KServe's error shape on /v2
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "fox"}, timeout=10)
        assert r.status_code == 200, r.text
        assert metric_value(httpx.get(f"{url}/metrics").text, "precast_requests_total", status="413") == 2


@pytest.mark.parametrize("limit", [None, 1 * MiB], ids=["default-8MiB", "1MiB"])
def test_streamed_body_is_cut_off_at_the_limit(tiny_encoder, limit):
    opts = {} if limit is None else {"max_request_bytes": limit}
    limit = limit or 8 * MiB
    with live_server(ServerConfig(tiny_encoder, model_name="enc", **opts)) as (url, _):
        # 64 KiB of JSON whitespace per chunk, up to 32 MiB: the server must answer long before the end
        # (what we sent beyond the limit sat in socket buffers when it did).
        status, body, sent = stream_chunks(url, "/v1/embeddings", b" " * (64 << 10), 32 * MiB)
        assert status == 413, body
        assert f"{limit} bytes" in _message(body), body
        assert sent < limit + 12 * MiB, f"the server read {sent} bytes of a body limited to {limit}"
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "fox"}, timeout=10)
        assert r.status_code == 200, r.text


def test_bodies_held_at_once_are_bounded_too(tiny_encoder):
    cfg = ServerConfig(tiny_encoder, model_name="enc", max_request_bytes=600_000, max_inflight_bytes=MiB)
    with live_server(cfg) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)  # 600 kB announced, sent slowly
        slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 600000\r\n\r\n{")
        time.sleep(0.2)
        status, body = head_only(url, "/v1/embeddings", 600_000)  # together: more than 1 MiB
        assert status == 503 and "server busy" in _message(body) and "1048576" in _message(body), body
        slow.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the slow request's bytes are released when it ends
            r = httpx.post(f"{url}/v1/embeddings", json={"input": "fox " * 100_000}, timeout=10)
            if r.status_code != 503:
                break
            time.sleep(0.05)
        assert r.status_code == 400 and "--max-text-chars" in _message(r.json()), r.text


def test_connections_are_bounded(tiny_encoder):
    with live_server(ServerConfig(tiny_encoder, model_name="enc", max_connections=2)) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.2)
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 5
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "connections were not released"
            time.sleep(0.05)


def test_limits_are_checked_in_server_config(tiny_encoder):
    for field, value in [("max_request_bytes", 0), ("max_embedding_inputs", -1), ("max_stop_strings", True)]:
        with pytest.raises(UsageError, match=f"{field} must be a positive integer"):
            ServerConfig(tiny_encoder, **{field: value})
    with pytest.raises(UsageError, match="max_inflight_bytes"):
        ServerConfig(tiny_encoder, max_request_bytes=4 * MiB, max_inflight_bytes=MiB)
    assert ServerConfig(tiny_encoder, max_request_bytes=MiB).max_inflight_bytes == 8 * MiB


@pytest.mark.parametrize(
    "raw, culprit",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"input": "fox", "dimensions": ' + "9" * 5000 + "}", "more than 4300 digits"),
        ('{"input": "\\ud800 fox"}', "lone UTF-16 surrogate"),
        ('{"input": ["fox", "\\udfff"]}', "lone UTF-16 surrogate"),
        ('{"input": "fox", "user": "\\ud800"}', "lone UTF-16 surrogate"),  # a field the route ignores
        ('{"input": "fox", "x": [1.0, NaN]}', "holds NaN"),  # Python's json takes it; JSON has no NaN
        ('{"input": "fox", "x": [1e999]}', "1e999 (out of range)"),  # a client-made 500 before
    ],
    ids=[
        "deep-nesting",
        "5000-digit-int",
        "lone-high-surrogate",
        "lone-low-surrogate",
        "surrogate-elsewhere",
        "nan",
        "inf",
    ],
)
def test_hostile_json_is_a_400_naming_it(tiny_encoder, raw, culprit):
    from fastapi.testclient import TestClient

    from precast.runtime.server.app import create_app

    app = create_app(ServerConfig(tiny_encoder, model_name="enc", max_queue_delay_ms=0))
    with TestClient(app, raise_server_exceptions=False) as c:
        for path in ("/v1/embeddings", "/v2/models/enc/infer"):
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            assert culprit in _message(r.json()), r.text[:300]
        assert c.post("/v1/embeddings", json={"input": "\U0001f98a fox"}).status_code == 200  # a real pair


def test_a_reset_during_upload_is_counted_as_a_client_disconnect(tiny_encoder):
    with live_server(ServerConfig(tiny_encoder, model_name="enc")) as (url, _):
        reset_mid_upload(url, "/v1/embeddings")
        deadline = time.monotonic() + 10
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics", timeout=2).text
            if metric_value(text, "precast_requests_total", endpoint="/v1/embeddings") >= 1:
                break
            time.sleep(0.05)
        assert metric_value(text, "precast_requests_total", endpoint="/v1/embeddings", status="499") == 1, (
            text
        )
        assert metric_value(text, "precast_requests_total", status="500") == 0
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "fox"}, timeout=10).status_code == 200
