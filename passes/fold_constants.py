"""Constant folding: evaluate nodes whose inputs are all constants (onnxscript's optimizer does the work)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants

from precast.errors import PassFailedError, first_line
from precast.ir.pipeline import count_nodes
from precast.ir.registry import Pass, PassResult, option, register
from precast.passes._opset_compat import axes_as_attributes


@register("fold-constants")
class FoldConstants(Pass):
    """Fold constant subgraphs (Shape/Reshape arithmetic, Constant nodes) into initializers.

    Constant -> Add(Constant) -> X   ==>   initializer X
    """

    @dataclass(frozen=True)
    class Options:
        input_size_limit: int = option(
            8192, "fold a node only if each constant input has at most this many elements"
        )
        output_size_limit: int = option(
            1 << 20,
            "fold a node only if its result has at most this many elements (bigger ones stay computed at run time)",
        )

    def call(self, model: ir.Model) -> PassResult:
        before = count_nodes(model)
        # The folder writes opset-13 forms (Unsqueeze/Split with an axes input) into older models too. Where
        # such a form has no older spelling (SplitToSequence's computed split sizes -> Split), the folded graph
        # is invalid for its opset: keep the unfolded one. onnxscript's sequence folding also raises on some
        # valid graphs (a SplitToSequence whose split is a graph input). Models with sequence ops pay for a
        # copy to fall back on; any other failure is named instead of written.
        original = None
        if any("Sequence" in n.op_type for n in model.graph.all_nodes()):
            original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        try:
            fold_constants(
                model,
                onnx_shape_inference=True,
                input_size_limit=self.options.input_size_limit,
                output_size_limit=self.options.output_size_limit,
            )
        except Exception as e:
            if original is None:
                raise
            return PassResult(
                original, False, {"folded": 0, "kept": f"onnxscript's folder failed: {first_line(e)}"}
            )
        stuck = axes_as_attributes(model)
        if stuck:
            opset = model.opset_imports.get("", 0)
            if original is None:
                raise PassFailedError(
                    f"fold-constants: node '{stuck[0].name}' ({stuck[0].op_type}) would need opset 13+ "
                    f"(the model imports opset {opset}); skip fold-constants for this model"
                )
            return PassResult(
                original, False, {"folded": 0, "kept": f"{stuck[0].op_type} has no opset-{opset} form"}
            )
        RemoveUnusedNodesPass()(model)
        # Constant nodes left behind become initializers: a graph with no Constant ops is simpler to match.
        LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=0)(model)
        folded = max(0, before - count_nodes(model))
        return PassResult(model, folded > 0, {"folded": folded})
