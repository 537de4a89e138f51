"""Residual Add (+ bias) + LayerNormalization -> SkipLayerNormalization; RMS variant too (onnxscript rules)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter.ort_fusions.skip_normalization import (
    skip_layer_normalization_ruleset,
    skip_rms_normalization_ruleset,
)

from precast.compiler.registry import PassResult, register
from precast.passes._rewrite import RewritePass, apply_rules


@register("fuse-skip-layernorm")
class FuseSkipLayerNorm(RewritePass):
    """Residual Add + LayerNormalization -> SkipLayerNormalization (and SkipSimplifiedLayerNormalization).

        Add(x, skip) [-> Add(bias)] -> LayerNormalization(g, b)   ==>  SkipLayerNormalization(x, skip, g, b, bias)
        Add(x, skip) -> SimplifiedLayerNormalization(g)           ==>  SkipSimplifiedLayerNormalization(x, skip, g)

    The sum stays available as SkipLayerNormalization's 4th output when the residual stream needs it.
    Shapes must be [B, S, D] with per-feature gamma/beta/bias (checked by the rules).
    """

    @dataclass(frozen=True)
    class Options:
        rms: bool = True

    def call(self, model: ir.Model) -> PassResult:
        fused = apply_rules(model, skip_layer_normalization_ruleset)
        rms = apply_rules(model, skip_rms_normalization_ruleset) if self.options.rms else 0
        return PassResult(model, {"fused": fused + rms, "rms": rms})
