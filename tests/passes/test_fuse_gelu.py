import pytest

from precast.passes.fuse_gelu import FuseGelu
from tests.helpers import op_types
from tests.passes import fusion_graphs as g


def test_erf_gelu_with_bias_becomes_biasgelu():
    model = g.check_fusion(FuseGelu, g.gelu("erf", bias=True), n=1, new_ops=["BiasGelu"])
    assert op_types(model) == ["BiasGelu"]


def test_erf_gelu_without_bias():
    model = g.check_fusion(FuseGelu, g.gelu("erf", bias=False), n=1, new_ops=["Gelu"])
    assert op_types(model) == ["Gelu"]


def test_tanh_gelu_with_bias_becomes_fastgelu_with_bias():
    model = g.check_fusion(FuseGelu, g.gelu("tanh", bias=True), n=1, new_ops=["FastGelu"])
    assert op_types(model) == ["FastGelu"]


def test_bias_option_off_keeps_the_add():
    model = g.check_fusion(FuseGelu, g.gelu("erf"), n=1, new_ops=["Gelu", "Add"], options={"bias": False})
    assert sorted(op_types(model)) == ["Add", "Gelu"]


@pytest.mark.parametrize("kind,const", [("erf", 1.5), ("tanh", 0.05)])
def test_wrong_constant_is_not_fused(kind, const):
    result = FuseGelu()(g.gelu(kind, const=const))
    assert result.stats["fused"] == 0
    assert {"Erf", "Tanh"} & set(op_types(result.model))


@pytest.mark.parametrize("kind", ["erf", "tanh"])
def test_shared_intermediate_is_not_fused(kind):
    assert FuseGelu()(g.gelu(kind, shared=True)).stats["fused"] == 0
