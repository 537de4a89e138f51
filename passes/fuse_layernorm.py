"""Decomposed layer norm -> LayerNormalization (opset 17+)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern

from precast.ir.registry import PassResult, register
from precast.passes._rewrite import (
    RewritePass,
    apply_rules,
    last_dim_vector,
    scalar_value,
)

# LayerNormalization's stash_type (the precision it normalizes in), opset 17.
_COMPUTE_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.DOUBLE])


# Written here from onnxscript 0.7.2's LayerNormFusion (rewriter/rules/fusion/_layer_norm.py): that module is
# private (onnxscript exports no layer-norm rule), and precast needs its own check (a per-feature scale).
class _LayerNorm(pattern.RewriteRuleClassBase):
    """(x - mean) / sqrt(var + eps) * scale   ==>   LayerNormalization(x, scale)."""

    def pattern(self, op, x, scale, epsilon):
        deviation = op.Sub(x, op.ReduceMean(x, [-1], keepdims=1))
        squared = pattern.OrValue([op.Mul(deviation, deviation), op.Pow(deviation, 2)])
        std_dev = op.Sqrt(op.Add(op.ReduceMean(squared, [-1], keepdims=1), epsilon))
        normalized = pattern.OrValue([op.Mul(deviation, op.Reciprocal(std_dev)), op.Div(deviation, std_dev)])
        return op.Mul(normalized, scale)

    def check(self, context, x, scale, epsilon, **_) -> pattern.MatchResult:  # type: ignore[override]
        result = pattern.MatchResult()
        if x.dtype not in _COMPUTE_TYPES:
            return result.fail("input is not float or double", x)
        eps = scalar_value(epsilon)
        if eps is None:
            return result.fail("epsilon is not a constant scalar", epsilon)
        if not last_dim_vector(scale, x):  # a scalar scale is not LN's
            return result.fail("scale is not a vector over the last axis", scale)
        self._stash_type, self._epsilon = x.dtype, float(eps)
        return result

    def rewrite(self, op, x, scale, epsilon, **_):
        return op.LayerNormalization(x, scale, axis=-1, epsilon=self._epsilon, stash_type=self._stash_type)


class _LayerNormBias(pattern.RewriteRuleClassBase):
    """LayerNormalization(x, scale) + bias   ==>   LayerNormalization(x, scale, bias)."""

    def pattern(self, op, x, scale, bias):
        return op.LayerNormalization(x, scale, _outputs=["normalized"]) + bias

    def check(self, context, x, bias, **_) -> pattern.MatchResult:  # type: ignore[override]
        if not last_dim_vector(bias, x):
            return pattern.MatchResult().fail("bias is not a vector over the last axis", bias)
        return pattern.MatchResult()

    def rewrite(self, op, x, scale, bias, normalized):
        node = normalized.producer()
        return op.LayerNormalization(x, scale, bias, _outputs=len(node.outputs), **node.attributes)


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
    rules = pattern.RewriteRuleSet([_LayerNorm.rule(), *_LayerNormBias.rule().commute()])

    def call(self, model: ir.Model) -> PassResult:
        if model.opset_imports.get("", 0) < 18:  # ReduceMean takes axes as an input from opset 18
            return PassResult(model, False, {"fused": 0, "skipped": "opset < 18"})
        fused = apply_rules(model, self.rules)
        return PassResult(model, fused > 0, {"fused": fused})
