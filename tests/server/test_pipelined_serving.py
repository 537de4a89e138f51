"""`precast serve` of a staged artifact: the batcher's batches go through the StagePipeline, one batcher worker
per stage, and every request gets its own outputs (same numbers as the unsplit model)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from precast.runtime.server import ServerConfig
from precast.runtime.server.pipelined import PipelinedModel
from tests.runtime.test_pipeline import (
    expected,
    request,
    stage_threads,
    staged_artifact,
)
from tests.server.conftest import live_server


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return staged_artifact(tmp_path_factory.mktemp("served"), 2)


def body(feeds: dict[str, np.ndarray]) -> dict:
    kinds = {"ids": "INT64", "mask": "FP32"}
    return {
        "inputs": [
            {"name": n, "shape": list(a.shape), "datatype": kinds[n], "data": a.ravel().tolist()}
            for n, a in feeds.items()
        ]
    }


def output(resp: dict, name: str) -> np.ndarray:
    out = next(o for o in resp["outputs"] if o["name"] == name)
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_staged_artifact_is_served_through_its_pipeline(staged):
    cfg = ServerConfig(staged, model_name="enc", max_batch_size=8, max_queue_delay_ms=20)
    feeds = [request(i, rows=1 + i % 2) for i in range(12)]
    barrier = threading.Barrier(6)

    def call(i: int, client: httpx.Client):
        if i < 6:
            barrier.wait(timeout=10)
        return client.post("/v2/models/enc/infer", json=body(feeds[i]))

    with live_server(cfg) as (url, state), httpx.Client(base_url=url, timeout=60) as c:
        model = state.host.current.model
        assert isinstance(model, PipelinedModel) and model.stages == 2
        # the pipeline shares the Model's stage sessions (one copy of the weights), 1 thread each
        assert [s.session for s in model.pipeline.stages] == [s for _, s in model.session.stages]
        assert len(state.batcher._threads) == 2  # one batch in flight per stage
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: call(i, c), range(12)))
        assert model.pipeline.stats.batches >= 1
    for f, r in zip(feeds, results):  # each request gets back its own rows
        assert r.status_code == 200, r.text
        want = expected(f)
        for name in ("hidden", "embedded"):
            np.testing.assert_allclose(output(r.json(), name), want[name], rtol=1e-5, atol=1e-6)
    assert not stage_threads()  # shutdown closed the pipeline and joined its workers
