"""lower-gathernd: GatherND with constant indices == Reshape + Gather, bit for bit on ONNX Runtime."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.passes.lower_gathernd import LowerGatherND
from tests.helpers import make_model, op_types, ort_run

F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64


def gathernd(data_shape, indices, dtype=F, batch_dims=0, const=True, symbolic=False):
    indices = np.asarray(indices, np.int64)
    k = indices.shape[-1]
    out = list(indices.shape[:-1]) + list(data_shape[batch_dims + k :])
    shape = ["n", *data_shape[1:]] if symbolic else list(data_shape)
    inputs = [("data", dtype, shape)] + ([] if const else [("indices", I64, list(indices.shape))])
    node = helper.make_node("GatherND", ["data", "indices"], ["y"], batch_dims=batch_dims)
    return make_model([node], inputs, [("y", dtype, out)], {"indices": indices} if const else {})


def check_exact(model, feeds):
    expected = ort_run(model, feeds)
    result = LowerGatherND()(model)
    assert result.stats == {"lowered": 1, "gathernd_left": 0}
    np.testing.assert_array_equal(ort_run(result.model, feeds)[0], expected[0])
    return result.model


@pytest.mark.parametrize(
    "shape, indices",
    [
        ((2, 3, 4), [[0, 1], [1, 2], [-1, 0]]),  # k=2 < rank: rows of the last axis; a negative index
        ((2, 3, 4), [[[1], [0]]]),  # k=1: plain Gather, no Reshape
        ((2, 3, 4), [[1, 2, 3], [0, 0, -1]]),  # k=rank: scalars
    ],
)
def test_constant_indices_lower_exactly(rng, shape, indices):
    model = check_exact(gathernd(shape, indices), {"data": rng.standard_normal(shape).astype(np.float32)})
    k = np.asarray(indices).shape[-1]
    assert op_types(model) == (["Gather"] if k == 1 else ["Reshape", "Gather"])


def test_minilm_attention_mask_selection(rng):
    # dynamo BERT: GatherND(Cast(mask, bool) [1, 128], indices [1, 1, 1, 128, 2]) -> [1, 1, 1, 128]
    idx = np.stack([np.zeros(128, np.int64), np.arange(128)], -1).reshape(1, 1, 1, 128, 2)
    mask = rng.integers(0, 2, (1, 128)).astype(bool)
    model = check_exact(gathernd((1, 128), idx, dtype=B), {"data": mask})
    assert op_types(model) == ["Reshape", "Gather"]


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(gathernd((2, 3, 4), [[0, 1]], const=False), id="run-time-indices"),
        pytest.param(gathernd((2, 3, 4), [[1], [2]], batch_dims=1), id="batch-dims"),
        pytest.param(gathernd((2, 3, 4), [[0, 1]], symbolic=True), id="symbolic-data-shape"),
        pytest.param(gathernd((2, 3, 4), [[0, 3]]), id="out-of-range"),
    ],
)
def test_left_alone(model):
    result = LowerGatherND()(model)
    assert result.stats == {"lowered": 0, "gathernd_left": 1} and op_types(result.model) == ["GatherND"]


def test_idempotent(rng):
    model = LowerGatherND()(gathernd((2, 3, 4), [[0, 1]])).model
    assert LowerGatherND()(model).stats == {"lowered": 0, "gathernd_left": 0}
