"""ort-qnn: static INT8 QDQ -> QNN EP-context model, run on x86 through HTP emulation, checked against fp32."""

import json

import numpy as np
import onnx
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.runtime import InputError, load
from precast.runtime.errors import ParityError, UsageError
from tests.helpers import ort_run, tiny_mlp
from tests.targets.conftest import cosine

pytest.importorskip("onnxruntime_qnn")


@pytest.fixture(scope="module")
def qnn_art(mlp_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("qnn") / "art"
    compile_model(str(mlp_path), out, CompileOptions(targets=["ort-qnn"]))
    return out


def test_artifact_is_one_ep_context_node_all_on_qnn(qnn_art):
    manifest = json.loads((qnn_art / "manifest.json").read_text())
    block = manifest["target"]
    assert block["precision"] == "int8" and block["providers"] == ["QNNExecutionProvider"]
    assert block["static_shapes"] == {"x": [2, 8]}
    assert block["quantization"]["by"].startswith("pipeline")
    q8 = next(p for p in manifest["passes"] if p["pass"].startswith("quantize-int8"))
    assert q8["stats"]["calibration"] == "sample-feeds" and q8["stats"]["int8_weights"] == 2
    assert manifest["parity"]["ok"] and manifest["parity"]["tolerance"]["atol"] is None
    assert [n.op_type for n in onnx.load(str(qnn_art / "model.onnx")).graph.node] == ["EPContext"]
    model = load(qnn_art)
    assert model.providers == ["QNNExecutionProvider"]
    assert list(model._session.assignment) == ["QNNExecutionProvider"]  # nothing fell back to the CPU EP


def test_int8_outputs_track_fp32_on_fresh_inputs(qnn_art, rng):
    x = rng.standard_normal((2, 8)).astype(np.float32)
    expected = ort_run(tiny_mlp(), {"x": x})[0]
    got = load(qnn_art).run({"x": x})["y"]
    assert cosine(expected, got) > 0.99
    assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()  # a few INT8 steps, not garbage


def test_wrong_batch_names_the_compiled_shape(qnn_art):
    with pytest.raises(InputError, match=r"input 'x': .*compiled for shape \[2, 8\]"):
        load(qnn_art).run({"x": np.zeros((3, 8), np.float32)})


def test_pipeline_without_quantize_pass_uses_qnn_recipe(mlp_path, tmp_path, rng):
    calib = [{"x": rng.standard_normal((5, 8)).astype(np.float32)} for _ in range(4)]
    opts = CompileOptions(
        targets=["ort-qnn"],
        passes="fold-constants",
        calibration_feeds=calib,
        dims={"batch": 1},
        target_options={"shapes": "x=1x8"},
    )
    result = compile_model(str(mlp_path), tmp_path / "a", opts)
    block = result.manifest["target"]
    assert block["static_shapes"] == {"x": [1, 8]} and "4 batches" in block["quantization"]["calibration"]
    x = rng.standard_normal((1, 8)).astype(np.float32)
    got = load(tmp_path / "a").run({"x": x})["y"]
    assert got.shape == (1, 4) and cosine(ort_run(tiny_mlp(), {"x": x})[0], got) > 0.99


def test_budget_can_fail(mlp_path, tmp_path):
    with pytest.raises(ParityError, match="cosine"):
        compile_model(
            str(mlp_path),
            tmp_path / "a",
            CompileOptions(targets=["ort-qnn"], accuracy_budget="cosine>=0.9999999"),
        )
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "opt, msg",
    [
        ({"htp": "73"}, "'htp' is not an option of target"),
        ({"shapes": "y=2x8"}, "not an input"),
        ({"shapes": "x=2by8"}, "NAME=2x8"),
    ],
)
def test_bad_options(mlp_path, tmp_path, opt, msg):
    with pytest.raises(UsageError, match=msg):
        compile_model(str(mlp_path), tmp_path / "a", CompileOptions(targets=["ort-qnn"], target_options=opt))
