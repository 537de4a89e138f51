"""Dead code: unused nodes and initializers, identities, duplicate initializers, common subexpressions."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    DeduplicateInitializersPass,
    IdentityEliminationPass,
    RemoveUnusedNodesPass,
    RemoveUnusedOpsetsPass,
)

from precast.ir.pipeline import count_nodes
from precast.ir.registry import Pass, PassResult, option, register


def _distinct_outputs(model: ir.Model) -> int:
    """Give a graph output listed twice its own Identity again.

    Identity elimination turns a body ``Add -> sum_out; Identity(sum_out) -> scan_out`` into outputs
    ``[scan_out, scan_out]``; ONNX Runtime's Scan then writes both loop-carried state and scan output through
    one buffer and returns wrong numbers (ONNX's own test_scan_sum case: max error 12).
    """
    fixed = 0
    for graph in model.graphs():
        seen: set[ir.Value] = set()
        for i, value in enumerate(list(graph.outputs)):
            if value in seen:
                copy = ir.Node("", "Identity", [value], name=f"{value.name}/output{i}")
                copy.outputs[0].name = f"{value.name}_output{i}"
                copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
                graph.append(copy)
                graph.outputs[i] = copy.outputs[0]
                fixed += 1
            seen.add(value)
    return fixed


@register("eliminate-dead-code")
class EliminateDeadCode(Pass):
    """Remove identities, unused nodes/initializers, duplicate initializers and common subexpressions.

    Identity(x) -> y        ==>   x
    f(a) ; f(a)             ==>   f(a)   (CSE)
    W1 == W2 (bytes)        ==>   W1     (dedup)
    """

    @dataclass(frozen=True)
    class Options:
        cse: bool = option(True, "merge common subexpressions (the same op on the same inputs)")
        dedup_initializers: bool = option(True, "share initializers whose bytes are identical")

    def call(self, model: ir.Model) -> PassResult:
        nodes0 = count_nodes(model)
        inits0 = len(model.graph.initializers)
        IdentityEliminationPass()(model)
        _distinct_outputs(model)
        if self.options.dedup_initializers:
            DeduplicateInitializersPass(size_limit=1 << 30)(model)
        if self.options.cse:
            CommonSubexpressionEliminationPass()(model)
        RemoveUnusedNodesPass()(model)
        RemoveUnusedOpsetsPass()(model)
        nodes, inits = nodes0 - count_nodes(model), inits0 - len(model.graph.initializers)
        return PassResult(
            model, bool(nodes or inits), {"nodes_removed": nodes, "initializers_removed": inits}
        )
