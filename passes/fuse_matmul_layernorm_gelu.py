"""MatMul [-> bias Add] -> LayerNormalization -> GeLU: centre the weight offline, drop LN's mean pass.

LayerNorm subtracts the per-row mean of its input. When that input is ``x @ W + b`` with constant W
and b, the mean is ``x @ rowmean(W) + mean(b)``, so subtracting it is the same as multiplying by a
column-centred weight: ``(x@W + b) - mean = x @ (W - rowmean(W)) + (b - mean(b))``. The LayerNorm then
sees a zero-mean row and reduces to ONNX Runtime's SimplifiedLayerNormalization (RMS norm, one pass
fewer over the activations), and LN's beta moves into the GeLU kernel's bias input
(BiasGelu / FastGelu), which adds it while computing GeLU.

Opt-in: exact, but measured slower on ONNX Runtime CPU (benchmarks/bench_chain.py: 1.05x at batch 1,
1.13x at batch 8 of the default pipeline's MatMul + Add + LayerNormalization + Gelu), so the ort-cpu
default pipeline does not list it. Add it after fuse-gelu for targets whose kernels favour RMS norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from precast.ir.registry import PassResult, register
from precast.passes._rewrite import RewritePass, apply_rules

_MS = "com.microsoft"
_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE}


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _is_vector(value: ir.Value | None, n: int) -> bool:
    return value is not None and value.shape is not None and len(value.shape) == 1 and value.shape[0] == n


class _ChainRule(pattern.RewriteRuleClassBase):
    """One variant of the chain: ``gelu`` in {"ms", "onnx", "fast"}, with/without the MatMul bias and LN beta."""

    def __init__(self, gelu: str, mm_bias: bool, beta: bool):
        super().__init__(
            f"MatMulLayerNorm{gelu.capitalize()}Gelu{'_bias' if mm_bias else ''}{'_beta' if beta else ''}"
        )
        self._gelu, self._mm_bias, self._beta = gelu, mm_bias, beta

    def pattern(self, op, x, w, b, scale, beta):
        h = op.MatMul(x, w)
        if self._mm_bias:
            h = op.Add(h, b)
        ln_inputs = (h, scale, beta) if self._beta else (h, scale)
        n = op.LayerNormalization(*ln_inputs, _allow_other_attributes=True, _outputs=["ln_out"])
        if self._gelu == "ms":
            return op.Gelu(n, _domain=_MS)
        if self._gelu == "fast":
            return op.FastGelu(n, _domain=_MS)
        return op.Gelu(n, _allow_other_attributes=True, _outputs=["gelu_out"])

    def check(self, context, x, w, b, scale, beta, ln_out, gelu_out=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        wv = _const(w)
        if wv is None or wv.ndim != 2 or w.dtype not in _FLOATS:
            return result.fail("weight is not a constant float matrix", w)
        n = wv.shape[1]
        if self._mm_bias:
            bv = _const(b)
            if bv is None or bv.shape != (n,):
                return result.fail("bias is not a constant vector over the output features", b)
        ln = ln_out.producer()
        axis = ln.attributes.get_int("axis", -1)
        rank = len(ln_out.shape) if ln_out.shape is not None else None
        if axis != -1 and axis != (rank or 0) - 1:
            return result.fail("LayerNormalization does not normalize the last axis alone", ln)
        if not _is_vector(scale, n) or (self._beta and not _is_vector(beta, n)):
            return result.fail("LayerNormalization scale/bias are not per-feature vectors", ln)
        if (
            gelu_out is not None
            and gelu_out.producer().attributes.get_string("approximate", "none") != "none"
        ):
            return result.fail(
                "ONNX Gelu with approximate='tanh' (fuse-gelu turns it into FastGelu first)", gelu_out
            )
        return result

    def rewrite(self, op, x, w, b, scale, beta, ln_out, **_):
        wv = _const(w).astype(np.float64)
        tag = ln_out.name or "ln"
        centred_w = (wv - wv.mean(axis=1, keepdims=True)).astype(_const(w).dtype)
        h = op.MatMul(x, op.initializer(ir.tensor(centred_w), name=f"{tag}/centred_weight"))
        if self._mm_bias:
            bv = _const(b)
            centred_b = (bv.astype(np.float64) - bv.astype(np.float64).mean()).astype(bv.dtype)
            h = op.Add(h, op.initializer(ir.tensor(centred_b), name=f"{tag}/centred_bias"))
        ln = ln_out.producer()
        n = op.SimplifiedLayerNormalization(
            h,
            scale,
            axis=-1,
            epsilon=ln.attributes.get_float("epsilon", 1e-5),
            stash_type=ln.attributes.get_int("stash_type", 1),
        )
        if self._gelu == "fast":
            return op.FastGelu(n, beta, _domain=_MS) if self._beta else op.FastGelu(n, _domain=_MS)
        return op.BiasGelu(n, beta, _domain=_MS) if self._beta else op.Gelu(n, _domain=_MS)


_RULES = pattern.RewriteRuleSet(
    [
        _ChainRule.rule(g, mm_bias, beta)
        for g in ("ms", "onnx", "fast")
        for mm_bias in (True, False)
        for beta in (True, False)
    ],
    commute=True,
)


@register("fuse-matmul-layernorm-gelu")
class FuseMatMulLayerNormGelu(RewritePass):
    """MatMul(W) [+ b] -> LayerNormalization(g, beta) -> Gelu/FastGelu  ==>  centred MatMul + RMS norm + BiasGelu.

        h = x @ W + b; y = Gelu(LN(h) * g + beta)
            ==>   h' = x @ (W - rowmean(W)) + (b - mean(b))            # zero-mean rows, exactly
                  y  = BiasGelu(SimplifiedLayerNormalization(h', g), beta)   # FastGelu(., beta) for tanh GeLU

    Only with constant W and b used by this chain alone; run after fuse-layernorm and fuse-gelu.
    """

    @dataclass(frozen=True)
    class Options:
        pass

    rules = _RULES

    def call(self, model: ir.Model) -> PassResult:
        fused = apply_rules(model, self.rules)
        return PassResult(model, fused > 0, {"fused": fused})
