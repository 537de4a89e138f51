"""quantize-int8 / quantize-int4 / convert-fp16: numbers checked against ONNX Runtime on the fp32 model."""

import numpy as np
import pytest

from precast.errors import InputError, PassFailedError, PassOptionError, UsageError
from precast.ir.pipeline import PassManager, parse_pipeline
from precast.ir.registry import PassContext
from tests.helpers import op_types, ort_run


def run(pipeline, model, **ctx):
    pm = PassManager(parse_pipeline(pipeline), context=PassContext(**ctx))
    return pm.run(model), pm.records[-1].stats


def test_calibrating_on_the_users_data_is_a_fact(mlp2, correlated):
    calib = [{"x": correlated(16, s)} for s in range(2)]
    for ctx, used in (({"calibration_feeds": calib}, True), ({"sample_feeds": calib[0]}, False)):
        pm = PassManager(parse_pipeline("quantize-int8{mode=static}"), context=PassContext(**ctx))
        pm.run(mlp2)
        assert pm.facts.calibration_used is used


def rel_err(model, ref_model, feeds):
    got, ref = ort_run(model, feeds)[0], ort_run(ref_model, feeds)[0]
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref)), got


def cosine(a, b):
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def test_int8_dynamic(mlp2, correlated):
    feeds = {"x": correlated(32, 1)}
    out, stats = run("quantize-int8", mlp2)
    assert stats["mode"] == "dynamic" and stats["int8_weights"] == 2
    assert "MatMulInteger" in op_types(out) and "MatMul" not in op_types(out)
    err, _ = rel_err(out, mlp2, feeds)
    assert 0 < err < 0.05


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_int8_static_qdq_calibrated(mlp2, correlated, method):
    calib = [{"x": correlated(16, s)} for s in range(3)]
    out, stats = run(f"quantize-int8{{mode=static,method={method}}}", mlp2, calibration_feeds=calib)
    assert stats["calibration"] == "calibration" and stats["calibration_batches"] == 3
    ops = op_types(out)
    assert (
        ops.count("QuantizeLinear") >= 2 and "DequantizeLinear" in ops and ops.count("MatMul") == 2
    )  # QDQ format
    err, _ = rel_err(out, mlp2, {"x": correlated(32, 9)})
    assert 0 < err < 0.1


def test_int8_static_falls_back_to_sample_feeds_and_says_so(mlp2, correlated):
    _, stats = run("quantize-int8{mode=static}", mlp2, sample_feeds={"x": correlated(8, 0)})
    assert stats["calibration"] == "sample-feeds" and "no --calibration" in stats["note"]


def test_int8_static_without_any_data_is_a_usage_error(mlp2):
    with pytest.raises(PassFailedError, match="needs calibration data"):
        run("quantize-int8{mode=static}", mlp2)


def test_int8_calibration_batch_with_wrong_input_names_the_input(mlp2):
    with pytest.raises(PassFailedError, match="calibration batch 0: unknown input 'z'"):
        run("quantize-int8{mode=static}", mlp2, calibration_feeds=[{"z": np.zeros((2, 128), np.float32)}])


def test_int8_exclude_keeps_named_layer_fp32(mlp2, correlated):
    out, stats = run("quantize-int8{exclude=[fc2]}", mlp2)
    assert stats["excluded"] == 1 and stats["int8_weights"] == 1
    assert op_types(out).count("MatMul") == 1
    by_type, _ = run("quantize-int8{exclude=[MatMul]}", mlp2)
    assert op_types(by_type) == ["MatMul", "Relu", "MatMul"]


def test_exclude_typo_is_an_option_error(mlp2):
    with pytest.raises(PassOptionError, match="no node or op type named 'fc3'; did you mean"):
        run("quantize-int8{exclude=[fc3]}", mlp2)


def test_int4_rtn_matmulnbits(mlp2, correlated):
    out, stats = run("quantize-int4{block=32}", mlp2)
    assert stats["quantized"] == 2 and op_types(out) == ["MatMulNBits", "Relu", "MatMulNBits"]
    err, _ = rel_err(out, mlp2, {"x": correlated(32, 1)})
    assert 0 < err < 0.3


@pytest.mark.parametrize("block", [32, 128])
def test_int4_gptq_beats_rtn_on_calibration_like_data(mlp2, correlated, block):
    calib = [{"x": correlated(64, s)} for s in range(4)]
    held_out = {"x": correlated(256, 99)}
    rtn, _ = run(f"quantize-int4{{block={block}}}", mlp2)
    gptq, stats = run(f"quantize-int4{{algo=gptq,block={block}}}", mlp2, calibration_feeds=calib)
    assert stats["quantized"] == 2 and stats["calibration"] == "calibration"
    err_rtn, _ = rel_err(rtn, mlp2, held_out)
    err_gptq, _ = rel_err(gptq, mlp2, held_out)
    assert err_gptq < 0.75 * err_rtn, (err_gptq, err_rtn)


def test_int4_gptq_asymmetric_and_exclude(mlp2, correlated):
    calib = [{"x": correlated(64, s)} for s in range(2)]
    out, stats = run("quantize-int4{algo=gptq,symmetric=false,exclude=[fc2]}", mlp2, calibration_feeds=calib)
    assert op_types(out) == ["MatMulNBits", "Relu", "MatMul"] and stats["excluded"] == 1
    err, _ = rel_err(out, mlp2, {"x": correlated(64, 5)})
    assert 0 < err < 0.1


def test_int4_options_are_validated():
    with pytest.raises(PassOptionError, match="'block' must be one of"):
        parse_pipeline("quantize-int4{block=48}")
    with pytest.raises(PassOptionError, match="accuracy_level"):
        parse_pipeline("quantize-int4{accuracy_level=7}")
    assert (
        str(parse_pipeline("quantize-int4{algo=gptq,block=128}")[0]) == "quantize-int4{algo=gptq,block=128}"
    )


def test_int4_artifact_weights_under_30_percent(mlp2):
    import onnx_ir as ir

    out, _ = run("quantize-int4{block=32}", mlp2)
    size = lambda m: len(ir.serde.serialize_model(m).SerializeToString())  # noqa: E731
    assert size(out) <= 0.3 * size(mlp2)


def test_convert_fp16_keeps_io_fp32(mlp2, correlated):
    out, stats = run("convert-fp16", mlp2)
    assert stats["fp16_initializers"] == 2
    assert out.graph.inputs[0].dtype.name == "FLOAT" and out.graph.outputs[0].dtype.name == "FLOAT"
    err, got = rel_err(out, mlp2, {"x": correlated(16, 3)})
    assert got.dtype == np.float32 and 0 < err < 5e-3


def test_calibration_npz_formats(tmp_path):
    from precast.ir.calibration import load_calibration

    np.savez(tmp_path / "one.npz", x=np.ones((2, 3), np.float32))
    np.savez(
        tmp_path / "many.npz", **{"1/x": np.ones((1, 3), np.float32), "0/x": np.zeros((1, 3), np.float32)}
    )
    np.savez(tmp_path / "mixed.npz", **{"0/x": np.ones(3), "x": np.ones(3)})
    (tmp_path / "t.txt").write_text("some text")
    assert len(load_calibration(tmp_path / "one.npz")[0]) == 1
    many = load_calibration(tmp_path / "many.npz")[0]
    assert [b["x"][0, 0] for b in many] == [0, 1]
    assert load_calibration(tmp_path / "t.txt") == (None, "some text")
    with pytest.raises(InputError, match="'x' has no 'N/' batch prefix"):
        load_calibration(tmp_path / "mixed.npz")
    with pytest.raises(UsageError, match="not found"):
        load_calibration(tmp_path / "nope.npz")
