"""quantize-int8 unpacks packed com.microsoft Attention (which ORT's quantizer leaves fp32) into Q/K/V MatMuls +
MultiHeadAttention, so the projections quantize too. Numbers checked against ONNX Runtime on the packed model."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.passes._unpack_attention import unpack_attention
from tests.helpers import make_model, op_types, ort_run
from tests.quant.test_quantize_passes import cosine, run

B, S, D, HEADS = 2, 16, 64, 4


def attention_model(mask: str = "bias", packed_sizes: bool = True, unidirectional: int = 0):
    """x[B,S,D] -> packed Attention (the form fuse-attention emits) -> y; mask: 'bias' (additive attention_bias
    [B,1,S,S], as on the dynamo MiniLM), 'index' (2D int32 mask_index) or 'none'."""
    rng = np.random.default_rng(3)
    inits = {
        "w": (rng.standard_normal((D, 3 * D)) / np.sqrt(D)).astype(np.float32),
        "b": (rng.standard_normal(3 * D) * 0.1).astype(np.float32),
    }
    inputs = [("x", TensorProto.FLOAT, [B, S, D])]
    att_in = ["x", "w", "b"]
    if mask == "bias":
        inputs.append(("bias", TensorProto.FLOAT, [B, 1, S, S]))
        att_in += ["", "", "bias"]
    elif mask == "index":
        inputs.append(("mask", TensorProto.INT32, [B, S]))
        att_in += ["mask"]
    attrs = {"num_heads": HEADS, "unidirectional": unidirectional}
    if packed_sizes:
        attrs["qkv_hidden_sizes"] = [D, D, D]
    nodes = [helper.make_node("Attention", att_in, ["a"], name="att", domain="com.microsoft", **attrs),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]  # fmt: skip
    return make_model(
        nodes, inputs, [("y", TensorProto.FLOAT, [B, S, D])], inits, extra_opsets={"com.microsoft": 1}
    )


def feeds_for(mask: str):
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((B, S, D)).astype(np.float32)}
    keep = np.ones((B, S), np.int32)
    keep[1, 11:] = 0  # second sequence padded: masking must survive the rewrite
    if mask == "bias":
        feeds["bias"] = np.broadcast_to(np.where(keep[:, None, None, :] > 0, 0.0, -1e4), (B, 1, S, S)).astype(
            np.float32
        )
    elif mask == "index":
        feeds["mask"] = keep
    return feeds


@pytest.mark.parametrize("mask", ["bias", "index", "none"])
def test_unpack_is_exact(mask):
    model, feeds = attention_model(mask), feeds_for(mask)
    ref = ort_run(model, feeds)[0]
    assert unpack_attention(model) == 1
    assert op_types(model) == ["MatMul", "MatMul", "MatMul", "MultiHeadAttention", "Relu"]
    assert "w" not in model.graph.initializers  # the packed weight is gone, not duplicated
    np.testing.assert_allclose(ort_run(model, feeds)[0], ref, rtol=1e-4, atol=1e-5)


def test_unidirectional_attention_is_left_alone():
    model = attention_model("none", unidirectional=1)
    assert unpack_attention(model) == 0 and op_types(model) == ["Attention", "Relu"]


@pytest.mark.parametrize("mask", ["bias", "index"])
def test_quantize_int8_quantizes_qkv(mask):
    model, feeds = attention_model(mask), feeds_for(mask)
    ref = ort_run(model, feeds)[0]
    out, stats = run("quantize-int8", model)
    assert stats["attention_unpacked"] == 1 and stats["int8_weights"] == 3
    assert op_types(out).count("MatMulInteger") == 3 and "Attention" not in op_types(out)
    for level in ("disable", "all"):  # as written, and after ORT's MatMulIntegerToFloat fusions
        assert cosine(ort_run(out, feeds, level=level)[0], ref) > 0.995


def test_quantize_int8_without_unpack_keeps_attention_fp32():
    model, feeds = attention_model("bias"), feeds_for("bias")
    ref = ort_run(model, feeds)[0]
    out, stats = run("quantize-int8{unpack_attention=false}", model)
    assert "attention_unpacked" not in stats and stats["int8_weights"] == 0
    assert op_types(out) == ["Attention", "Relu"]
    np.testing.assert_allclose(ort_run(out, feeds)[0], ref, rtol=1e-5, atol=1e-6)


def test_excluded_attention_stays_packed():
    model = attention_model("bias")
    out, stats = run("quantize-int8{exclude=[att]}", model)
    assert "attention_unpacked" not in stats and "Attention" in op_types(out)


def test_exclude_matmul_covers_the_unpacked_projections():
    model = attention_model("bias")
    out, stats = run("quantize-int8{exclude=[MatMul]}", model)
    assert stats["int8_weights"] == 0 and "MatMulInteger" not in op_types(out)
