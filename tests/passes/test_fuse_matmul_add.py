from precast.passes.fuse_matmul_add import FuseMatMulAdd
from tests.helpers import op_types
from tests.passes import fusion_graphs as g


def test_2d_matmul_bias_becomes_gemm():
    model = g.check_fusion(FuseMatMulAdd, g.matmul_add(rank=2), n=1, new_ops=["Gemm"])
    assert op_types(model) == ["Gemm"]


def test_rank3_activation_keeps_matmul_add():
    assert FuseMatMulAdd()(g.matmul_add(rank=3)).stats["gemm"] == 0


def test_bias_that_would_broadcast_the_result_is_not_fused():
    # Add(MatMul [b,16], c [3,1,16]) is rank 3; Gemm would drop the leading axis.
    assert FuseMatMulAdd()(g.matmul_add(rank=2, bias_shape=(3, 1, g.D))).stats["gemm"] == 0


def _transposed_matmul(w_shape):
    """MatMul(Transpose(x [S, B, D], perm=[1, 0, 2]), Transpose(w)) -- SigLIP's attention-pooling head."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal(w_shape).astype(np.float32)
    perm_w = [1, 0] if len(w_shape) == 2 else [0, 2, 1]
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
            helper.make_node("Transpose", ["w"], ["wt"], perm=perm_w),
            helper.make_node("MatMul", ["xt", "wt"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model, {"x": rng.standard_normal((5, 3, 8)).astype(np.float32)}


def test_batch_transpose_is_fused_only_where_onnx_runtime_runs_it():
    """transBatchA needs both operands of one rank >= 3 in ONNX Runtime: a rank-2 weight keeps its Transpose (it
    was fused and the compiled SigLIP failed to run), a rank-3 one is fused; both give the graph's numbers."""
    import numpy as np

    from tests.helpers import ort_run, to_ir

    for w_shape, batch_fused in (((4, 8), False), ((3, 4, 8), True)):
        model, feeds = _transposed_matmul(w_shape)
        expected = ort_run(model, feeds)
        result = FuseMatMulAdd()(to_ir(model))
        attrs = [n.attributes for n in result.model.graph if n.op_type == "FusedMatMul"]
        assert attrs, w_shape
        assert any(a.get_int("transBatchA", 0) for a in attrs) == batch_fused, w_shape
        np.testing.assert_allclose(ort_run(result.model, feeds)[0], expected[0], rtol=1e-5, atol=1e-5)
