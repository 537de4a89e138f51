"""ONNX shape inference over the whole graph (onnx_ir's ShapeInferencePass)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from precast.compiler.registry import Pass, PassResult, register


def _known_shapes(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() for v in n.outputs if v.shape is not None)


@register("infer-shapes")
class InferShapes(Pass):
    """Infer value shapes and types with ONNX shape inference (strict mode off: unknown ops are kept)."""

    @dataclass(frozen=True)
    class Options:
        data_prop: bool = True

    def call(self, model: ir.Model) -> PassResult:
        before = _known_shapes(model)
        result = ShapeInferencePass(check_type=False, strict_mode=False, data_prop=self.options.data_prop)(
            model
        )
        return PassResult(
            result.model,
            {"shapes_known": _known_shapes(result.model), "new": _known_shapes(result.model) - before},
        )
