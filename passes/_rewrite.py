"""Shared machinery for fusion passes built from onnxscript rewrite rules (not a pass itself)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import pattern

from precast.ir.registry import Pass, PassResult

__all__ = ["RewritePass", "apply_rules", "bind_shape", "dim", "has_rank", "last_dim_vector", "scalar_value"]


def apply_rules(model: ir.Model, rules: pattern.RewriteRuleSet | Sequence[pattern.RewriteRule]) -> int:
    """Apply a rule set until nothing changes; returns the number of rewrites."""
    ruleset = rules if isinstance(rules, pattern.RewriteRuleSet) else pattern.RewriteRuleSet(list(rules))
    total = 0
    for _ in range(8):  # rewrites can expose new matches (e.g. Gelu then BiasGelu); bounded
        count = ruleset.apply_to_model(model)
        total += count
        if not count:
            break
    if total:
        RemoveUnusedNodesPass()(model)
    return total


# Small shape/constant helpers for rule checks. onnxscript has the same in rewriter._ir_utils and
# rewriter._fusion_utils, which are private modules (not a stable API), so precast keeps its own.
def has_rank(value: ir.Value | None, rank: int) -> bool:
    return value is not None and value.shape is not None and len(value.shape) == rank


def dim(value: ir.Value | None, axis: int):
    """``value``'s size on ``axis`` (an int or a symbolic dim), or None when its shape is unknown."""
    if value is None or value.shape is None or not -len(value.shape) <= axis < len(value.shape):
        return None
    return value.shape[axis]


def scalar_value(value: ir.Value | None) -> float | int | None:
    """The value of a constant one-element tensor, else None."""
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None or tensor.size != 1 else tensor.numpy().reshape(()).item()


def bind_shape(bindings: dict, value: ir.Value, names: Sequence[str]) -> bool:
    """True when ``value``'s shape is ``names`` long and agrees with the sizes already bound to those names
    (binding the new ones): [B, S, D] and then [B, S, Dkv] share B and S."""
    if value.shape is None or len(value.shape) != len(names):
        return False
    for actual, name in zip(value.shape, names):
        if bindings.setdefault(name, actual) != actual:
            return False
    return True


def last_dim_vector(vec: ir.Value | None, x: ir.Value) -> bool:
    """True when ``vec`` is a rank-1 tensor whose length is x's last dimension (a per-feature vector).

    The normalization ops take scale/bias of the normalized shape; a scalar or a broadcast of
    another shape would change the meaning, so such chains are left alone.
    """
    if vec is None or vec.shape is None or len(vec.shape) != 1:
        return False
    if x.shape is None or len(x.shape) == 0:
        return False
    return vec.shape[0] == x.shape[-1] or (isinstance(vec.shape[0], int) and not isinstance(x.shape[-1], int))


class RewritePass(Pass):
    """A pass that applies ``rules`` (a RewriteRuleSet) and reports ``{"fused": n}``."""

    rules: pattern.RewriteRuleSet

    def call(self, model: ir.Model) -> PassResult:
        fused = apply_rules(model, self.rules)
        return PassResult(model, fused > 0, {"fused": fused})
