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
