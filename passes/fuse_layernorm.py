"""Decomposed layer norm -> LayerNormalization (opset 17+), via onnxscript's maintained rules."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.fusion._layer_norm import LayerNormBiasFusion, LayerNormFusion

from precast.compiler.registry import PassResult, register
from precast.passes._rewrite import RewritePass, apply_rules, last_dim_vector


class _CheckedLayerNorm(LayerNormFusion):
    """onnxscript's rule, plus: the scale must be a per-feature vector (a scalar scale is not LN's)."""

    def check(self, context, x, scale, epsilon, **kw) -> pattern.MatchResult:  # type: ignore[override]
        result = super().check(context, x=x, epsilon=epsilon, **kw)
        if result and not last_dim_vector(scale, x):
            return pattern.MatchResult().fail("scale is not a vector over the last axis", scale)
        return result


class _CheckedLayerNormBias(LayerNormBiasFusion):
    def check(self, context, x, bias, **_) -> pattern.MatchResult:  # type: ignore[override]
        if not last_dim_vector(bias, x):
            return pattern.MatchResult().fail("bias is not a vector over the last axis", bias)
        return pattern.MatchResult()


@register("fuse-layernorm")
class FuseLayerNorm(RewritePass):
    """Decomposed layer norm chains -> LayerNormalization.

    m = ReduceMean(x,-1); d = x - m; v = ReduceMean(d*d | d^2, -1)
    d / Sqrt(v + eps) | d * Reciprocal(Sqrt(v + eps))  -> Mul(scale) -> Add(bias)
        ==>   LayerNormalization(x, scale, bias, axis=-1, epsilon=eps)
    """

    @dataclass(frozen=True)
    class Options:
        pass

    # LN(x) * s + b == LayerNormalization(x, s, b): the second rule folds the trailing bias Add in.
    rules = pattern.RewriteRuleSet([_CheckedLayerNorm.rule(), *_CheckedLayerNormBias.rule().commute()])

    def call(self, model: ir.Model) -> PassResult:
        if model.opset_imports.get("", 0) < 18:  # ReduceMean takes axes as an input from opset 18
            return PassResult(model, {"fused": 0, "skipped": "opset < 18"})
        return PassResult(model, {"fused": apply_rules(model, self.rules)})
