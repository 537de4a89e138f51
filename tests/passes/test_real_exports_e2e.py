"""Patterns real exporters produce: a Llama-style decoder (torch.onnx dynamo, no KV cache) and a scripted
Python loop (legacy exporter -> ONNX Loop), compiled with the ort-cpu default pipeline, checked against torch."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from precast.compiler.driver import CompileOptions, compile_model
from precast.passes._decoder_rules import is_causal_mask
from tests.helpers import make_model, to_ir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_llama(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256):
    """A Hugging Face Llama with seeded random weights; forward(input_ids) -> logits, no KV cache."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a fusion that drops them cannot pass
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    return Logits().eval()


def llama_source(module):
    from precast.artifact.manifest import TensorSpec
    from precast.compiler.frontends.source import Source
    from precast.compiler.frontends.torch_export import export_module, torch_reference

    spec = [TensorSpec("input_ids", "int64", ("batch", "sequence"))]
    model = export_module(module, spec, ["logits"], {"batch": 2, "sequence": 7})
    return Source(
        "torch",
        "tiny_llama",
        model,
        "0" * 64,
        reference=torch_reference(module, ["input_ids"], ["logits"]),
        reference_name="torch (eager)",
    )


@pytest.mark.slow
def test_llama_decoder_fuses_rmsnorm_rotary_gqa_with_torch_parity(tmp_path):
    module = tiny_llama()
    res = compile_model(
        llama_source(module), tmp_path / "art", CompileOptions(target_options={"ort_level": "none"})
    )
    stats = {str(r.spec).split("{")[0]: r.stats for r in res.records["ort-cpu"]}
    # 5 RMSNorms (2 per layer + final); all but the first follow a residual Add.
    assert stats["fuse-rmsnorm"]["fused"] == 5
    assert stats["fuse-skip-layernorm"]["rms"] == 4
    attn = stats["fuse-attention"]
    assert attn["fused"] == 2 and attn["gqa"] == 2 and attn["rotary"] == 4 and attn["cos_sin_cache"] == 4
    assert res.manifest["parity"]["ok"] and res.manifest["parity"]["reference"] == "torch (eager)"
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "art" / "model.onnx")).graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["SkipSimplifiedLayerNormalization"] == 4
    assert ops["Softmax"] == 0 and ops["RotaryEmbedding"] == 0  # rotary runs inside GQA (do_rotary=1)

    from precast.runtime import load

    art = load(tmp_path / "art")
    rng = np.random.default_rng(1)
    for batch, seq in [(1, 1), (3, 11), (2, 40)]:  # other shapes than the export's sample
        ids = rng.integers(0, 256, (batch, seq)).astype(np.int64)
        with torch.no_grad():
            expected = module(torch.from_numpy(ids)).numpy()
        got = art.run({"input_ids": ids})["logits"]
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)


def _mask_model(kind: str):
    """mask[1,1,S,S] from Shape(x): causal (0 below/on diagonal), anti-causal, or reading x's values."""
    F, I64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], start=1, end=2),
        helper.make_node("Squeeze", ["shp"], ["s"]),
        helper.make_node("Range", ["zero", "s", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["row"]),
        helper.make_node("Unsqueeze", ["r", "ax1"], ["col"]),
        helper.make_node("Greater" if kind != "anti" else "Less", ["row", "col"], ["above"]),
        helper.make_node("Where", ["above", "neg", "zerof"], ["m2"]),
    ]
    if kind == "data":  # a padding mask would read the input's values
        nodes += [
            helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
            helper.make_node("Cast", ["sx"], ["sxf"], to=F),
            helper.make_node("Mul", ["m2", "sxf"], ["m2b"]),
        ]
    last = "m2b" if kind == "data" else "m2"
    nodes.append(helper.make_node("Unsqueeze", [last, "ax01"], ["mask"]))
    inits = {
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "ax0": np.array([0], np.int64),
        "ax1": np.array([1], np.int64),
        "ax01": np.array([0, 1], np.int64),
        "neg": np.array(np.finfo(np.float32).min, np.float32),
        "zerof": np.array(0, np.float32),
    }
    return make_model(nodes, [("x", I64, ["batch", "seq"])], [("mask", F, ["batch", 1, "seq", "seq"])], inits)


@pytest.mark.parametrize("kind,expected", [("causal", True), ("anti", False), ("data", False)])
def test_causal_mask_proof(kind, expected):
    from onnx_ir.passes.common import ShapeInferencePass

    model = to_ir(_mask_model(kind))
    ShapeInferencePass()(model)
    mask = model.graph.outputs[0]
    query = model.graph.inputs[0]  # stands in for [B,S,D]: only dim 1 (the sequence) is compared
    assert is_causal_mask(model, mask, query) is expected


class RecurrentLoop(torch.nn.Module):
    """h <- tanh(x[:, t] @ W + h @ U) for t in range(x.size(1)): a Python loop torch.jit.script keeps."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.3)
        self.u = torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.3)

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        for t in range(x.size(1)):
            h = torch.tanh(x[:, t] @ self.w + h @ self.u)
        return h


def export_loop(path, steps: int = 6):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            torch.jit.script(RecurrentLoop().eval()),
            (torch.randn(2, steps, 16),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )


@pytest.mark.slow
def test_scripted_python_loop_is_unrolled_with_parity(tmp_path):
    export_loop(tmp_path / "loop.onnx")
    assert "Loop" in [n.op_type for n in onnx.load(str(tmp_path / "loop.onnx")).graph.node]
    res = compile_model(
        str(tmp_path / "loop.onnx"), tmp_path / "art", CompileOptions(target_options={"ort_level": "none"})
    )
    stats = {str(r.spec).split("{")[0]: r.stats for r in res.records["ort-cpu"]}
    assert stats["unroll-loops"]["unrolled"] == 1 and "kept" not in stats["unroll-loops"]
    assert res.manifest["parity"]["ok"]
    ops = [n.op_type for n in onnx.load(str(tmp_path / "art" / "model.onnx")).graph.node]
    assert "Loop" not in ops and ops.count("Tanh") == 6

    from precast.runtime import load

    x = np.random.default_rng(2).standard_normal((5, 6, 16)).astype(np.float32)
    with torch.no_grad():
        expected = RecurrentLoop().eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(load(tmp_path / "art").run({"x": x})["y"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_loop_longer_than_max_trip_is_kept(tmp_path):
    export_loop(tmp_path / "loop.onnx", steps=20)
    res = compile_model(
        str(tmp_path / "loop.onnx"), tmp_path / "art", CompileOptions(target_options={"ort_level": "none"})
    )
    stats = {str(r.spec).split("{")[0]: r.stats for r in res.records["ort-cpu"]}
    assert stats["unroll-loops"] == {"unrolled": 0, "kept": 1} and res.manifest["parity"]["ok"]
