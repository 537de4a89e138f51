"""MatMul + bias Add -> Gemm (2-D), and Transpose/scale around MatMul -> FusedMatMul (ONNX Runtime)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import fused_matmul_rule_sets as _fmm

from precast.ir.registry import Pass, PassResult, option, register
from precast.passes._rewrite import apply_rules

_GEMM_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16}


def _bias_fits(c: ir.Value, m, n) -> bool:
    """Gemm's C must broadcast to (M, N) without growing the result (Add would broadcast further)."""
    if c.shape is None or len(c.shape) > 2 or c.dtype not in _GEMM_TYPES:
        return False
    want = (m, n)[2 - len(c.shape) :]
    return all(d == 1 or d == w for d, w in zip(c.shape, want))


# Written here from onnxscript 0.7.2's MatMulAddToGemm family (rewriter/rules/common/_matmul_add_to_gemm.py):
# onnxscript exports only the rules, not the classes, and precast adds a check (the bias must broadcast).
class _MatMulAddToGemm(pattern.RewriteRuleClassBase):
    """Add(MatMul(a', b'), c) ==> Gemm(a, b, c, transA, transB), where a' is a or Transpose(a) (b' likewise)."""

    def __init__(self, trans_a: bool, trans_b: bool):
        super().__init__(f"MatMulAddToGemm{'A' if trans_a else ''}{'B' if trans_b else ''}")
        self.trans_a, self.trans_b = trans_a, trans_b

    def pattern(self, op, input_a, input_b, input_c):
        a = op.Transpose(input_a, perm=[1, 0]) if self.trans_a else input_a
        b = op.Transpose(input_b, perm=[1, 0]) if self.trans_b else input_b
        return op.Add(op.MatMul(a, b), input_c)

    def check(self, context, input_a, input_b, input_c, **_) -> pattern.MatchResult:  # type: ignore[override]
        result = pattern.MatchResult()
        if any(v.shape is None or len(v.shape) != 2 for v in (input_a, input_b)):
            return result.fail("MatMul operands are not rank 2", input_a)
        a_rows = input_a.shape[1] if self.trans_a else input_a.shape[0]
        b_cols = input_b.shape[0] if self.trans_b else input_b.shape[1]
        if not _bias_fits(input_c, a_rows, b_cols):
            return result.fail("bias does not broadcast to (M, N)", input_c)
        return result

    def rewrite(self, op, input_a, input_b, input_c):
        attributes = {"transA": 1} if self.trans_a else {}
        if self.trans_b:
            attributes["transB"] = 1
        return op.Gemm(input_a, input_b, input_c, **attributes)


_GEMM_RULES = pattern.RewriteRuleSet(
    [
        _MatMulAddToGemm.rule(ta, tb)
        for ta, tb in ((True, True), (True, False), (False, True), (False, False))
    ],
    commute=True,
)


def _rank3_only(cls):
    """onnxscript 0.7.2's batch-transpose rules emit transBatchA/B=1 whatever the other operand's rank, which ONNX
    Runtime refuses unless both operands have one rank >= 3 (SigLIP's attention-pooling head, a rank-3
    Transpose times a rank-2 weight, failed to run): the same rules, refused there."""

    class RankChecked(cls):
        def check(self, context, x, y, transposed, fused, **kw):
            node = transposed.producer()
            rank = len(node.attributes["perm"].as_ints()) if node is not None else 0
            other = y if self._pos == 1 else x  # ORT: both operands of that rank
            if rank < 3 or other.shape is None or len(other.shape) != rank:
                return pattern.MatchResult().fail("transBatchA/B needs both operands of one rank >= 3")
            return super().check(context, x, y, transposed, fused, **kw)

    RankChecked.__name__ = cls.__name__
    return RankChecked


def fused_matmul_rule_sets() -> pattern.RewriteRuleSet:
    """onnxscript's FusedMatMul rule set, its batch-transpose rules checked for rank (_rank3_only)."""
    rules = [
        rule.rule() if not issubclass(rule, _fmm._TransposeFusedMatMulBaseWithBatch) else _rank3_only(rule).rule()
        for rule in (
            _fmm.FusedMatMulDiv1, _fmm.FusedMatMulDiv2, _fmm.FusedMatMulTranspose, _fmm.MatMulTranspose,
            _fmm.TransposeMatMul1, _fmm.TransposeFusedMatMul1, _fmm.TransposeMatMul2, _fmm.TransposeFusedMatMul2,
            _fmm.TransposeFusedMatMulWithFlippedBatch1, _fmm.TransposeFusedMatMulWithFlippedBatch2,
            _fmm.TransposeFusedMatMulWithFlippedBatchAndTranspose1,
            _fmm.TransposeFusedMatMulWithFlippedBatchAndTranspose2,
            _fmm.TransposeFusedMatMulWithBatchAndTranspose1, _fmm.TransposeFusedMatMulWithBatchAndTranspose2,
        )
    ]  # fmt: skip
    if len(rules) != len(_fmm.fused_matmul_rule_sets().rules):  # onnxscript added or dropped a rule
        raise RuntimeError("onnxscript's fused_matmul_rule_sets changed: update passes/fuse_matmul_add.py")
    return pattern.RewriteRuleSet(rules)


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
        gemm: bool = option(True, "MatMul + bias Add on 2-D operands -> Gemm")
        fused_matmul: bool = option(True, "Transpose / scale around MatMul -> FusedMatMul")

    def call(self, model: ir.Model) -> PassResult:
        gemm = apply_rules(model, _GEMM_RULES) if self.options.gemm else 0
        fused = apply_rules(model, fused_matmul_rule_sets()) if self.options.fused_matmul else 0
        return PassResult(
            model, gemm + fused > 0, {"fused": gemm + fused, "gemm": gemm, "fused_matmul": fused}
        )
