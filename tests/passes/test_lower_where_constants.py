"""lower-where-constants: Where(c, a, b) with scalar constants == Cast(c) * (a - b) + b, bit for bit."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.passes.lower_where_constants import LowerWhereConstants
from tests.helpers import make_model, op_types, ort_run

F, B = TensorProto.FLOAT, TensorProto.BOOL
FMAX = float(np.finfo(np.float32).max)


def where(a, b, cond_shape=(2, 5), branch_shape=(), scores=False):
    """cond [2, 5] -> Where(cond, a, b) [-> Add(scores) -> Softmax]: a BERT's additive attention mask."""
    inits = {
        "a": np.full(branch_shape, a, np.float32),
        "b": np.full(branch_shape, b, np.float32),
    }
    out_shape = list(np.broadcast_shapes(cond_shape, branch_shape))
    nodes = [helper.make_node("Where", ["cond", "a", "b"], ["m" if scores else "y"])]
    inputs = [("cond", B, list(cond_shape))]
    if scores:
        nodes += [
            helper.make_node("Add", ["s", "m"], ["t"]),
            helper.make_node("Softmax", ["t"], ["y"], axis=-1),
        ]
        inputs.append(("s", F, out_shape))
    return make_model(nodes, inputs, [("y", F, out_shape)], inits)


def feeds(rng, shape=(2, 5), scores=False):
    out = {"cond": rng.integers(0, 2, shape).astype(bool)}
    out["cond"][:, 0] = True  # every softmax row keeps one position
    if scores:
        out["s"] = (10 * rng.standard_normal(shape)).astype(np.float32)
    return out


@pytest.mark.parametrize("a, b", [(0.0, -FMAX), (1.0, 0.0), (-2.5, 4.0)])
def test_scalar_branches_lower_exactly(rng, a, b):
    model, f = where(a, b), feeds(rng)
    expected = ort_run(model, f)[0]
    result = LowerWhereConstants()(model)
    assert result.stats == {"lowered": 1, "where_left": 0}
    assert op_types(result.model) == ["Cast", "Mul", "Add"]
    got = ort_run(result.model, f)[0]
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == expected.dtype


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(where(0.1, 0.7), id="inexact-(a-b)+b"),
        pytest.param(where(0.0, -np.inf), id="minus-inf-fill"),
        pytest.param(where(FMAX, -FMAX), id="a-b-overflows"),
        pytest.param(where(0.0, 1.0, branch_shape=(5,)), id="vector-branches"),
        pytest.param(where(0.0, 1.0, cond_shape=(5,), branch_shape=(1, 1)), id="branch-broadcasts-cond"),
    ],
)
def test_left_alone(model):
    result = LowerWhereConstants()(model)
    assert result.stats == {"lowered": 0, "where_left": 1} and op_types(result.model) == ["Where"]


def test_limit_clamps_minus_inf_fill_and_softmax_after_it_agrees(rng):
    model, f = where(0.0, -np.inf, scores=True), feeds(rng, scores=True)
    expected = ort_run(model, f)[0]
    result = LowerWhereConstants(limit=1e4)(model)
    assert result.stats["lowered"] == 1
    # The mask itself now says -1e4 where it said -inf; after the softmax both are exactly 0.
    np.testing.assert_array_equal(ort_run(result.model, f)[0], expected)


def test_idempotent(rng):
    model = LowerWhereConstants()(where(0.0, -FMAX)).model
    assert LowerWhereConstants()(model).stats == {"lowered": 0, "where_left": 0}
