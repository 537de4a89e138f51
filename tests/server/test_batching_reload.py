"""A real uvicorn server on 127.0.0.1: dynamic batching, backpressure, timeouts, hot reload under load."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from precast.runtime.server import ServerConfig
from tests.helpers import ort_run, tiny_mlp
from tests.server.conftest import live_server, metric_value, v2_body, v2_output


def _concurrently(fn, n: int) -> list:
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait(timeout=10)
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_concurrent_requests_run_as_one_batch(mlp_a):
    cfg = ServerConfig(mlp_a, model_name="mlp", max_batch_size=16, max_queue_delay_ms=300)
    xs = [np.random.default_rng(i).standard_normal((1 + i % 2, 8), dtype=np.float32) for i in range(8)]
    with live_server(cfg) as (url, state), httpx.Client(base_url=url, timeout=30) as c:
        results = _concurrently(lambda i: c.post("/v2/models/mlp/infer", json=v2_body(xs[i])), 8)
        metrics = c.get("/metrics").text
    for x, r in zip(xs, results):  # each request gets back its own rows
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(
            v2_output(r.json()), ort_run(tiny_mlp(seed=0), {"x": x})[0], rtol=1e-5, atol=1e-5
        )
    rows = sum(x.shape[0] for x in xs)
    assert metric_value(metrics, "precast_batch_size_sum") == rows
    assert metric_value(metrics, "precast_batch_size_count") < 8, "8 concurrent requests ran as 8 model calls"
    assert state.batcher.max_rows_seen > 2


def test_batching_off_runs_each_request_alone(mlp_a):
    cfg = ServerConfig(mlp_a, model_name="mlp", max_batch_size=1, max_queue_delay_ms=50)
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        results = _concurrently(
            lambda i: c.post("/v2/models/mlp/infer", json=v2_body(np.ones((1, 8), np.float32))), 4
        )
        assert all(r.status_code == 200 for r in results)
        assert metric_value(c.get("/metrics").text, "precast_batch_size_count") == 4


def test_full_queue_answers_429_with_retry_after(mlp_a):
    # A long queue delay holds the first requests in the batcher, so the bounded queue fills up.
    cfg = ServerConfig(mlp_a, model_name="mlp", max_batch_size=64, max_queue_delay_ms=1000, max_queue=2)
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        results = _concurrently(
            lambda i: c.post("/v2/models/mlp/infer", json=v2_body(np.ones((1, 8), np.float32))), 6
        )
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) == 2 and codes.count(429) == 4, codes
        busy = next(r for r in results if r.status_code == 429)
        assert int(busy.headers["retry-after"]) >= 1 and "server busy" in busy.json()["error"]
        metrics = c.get("/metrics").text
        assert metric_value(metrics, "precast_requests_total", status="429") == 4
        # afterwards the server serves normally
        assert c.post("/v2/models/mlp/infer", json=v2_body(np.ones((1, 8), np.float32))).status_code == 200


def test_request_timeout_is_504(mlp_a):
    cfg = ServerConfig(
        mlp_a, model_name="mlp", max_batch_size=64, max_queue_delay_ms=800, request_timeout=0.1
    )
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v2/models/mlp/infer", json=v2_body(np.ones((1, 8), np.float32)))
        assert r.status_code == 504 and "timed out" in r.json()["error"]


def test_reload_under_load_drops_nothing(mlp_a, mlp_b):
    x = np.random.default_rng(3).standard_normal((2, 8), dtype=np.float32)
    want_a = ort_run(tiny_mlp(seed=0), {"x": x})[0]
    want_b = ort_run(tiny_mlp(seed=1), {"x": x})[0]
    cfg = ServerConfig(mlp_a, model_name="mlp", max_batch_size=8, max_queue_delay_ms=2)
    seen = {"a": 0, "b": 0}
    errors: list[str] = []
    reloaded = threading.Event()
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=30) as c:

        def client(i):
            for k in range(40):
                if i == 0 and k == 10:
                    r = c.post("/admin/reload", json={"path": str(mlp_b)})
                    assert r.status_code == 200, r.text
                    reloaded.set()
                r = c.post("/v2/models/mlp/infer", json=v2_body(x))
                if r.status_code != 200:
                    errors.append(r.text)
                    continue
                y = v2_output(r.json())
                which = (
                    "a"
                    if np.allclose(y, want_a, atol=1e-4)
                    else "b"
                    if np.allclose(y, want_b, atol=1e-4)
                    else "?"
                )
                seen[which] = seen.get(which, 0) + 1

        _concurrently(client, 4)
        assert reloaded.is_set()
        assert not errors, errors[:3]
        assert seen.get("?", 0) == 0 and seen["a"] + seen["b"] == 160 and seen["a"] > 0 and seen["b"] > 0, (
            seen
        )
        r = c.post("/v2/models/mlp/infer", json=v2_body(x))
        np.testing.assert_allclose(v2_output(r.json()), want_b, rtol=1e-5, atol=1e-5)
        assert r.json()["model_version"] == "2"
        metrics = c.get("/metrics").text
        assert metric_value(metrics, "precast_reloads_total", result="ok") == 1
        assert metric_value(metrics, "precast_model_version") == 2


def test_failed_reload_keeps_the_old_model(mlp_a, mlp_tampered):
    x = np.ones((1, 8), np.float32)
    cfg = ServerConfig(mlp_a, model_name="mlp")
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/admin/reload", json={"path": str(mlp_tampered)})
        assert r.status_code == 422
        msg = r.json()["error"]
        assert "still serving version 1" in msg and "model.onnx" in msg, msg
        r = c.post("/admin/reload", json={"path": str(mlp_a.parent / "missing")})
        assert r.status_code == 422 and "artifact not found" in r.json()["error"]
        assert (
            c.post("/admin/reload", content="{x", headers={"content-type": "application/json"}).status_code
            == 400
        )
        assert c.post("/admin/reload", content="{x").status_code == 415  # a body must say it is JSON
        r = c.post("/v2/models/mlp/infer", json=v2_body(x))
        assert r.json()["model_version"] == "1"
        np.testing.assert_allclose(
            v2_output(r.json()), ort_run(tiny_mlp(seed=0), {"x": x})[0], rtol=1e-5, atol=1e-5
        )
        status = c.get("/admin/status").json()
        assert status["version"] == 1 and status["last_reload"]["ok"] is False
        assert metric_value(c.get("/metrics").text, "precast_reloads_total", result="failed") == 2
        # reloading the same path again works (a new version of the same files)
        assert c.post("/admin/reload").json()["version"] == 2


def test_admin_needs_a_token_beyond_loopback(mlp_a):
    from fastapi.testclient import TestClient

    from precast.runtime.server.app import create_app

    # host is only recorded here (TestClient binds nothing): the policy is what is tested.
    with TestClient(create_app(ServerConfig(mlp_a, host="0.0.0.0", admin_token=None))) as c:
        r = c.post("/admin/reload")
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]
    with TestClient(create_app(ServerConfig(mlp_a, host="0.0.0.0", admin_token="s3cret"))) as c:
        assert c.post("/admin/reload").status_code == 401
        assert c.post("/admin/reload", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = c.post("/admin/reload", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["version"] == 2


def test_embeddings_of_different_lengths_batch_with_padding(tiny_encoder):
    from tests.server.test_v2_infer import _expected_embedding

    texts = ["fox", "hello world", "the quick brown fox jumps", "lazy dog", "over the lazy dog", "hello"]
    cfg = ServerConfig(tiny_encoder, model_name="enc", max_batch_size=16, max_queue_delay_ms=300)
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        results = _concurrently(lambda i: c.post("/v1/embeddings", json={"input": texts[i]}), len(texts))
        assert metric_value(c.get("/metrics").text, "precast_batch_size_count") < len(texts)
    for t, r in zip(texts, results):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(
            r.json()["data"][0]["embedding"], _expected_embedding(t), rtol=1e-5, atol=1e-6
        )
