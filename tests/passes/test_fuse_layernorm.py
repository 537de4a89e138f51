from precast.passes.fuse_layernorm import FuseLayerNorm
from tests.helpers import op_types
from tests.passes import fusion_graphs as g


def test_fuses_pytorch_layernorm_chain_with_bias():
    model = g.check_fusion(FuseLayerNorm, g.layernorm(), n=2, new_ops=["LayerNormalization"])
    assert op_types(model) == ["LayerNormalization"]


def test_fuses_without_bias():
    g.check_fusion(FuseLayerNorm, g.layernorm(bias=False), n=1, new_ops=["LayerNormalization"])


def test_wrong_exponent_is_not_fused():
    assert FuseLayerNorm()(g.layernorm(pow_exp=3.0)).stats["fused"] == 0


def test_shared_intermediate_is_not_fused():
    result = FuseLayerNorm()(g.layernorm(shared=True))
    assert "LayerNormalization" not in op_types(result.model)
