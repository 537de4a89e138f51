"""MatMul + bias Add -> Gemm (2-D), and Transpose/scale around MatMul -> FusedMatMul (ONNX Runtime)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.fused_matmul_rule_sets import fused_matmul_rule_sets
from onnxscript.rewriter.rules.common._matmul_add_to_gemm import (
    MatMulAddToGemm,
    TransABMatMulAddToGemm,
    TransAMatMulAddToGemm,
    TransBMatMulAddToGemm,
)

from precast.compiler.registry import Pass, PassResult, register
from precast.passes._rewrite import apply_rules

_GEMM_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16}


def _bias_fits(c: ir.Value, a: ir.Value, b: ir.Value) -> bool:
    """Gemm's C must broadcast to (M, N) without growing the result (Add would broadcast further)."""
    if (
        c.shape is None
        or a.shape is None
        or b.shape is None
        or len(c.shape) > 2
        or c.dtype not in _GEMM_TYPES
    ):
        return False
    m, n = a.shape[0], b.shape[1]
    want = (m, n)[2 - len(c.shape) :]
    return all(d == 1 or d == w for d, w in zip(c.shape, want))


def _checked(rule_cls: type) -> type:
    class Checked(rule_cls):  # type: ignore[misc, valid-type]
        def check(self, context, input_a, input_b, input_c, **kw) -> pattern.MatchResult:  # type: ignore[override]
            result = super().check(context, input_a, input_b, **kw)
            if result and not _bias_fits(input_c, input_a, input_b):
                return pattern.MatchResult().fail("bias does not broadcast to (M, N)", input_c)
            return result

    Checked.__name__ = rule_cls.__name__
    return Checked


_GEMM_RULES = pattern.RewriteRuleSet(
    [
        _checked(cls).rule()
        for cls in (MatMulAddToGemm, TransAMatMulAddToGemm, TransBMatMulAddToGemm, TransABMatMulAddToGemm)
    ],
    commute=True,
)


@register("fuse-matmul-add")
class FuseMatMulAdd(Pass):
    """MatMul + bias -> Gemm for 2-D operands; Transpose / Div around MatMul -> FusedMatMul.

        Add(MatMul(a, b), c)           [a, b rank 2, c broadcasts to (M, N)]   ==>  Gemm(a, b, c)
        MatMul(Transpose(a), b) / s                                           ==>  FusedMatMul(a, b, transA, alpha=1/s)

    Rank-3 activations keep MatMul + Add: ONNX Runtime's own MatMulAddFusion (run by the ort-cpu target)
    flattens them to a Gemm only where that is profitable.
    """

    @dataclass(frozen=True)
    class Options:
        gemm: bool = True
        fused_matmul: bool = True

    def call(self, model: ir.Model) -> PassResult:
        gemm = apply_rules(model, _GEMM_RULES) if self.options.gemm else 0
        fused = apply_rules(model, fused_matmul_rule_sets()) if self.options.fused_matmul else 0
        return PassResult(model, {"fused": gemm + fused, "gemm": gemm, "fused_matmul": fused})
