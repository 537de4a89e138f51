from precast.passes.fuse_rmsnorm import FuseRmsNorm
from tests.helpers import op_types
from tests.passes import fusion_graphs as g


def test_fuses_llama_rmsnorm():
    model = g.check_fusion(FuseRmsNorm, g.rmsnorm(), n=1, new_ops=["SimplifiedLayerNormalization"])
    assert op_types(model) == ["SimplifiedLayerNormalization"]


def test_wrong_exponent_is_not_fused():
    assert FuseRmsNorm()(g.rmsnorm(pow_exp=3.0)).stats["fused"] == 0


def test_shared_intermediate_is_not_fused():
    assert FuseRmsNorm()(g.rmsnorm(shared=True)).stats["fused"] == 0


def test_scalar_weight_is_not_fused():
    assert FuseRmsNorm()(g.rmsnorm(scale_shape=())).stats["fused"] == 0
