import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.passes.fuse_matmul_layernorm_gelu import FuseMatMulLayerNormGelu
from tests.helpers import make_model, op_types, ort_run
from tests.passes import fusion_graphs as g

F = TensorProto.FLOAT
K, N = 8, 16


def chain(
    gelu: str = "ms",
    mm_bias: bool = True,
    beta: bool = True,
    shared: str | None = None,
    axis: int = -1,
    bias_shape=(N,),
    opset: int = 18,
):
    """x[batch,seq,K] -> MatMul(W) [-> Add(b)] -> LayerNormalization(g[, beta]) -> Gelu / FastGelu / ONNX Gelu."""
    rng = np.random.default_rng(7)
    h = "m"
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"])]
    if mm_bias:
        nodes.append(helper.make_node("Add", ["m", "b"], ["h"]))
        h = "h"
    nodes.append(
        helper.make_node(
            "LayerNormalization", [h, "g"] + (["beta"] if beta else []), ["n"], axis=axis, epsilon=1e-5
        )
    )
    if gelu == "onnx":
        nodes.append(helper.make_node("Gelu", ["n"], ["y"]))
    elif gelu == "onnx-tanh":
        nodes.append(helper.make_node("Gelu", ["n"], ["y"], approximate="tanh"))
    else:
        nodes.append(
            helper.make_node("FastGelu" if gelu == "fast" else "Gelu", ["n"], ["y"], domain="com.microsoft")
        )
    outputs = [("y", F, ["batch", "seq", N])] + ([(shared, F, ["batch", "seq", N])] if shared else [])
    inits = {
        "w": rng.standard_normal((K, N)).astype(np.float32),
        # a large mean in the bias is the case where the rewrite's centring matters most
        "b": (rng.standard_normal(bias_shape) + 3.0).astype(np.float32),
        "g": (1 + 0.2 * rng.standard_normal(N)).astype(np.float32),
        "beta": (0.3 * rng.standard_normal(N)).astype(np.float32),
    }
    opset = 20 if gelu.startswith("onnx") else opset
    return make_model(
        nodes, [("x", F, ["batch", "seq", K])], outputs, inits, opset=opset, extra_opsets={"com.microsoft": 1}
    )


@pytest.mark.parametrize("gelu,new", [("ms", "BiasGelu"), ("onnx", "BiasGelu"), ("fast", "FastGelu")])
def test_chain_fuses_with_ort_numbers(gelu, new):
    model = g.check_fusion(
        FuseMatMulLayerNormGelu, chain(gelu), n=1, new_ops=["SimplifiedLayerNormalization", new]
    )
    assert op_types(model) == ["MatMul", "Add", "SimplifiedLayerNormalization", new]


@pytest.mark.parametrize("mm_bias,beta", [(False, True), (True, False), (False, False)])
def test_optional_bias_and_beta(mm_bias, beta):
    model = g.check_fusion(
        FuseMatMulLayerNormGelu,
        chain("ms", mm_bias=mm_bias, beta=beta),
        n=1,
        new_ops=["SimplifiedLayerNormalization"],
    )
    assert "LayerNormalization" not in op_types(model)
    assert ("BiasGelu" if beta else "Gelu") in op_types(model)


@pytest.mark.parametrize("shared", ["m", "n"])
def test_shared_intermediate_is_not_fused(shared):
    model = chain(shared=shared)
    result = FuseMatMulLayerNormGelu()(model)
    assert result.stats["fused"] == 0
    assert "LayerNormalization" in op_types(result.model)


def test_other_layouts_are_not_fused():
    assert FuseMatMulLayerNormGelu()(chain(axis=1)).stats["fused"] == 0  # normalizes [seq, features]
    assert FuseMatMulLayerNormGelu()(chain(bias_shape=(1, N))).stats["fused"] == 0  # bias not a vector
    assert FuseMatMulLayerNormGelu()(chain("onnx-tanh")).stats["fused"] == 0  # fuse-gelu's job first


def test_weight_shared_with_another_matmul_stays_intact():
    import onnx_ir as ir

    model = chain()
    w = model.graph.initializers["w"]  # a second MatMul on the same weight, as another graph output
    node = ir.Node("", "MatMul", [model.graph.inputs[0], w], name="other")
    model.graph.append(node)
    node.outputs[0].name = "z"
    model.graph.outputs.append(node.outputs[0])
    feeds = g.feeds_for(model)
    expected = ort_run(model, feeds)
    result = FuseMatMulLayerNormGelu()(model)
    assert result.stats["fused"] == 1
    for got, want in zip(ort_run(result.model, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
