"""4-bit embedding tables (quantize-int4 embeddings=true) on Llamas whose vocabulary dwarfs the hidden size.

A tied model's fp32 artifact stores its table once (the embedding Gather reads Transpose of the lm head's
[E, V] weight); INT4 shares the head's MatMulNBits bytes with a GatherBlockQuantized. Sizes are checked
on the compiled artifacts, numbers against the fp32 table and Hugging Face generate().
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.frontends.source import load_source
from precast.runtime.llm import ModelRunner
from tests.helpers import op_types
from tests.llm.fixtures import build_llama
from tests.llm.test_causal_lm import PROMPTS, _encode, greedy, hf_greedy
from tests.quant.test_quantize_passes import run

pytestmark = pytest.mark.slow

WIDE = {"vocab_size": 4096}  # hidden 64: the table is ~80% of the weights, as in small real LMs


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    folder = build_llama(tmp_path_factory.mktemp("emb") / "tied", tie_word_embeddings=True, **WIDE)
    return folder, load_source(str(folder), task="causal-lm")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = build_llama(tmp_path_factory.mktemp("emb") / "untied", **WIDE)
    return folder, load_source(str(folder), task="causal-lm")


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _model_bytes(art) -> int:
    return sum(p.stat().st_size for p in art.iterdir() if p.is_file() and p.suffix in (".onnx", ".data"))


def _rows(model: ir.Model, feeds: dict, output: str) -> np.ndarray:
    """Run ``model`` with an intermediate value ``output`` exposed."""
    import onnxruntime as ort

    proto = ir.to_proto(model)
    proto.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([output], feeds)[0]


def _embedding_output(model: ir.Model) -> str:
    node = next(
        n
        for n in model.graph
        if n.op_type in ("GatherBlockQuantized", "Gather") and n.name.startswith("node_embedding")
    )
    out = node.outputs[0]
    after = [u.node for u in out.uses() if u.node.op_type == "Slice"]
    return (after[0].outputs[0] if after else out).name


def _feeds_and_rows(source, table: np.ndarray):
    feeds = dict(source.sample_feeds)
    ids = np.random.default_rng(0).integers(0, table.shape[0], feeds["input_ids"].shape)
    feeds["input_ids"] = ids
    return feeds, table[ids]


@pytest.mark.parametrize("options", ["", "{block=128}", "{algo=gptq}"])
def test_tied_table_shares_the_heads_bytes(tied, options):
    """GatherBlockQuantized reads the lm head's MatMulNBits bytes (no fp32 table left), rows within 4-bit error."""
    logging.disable(logging.INFO)
    _, source = tied
    table = source.model.graph.initializers["lm_head_t"].const_value.numpy().T  # [V, E]
    out, stats = run(f"quantize-int4{options}", _copy(source.model), sample_feeds=source.sample_feeds)
    assert stats["embeddings"] == 1 and stats["embeddings_shared"] == 1 and stats["kept_fp32"] == 0
    ops = op_types(out)
    assert "GatherBlockQuantized" in ops and "Transpose" not in ops
    assert not [
        v
        for v in out.graph.initializers.values()
        if v.const_value.dtype == ir.DataType.FLOAT and v.const_value.size >= table.size // 8
    ], "an fp32 copy of the table survived"
    feeds, ref = _feeds_and_rows(source, table)
    got = _rows(out, feeds, _embedding_output(out))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < err < 0.12, err  # 16 levels per block; a wrong zero point or layout gives ~1


def test_untied_and_fallbacks(untied, tied):
    """Untied tables and a tied table whose head stays fp32 go through ONNX Runtime's Gather quantizer."""
    logging.disable(logging.INFO)
    for (_, source), pipeline, shared in [
        (untied, "quantize-int4", 0),
        (tied, "quantize-int4{exclude=[node_matmul]}", 0),
        (tied, "quantize-int4{symmetric=false}", 0),
    ]:
        init = source.model.graph.initializers
        table = (
            init["embed.weight"].const_value.numpy()
            if "embed.weight" in init
            else init["lm_head_t"].const_value.numpy().T
        )
        out, stats = run(pipeline, _copy(source.model), sample_feeds=source.sample_feeds)
        assert stats["embeddings"] == 1 and stats["embeddings_shared"] == shared, (pipeline, stats)
        feeds, ref = _feeds_and_rows(source, table)
        err = np.linalg.norm(_rows(out, feeds, _embedding_output(out)) - ref) / np.linalg.norm(ref)
        assert 0 < err < 0.12, (pipeline, err)
    # Opt-out, and small tables (the 512x64 fixture: 32Ki elements) stay fp32 Gathers.
    out, stats = run("quantize-int4{embeddings=false}", _copy(untied[1].model))
    assert "embeddings" not in stats and "GatherBlockQuantized" not in op_types(out)
    small = load_source(str(build_llama(untied[0].parent / "small")), task="causal-lm")
    out, stats = run("quantize-int4", _copy(small.model))
    assert stats["embeddings"] == 0 and "GatherBlockQuantized" not in op_types(out)


def test_tied_artifacts_fp32_once_and_int4_under_30_percent(tied, tmp_path):
    """fp32: the table is stored once and greedy decoding equals HF; INT4 (RTN, block 32) <= 30% of fp32."""
    folder, source = tied
    fp32 = compile_model(source, tmp_path / "fp32", CompileOptions(task="causal-lm"))
    int4 = compile_model(
        source,
        tmp_path / "int4",
        CompileOptions(task="causal-lm", passes="default,quantize-int4", accuracy_budget="cosine>=0.9"),
    )
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    unique = sum(p.numel() for p in hf.parameters()) * 4  # parameters() lists a tied table once
    size32, size4 = _model_bytes(fp32.output), _model_bytes(int4.output)
    table = hf.get_input_embeddings().weight.numel() * 4
    assert size32 < unique + table // 2, (
        size32,
        unique,
    )  # rotary caches and graph on top; not a second table
    assert size4 <= 0.30 * size32, f"INT4 {size4} B is {size4 / size32:.0%} of fp32 {size32} B"
    prompts = _encode(fp32, PROMPTS[:2])
    ours = greedy(ModelRunner.from_artifact(fp32.output, num_blocks=64), prompts, 12)
    assert ours == [hf_greedy(folder, p, 12) for p in prompts]
    # INT4 still decodes (every logit row finite; the budget tests cover its accuracy on a trained LM).
    q = greedy(ModelRunner.from_artifact(int4.output, num_blocks=64), prompts, 4)
    assert all(len(t) == 4 for t in q)
