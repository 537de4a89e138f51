import numpy as np
import onnx_ir as ir
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
        body_nodes,
        "body",
        [
            helper.make_tensor_value_info("i", I64, []),
            helper.make_tensor_value_info("cond_in", B, []),
            helper.make_tensor_value_info("v_in", F, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", B, []),
            helper.make_tensor_value_info("v_out", F, ["batch", 4]),
            helper.make_tensor_value_info("scan_out", F, ["batch", 4]),
        ],
    )
    nodes = [helper.make_node("Loop", ["M", "", "x"], ["v_final", "scans"], body=body, name="loop")]
    inits = {"M": np.array(trip, np.int64), "w": np.linspace(0.5, 1.5, 4).astype(np.float32)}
    return make_model(
        nodes, [("x", F, ["batch", 4])], [("v_final", F, ["batch", 4]), ("scans", F, None)], inits
    )


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


def scan_model(length=3, in_axis=0, in_dir=0, out_axis=0, out_dir=0, static=True):
    """h <- tanh(h * w + x_t) + y_t over two scanned inputs; scan output h_t + x_t; h_final and the stack are outputs."""
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["h_in", "w"], ["hw"]),
            helper.make_node("Add", ["hw", "x_t"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["th"]),
            helper.make_node("Add", ["th", "y_t"], ["h_out"]),
            helper.make_node("Add", ["h_out", "x_t"], ["s_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("h_in", F, ["batch", 4]),
            helper.make_tensor_value_info("x_t", F, ["batch", 4]),
            helper.make_tensor_value_info("y_t", F, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("h_out", F, ["batch", 4]),
            helper.make_tensor_value_info("s_out", F, ["batch", 4]),
        ],
    )
    seq = length if static else "seq"
    xs_shape = [seq, "batch", 4] if in_axis == 0 else ["batch", seq, 4]
    scan = helper.make_node(
        "Scan",
        ["h0", "xs", "ys"],
        ["h_final", "stacked"],
        body=body,
        num_scan_inputs=2,
        name="scan",
        scan_input_axes=[in_axis, in_axis],
        scan_input_directions=[in_dir, 0],
        scan_output_axes=[out_axis],
        scan_output_directions=[out_dir],
    )
    inputs = [("h0", F, ["batch", 4]), ("xs", F, xs_shape), ("ys", F, xs_shape)]
    inits = {"w": np.linspace(0.5, 1.5, 4).astype(np.float32)}
    return make_model([scan], inputs, [("h_final", F, ["batch", 4]), ("stacked", F, None)], inits)


def scan_feeds(model, batch, length=3):
    rng = np.random.default_rng(batch)
    feeds = {}
    for v in model.graph.inputs:
        shape = [
            batch
            if d == "batch" or getattr(d, "value", None) == "batch"
            else (d if isinstance(d, int) else length)
            for d in v.shape
        ]
        feeds[v.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "axes_dirs",
    [(0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 1), (1, 1, 1, 0), (0, 0, -1, 1)],
    ids=["fwd", "reverse-in", "axis1-reverse-out", "axis1-reverse-in-out-axis1", "out-axis-neg1-reverse"],
)
def test_static_length_scan_is_unrolled(batch, axes_dirs):
    in_axis, in_dir, out_axis, out_dir = axes_dirs
    model = scan_model(in_axis=in_axis, in_dir=in_dir, out_axis=out_axis, out_dir=out_dir)
    feeds = scan_feeds(model, batch)
    expected = ort_run(model, feeds)
    result = UnrollLoops()(model.clone())
    assert result.stats["unrolled"] == 1 and "Scan" not in op_types(result.model)
    assert [v.name for v in result.model.graph.outputs] == ["h_final", "stacked"]
    for g, e in zip(ort_run(result.model, feeds), expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    assert UnrollLoops()(result.model).stats["unrolled"] == 0  # idempotent


def test_scan_longer_than_limit_is_kept():
    result = UnrollLoops(max_trip=4)(scan_model(length=5))
    assert result.stats == {"unrolled": 0, "kept": 1} and "Scan" in op_types(result.model)


def test_scan_with_dynamic_length_is_kept():
    model = scan_model(static=False)
    feeds = scan_feeds(model, 2, length=4)
    result = UnrollLoops()(model.clone())
    assert result.stats == {"unrolled": 0, "kept": 1}
    np.testing.assert_array_equal(ort_run(result.model, feeds)[1], ort_run(model, feeds)[1])


def test_two_unnamed_scans_get_distinct_names():
    one = scan_model()
    proto = ir.serde.serialize_model(one)
    first = proto.graph.node[0]
    first.name = ""
    second = helper.make_node(
        "Scan", ["h_final", "xs", "ys"], ["h2", "stacked2"], body=first.attribute[0].g, num_scan_inputs=2
    )
    proto.graph.node.append(second)
    proto.graph.output.append(helper.make_tensor_value_info("h2", F, ["batch", 4]))
    model = ir.serde.deserialize_model(proto)
    feeds = scan_feeds(model, 2)
    expected = ort_run(model, feeds)
    result = UnrollLoops()(model.clone())
    assert result.stats["unrolled"] == 2
    for g, e in zip(ort_run(result.model, feeds), expected):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def test_opset8_batched_scan_is_kept():
    model = scan_model()
    model.graph.opset_imports[""] = 8  # Scan-8: inputs are [sequence_lens, ...] with a batch axis
    assert UnrollLoops()(model).stats == {"unrolled": 0, "kept": 1}
