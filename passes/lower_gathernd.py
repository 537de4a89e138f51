"""GatherND with constant indices -> Reshape + Gather (QNN's HTP refuses GatherND; Gather it takes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from precast.ir.registry import PassResult, register
from precast.passes._rewrite import RewritePass, apply_rules

__all__ = ["LowerGatherND"]


class _ConstantGatherND(pattern.RewriteRuleClassBase):
    """GatherND(data, I, batch_dims=0), I constant [..., k], data static [d0, .., dk-1, *rest]:
    out[j] = data[I[j, 0], .., I[j, k-1]] = Reshape(data, [d0*..*dk-1, *rest])[ravel(I[j], (d0, .., dk-1))]."""

    def pattern(self, op, data, indices):
        return op.GatherND(data, indices, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, data, indices, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if out.producer().attributes.get_int("batch_dims", 0) != 0:
            return result.fail("batch_dims > 0", out)
        if indices.const_value is None:
            return result.fail("indices are computed at run time", indices)
        if data.shape is None or not all(isinstance(d, int) for d in data.shape):
            return result.fail("data shape is not static (run pin-dims and fold-constants first)", data)
        idx = indices.const_value.numpy()
        k = idx.shape[-1] if idx.ndim else 0
        if idx.ndim == 0 or not 1 <= k <= len(data.shape):
            return result.fail("indices' last dim is not in 1..rank(data)", indices)
        dims = np.array(data.shape[:k])
        if np.any(idx < -dims) or np.any(idx >= dims):
            return result.fail("an index is out of range", indices)  # ORT would refuse at run time: keep it
        return result

    def rewrite(self, op, data, indices, out, **_):
        idx = indices.const_value.numpy().astype(np.int64)
        k = idx.shape[-1]
        lead, rest = list(data.shape[:k]), list(data.shape[k:])
        idx = np.where(idx < 0, idx + np.array(lead), idx)  # GatherND counts negative indices from the end
        flat = np.ravel_multi_index(tuple(np.moveaxis(idx, -1, 0)), lead).astype(np.int64)
        tag = out.name or "gathernd"
        table = data
        if k > 1:
            shape = np.array([int(np.prod(lead)), *rest], np.int64)
            table = op.Reshape(data, op.initializer(ir.tensor(shape), name=f"{tag}/flat_shape"))
        return op.Gather(table, op.initializer(ir.tensor(flat), name=f"{tag}/flat_indices"), axis=0)


@register("lower-gathernd")
class LowerGatherND(RewritePass):
    """GatherND with constant indices and a static data shape -> Reshape + Gather (exact).

        data [d0, d1, *rest] --GatherND(I [..., 2], batch_dims=0)--> out [..., *rest]
            ==>   data --Reshape([d0*d1, *rest])--> Gather(axis=0, ravel_multi_index(I, (d0, d1)))--> out

    A dynamo-exported BERT selects its attention mask this way; QNN's HTP has Gather but not GatherND.
    Run-time indices, batch_dims > 0 or an unknown data shape are left alone (the stats say how many).
    """

    @dataclass(frozen=True)
    class Options:
        pass

    rules = pattern.RewriteRuleSet([_ConstantGatherND.rule()])

    def call(self, model: ir.Model) -> PassResult:
        lowered = apply_rules(model, self.rules)
        left = sum(
            1 for g in model.graphs() for n in g if n.op_type == "GatherND" and n.domain in ("", "ai.onnx")
        )
        return PassResult(model, lowered > 0, {"lowered": lowered, "gathernd_left": left})
