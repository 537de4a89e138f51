"""ort-qnn: static QDQ (A16W8 by default) -> QNN EP-context model, run on x86 through HTP emulation, checked against fp32."""

import json
import time

import numpy as np
import onnx
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import ParityError, UsageError
from precast.runtime import InputError, load
from tests.helpers import make_model, ort_run, save, tiny_mlp
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
    q = block["quantization"]
    assert q["by"].startswith("ort-qnn build") and q["activations"] == "uint16" and q["weights"] == "uint8"
    assert q["calibration"].startswith("sample feeds")  # float inputs, no tokenizer: nothing else to use
    assert manifest["parity"]["ok"] and manifest["parity"]["tolerance"]["atol"] is None
    assert [n.op_type for n in onnx.load(str(qnn_art / "model.onnx")).graph.node] == ["EPContext"]
    model = load(qnn_art)
    assert model.providers == ["QNNExecutionProvider"]
    assert list(model.session.assignment) == ["QNNExecutionProvider"]  # nothing fell back to the CPU EP


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
        ({"htp": "73"}, "target 'ort-qnn' has no option 'htp'"),
        ({"shapes": "y=2x8"}, "not an input"),
        ({"shapes": "x=2by8"}, "NAME=2x8"),
        ({"activations": "u4"}, "activations"),
        ({"weights": "fp8"}, "weights"),
        ({"activations": "u8", "weights": "int16"}, "weights=int16 needs activations=u16"),
        ({"buckets": "6x"}, "option buckets: expected sizes like 64,128, got '6x'"),
        ({"buckets": "4,8"}, r"no input has a dim 'sequence' \(symbolic dims: batch\)"),
    ],
)
def test_bad_options(mlp_path, tmp_path, opt, msg):
    with pytest.raises(UsageError, match=msg):
        compile_model(str(mlp_path), tmp_path / "a", CompileOptions(targets=["ort-qnn"], target_options=opt))


def _error_line(r) -> str:
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err  # -q: the error is the only line
    return lines[0]


def test_segfault_in_ep_context_compile_is_exit_5_naming_target_and_stage(
    cli, mlp_path, tmp_path, child_entry
):
    child_entry("qnn-compile", "segfault")
    r = cli("compile", mlp_path, "--target", "ort-qnn", "-o", tmp_path / "a", "-q")
    assert r.code == 5, r.err
    assert _error_line(r) == "error: target 'ort-qnn' stage 'EP-context compile' crashed (SIGSEGV)"
    assert not (tmp_path / "a").exists()


def test_crash_names_the_nodes_qnn_refused_before_it(cli, mlp_path, tmp_path, child_entry):
    child_entry("qnn-placement", "segfault_after_qnn_log")
    child_entry("qnn-compile", "hang")  # never reached: a crashed placement check stops the build
    t0 = time.perf_counter()
    r = cli("compile", mlp_path, "--target", "ort-qnn", "-o", tmp_path / "a", "-q")
    assert r.code == 5, r.err
    assert _error_line(r) == (
        "error: target 'ort-qnn' stage 'placement check' crashed (SIGSEGV); QNN listed 2 node(s) not supported "
        "by the QNN HTP (Shape 1, GatherND 1): node_Shape_4 (Shape), node_GatherND_75 (GatherND)"
    )
    assert time.perf_counter() - t0 < 60


def test_hung_vendor_step_is_killed_at_the_timeout(cli, mlp_path, tmp_path, child_entry):
    child_entry("qnn-placement", "hang")
    t0 = time.perf_counter()
    r = cli(
        "compile", mlp_path, "-t", "ort-qnn", "--target-option", "timeout_s=2", "-o", tmp_path / "a", "-q"
    )
    assert r.code == 5, r.err
    assert (
        _error_line(r)
        == "error: target 'ort-qnn' stage 'placement check' did not finish in 2 s and was killed"
    )
    assert time.perf_counter() - t0 < 60


def test_manifest_records_placement(qnn_art):
    block = json.loads((qnn_art / "manifest.json").read_text())["target"]
    assert block["placement"] == {"on_htp": block["placement"]["nodes"], "nodes": block["placement"]["nodes"]}
    assert block["placement"]["nodes"] >= 5  # Q, MatMul/Gemm + DQ pairs, Relu, ... as ORT partitioned them


@pytest.fixture(scope="module")
def bool_gathernd_path(tmp_path_factory):
    """x [batch, 8] -> MatMul -> Greater(0) -> GatherND(bool, constant indices) -> Cast(float): a BERT mask's shape."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Greater", ["h", "zero"], ["positive"], name="gt"),
        helper.make_node("GatherND", ["positive", "idx"], ["picked"], name="pick"),
        helper.make_node("Cast", ["picked"], ["y"], to=TensorProto.FLOAT, name="cast"),
    ]
    inits = {
        "w": np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32),
        "zero": np.array(0, np.float32),
        "idx": np.array([[0, 1], [1, 3]], np.int64),
    }
    model = make_model(
        nodes, [("x", TensorProto.FLOAT, ["batch", 8])], [("y", TensorProto.FLOAT, [2])], inits
    )
    return save(model, tmp_path_factory.mktemp("gnd") / "gathernd.onnx")


def test_placement_check_refuses_before_compiling(cli, bool_gathernd_path, tmp_path, child_entry):
    child_entry("qnn-compile", "segfault")  # were the compile reached, this would say 'crashed'
    passes = "pin-dims,fold-constants,quantize-int8{mode=static,format=qdq,weight=uint8}"  # no lower-gathernd
    r = cli("compile", bool_gathernd_path, "-t", "ort-qnn", "--passes", passes, "-o", tmp_path / "a", "-q")
    assert r.code == 5, r.err
    assert _error_line(r) == (
        "error: target 'ort-qnn' stage 'placement check': 1 of 9 node(s) not supported by the QNN HTP "
        "(GatherND 1): pick (GatherND) (they would fall back to the CPU); nothing was compiled"
    )
    assert not (tmp_path / "a").exists()


def test_default_pipeline_lowers_gathernd_and_lands_all_on_the_htp(bool_gathernd_path, tmp_path, rng):
    result = compile_model(str(bool_gathernd_path), tmp_path / "a", CompileOptions(targets=["ort-qnn"]))
    stats = {p["pass"]: p["stats"] for p in result.manifest["passes"]}
    assert stats["lower-gathernd"] == {"lowered": 1, "gathernd_left": 0}
    assert stats["pin-dims"]["dims"] == "batch=2"
    placement = result.manifest["target"]["placement"]
    assert placement["on_htp"] == placement["nodes"]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    want = ort_run(onnx.load(str(bool_gathernd_path)), {"x": x})[0]
    np.testing.assert_array_equal(load(tmp_path / "a").run({"x": x})["y"], want)  # 0/1 values: exact
