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

from precast.compiler.pipeline import count_nodes
from precast.compiler.registry import Pass, PassResult, register


@register("eliminate-dead-code")
class EliminateDeadCode(Pass):
    """Remove identities, unused nodes/initializers, duplicate initializers and common subexpressions.

    Identity(x) -> y        ==>   x
    f(a) ; f(a)             ==>   f(a)   (CSE)
    W1 == W2 (bytes)        ==>   W1     (dedup)
    """

    @dataclass(frozen=True)
    class Options:
        cse: bool = True
        dedup_initializers: bool = True

    def call(self, model: ir.Model) -> PassResult:
        nodes0 = count_nodes(model)
        inits0 = len(model.graph.initializers)
        IdentityEliminationPass()(model)
        if self.options.dedup_initializers:
            DeduplicateInitializersPass(size_limit=1 << 30)(model)
        if self.options.cse:
            CommonSubexpressionEliminationPass()(model)
        RemoveUnusedNodesPass()(model)
        RemoveUnusedOpsetsPass()(model)
        return PassResult(
            model,
            {
                "nodes_removed": nodes0 - count_nodes(model),
                "initializers_removed": inits0 - len(model.graph.initializers),
            },
        )
