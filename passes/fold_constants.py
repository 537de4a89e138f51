"""Constant folding: evaluate nodes whose inputs are all constants (onnxscript's optimizer does the work)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants

from precast.compiler.pipeline import count_nodes
from precast.compiler.registry import Pass, PassResult, register


@register("fold-constants")
class FoldConstants(Pass):
    """Fold constant subgraphs (Shape/Reshape arithmetic, Constant nodes) into initializers.

    Constant -> Add(Constant) -> X   ==>   initializer X
    """

    @dataclass(frozen=True)
    class Options:
        input_size_limit: int = 8192
        output_size_limit: int = 1 << 20  # elements; bigger results stay computed at run time

    def call(self, model: ir.Model) -> PassResult:
        before = count_nodes(model)
        fold_constants(
            model,
            onnx_shape_inference=True,
            input_size_limit=self.options.input_size_limit,
            output_size_limit=self.options.output_size_limit,
        )
        RemoveUnusedNodesPass()(model)
        # Constant nodes left behind become initializers: a graph with no Constant ops is simpler to match.
        LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=0)(model)
        return PassResult(model, {"folded": max(0, before - count_nodes(model))})
