"""KServe v2 infer, metadata, health, bad input and /v1/embeddings through FastAPI's TestClient."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from precast.runtime.server import ServerConfig
from precast.runtime.server.app import create_app
from tests.helpers import ort_run, tiny_mlp
from tests.server.conftest import VOCAB, encoder_table, metric_value, v2_body, v2_output


@pytest.fixture
def client(mlp_a):
    with TestClient(create_app(ServerConfig(mlp_a, model_name="mlp"))) as c:
        yield c


def test_infer_matches_onnxruntime(client, rng):
    x = rng.standard_normal((3, 8), dtype=np.float32)
    r = client.post("/v2/models/mlp/infer", json={**v2_body(x), "id": "req-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "mlp" and body["model_version"] == "1" and body["id"] == "req-1"
    np.testing.assert_allclose(v2_output(body), ort_run(tiny_mlp(seed=0), {"x": x})[0], rtol=1e-5, atol=1e-5)
    # the versioned route, and asking for a subset of outputs
    r = client.post("/v2/models/mlp/versions/1/infer", json={**v2_body(x), "outputs": [{"name": "y"}]})
    assert r.status_code == 200 and [o["name"] for o in r.json()["outputs"]] == ["y"]


def test_metadata_and_health(client):
    meta = client.get("/v2/models/mlp").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["versions"] == ["1"]
    for path in ("/health", "/ready", "/v2/health/live", "/v2/health/ready", "/v2/models/mlp/ready"):
        assert client.get(path).status_code == 200, path
    assert client.get("/v1/models").json()["data"][0]["id"] == "mlp"


@pytest.mark.parametrize(
    "body, status, culprit",
    [
        ("{not json", 400, "malformed JSON"),
        ('{"inputs": []}', 400, "non-empty 'inputs'"),
        (
            '{"inputs": [{"name": "x", "shape": [1, 7], "datatype": "FP32", "data": [0,0,0,0,0,0,0]}]}',
            400,
            "input 'x': dim 1 must be 8",
        ),
        (
            '{"inputs": [{"name": "x", "shape": [1, 8], "datatype": "INT64", "data": [0,0,0,0,0,0,0,0]}]}',
            400,
            "input 'x': expected dtype float32, got int64",
        ),
        (
            '{"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0,0,0]}]}',
            400,
            "input 'x': shape [1, 8] needs 8 values, got 3",
        ),
        (
            '{"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP99", "data": [0]}]}',
            400,
            "unsupported datatype",
        ),
        (
            '{"inputs": [{"name": "z", "shape": [1, 8], "datatype": "FP32", "data": [0,0,0,0,0,0,0,0]}]}',
            400,
            "unknown input 'z'",
        ),
        (
            '{"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": ["a","b","c","d","e","f","g","h"]}]}',
            400,
            "input 'x': data is not FP32",
        ),
        (
            (
                '{"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0,0,0,0,0,0,0,0]}],'
                ' "outputs": [{"name": "nope"}]}'
            ),
            400,
            "unknown output 'nope'",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_the_culprit(client, body, status, culprit):
    r = client.post("/v2/models/mlp/infer", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and culprit in r.json()["error"], r.text
    ok = client.post("/v2/models/mlp/infer", json=v2_body(np.zeros((1, 8), np.float32)))
    assert ok.status_code == 200  # the server keeps serving


def test_unknown_model_and_version(client):
    r = client.post("/v2/models/other/infer", json=v2_body(np.zeros((1, 8), np.float32)))
    assert r.status_code == 404 and "unknown model 'other'" in r.json()["error"]
    r = client.post("/v2/models/mlp/versions/7/infer", json=v2_body(np.zeros((1, 8), np.float32)))
    assert r.status_code == 404 and "no version 7" in r.json()["error"]
    assert client.get("/v2/models/other").status_code == 404


def test_metrics_count_requests_by_status(client):
    client.post("/v2/models/mlp/infer", json=v2_body(np.zeros((2, 8), np.float32)))
    client.post("/v2/models/mlp/infer", content="{")
    text = client.get("/metrics").text
    assert metric_value(text, "precast_requests_total", endpoint="/v2/models/{name}/infer", status="200") == 1
    assert metric_value(text, "precast_requests_total", endpoint="/v2/models/{name}/infer", status="400") == 1
    assert metric_value(text, "precast_batch_size_count") == 1
    assert (
        metric_value(text, "precast_request_latency_seconds_count", endpoint="/v2/models/{name}/infer") == 2
    )
    assert "precast_queue_depth 0.0" in text


def test_embeddings_not_offered_for_a_non_encoder(client):
    r = client.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "not a text encoder" in r.json()["error"]["message"]


def _expected_embedding(text: str) -> np.ndarray:
    table = encoder_table()
    ids = [VOCAB.index(w) if w in VOCAB else 1 for w in text.split()]
    v = table[ids].mean(axis=0)
    return v / np.linalg.norm(v)


def test_embeddings_mean_pool_and_normalize(tiny_encoder):
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "fox"]
    with TestClient(create_app(ServerConfig(tiny_encoder, model_name="enc", max_queue_delay_ms=0))) as c:
        r = c.post("/v1/embeddings", json={"input": texts, "model": "enc"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert body["usage"]["prompt_tokens"] == 2 + 9 + 1
        for d, t in zip(body["data"], texts):
            np.testing.assert_allclose(d["embedding"], _expected_embedding(t), rtol=1e-5, atol=1e-6)
        r = c.post("/v1/embeddings", json={"input": "fox", "encoding_format": "base64"})
        import base64

        vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), np.float32)
        np.testing.assert_allclose(vec, _expected_embedding("fox"), rtol=1e-5, atol=1e-6)
        for bad, culprit in [
            ({"input": []}, "'input'"),
            ({"input": [""]}, "empty string"),
            ({"input": "x", "model": "gpt"}, "unknown model 'gpt'"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ]:
            r = c.post("/v1/embeddings", json=bad)
            assert r.status_code in (400, 404) and culprit in r.json()["error"]["message"], r.text
