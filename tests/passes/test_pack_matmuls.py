"""pack-matmuls: sibling MatMuls of one input -> one MatMul + Split, numbers checked against ONNX Runtime."""

import numpy as np
from onnx import TensorProto, helper

from precast.passes.pack_matmuls import PackMatMuls
from precast.passes.quantize_int4 import QuantizeInt4
from tests.helpers import make_model, op_types, ort_run
from tests.passes import fusion_graphs as g

F = TensorProto.FLOAT
K, N = 16, 24


def swiglu(tied: bool = False, seed: int = 0):
    """A gated MLP down(silu(x @ Wg) * (x @ Wu)) with gate, up [K, N], and a third sibling x @ Wa [K, N + 8]."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["gate"]),
        helper.make_node("MatMul", ["x", "wu"], ["up"]),
        helper.make_node("Sigmoid", ["gate"], ["sg"]),
        helper.make_node("Mul", ["gate", "sg"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["h"]),
        helper.make_node("MatMul", ["h", "wd"], ["y"]),
        helper.make_node("MatMul", ["x", "wa"], ["a"]),
        helper.make_node("Relu", ["a"], ["aux"]),  # (a graph output itself would not pack: its name must stay)
    ]
    inits = {
        "wg": rng.normal(0, 0.3, (K, N)).astype(np.float32),
        "wu": rng.normal(0, 0.3, (K, N)).astype(np.float32),
        "wa": rng.normal(0, 0.3, (K, N + 8)).astype(np.float32),
        "wd": rng.normal(0, 0.3, (N, K)).astype(np.float32),
    }
    if tied:  # the up weight is read by another node too: it stays where it is
        nodes.append(helper.make_node("MatMul", ["h2", "wu"], ["z"], name="other"))
    outputs = [("y", F, ["batch", "seq", K]), ("aux", F, ["batch", "seq", N + 8])]
    inputs = [("x", F, ["batch", "seq", K])]
    if tied:
        inputs.append(("h2", F, ["batch", "seq", K]))
        outputs.append(("z", F, ["batch", "seq", N]))
    return make_model(nodes, inputs, outputs, inits)


def test_gate_and_up_pack_into_one_matmul_and_split_with_ort_numbers():
    model = g.check_fusion(PackMatMuls, swiglu(), n=1, new_ops=["Split"], key="packed")
    ops = op_types(model)
    assert ops.count("MatMul") == 2 and ops.count("Split") == 1  # (packed gate|up|aux, and down)
    mm = next(n for n in model.graph if n.op_type == "MatMul" and "packed" in n.name)
    split = next(n for n in model.graph if n.op_type == "Split")
    assert list(mm.inputs[1].const_value.shape) == [K, 3 * N + 8]
    assert split.inputs[1].const_value.numpy().tolist() == [N, N, N + 8]
    assert set(model.graph.initializers) == {mm.inputs[1].name, "wd", split.inputs[1].name}  # old ones gone


def test_a_shared_weight_or_a_single_matmul_is_left_alone():
    tied = PackMatMuls()(swiglu(tied=True))  # gate and aux pack; up's weight is also read by "other"
    assert tied.stats["matmuls_replaced"] == 2 and "wu" in tied.model.graph.initializers
    single = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [("x", F, ["batch", K])],
        [("y", F, ["batch", N])],
        {"w": np.ones((K, N), np.float32)},
    )
    assert PackMatMuls()(single).stats["packed"] == 0


def test_max_n_bounds_the_packed_width():
    assert PackMatMuls(max_n=3 * N)(swiglu()).stats["packed"] == 0  # 3N + 8 > 3N
    assert PackMatMuls(max_n=3 * N + 8)(swiglu()).stats["packed"] == 1


def test_int4_of_the_packed_weights_equals_int4_of_the_separate_ones():
    # MatMulNBits quantizes each output column by blocks along K: packing before quantize-int4 changes no byte
    # of what is computed, so the packed INT4 graph's numbers are the separate INT4 graph's.
    base = swiglu(seed=3)
    feeds = g.feeds_for(base, batch=2, seed=1)
    separate = QuantizeInt4(block=16)(base.clone()).model
    packed = QuantizeInt4(block=16)(PackMatMuls()(base.clone()).model).model
    assert op_types(packed).count("MatMulNBits") == 2 and op_types(separate).count("MatMulNBits") == 4
    for got, want in zip(ort_run(packed, feeds), ort_run(separate, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
