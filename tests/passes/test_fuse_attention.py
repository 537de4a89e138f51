"""Attention fusion on the graph torch's dynamo exporter writes for a (tiny, random) BERT encoder."""

import numpy as np
import pytest

from precast.passes.fuse_attention import FuseAttention
from tests.helpers import op_types, ort_run


@pytest.fixture(scope="module")
def tiny_bert():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from precast.artifact.manifest import TensorSpec
    from precast.compiler.frontends.torch_export import export_module

    cfg = transformers.BertConfig(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=100,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    import torch

    torch.manual_seed(0)
    module = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    inputs = [TensorSpec(n, "int64", ("batch", "sequence")) for n in ("input_ids", "attention_mask")]
    return export_module(module, inputs, ["last_hidden_state"], {"batch": 2, "sequence": 7})


def _feeds(batch, seq=6):
    rng = np.random.default_rng(batch)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, -2:] = 0
    return {"input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.slow
def test_dynamo_bert_attention_fused(tiny_bert):
    feeds = [_feeds(1), _feeds(3)]
    expected = [ort_run(tiny_bert, f)[0] for f in feeds]
    result = FuseAttention()(tiny_bert.clone())
    assert result.stats["fused"] == 2 and op_types(result.model).count("Attention") == 2
    assert "Softmax" not in op_types(result.model)
    for f, e in zip(feeds, expected):
        np.testing.assert_allclose(ort_run(result.model, f)[0], e, rtol=1e-4, atol=1e-5)
    again = FuseAttention()(result.model)
    assert again.stats["fused"] == 0 and op_types(again.model) == op_types(result.model)


@pytest.mark.slow
def test_unpacked_option_gives_multiheadattention(tiny_bert):
    result = FuseAttention(packed=False)(tiny_bert.clone())
    assert op_types(result.model).count("MultiHeadAttention") == 2
    np.testing.assert_allclose(
        ort_run(result.model, _feeds(2))[0], ort_run(tiny_bert, _feeds(2))[0], rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
def test_scores_used_elsewhere_is_not_fused(tiny_bert):
    import onnx_ir as ir

    model = tiny_bert.clone()
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    model.graph.outputs.append(softmax.outputs[0])  # a second consumer of the attention probabilities
    result = FuseAttention()(model)
    assert op_types(result.model).count("Attention") == 1  # the other layer still fuses
    assert isinstance(result.model, ir.Model)
