"""Target `triton`: repository layout, config.pbtxt contents, runtime verification of the served file,
and the Python-backend model run in-process against a stand-in for Triton's pb_utils (the real
tritonserver runs in test_triton_smoke.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.artifact.manifest import dump_json, sha256_file
from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from precast.runtime import load
from precast.targets import get_target
from tests.helpers import make_model, ort_run, save, tiny_mlp
from tests.targets.pbtxt import one, parse
from tests.targets.triton_fixtures import llama_triton, mlp_triton, with_model_py
from tests.targets.triton_stub import Request, load_python_model, stub_module

OPTIONS = {
    "preferred_batch_sizes": "4,8",
    "max_queue_delay_us": "500",
    "instance_count": "2",
    "instance_kind": "gpu",
}


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return mlp_triton(tmp_path_factory, **OPTIONS)


def _config(art: Path, model: str) -> dict:
    return parse((art / "model_repository" / model / "config.pbtxt").read_text())


def test_repository_layout_and_manifest_block(art):
    repo = art / "model_repository"
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()) == [
        "mlp/1/model.onnx",
        "mlp/config.pbtxt",
        "mlp_precast/1/model.py",
        "mlp_precast/config.pbtxt",
    ]
    manifest = json.loads((art / "manifest.json").read_text())
    block = manifest["target"]
    assert block["model"] == "model_repository/mlp/1/model.onnx" and block["providers"] == [
        "CPUExecutionProvider"
    ]
    assert block["triton"] == {
        "repository": "model_repository",
        "onnx_model": "mlp",
        "python_model": "mlp_precast",
        "version": 1,
        "max_batch_size": 8,
        "batch_dim": "batch",
        "mode": "tensor",
        "decoupled": False,
        "instance_kind": "KIND_GPU",
    }
    assert manifest["parity"]["ok"] and "model_repository/mlp_precast/1/model.py" in manifest["files"]


def test_onnx_model_config(art):
    cfg = _config(art, "mlp")
    assert one(cfg, "name") == "mlp" and one(cfg, "platform") == "onnxruntime_onnx" and "backend" not in cfg
    assert one(cfg, "max_batch_size") == 8 and one(cfg, "default_model_filename") == "model.onnx"
    # The batch dim is Triton's: dims start after it.
    assert [(one(t, "name"), one(t, "data_type"), t["dims"]) for t in cfg["input"]] == [
        ("x", "TYPE_FP32", [8])
    ]
    assert [(one(t, "name"), one(t, "data_type"), t["dims"]) for t in cfg["output"]] == [
        ("y", "TYPE_FP32", [4])
    ]
    batching = one(cfg, "dynamic_batching")
    assert batching["preferred_batch_size"] == [4, 8] and one(batching, "max_queue_delay_microseconds") == 500
    assert cfg["instance_group"] == [{"count": [2], "kind": ["KIND_GPU"]}]


def test_python_model_config_points_at_the_artifact(art):
    cfg = _config(art, "mlp_precast")
    assert one(cfg, "backend") == "python" and "platform" not in cfg and one(cfg, "max_batch_size") == 8
    assert cfg["input"] == _config(art, "mlp")["input"] and "model_transaction_policy" not in cfg
    assert cfg["instance_group"] == [{"count": [2], "kind": ["KIND_CPU"]}]  # the artifact runs on ORT CPU
    params = {one(p, "key"): one(one(p, "value"), "string_value") for p in cfg["parameters"]}
    assert params["precast_mode"] == "tensor"
    model_dir = art / "model_repository" / "mlp_precast"
    assert (model_dir / params["precast_artifact"]).resolve() == art.resolve()


def test_runtime_runs_the_served_onnx_file(art, rng):
    model = load(art)
    assert model.target == "triton" and model.providers == ["CPUExecutionProvider"]
    x = rng.standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_allclose(
        model.run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5
    )
    served = ort_run(art / "model_repository" / "mlp" / "1" / "model.onnx", {"x": x})[0]
    np.testing.assert_allclose(served, ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)


def _two_input_model():
    """a[batch, n] + b[n] (b has no batch dim) -> c[batch, n], d = ReduceSum(a) -> [batch, 1]."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("ReduceSum", ["a", "axes"], ["d"], keepdims=1),
    ]
    ins = [("a", TensorProto.FLOAT, ["batch", "n"]), ("b", TensorProto.FLOAT, ["n"])]
    outs = [("c", TensorProto.FLOAT, ["batch", "n"]), ("d", TensorProto.FLOAT, ["batch", 1])]
    return make_model(nodes, ins, outs, initializers={"axes": np.array([1], dtype=np.int64)})


def test_no_shared_batch_dim_means_no_triton_batching(tmp_path):
    src = save(_two_input_model(), tmp_path / "m.onnx")
    compile_model(str(src), tmp_path / "art", CompileOptions(targets=("triton",), dims={"batch": 2, "n": 3}))
    cfg = _config(tmp_path / "art", "model")
    assert one(cfg, "max_batch_size") == 0 and "dynamic_batching" not in cfg
    assert {one(t, "name"): t["dims"] for t in cfg["input"]} == {"a": [-1, -1], "b": [-1]}
    assert {one(t, "name"): t["dims"] for t in cfg["output"]} == {"c": [-1, -1], "d": [-1, 1]}


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("instance_kind", "tpu", "instance_kind must be cpu|gpu"),
        ("preferred_batch_sizes", "4,16", "preferred batch size 16 is outside"),
        ("preferred_batch_sizes", "four", "comma-separated integers"),
        ("model_name", "../evil", "folder-safe name"),
        ("mode", "chat", "auto|tensor|llm"),
    ],
)
def test_bad_options_name_the_option(tmp_path, option, value, match):
    src = save(tiny_mlp(), tmp_path / "mlp.onnx")
    with pytest.raises(UsageError, match=match):
        compile_model(
            str(src), tmp_path / "art", CompileOptions(targets=("triton",), target_options={option: value})
        )
    assert not (tmp_path / "art").exists()


def test_unknown_option_is_a_usage_error():
    with pytest.raises(UsageError, match="did you mean 'instance_count'"):
        get_target("triton")({"instance_cnt": "2"})


# -- the Python-backend model, in-process ------------------------------------------------------------
@pytest.fixture
def pb_utils(monkeypatch):
    """Stand-in for triton_python_backend_utils with the calls model.py makes."""
    mod = stub_module()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", mod)
    return mod


def test_python_model_batches_requests_and_isolates_a_bad_one(art, pb_utils, rng):
    instance = load_python_model(art, "mlp_precast")
    xs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 3, 2)]
    requests = [Request(x=x) for x in xs] + [Request(x=xs[0].astype(np.float64)), Request()]
    responses = instance.execute(requests)
    for x, r in zip(xs, responses):
        assert r.error is None
        np.testing.assert_allclose(r.outputs["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert "expected dtype float32" in responses[3].error and "'x'" in responses[3].error
    assert responses[4].error == "missing input 'x'"
    load(art)  # the artifact is still exactly what the manifest lists (no __pycache__ left beside model.py)


def test_python_model_of_the_previous_release_runs_on_this_runtime(art, pb_utils, tmp_path, rng):
    """A Triton artifact's model.py runs against the serving host's precast. The previous release's reads
    the manifest as a dict (read_manifest(root)["files"]); the typed Manifest broke it (TypeError)."""
    old = tmp_path / "old"
    shutil.copytree(art, old)
    rel = "model_repository/mlp_precast/1/model.py"
    text = (old / rel).read_text()
    for line in text.splitlines():  # the line as 10513b7 wrote it (the file may say so itself)
        if "in sorted(read_manifest(root)" in line:
            text = text.replace(line, '    for rel, digest in sorted(read_manifest(root)["files"].items()):')
    (old / rel).write_text(text)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"][rel] = sha256_file(old / rel)
    dump_json(manifest, old / "manifest.json")
    instance = load_python_model(old, "mlp_precast")
    x = rng.standard_normal((2, 8)).astype(np.float32)
    (response,) = instance.execute([Request(x=x)])
    assert response.error is None
    np.testing.assert_allclose(response.outputs["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_python_model_streams_llm_tokens_like_the_engine(tmp_path_factory, pb_utils):
    from precast.runtime.llm import Engine, SamplingParams

    art = llama_triton(tmp_path_factory)
    cfg = _config(art, "llama_precast")
    assert one(one(cfg, "model_transaction_policy"), "decoupled") is True
    assert [one(t, "name") for t in cfg["output"]] == ["text_output", "token_id", "finish_reason"]
    assert _config(art, "llama")["instance_group"] and one(_config(art, "llama"), "max_batch_size") == 0
    prompts = ["def main(", "import os\n"]
    expected = Engine.load(art).generate(prompts, SamplingParams(max_tokens=6))
    instance = load_python_model(art, "llama_precast")
    try:
        requests = [
            Request(text_input=np.array([p.encode()], dtype=object), max_tokens=np.array([6], np.int32))
            for p in prompts
        ]
        bad = Request(text_input=np.array([b"x"], dtype=object), temperature=np.array([-1.0], np.float32))
        assert instance.execute([*requests, bad]) is None  # decoupled: answers go through the senders
        for req, exp in zip(requests, expected):
            _wait(lambda req=req: req.sender.sent and req.sender.sent[-1][1] == 1)
            sent = req.sender.sent
            assert [int(r.outputs["token_id"][0]) for r, _ in sent] == exp.token_ids
            assert "".join(r.outputs["text_output"][0].decode() for r, _ in sent) == exp.text
            assert [f for _, f in sent] == [0] * (len(sent) - 1) + [1]
            assert sent[-1][0].outputs["finish_reason"][0].decode() == exp.finish_reason
        ((response, flags),) = bad.sender.sent
        assert flags == 1 and "temperature" in response.error
    finally:
        instance.finalize()


def _wait(cond, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.01)


def test_python_model_of_the_release_before_the_layout_runs_on_this_runtime(art, pb_utils, tmp_path, rng):
    """25d92ff's model.py (tests/data/triton_v1), which imports precast.runtime.errors and
    precast.runtime.manifest from before those modules moved, on this runtime."""
    data = Path(__file__).resolve().parent.parent / "data" / "triton_v1"
    old = with_model_py(art, tmp_path / "old", "mlp_precast", data / "python_model.py")
    instance = load_python_model(old, "mlp_precast")
    x = rng.standard_normal((3, 8)).astype(np.float32)
    (response,) = instance.execute([Request(x=x)])
    assert response.error is None
    np.testing.assert_allclose(response.outputs["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)
