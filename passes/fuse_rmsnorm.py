"""x * rsqrt(mean(x^2) + eps) * w -> SimplifiedLayerNormalization (ONNX Runtime), via onnxscript's rules."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.rms_normalization import RmsNormFusion

from precast.ir.registry import PassResult, register
from precast.passes._rewrite import RewritePass, apply_rules, last_dim_vector


class _CheckedRmsNorm(RmsNormFusion):
    """onnxscript's rule, plus: the weight must be a per-feature vector; ReduceMean may omit
    noop_with_empty_axes (the axes here are never empty, so its value does not matter)."""

    def pattern(self, op, x, scale, epsilon, compute_dtype, target_dtype):
        x = pattern.OrValue([op.Cast(x, to=compute_dtype), x])
        mean_square = op.ReduceMean(op.Pow(x, 2.0), [-1], keepdims=1)
        normalized = op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean_square, epsilon))))
        normalized = pattern.OrValue([op.Cast(normalized, to=target_dtype), normalized])
        scale = pattern.OrValue([op.Cast(scale, to=compute_dtype), scale])
        return op.Mul(normalized, scale) if self._mul_order else op.Mul(scale, normalized)

    def check(self, op, x, scale, epsilon, compute_dtype, target_dtype, **kw) -> pattern.MatchResult:  # type: ignore[override]
        result = super().check(op, x, scale, epsilon, compute_dtype, target_dtype, **kw)
        if result and not last_dim_vector(scale, x):
            return pattern.MatchResult().fail("scale is not a vector over the last axis", scale)
        return result


@register("fuse-rmsnorm")
class FuseRmsNorm(RewritePass):
    """RMS norm chains -> SimplifiedLayerNormalization.

    [Cast] -> Pow(2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x) -> [Cast] -> Mul(w)
        ==>   SimplifiedLayerNormalization(x, w, axis=-1, epsilon=eps)
    """

    @dataclass(frozen=True)
    class Options:
        pass

    # x / sqrt(mean(x^2) + eps) * w, with w on either side of the Mul.
    rules = pattern.RewriteRuleSet(
        [
            _CheckedRmsNorm.rule("RmsNorm1", _mul_order=False),
            _CheckedRmsNorm.rule("RmsNorm2", _mul_order=True),
        ]
    )

    def call(self, model: ir.Model) -> PassResult:
        if model.opset_imports.get("", 0) < 18:
            return PassResult(model, False, {"fused": 0, "skipped": "opset < 18"})
        fused = apply_rules(model, self.rules)
        return PassResult(model, fused > 0, {"fused": fused})
