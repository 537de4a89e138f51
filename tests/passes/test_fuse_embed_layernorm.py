"""fuse-embed-layernorm: BERT embedding Gathers + Adds + LayerNormalization -> EmbedLayerNormalization."""

import collections

import numpy as np
import pytest
from onnx import TensorProto, helper

from precast.passes.fuse_embed_layernorm import FuseEmbedLayerNorm
from tests.helpers import make_model, op_types, ort_run

F, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
D, VOCAB, TYPES, MAXPOS = 16, 50, 2, 32


def embeddings(
    segments: bool = True,
    positions: str = "arange",  # arange | offset (table not 0..P-1) | input (position_ids graph input)
    shared: bool = False,
    type_hidden: int = D,
    ids_dtype: int = I64,
    order: str = "word-type-pos",
):
    """The dynamo export of BertEmbeddings: Gather(word, ids) + Gather(type, seg) + Gather(pos, Slice(...)) -> LN."""
    rng = np.random.default_rng(0)
    inits = {
        "word": rng.standard_normal((VOCAB, D)).astype(np.float32),
        "type": rng.standard_normal((TYPES, type_hidden)).astype(np.float32),
        "pos": rng.standard_normal((MAXPOS, D)).astype(np.float32),
        "gamma": rng.standard_normal(D).astype(np.float32),
        "beta": rng.standard_normal(D).astype(np.float32),
        "zero": np.array([0], np.int64),
        "one": np.array([1], np.int64),
    }
    inputs = [("input_ids", ids_dtype, ["batch", "seq"])]
    nodes = []
    if positions == "input":
        inputs.append(("position_ids", I64, ["batch", "seq"]))
        pidx = "position_ids"
    else:
        first = 0 if positions == "arange" else 2
        inits["position_table"] = np.arange(first, first + MAXPOS - 2, dtype=np.int64)[None, :]
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["seq_len"], start=1, end=2),
            helper.make_node("Slice", ["position_table", "zero", "seq_len", "one", "one"], ["pidx"]),
        ]
        pidx = "pidx"
    gathers = {
        "word": helper.make_node("Gather", ["word", "input_ids"], ["e_word"], axis=0),
        "pos": helper.make_node("Gather", ["pos", pidx], ["e_pos"], axis=0),
    }
    if segments:
        inputs.append(("token_type_ids", ids_dtype, ["batch", "seq"]))
        gathers["type"] = helper.make_node("Gather", ["type", "token_type_ids"], ["e_type"], axis=0)
    terms = [
        f"e_{k}" for k in order.split("-") if f"e_{k}" in {o for g in gathers.values() for o in g.output}
    ]
    nodes += list(gathers.values())
    nodes.append(helper.make_node("Add", terms[:2], ["sum01"]))
    last = "sum01"
    if len(terms) == 3:
        nodes.append(helper.make_node("Add", ["sum01", terms[2]], ["sum"]))
        last = "sum"
    nodes.append(
        helper.make_node("LayerNormalization", [last, "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12)
    )
    outputs = [("y", F, ["batch", "seq", D])] + ([("sum01", F, None)] if shared else [])
    return make_model(nodes, inputs, outputs, inits)


def feeds_for(model, batch: int, seq: int = 7, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in model.graph.inputs:
        dtype = np.int32 if v.dtype.name == "INT32" else np.int64
        high = {"input_ids": VOCAB, "token_type_ids": TYPES, "position_ids": MAXPOS}[v.name]
        feeds[v.name] = rng.integers(0, high, (batch, seq)).astype(dtype)
    return feeds


def check_fused(model, batch: int = 2, position_ids: bool = False):
    feeds = feeds_for(model, batch)
    expected = ort_run(model, feeds)
    result = FuseEmbedLayerNorm()(model.clone())
    assert result.stats["fused"] == 1
    ops = collections.Counter(op_types(result.model))
    assert ops["EmbedLayerNormalization"] == 1
    assert not ops["Gather"] and not ops["Add"] and not ops["LayerNormalization"]
    assert ops["Slice"] == (1 if position_ids and "position_table" in model.graph.initializers else 0)
    embed = next(n for n in result.model.graph if n.op_type == "EmbedLayerNormalization")
    assert (len(embed.inputs) == 9) == position_ids
    np.testing.assert_allclose(ort_run(result.model, feeds)[0], expected[0], rtol=1e-5, atol=1e-5)
    return result.model


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("order", ["word-type-pos", "pos-word-type", "type-pos-word"])
def test_bert_embeddings_fuse_with_symbolic_batch(batch, order):
    check_fused(embeddings(order=order), batch=batch)


def test_int32_ids_need_no_cast():
    fused = check_fused(embeddings(ids_dtype=I32))
    assert "Cast" not in op_types(fused)


def test_distilbert_embeddings_without_token_types():
    fused = check_fused(embeddings(segments=False))
    embed = next(n for n in fused.graph if n.op_type == "EmbedLayerNormalization")
    assert embed.inputs[1] is None and embed.inputs[4] is None


def test_position_table_that_is_not_arange_goes_in_as_position_ids():
    # A RoBERTa-like offset table: positions are data, not the sequence index, so they are passed explicitly.
    check_fused(embeddings(positions="offset"), position_ids=True)


def test_position_ids_graph_input_is_passed_through():
    check_fused(embeddings(positions="input"), batch=3, position_ids=True)


def test_idempotent():
    once = FuseEmbedLayerNorm()(embeddings()).model
    assert FuseEmbedLayerNorm()(once).stats["fused"] == 0


@pytest.mark.parametrize(
    "model",
    [embeddings(type_hidden=1), embeddings(shared=True)],
    ids=["token-type-table-hidden-1", "shared-intermediate-sum"],
)
def test_not_fused(model):
    feeds = feeds_for(model, 2)
    expected = ort_run(model, feeds)
    result = FuseEmbedLayerNorm()(model.clone())
    assert result.stats["fused"] == 0 and "EmbedLayerNormalization" not in op_types(result.model)
    for got, want in zip(ort_run(result.model, feeds), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_minilm_dynamo_export_fuses_embeddings_with_parity(minilm_dir, tmp_path):
    from precast.compiler.driver import CompileOptions, compile_model
    from precast.targets.ort_cpu import OrtCpu

    # The pass is opt-in (see targets/ort_cpu.py): the default pipeline plus fuse-embed-layernorm.
    options = CompileOptions(passes="default,fuse-embed-layernorm,eliminate-dead-code")
    assert "fuse-embed-layernorm" not in OrtCpu.default_pipeline
    res = compile_model(str(minilm_dir), tmp_path / "art", options)
    stats = {str(r.spec).split("{")[0]: r.stats for r in res.records["ort-cpu"]}
    assert stats["fuse-embed-layernorm"]["fused"] == 1
    assert stats["fuse-attention"]["fused"] == 6  # the Attention fusion downstream is unaffected
    assert res.manifest["parity"]["ok"]  # the driver also refuses to write an artifact that fails parity
    import onnx

    nodes = onnx.load(str(tmp_path / "art" / "model.onnx")).graph.node
    ops = collections.Counter(n.op_type for n in nodes)
    assert ops["EmbedLayerNormalization"] == 1 and ops["LayerNormalization"] == 0
    # The pooler's first-token Gather stays; no Gather reads an embedding table any more.
    assert not [n for n in nodes if n.op_type == "Gather" and "embeddings" in n.input[0]]
