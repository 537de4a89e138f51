"""Attention fusion (onnxscript's ORT fusion rules): encoder self-attention -> Attention / MultiHeadAttention,
decoder attention with rotary embeddings and grouped KV heads -> RotaryEmbedding / GroupQueryAttention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
from onnxscript.rewriter.ort_fusions.attention import attention_rules
from onnxscript.rewriter.ort_fusions.cos_sin_cache import cos_sin_cache_rules
from onnxscript.rewriter.ort_fusions.gqa import gqa_rules
from onnxscript.rewriter.ort_fusions.gqa_packed_qkv import fuse_qkv_gqa_rules
from onnxscript.rewriter.ort_fusions.mha import mha_rules_no_past, mha_rules_with_past
from onnxscript.rewriter.ort_fusions.mha_bias import mha_bias_rules
from onnxscript.rewriter.ort_fusions.mha_scale import fuse_mha_scale
from onnxscript.rewriter.ort_fusions.rotary_embedding import (
    partial_embedding_rules,
    rotary_embedding_rules,
)
from onnxscript.rewriter.ort_fusions.sdpa import sdpa_rules
from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha

from precast.ir.registry import Pass, PassResult, option, register
from precast.passes._decoder_rules import cos_sin_cache_mul_rules, gqa_no_past_rules
from precast.passes._rewrite import apply_rules

# onnxscript's rules go through intermediate ops in this private domain; none may survive the pass.
_PRIVATE_DOMAIN = "ai.onnxruntime._fusion"


def _fold_constant_concats(model: ir.Model) -> int:
    """Concat of initializers (the packed Q|K|V weight and bias the Attention rule builds) -> one initializer."""
    folded = 0
    for node in list(model.graph):
        if node.op_type != "Concat" or node.domain != "":
            continue
        values = [v.const_value for v in node.inputs if v is not None]
        if len(values) != len(node.inputs) or any(c is None for c in values) or not values:
            continue
        axis = node.attributes.get_int("axis", 0)
        out = node.outputs[0]
        tensor = ir.tensor(np.concatenate([c.numpy() for c in values], axis=axis), name=out.name)
        const = ir.Value(
            name=out.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
        )
        out.replace_all_uses_with(const)
        model.graph.remove(node, safe=True)
        model.graph.register_initializer(const)
        folded += 1
    return folded


@register("fuse-attention")
class FuseAttention(Pass):
    """Attention subgraphs -> ONNX Runtime's fused attention ops.

    MatMul(Q,K^T) -> Mul(scale) -> Add(mask) -> Softmax -> MatMul(V)       ==>  SDPA (intermediate)
    Q/K/V projections + Reshape/Transpose + SDPA                           ==>  MultiHeadAttention
    MultiHeadAttention with three biased projections of one input          ==>  Attention (packed QKV)
    decoder: rotate-half(x)*sin + x*cos                                    ==>  RotaryEmbedding
             repeat-kv + causal mask + SDPA with past/present              ==>  GroupQueryAttention
    """

    @dataclass(frozen=True)
    class Options:
        packed: bool = option(True, "MultiHeadAttention -> Attention with one packed QKV MatMul")
        decoder: bool = option(True, "also the decoder rules: rotary embeddings and grouped-query attention")

    def call(self, model: ir.Model) -> PassResult:
        backup = model.clone()
        stats: dict[str, int] = {}

        def step(name: str, rules) -> None:
            stats[name] = apply_rules(model, rules)

        ShapeInferencePass()(model)
        if self.options.decoder:
            # One application: the rule wraps its match in a function whose body it would match again.
            stats["rotary"] = rotary_embedding_rules.apply_to_model(model)
            step("cos_sin_cache", cos_sin_cache_rules)
            stats["cos_sin_cache"] += apply_rules(model, cos_sin_cache_mul_rules)  # dynamo export's Mul form
            step("partial_rotary", partial_embedding_rules)
        step("sdpa", sdpa_rules)
        ShapeInferencePass()(model)  # the SDPA rewrite adds nodes whose shapes the next rules check
        if self.options.decoder:
            step("gqa", gqa_rules)
            stats["gqa"] += apply_rules(model, gqa_no_past_rules)  # plain forward, causal mask, no KV cache
            step("packed_qkv_gqa", fuse_qkv_gqa_rules)
        step("mha", mha_rules_with_past)
        stats["mha"] += apply_rules(model, mha_rules_no_past)
        stats["mha_scale"] = fuse_mha_scale(model)
        if stats["mha"]:
            step("mha_bias", mha_bias_rules)
            if self.options.packed:
                step("attention", attention_rules)
        stats["sdpa_to_mha"] = replace_sdpa_by_mha(model)
        leftover = [n.name for n in model.graph if n.domain == _PRIVATE_DOMAIN]
        if leftover:  # a half-fused graph would not run; keep the input as it was
            return PassResult(
                backup, False, {"fused": 0, "skipped": f"unfinished fusion at node '{leftover[0]}'"}
            )
        stats["packed_weights"] = _fold_constant_concats(model)
        RemoveUnusedNodesPass()(model)
        for key in [k for k in model.functions if k[0] == _PRIVATE_DOMAIN]:  # bodies of fused rotary matches
            del model.functions[key]
        fused = sum(1 for n in model.graph if n.domain == "com.microsoft" and n.op_type in _ATTENTION_OPS)
        before = sum(1 for n in backup.graph if n.domain == "com.microsoft" and n.op_type in _ATTENTION_OPS)
        done = {k: v for k, v in stats.items() if v}
        return PassResult(model, fused > before or bool(done), {"fused": fused - before, **done})


_ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
