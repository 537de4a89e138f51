"""The quantizers report inside their pass: GPTQ per MatMul (and per calibration batch of its Hessians), static
INT8 per calibration batch."""

from precast.ir.pipeline import PassManager, parse_pipeline
from precast.ir.registry import PassContext
from tests.fake_progress import RecordingProgress


def _run(pipeline, model, **ctx):
    rec = RecordingProgress()
    pm = PassManager(parse_pipeline(pipeline), context=PassContext(progress=rec, **ctx))
    pm.run(model)
    return rec


def test_gptq_reports_each_layer_and_each_hessian_batch(mlp2, correlated):
    calib = [{"x": correlated(16, s)} for s in range(3)]
    rec = _run("quantize-int4{algo=gptq,block=32}", mlp2, calibration_feeds=calib)
    hessians = [a for a in rec.calls if a[0] == "advance" and "Hessians" in a[3]]
    assert [(d, t) for _, d, t, _ in hessians] == [(0, 3), (1, 3), (2, 3)]
    layers = [a[1:] for a in rec.calls if a[0] == "advance" and a[3].startswith("MatMul '")]
    assert layers == [(0, 2, "MatMul 'fc1' (1 of 2)"), (1, 2, "MatMul 'fc2' (2 of 2)")]
    assert rec.calls[-1][:3] == ("advance", 2, 2)  # the bar ends full


def test_gptq_excluded_layer_is_not_counted(mlp2, correlated):
    calib = [{"x": correlated(16, 0)}]
    rec = _run("quantize-int4{algo=gptq,block=32,exclude=[fc2]}", mlp2, calibration_feeds=calib)
    layers = [a[1:] for a in rec.calls if a[0] == "advance" and a[3].startswith("MatMul '")]
    assert layers == [(0, 1, "MatMul 'fc1' (1 of 1)")]


def test_static_int8_reports_each_calibration_batch(mlp2, correlated):
    calib = [{"x": correlated(16, s)} for s in range(3)]
    rec = _run("quantize-int8{mode=static}", mlp2, calibration_feeds=calib)
    got = [a[1:] for a in rec.calls if a[0] == "advance"]
    assert got[:3] == [(i, 3, f"calibration batch {i + 1} of 3") for i in range(3)]
    assert (3, 3, "computing activation ranges") in got
