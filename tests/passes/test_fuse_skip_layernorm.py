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
