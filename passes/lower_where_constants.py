"""Where(cond, scalar a, scalar b) -> Cast(cond) * (a - b) + b: arithmetic a static INT8 quantizer covers.

ONNX Runtime's quantizer leaves Where's constant branches float; on QNN's HTP such a Where (a BERT's
attention-mask fill, ``Where(mask, 0, -3.4e38)``) makes the graph's finalize fail (QNN_COMMON_ERROR_MEM_ALLOC).
Mul and Add with constant operands quantize like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from precast.ir.registry import PassResult, option, register
from precast.passes._rewrite import RewritePass, apply_rules

__all__ = ["LowerWhereConstants"]

_FLOATS = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16, ir.DataType.DOUBLE: np.float64}


def _scalar(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.const_value.size != 1:
        return None
    return value.const_value.numpy().reshape(())


class _WhereScalars(pattern.RewriteRuleClassBase):
    """Where(c, a, b) == Cast(c) * (a - b) + b, in the branches' dtype: c=1 -> (a - b) + b, c=0 -> 0 * (a - b) + b.
    Taken only when (a - b) + b == a exactly in that dtype (and a - b is finite); ``limit`` first clamps a and b
    to [-limit, limit] (a -inf or -3.4e38 mask fill becomes -limit)."""

    def __init__(self, limit: float | None):
        super().__init__("WhereScalars")
        self._limit = limit

    def pattern(self, op, cond, a, b):
        return op.Where(cond, a, b, _outputs=["out"])

    def _values(self, a, b):
        av, bv = _scalar(a), _scalar(b)
        if self._limit is not None and av is not None and bv is not None:
            av, bv = (np.asarray(np.clip(v, -self._limit, self._limit), dtype=v.dtype) for v in (av, bv))
        return av, bv

    def check(self, context, cond, a, b, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        av, bv = self._values(a, b)
        if av is None or bv is None:
            return result.fail("a branch is not a constant scalar", out)
        if a.dtype != b.dtype or a.dtype not in _FLOATS:
            return result.fail("branches are not floats of one dtype", out)
        # Size-1 branches of rank <= rank(cond) broadcast to cond's shape: the output's, as Cast(cond)'s is
        rank = max(len(a.const_value.shape), len(b.const_value.shape))
        if cond.shape is None or rank > len(cond.shape):
            return result.fail("a branch has a higher rank than the condition (it broadcasts it)", out)
        with np.errstate(over="ignore", invalid="ignore"):
            diff = av - bv
            exact = np.isfinite(diff) and diff + bv == av
        if not exact:
            return result.fail(f"(a - b) + b != a for a={av}, b={bv} in {a.dtype}", out)
        return result

    def rewrite(self, op, cond, a, b, out, **_):
        av, bv = self._values(a, b)
        tag = out.name or "where"
        mask = op.Cast(cond, to=a.dtype)
        scaled = op.Mul(mask, op.initializer(ir.tensor(np.asarray(av - bv)), name=f"{tag}/a_minus_b"))
        return op.Add(scaled, op.initializer(ir.tensor(bv), name=f"{tag}/b"))


@register("lower-where-constants")
class LowerWhereConstants(RewritePass):
    """Where with two constant scalar branches -> Cast + Mul + Add (exact; quantizable).

        cond (bool) --Where(cond, a, b)-->  y                                   # a, b float scalars
            ==>   cond --Cast(float)--> Mul(a - b) --> Add(b) --> y               # 1 -> a, 0 -> b, exactly

    Only where that arithmetic gives a and b bit for bit (and the output has the condition's shape).
    ``limit`` (0: off, the default) clamps the branches to [-limit, limit] first: a -inf fill has no exact form,
    and a finite one (1e4) keeps an INT8 range from spanning 3.4e38; that changes the Where's own output, so
    it is opt-in, to be checked by the compile's parity (a softmax after the mask gives the same result).
    """

    @dataclass(frozen=True)
    class Options:
        limit: float = option(
            0.0,
            "clamp the constant branches to [-limit, limit] first (0: off); changes the Where's own output",
        )

    def call(self, model: ir.Model) -> PassResult:
        rules = pattern.RewriteRuleSet([_WhereScalars.rule(self.options.limit or None)])
        lowered = apply_rules(model, rules)
        left = sum(
            1 for g in model.graphs() for n in g if n.op_type == "Where" and n.domain in ("", "ai.onnx")
        )
        return PassResult(model, lowered > 0, {"lowered": lowered, "where_left": left})
