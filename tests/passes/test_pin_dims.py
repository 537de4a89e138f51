"""pin-dims: symbolic input dims take the sample feeds' sizes; the shape arithmetic then folds away."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.errors import PassFailedError
from precast.ir.registry import PassContext
from precast.passes.fold_constants import FoldConstants
from precast.passes.pin_dims import PinDims
from tests.helpers import make_model, op_types, ort_run

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def shape_arithmetic():
    """x [batch, 8] -> Reshape(x, Concat(Shape(x)[0], [2, 4])) -> y [batch, 2, 4]; Range(0, batch) -> r."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "tail"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
        helper.make_node("Range", ["zero", "b", "one"], ["r"]),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "axes": np.array([0], np.int64),
        "tail": np.array([2, 4], np.int64),
    }
    return make_model(
        nodes, [("x", F, ["batch", 8])], [("y", F, ["batch", 2, 4]), ("r", I64, ["batch"])], inits
    )


def run(model, feeds, **options):
    return PinDims(context=PassContext(sample_feeds=feeds), **options)(model)


def test_pinned_graph_folds_to_static_and_computes_the_same(rng):
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
    expected = ort_run(shape_arithmetic(), feeds)
    result = run(shape_arithmetic(), feeds)
    assert result.stats == {"inputs_pinned": 1, "dims": "batch=3", "symbolic_left": 0}
    model = result.model
    assert [list(v.shape) for v in model.graph.outputs] == [[3, 2, 4], [3]]
    folded = FoldConstants()(model).model
    assert "Shape" not in op_types(folded) and "Range" not in op_types(folded)
    assert op_types(folded) == ["Reshape"]  # r is a constant now
    for got, want in zip(ort_run(folded, feeds), expected):
        np.testing.assert_array_equal(got, want)


def test_unpinned_graph_keeps_its_shape_ops(rng):
    # The negative case: without pinning, folding cannot remove the run-time shape arithmetic.
    folded = FoldConstants()(shape_arithmetic()).model
    assert {"Shape", "Range"} <= set(op_types(folded))


def test_idempotent(rng):
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
    once = run(shape_arithmetic(), feeds).model
    again = run(once, feeds)
    assert again.stats["inputs_pinned"] == 0 and again.stats["symbolic_left"] == 0


def test_one_symbol_two_sizes_is_refused():
    model = make_model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [("a", F, ["batch", 4]), ("b", F, ["batch", 4])],
        [("y", F, ["batch", 4])],
    )
    feeds = {"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)}
    with pytest.raises(PassFailedError, match="dim 'batch' is 2 in one sample feed and 3 in 'b'"):
        run(model, feeds)


def test_static_dim_that_disagrees_with_the_feed_is_refused():
    with pytest.raises(PassFailedError, match="input 'x' has dim 8, its sample feed 9"):
        run(shape_arithmetic(), {"x": np.zeros((3, 9), np.float32)})


def test_needs_sample_feeds():
    with pytest.raises(PassFailedError, match="needs the compile's sample feeds"):
        PinDims()(shape_arithmetic())


def test_symbolic_io_before_pinning_is_a_fact_the_pass_manager_hands_on(rng):
    from precast.ir.pipeline import PassManager, parse_pipeline

    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
    result = run(shape_arithmetic(), feeds)
    assert result.modified and result.facts.symbolic_io == {
        "x": ("batch", 8),
        "y": ("batch", 2, 4),
        "r": ("batch",),
    }
    pm = PassManager(parse_pipeline("pin-dims,fold-constants"), context=PassContext(sample_feeds=feeds))
    pm.run(shape_arithmetic())
    assert pm.facts.symbolic_io == result.facts.symbolic_io and not pm.facts.calibration_used
