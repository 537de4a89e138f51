"""Target `triton` with a staged model (pipeline ending in split-stages): one model per stage, an ensemble
under the unsplit model's name wiring them, the manifest's stages block naming the served files, and the
stage Python models chained in-process against a stand-in for Triton's pb_utils (the real tritonserver
runs the ensemble in test_triton_smoke.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from precast.runtime import load
from precast.targets.triton import Triton
from precast.targets.triton_config import (
    EnsembleStep,
    ModelConfig,
    TensorConfig,
    render_config,
)
from precast.targets.triton_ensemble import check_wiring
from tests.helpers import ort_run, save, tiny_mlp
from tests.targets.pbtxt import one, parse
from tests.targets.triton_fixtures import (
    llama_triton,
    masked_stack,
    mlp_triton,
    staged_llama_triton,
    staged_masked_triton,
    staged_mlp_triton,
    with_model_py,
)
from tests.targets.triton_stub import Request, load_python_model, stub_module

OPTIONS = {"preferred_batch_sizes": "4,8", "max_queue_delay_us": "500", "stage_instances": "1,2"}
STAGED = Triton.default_pipeline + ",split-stages{n=2}"
_ORT_DTYPES = {"tensor(float)": "TYPE_FP32", "tensor(int64)": "TYPE_INT64"}


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return staged_mlp_triton(tmp_path_factory, **OPTIONS)


def _config(art: Path, model: str) -> dict:
    return parse((art / "model_repository" / model / "config.pbtxt").read_text())


def _io(cfg: dict, key: str) -> list[tuple[str, str, list[int]]]:
    return [(one(t, "name"), one(t, "data_type"), t["dims"]) for t in cfg.get(key, [])]


def _steps(cfg: dict) -> list[dict]:
    return one(cfg, "ensemble_scheduling")["step"]


def _map(step: dict, key: str) -> dict[str, str]:
    return {one(e, "key"): one(e, "value") for e in step.get(key, [])}


def test_repository_manifest_and_stages_block(art):
    repo = art / "model_repository"
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()) == [
        "mlp_staged/1/ENSEMBLE.txt",  # the version folder Triton requires, kept by a packed artifact
        "mlp_staged/config.pbtxt",
        "mlp_staged_stage_0/1/model.onnx",
        "mlp_staged_stage_0/1/model.py",
        "mlp_staged_stage_0/config.pbtxt",
        "mlp_staged_stage_1/1/model.onnx",
        "mlp_staged_stage_1/1/model.py",
        "mlp_staged_stage_1/config.pbtxt",
    ]
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["parity"]["ok"]
    block = manifest["target"]
    assert block["triton"] == {
        "repository": "model_repository",
        "ensemble": "mlp_staged",
        "stage_models": ["mlp_staged_stage_0", "mlp_staged_stage_1"],
        "stage_backend": "python",
        "version": 1,
        "max_batch_size": 8,
        "batch_dim": "batch",
        "stage_batching": [True, True],
        "mode": "tensor",
        "decoupled": False,
        "instance_kind": "KIND_CPU",
    }
    stages = manifest["stages"]
    assert stages["n"] == 2 and stages["by"] == "bytes"
    assert [s["model"] for s in stages["stages"]] == [
        f"model_repository/mlp_staged_stage_{k}/1/model.onnx" for k in range(2)
    ]
    assert "model" not in block  # the stages block names the files, as ort-cpu's staged block
    # The boundary tensor leaves stage 0 and enters stage 1; the model's IO are the ends.
    (boundary,) = stages["stages"][0]["outputs"]
    assert stages["stages"][0]["inputs"] == ["x"] and stages["stages"][1] == {
        **stages["stages"][1],
        "inputs": [boundary],
        "outputs": ["y"],
    }


def test_ensemble_has_the_unsplit_models_name_and_io(art, tmp_path_factory):
    cfg = _config(art, "mlp_staged")
    unsplit = _config(mlp_triton(tmp_path_factory, **OPTIONS), "mlp")
    assert one(cfg, "platform") == "ensemble" and "backend" not in cfg
    assert one(cfg, "max_batch_size") == one(unsplit, "max_batch_size") == 8
    assert _io(cfg, "input") == _io(unsplit, "input") == [("x", "TYPE_FP32", [8])]
    assert _io(cfg, "output") == _io(unsplit, "output") == [("y", "TYPE_FP32", [4])]
    # The ensemble scheduler runs it: no instances or batcher of its own (each stage has them).
    assert "instance_group" not in cfg and "dynamic_batching" not in cfg


def test_steps_wire_every_boundary_tensor_once(art):
    manifest = json.loads((art / "manifest.json").read_text())
    cfg = _config(art, "mlp_staged")
    steps = _steps(cfg)
    assert [one(s, "model_name") for s in steps] == ["mlp_staged_stage_0", "mlp_staged_stage_1"]
    available = {one(t, "name") for t in cfg["input"]}
    written: list[str] = []
    for step, stage in zip(steps, manifest["stages"]["stages"]):
        inputs, outputs = _map(step, "input_map"), _map(step, "output_map")
        assert list(inputs) == stage["inputs"] and list(outputs) == stage["outputs"]
        assert set(inputs.values()) <= available, f"{one(step, 'model_name')} reads an unwritten tensor"
        written += outputs.values()
        available |= set(outputs.values())
    assert len(written) == len(set(written)), "an ensemble tensor is written twice"
    assert not set(written) & {one(t, "name") for t in cfg["input"]}
    assert {one(t, "name") for t in cfg["output"]} <= set(written)
    # Every boundary tensor (what crosses a cut) is an output of one step and an input of a later one.
    for k, step in enumerate(steps[:-1]):
        for tensor in _map(step, "output_map").values():
            assert any(tensor in _map(later, "input_map").values() for later in steps[k + 1 :])


def test_stage_configs_match_their_onnx_files(art):
    for k in range(2):
        name = f"mlp_staged_stage_{k}"
        cfg = _config(art, name)
        sess = ort.InferenceSession(str(art / "model_repository" / name / "1" / "model.onnx"))
        for key, args in (("input", sess.get_inputs()), ("output", sess.get_outputs())):
            # The batch dim is Triton's (max_batch_size > 0): the config's dims start after it.
            assert [a.shape[0] for a in args] == ["batch"] * len(args)
            expected = [
                (a.name, _ORT_DTYPES[a.type], [d if isinstance(d, int) else -1 for d in a.shape[1:]])
                for a in args
            ]
            assert _io(cfg, key) == expected, f"{name} {key}"
        assert one(cfg, "backend") == "python" and one(cfg, "max_batch_size") == 8
        batching = one(cfg, "dynamic_batching")
        assert (
            batching["preferred_batch_size"] == [4, 8]
            and one(batching, "max_queue_delay_microseconds") == 500
        )
        params = {one(p, "key"): one(one(p, "value"), "string_value") for p in cfg["parameters"]}
        assert params["precast_stage"] == str(k)
        assert (art / "model_repository" / name / params["precast_artifact"]).resolve() == art.resolve()
    # stage_instances=1,2: each stage its own instance group (the python stub runs ORT on the CPU).
    assert _config(art, "mlp_staged_stage_0")["instance_group"] == [{"count": [1], "kind": ["KIND_CPU"]}]
    assert _config(art, "mlp_staged_stage_1")["instance_group"] == [{"count": [2], "kind": ["KIND_CPU"]}]


def test_runtime_and_chained_stage_files_match_the_unsplit_model(art, rng):
    x = rng.standard_normal((5, 8)).astype(np.float32)
    expected = ort_run(tiny_mlp(), {"x": x})[0]
    np.testing.assert_allclose(load(art).run({"x": x})["y"], expected, rtol=1e-5, atol=1e-5)
    repo = art / "model_repository"
    (boundary,) = json.loads((art / "manifest.json").read_text())["stages"]["stages"][0]["outputs"]
    (h,) = ort_run(repo / "mlp_staged_stage_0" / "1" / "model.onnx", {"x": x})
    (y,) = ort_run(repo / "mlp_staged_stage_1" / "1" / "model.onnx", {boundary: h})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def pb_utils(monkeypatch):
    mod = stub_module()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", mod)
    return mod


def test_stage_python_models_chain_like_the_ensemble(art, pb_utils, rng):
    """What Triton's ensemble does with one dynamic batch: stage 0's responses feed stage 1's requests."""
    manifest = json.loads((art / "manifest.json").read_text())
    (boundary,) = manifest["stages"]["stages"][0]["outputs"]
    first, second = (load_python_model(art, f"mlp_staged_stage_{k}") for k in range(2))
    xs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 3, 2)]
    mid = first.execute([Request(x=x) for x in xs] + [Request(x=xs[0].astype(np.float64)), Request()])
    assert all(r.error is None for r in mid[:3])
    assert "stage 'model_repository/mlp_staged_stage_0/1/model.onnx' rejected" in mid[3].error
    assert "missing input 'x'" in mid[4].error
    out = second.execute([Request(**{boundary: r.outputs[boundary]}) for r in mid[:3]])
    for x, r in zip(xs, out):
        assert r.error is None and list(r.outputs) == ["y"]
        np.testing.assert_allclose(r.outputs["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)
    load(art)  # no __pycache__ left beside the stage model.py files


def test_stage_model_refuses_a_modified_stage_file(tmp_path_factory, pb_utils, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(staged_mlp_triton(tmp_path_factory, **OPTIONS), art)
    onnx_file = art / "model_repository" / "mlp_staged_stage_1" / "1" / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")
    load_python_model(art, "mlp_staged_stage_0")  # stage 0 hashes only its own files
    from precast.errors import IntegrityError

    with pytest.raises(IntegrityError, match="mlp_staged_stage_1/1/model.onnx' is missing or was modified"):
        load_python_model(art, "mlp_staged_stage_1")


def test_three_stages_pass_the_mask_through_as_one_ensemble_tensor(tmp_path_factory, pb_utils, rng):
    """Stage 0 computes the mask every layer reads; stage 1 passes it through to stage 2 (an input and an
    output of stage 1's ONNX). In the ensemble it is written once, by stage 0, and read by stages 1 and 2."""
    art = staged_masked_triton(tmp_path_factory)
    stages = json.loads((art / "manifest.json").read_text())["stages"]["stages"]
    assert [s["inputs"] for s in stages] == [["x", "m"], ["mask", "h1"], ["mask", "h2"]]
    assert [s["outputs"] for s in stages] == [["mask", "h1"], ["mask", "h2"], ["y"]]
    steps = _steps(_config(art, "masked"))
    assert [_map(s, "output_map") for s in steps] == [{"mask": "mask", "h1": "h1"}, {"h2": "h2"}, {"y": "y"}]
    assert [_map(s, "input_map") for s in steps] == [
        {"x": "x", "m": "m"},
        {"mask": "mask", "h1": "h1"},
        {"mask": "mask", "h2": "h2"},
    ]
    # Stage 1's Triton outputs leave the passed-through mask out; its int64 input stays int64 at stage 0.
    assert _io(_config(art, "masked_stage_1"), "output") == [("h2", "TYPE_FP32", [8])]
    assert _io(_config(art, "masked_stage_0"), "input") == [("x", "TYPE_FP32", [8]), ("m", "TYPE_INT64", [8])]
    # The three stage models chained as the ensemble scheduler chains them == the unsplit graph.
    models = [load_python_model(art, f"masked_stage_{k}") for k in range(3)]
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32), "m": rng.integers(0, 2, (3, 8))}
    tensors = dict(feeds)
    for model in models:
        wanted = {n: tensors[n] for n in model.stage.inputs}
        (response,) = model.execute([Request(**wanted)])
        assert response.error is None
        assert not set(response.outputs) & set(tensors), "a stage wrote an ensemble tensor twice"
        tensors.update(response.outputs)
    np.testing.assert_allclose(tensors["y"], ort_run(masked_stack(), feeds)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(load(art).run(feeds)["y"], tensors["y"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_staged_llm_is_served_by_the_decoupled_engine(tmp_path_factory, pb_utils):
    """A staged causal-LM step graph is no ensemble (its engine binds each stage's KV in place): the decoupled
    precast model runs the staged artifact's engine, and streams the unsplit artifact's greedy tokens."""
    from precast.runtime.llm import Engine, SamplingParams

    art = staged_llama_triton(tmp_path_factory)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["triton"]["python_model"] == "llama_staged_precast"
    assert manifest["target"]["triton"]["decoupled"] and "ensemble" not in manifest["target"]["triton"]
    assert [s["model"] for s in manifest["stages"]["stages"]] == [
        "stages/stage_0.onnx",
        "stages/stage_1.onnx",
    ]
    assert sorted(p.name for p in (art / "model_repository").iterdir()) == ["llama_staged_precast"]
    cfg = _config(art, "llama_staged_precast")
    assert one(one(cfg, "model_transaction_policy"), "decoupled") is True
    prompts = ["def main(", "import os\n"]
    expected = Engine.load(llama_triton(tmp_path_factory)).generate(prompts, SamplingParams(max_tokens=6))
    instance = load_python_model(art, "llama_staged_precast")
    try:
        requests = [
            Request(text_input=np.array([p.encode()], dtype=object), max_tokens=np.array([6], np.int32))
            for p in prompts
        ]
        assert instance.execute(requests) is None  # decoupled: answers go through the senders
        for req, exp in zip(requests, expected):
            _wait(lambda req=req: req.sender.sent and req.sender.sent[-1][1] == 1)
            assert [int(r.outputs["token_id"][0]) for r, _ in req.sender.sent] == exp.token_ids
    finally:
        instance.finalize()


def _wait(cond, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.01)


def _compile_staged(tmp_path: Path, **options: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = save(tiny_mlp(), tmp_path / "mlp.onnx")
    opts = CompileOptions(targets=("triton",), passes=STAGED, target_options=options)
    compile_model(str(src), tmp_path / "art", opts)
    return tmp_path / "art"


def test_onnxruntime_stage_backend_and_no_batching(tmp_path):
    art = _compile_staged(tmp_path, stage_backend="onnxruntime", instance_kind="gpu", max_batch_size="0")
    repo = art / "model_repository"
    assert not list(repo.rglob("model.py"))
    ensemble = _config(art, "model")
    assert one(ensemble, "max_batch_size") == 0 and _io(ensemble, "input") == [("x", "TYPE_FP32", [-1, 8])]
    for k in range(2):
        cfg = _config(art, f"model_stage_{k}")
        assert (
            one(cfg, "platform") == "onnxruntime_onnx" and one(cfg, "default_model_filename") == "model.onnx"
        )
        assert one(cfg, "max_batch_size") == 0 and "dynamic_batching" not in cfg
        assert cfg["instance_group"] == [{"count": [1], "kind": ["KIND_GPU"]}]
    assert _io(_config(art, "model_stage_1"), "output") == [("y", "TYPE_FP32", [-1, 4])]
    x = np.ones((3, 8), np.float32)
    np.testing.assert_allclose(
        load(art).run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5
    )


def test_staged_triton_artifact_is_reproducible(tmp_path):
    a = json.loads((_compile_staged(tmp_path / "a") / "manifest.json").read_text())["files"]
    b = json.loads((_compile_staged(tmp_path / "b") / "manifest.json").read_text())["files"]
    assert a == b and any(rel.endswith("ENSEMBLE.txt") for rel in a)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"stage_instances": "1,2,3"}, "stage_instances lists 3 counts for a model of 2 stages"),
        ({"stage_instances": "1,x"}, "stage_instances must be comma-separated counts >= 1"),
        ({"stage_instances": "0,1"}, "stage_instances must be comma-separated counts >= 1"),
        ({"stage_backend": "tensorrt"}, "stage_backend must be python|onnxruntime"),
    ],
)
def test_bad_staged_options_name_the_option(tmp_path, options, match):
    with pytest.raises(UsageError, match=match):
        _compile_staged(tmp_path, **options)
    assert not (tmp_path / "art").exists()


def test_render_and_check_wiring_refuse_broken_ensembles():
    x, h, y = (TensorConfig(n, "TYPE_FP32", (4,)) for n in ("x", "h", "y"))
    stages = [
        ModelConfig(name="s0", backend="python", inputs=[x], outputs=[h]),
        ModelConfig(name="s1", backend="python", inputs=[h], outputs=[y]),
    ]

    def ensemble(*steps):
        return ModelConfig(name="e", platform="ensemble", inputs=[x], outputs=[y], ensemble_steps=list(steps))

    good = ensemble(EnsembleStep("s0", {"x": "x"}, {"h": "h"}), EnsembleStep("s1", {"h": "h"}, {"y": "y"}))
    check_wiring(good, stages)
    assert "ensemble_scheduling" in parse(render_config(good))
    with pytest.raises(UsageError, match="reads 'h', which no earlier step"):
        check_wiring(
            ensemble(EnsembleStep("s1", {"h": "h"}, {"y": "y"}), EnsembleStep("s0", {"x": "x"}, {"h": "h"})),
            stages,
        )
    with pytest.raises(UsageError, match="output 'y' is written by no stage"):
        check_wiring(ensemble(EnsembleStep("s0", {"x": "x"}, {"h": "h"})), stages)
    with pytest.raises(UsageError, match="step 's1' does not map its model's IO"):
        check_wiring(
            ensemble(EnsembleStep("s0", {"x": "x"}, {"h": "h"}), EnsembleStep("s1", {}, {"y": "y"})), stages
        )
    with pytest.raises(ValueError, match="ensemble 'e' has no steps"):
        render_config(ensemble())


def test_model_py_files_of_the_release_before_the_layout_run_on_this_runtime(art, pb_utils, tmp_path, rng):
    """A Triton repository ships model.py files that import the serving host's precast: the ones written
    before precast.runtime's modules moved (tests/data/triton_v1: 25d92ff's, which import
    precast.runtime.errors / precast.runtime.manifest) must keep running on this one."""
    data = Path(__file__).resolve().parent.parent / "data" / "triton_v1"
    old = tmp_path / "old"
    for k in range(2):
        with_model_py(art, old, f"mlp_staged_stage_{k}", data / "stage_model.py")
    first, second = (load_python_model(old, f"mlp_staged_stage_{k}") for k in range(2))
    (boundary,) = json.loads((art / "manifest.json").read_text())["stages"]["stages"][0]["outputs"]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    (mid,) = first.execute([Request(x=x)])
    (out,) = second.execute([Request(**{boundary: mid.outputs[boundary]})])
    assert mid.error is None and out.error is None
    np.testing.assert_allclose(out.outputs["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)
