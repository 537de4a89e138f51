"""runtime/triton_python.py: what the Triton Python-backend models share (no Triton, no model)."""

from __future__ import annotations

import json

import numpy as np

from precast.errors import InputError
from precast.runtime.triton_python import StubConfig, request_feeds, run_requests


def test_config_resolves_the_artifact_and_reads_the_parameters(tmp_path):
    config = {
        "max_batch_size": 8,
        "parameters": {"precast_threads": {"string_value": "2"}, "precast_mode": {"string_value": "tensor"}},
    }
    cfg = StubConfig.from_args(
        {"model_config": json.dumps(config), "model_repository": str(tmp_path / "repo" / "m")}
    )
    assert cfg == StubConfig(tmp_path, cfg.params, 8, 2) and cfg.params["precast_mode"] == "tensor"
    bare = StubConfig.from_args({"model_config": "{}", "model_repository": str(tmp_path / "m")})
    assert bare.max_batch_size == 0 and bare.threads is None


class Tensor:
    def __init__(self, array):
        self.array = array

    def as_numpy(self):
        return self.array


def test_requests_group_by_shape_and_a_missing_input_is_its_own_error():
    requests = [
        {"x": np.ones((1, 3), np.float32)},
        {},
        {"x": np.ones((2, 3), np.float32)},
        {"x": np.ones((1, 4))},
    ]
    feeds = request_feeds(requests, ["x"], lambda r, n: Tensor(r[n]) if n in r else None, "stage 's': ")
    assert isinstance(feeds[1], InputError) and str(feeds[1]) == "stage 's': missing input 'x'"
    calls = []
    results = run_requests(feeds, lambda f: (calls.append(f["x"].shape), {"y": f["x"] + 1})[1], batched=True)
    assert calls == [(3, 3), (1, 4)]  # requests 0 and 2 merged; 3 differs past dim 0
    assert results[1] is feeds[1] and results[2]["y"].shape == (2, 3)
    calls.clear()
    run_requests(feeds, lambda f: (calls.append(f["x"].shape), {"y": f["x"]})[1], batched=False)
    assert calls == [(1, 3), (2, 3), (1, 4)]  # Triton does not batch this model: one call per request
