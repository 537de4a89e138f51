import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.passes.unroll_loops import UnrollLoops
from tests.helpers import make_model, op_types, ort_run

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def loop_model(trip: int = 3, early_exit: bool = False):
    """v <- v * w + i (w from the outer scope); scan output v each step; v_final and the scan are outputs."""
    body_nodes = [
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["v_in", "w"], ["vw"]),
        helper.make_node("Add", ["vw", "fi"], ["v_out"]),
        helper.make_node("Identity", ["v_out"], ["scan_out"]),
    ]
    if early_exit:
        body_nodes += [
            helper.make_node("ReduceSum", ["v_out"], ["s"], keepdims=0),
            helper.make_node("Constant", [], ["lim"], value=helper.make_tensor("lim", F, [], [1e9])),
            helper.make_node("Less", ["s", "lim"], ["cond_out"]),
        ]
    else:
        body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body = helper.make_graph(
        body_nodes, "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", B, []),
         helper.make_tensor_value_info("v_in", F, ["batch", 4])],
        [helper.make_tensor_value_info("cond_out", B, []), helper.make_tensor_value_info("v_out", F, ["batch", 4]),
         helper.make_tensor_value_info("scan_out", F, ["batch", 4])],
    )
    nodes = [helper.make_node("Loop", ["M", "", "x"], ["v_final", "scans"], body=body, name="loop")]
    inits = {"M": np.array(trip, np.int64), "w": np.linspace(0.5, 1.5, 4).astype(np.float32)}
    return make_model(nodes, [("x", F, ["batch", 4])], [("v_final", F, ["batch", 4]), ("scans", F, None)], inits)


@pytest.mark.parametrize("batch", [1, 3])
def test_constant_trip_loop_is_unrolled(batch):
    model = loop_model(trip=3)
    feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)}
    expected = ort_run(model, feeds)
    result = UnrollLoops()(model.clone())
    assert result.stats["unrolled"] == 1 and "Loop" not in op_types(result.model)
    got = ort_run(result.model, feeds)
    assert [v.name for v in result.model.graph.outputs] == ["v_final", "scans"]
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-6)
    assert UnrollLoops()(result.model).stats["unrolled"] == 0  # idempotent


def test_trip_count_above_limit_is_kept():
    result = UnrollLoops(max_trip=4)(loop_model(trip=5))
    assert result.stats == {"unrolled": 0, "kept": 1} and "Loop" in op_types(result.model)


def test_body_that_can_exit_early_is_kept():
    assert UnrollLoops()(loop_model(early_exit=True)).stats["unrolled"] == 0
