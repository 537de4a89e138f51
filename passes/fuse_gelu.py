"""Erf / tanh GELU -> Gelu / FastGelu (com.microsoft); a preceding bias Add -> BiasGelu / FastGelu(bias)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.bias_gelu import bias_gelu_rules
from onnxscript.rewriter.ort_fusions.erfgelu import rules as erf_gelu_rules
from onnxscript.rewriter.ort_fusions.gelu import gelu_rules

from precast.ir.registry import PassResult, option, register
from precast.passes._rewrite import RewritePass, apply_rules


class _OnnxTanhGelu(pattern.RewriteRuleClassBase):
    """Gelu(approximate='tanh') (opset 20) == FastGelu: same formula, ORT's kernel is vectorized."""

    def pattern(self, op, x):
        return op.Gelu(x, approximate="tanh")

    def rewrite(self, op, x):
        return op.FastGelu(x, _domain="com.microsoft")


class _BiasFastGelu(pattern.RewriteRuleClassBase):
    """FastGelu(x + b) == FastGelu(x, bias=b) for a 1-D per-feature b."""

    def pattern(self, op, x, bias):
        return op.FastGelu(op.Add(x, bias), _domain="com.microsoft")

    def check(self, context, x, bias, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if bias.shape is None or len(bias.shape) != 1 or bias.const_value is None:
            return result.fail("bias is not a constant 1-D vector", bias)
        if x.shape is None or len(x.shape) < 1 or x.shape[-1] != bias.shape[0]:
            return result.fail("bias length differs from the last axis of x", bias)
        return result

    def rewrite(self, op, x, bias):
        return op.FastGelu(x, bias, _domain="com.microsoft")


@register("fuse-gelu")
class FuseGelu(RewritePass):
    """Erf/tanh GELU -> Gelu/FastGelu (com.microsoft), with bias -> BiasGelu.

    x -> Div(1.4142) -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)                   ==>  Gelu(x)
    x -> Pow(3) -> Mul(0.0447) -> Add(x) -> Mul(0.7979) -> Tanh -> Add(1) ... ==>  FastGelu(x)
    Add(x, b) -> Gelu                                                          ==>  BiasGelu(x, b)
    """

    @dataclass(frozen=True)
    class Options:
        bias: bool = option(True, "also absorb a preceding bias Add (BiasGelu)")

    rules = pattern.RewriteRuleSet(
        [*erf_gelu_rules.rules, *gelu_rules.rules, _OnnxTanhGelu.rule()], commute=True
    )
    bias_rules = pattern.RewriteRuleSet([*bias_gelu_rules.rules, *_BiasFastGelu.rule().commute()])

    def call(self, model: ir.Model) -> PassResult:
        fused = apply_rules(model, self.rules)
        biased = apply_rules(model, self.bias_rules) if self.options.bias else 0
        return PassResult(model, fused + biased > 0, {"fused": fused, "bias_fused": biased})
