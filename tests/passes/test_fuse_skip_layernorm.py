from precast.passes.fuse_skip_layernorm import FuseSkipLayerNorm
from tests.helpers import op_types
from tests.passes import fusion_graphs as g


def test_residual_bias_layernorm_fused():
    model = g.check_fusion(FuseSkipLayerNorm, g.skip_layernorm(), n=1, new_ops=["SkipLayerNormalization"])
    assert op_types(model) == ["SkipLayerNormalization"]


def test_sum_used_elsewhere_comes_from_the_fused_op():
    # The residual sum is SkipLayerNormalization's 4th output; the fusion keeps it for other users.
    model = g.check_fusion(
        FuseSkipLayerNorm, g.skip_layernorm(bias=False, shared=True), n=1, new_ops=["SkipLayerNormalization"]
    )
    assert op_types(model) == ["SkipLayerNormalization"]


def test_rank2_is_not_fused():
    assert FuseSkipLayerNorm()(g.skip_layernorm(rank=2)).stats["fused"] == 0


def _outputs(model, op_type):
    node = next(n for n in model.graph if n.op_type == op_type)
    return [v.name for v in node.outputs]


def test_unread_statistics_are_dropped_and_a_read_sum_kept():
    # Mean / inv-std-dev are not read by anything: unnamed (absent), so ORT does not compute them. The
    # residual sum (output 3) is read by the second consumer and must stay.
    plain = FuseSkipLayerNorm()(g.skip_layernorm()).model
    assert [bool(n) for n in _outputs(plain, "SkipLayerNormalization")[1:]] == [False] * (
        len(_outputs(plain, "SkipLayerNormalization")) - 1
    )
    shared = g.check_fusion(
        FuseSkipLayerNorm, g.skip_layernorm(bias=False, shared=True), n=1, new_ops=["SkipLayerNormalization"]
    )
    names = _outputs(shared, "SkipLayerNormalization")
    assert names[1] == names[2] == "" and names[3]
