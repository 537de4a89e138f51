"""A hot reload keeps the served API: an artifact of another kind, or with other inputs, is refused (409)
and the old model keeps serving; /ready says whether the served endpoints can answer."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.runtime.server import ServerConfig
from tests.helpers import make_model
from tests.server.conftest import compile_tiny, live_server, metric_value, v2_body


def _refused(r, *words) -> str:
    assert r.status_code == 409, r.text
    msg = r.json()["error"]
    assert "still serving version 1" in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_an_embeddings_server_refuses_a_tensor_model(tiny_encoder, mlp_a):
    with (
        live_server(ServerConfig(tiny_encoder, model_name="enc")) as (url, _),
        httpx.Client(base_url=url) as c,
    ):
        _refused(c.post("/admin/reload", json={"path": str(mlp_a)}), "tensor", "embeddings")
        r = c.post("/v1/embeddings", json={"input": "fox"})
        assert r.status_code == 200, r.text
        assert c.get("/ready").status_code == 200
        status = c.get("/admin/status").json()
        assert (
            status["version"] == 1 and status["kind"] == "embeddings" and status["last_reload"]["ok"] is False
        )
        assert metric_value(c.get("/metrics").text, "precast_reloads_total", result="failed") == 1
        assert c.post("/admin/reload").json()["version"] == 2  # the same kind reloads


def test_a_tensor_server_refuses_other_inputs(mlp_a, tmp_path):
    relu = make_model(
        [helper.make_node("Relu", ["z"], ["y"])],
        [("z", TensorProto.FLOAT, ["batch", 8])],
        [("y", TensorProto.FLOAT, ["batch", 8])],
        {},
    )
    other = compile_tiny(relu, tmp_path / "relu")
    with live_server(ServerConfig(mlp_a, model_name="mlp")) as (url, _), httpx.Client(base_url=url) as c:
        _refused(c.post("/admin/reload", json={"path": str(other)}), "z:float32", "x:float32")
        r = c.post("/v2/models/mlp/infer", json=v2_body(np.ones((1, 8), np.float32)))
        assert r.status_code == 200 and r.json()["model_version"] == "1"


@pytest.mark.slow
def test_an_embeddings_server_refuses_an_llm(tiny_encoder, llm_artifact):
    with (
        live_server(ServerConfig(tiny_encoder, model_name="enc")) as (url, _),
        httpx.Client(base_url=url) as c,
    ):
        _refused(
            c.post("/admin/reload", json={"path": str(llm_artifact)}, timeout=60), "llm", "/v1/completions"
        )
        assert c.post("/v1/embeddings", json={"input": "fox"}).status_code == 200
        assert c.get("/ready").status_code == 200
        assert metric_value(c.get("/metrics").text, "precast_reloads_total", result="failed") == 1


@pytest.mark.slow
def test_ready_is_503_when_the_llm_engine_loop_is_gone(llm_artifact):
    cfg = ServerConfig(llm_artifact, model_name="tiny", llm={"num_blocks": 16})
    with live_server(cfg) as (url, state), httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/ready").status_code == 200
        state.host.current.llm.engine.stop()  # what a crashed step loop leaves: nobody steps the requests
        deadline = time.monotonic() + 5
        while c.get("/ready").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["ready"] is False
        assert c.get("/health").status_code == 200  # alive, not ready: restart it, do not route to it
