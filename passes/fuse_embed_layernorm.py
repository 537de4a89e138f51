"""BERT embeddings: word + token-type + position Gathers, Adds, LayerNormalization -> EmbedLayerNormalization."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from precast.ir.registry import register
from precast.passes._rewrite import RewritePass

__all__ = ["FuseEmbedLayerNorm"]

_INTS = (ir.DataType.INT32, ir.DataType.INT64)


def _same_dim(a, b) -> bool:
    """Provably equal: the same int, or the same named symbolic dim (an unnamed dim proves nothing)."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return a.value is not None and a.value == b.value


def _ints(value: ir.Value | None) -> list[int] | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(x) for x in tensor.numpy().ravel()]


def _seq_len_of(ends: ir.Value, ids: ir.Value) -> bool:
    """``ends`` is ids' sequence length: a constant equal to it, or Shape(x, start=1, end=2) of an x as long."""
    assert ids.shape is not None
    seq = ids.shape[1]
    const = _ints(ends)
    if const is not None:
        return len(const) == 1 and isinstance(seq, int) and const[0] == seq
    node = ends.producer()
    if node is None or node.op_type != "Shape" or node.domain != "":
        return False
    x = node.inputs[0]
    start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", None)
    if start != 1 or end != 2 or x is None or x.shape is None or x.shape.rank() < 2:
        return False
    return x is ids or _same_dim(x.shape[1], seq)


def _position_slice(index: ir.Value, ids: ir.Value) -> np.ndarray | None:
    """The table when ``index`` == table[:, 0:S] (S = ids' sequence length) of a constant [1, P] table, else None."""
    node = index.producer()
    if node is None or node.op_type != "Slice" or node.domain != "" or len(node.inputs) < 4:
        return None
    data, starts, ends, axes = node.inputs[:4]
    steps = node.inputs[4] if len(node.inputs) > 4 else None
    table = ir.convenience.get_const_tensor(data) if data is not None else None
    if table is None or len(table.shape) != 2 or table.shape[0] != 1:
        return None
    if _ints(starts) != [0] or _ints(axes) not in ([1], [-1]) or (steps is not None and _ints(steps) != [1]):
        return None
    if ends is None or not _seq_len_of(ends, ids):
        return None
    return table.numpy()


class _EmbedLayerNorm(pattern.RewriteRuleClassBase):
    """LayerNormalization(Gather(A, a) + Gather(B, b) [+ Gather(C, c)]) with one Gather reading positions.

    The commuted variants bind the Gathers in every order; ``check`` picks the roles itself (the position
    Gather is the one whose indices are [1 or B, S] positions), so any binding that passes is right:
    the sum is symmetric in its terms.
    """

    def __init__(self, name: str, three: bool):
        super().__init__(name)
        self._three = three

    def pattern(self, op, t0, i0, t1, i1, t2, i2, gamma, beta):
        total = op.Add(op.Gather(t0, i0, _outputs=["e0"]), op.Gather(t1, i1, _outputs=["e1"]))
        if self._three:
            total = op.Add(total, op.Gather(t2, i2, _outputs=["e2"]))
        return op.LayerNormalization(total, gamma, beta, _outputs=["ln"])

    def _roles(self, tables, indices):
        """(word, segment | None, position, omit_position_ids) or a failure reason (str)."""
        for t in tables:
            if t.dtype != ir.DataType.FLOAT or t.shape is None or t.shape.rank() != 2:
                return "embedding tables must be float [rows, hidden]"
        hidden = tables[0].shape[1]
        if not isinstance(hidden, int) or any(t.shape[1] != hidden for t in tables):
            return "embedding tables differ in hidden size"

        def ids_like(i: ir.Value) -> bool:
            return i.dtype in _INTS and i.shape is not None and i.shape.rank() == 2

        pairs = list(zip(tables, indices))
        for k, (pos_t, pos_i) in enumerate(pairs):
            rest = pairs[:k] + pairs[k + 1 :]
            ids = rest[0][1]
            if not all(
                ids_like(i) and all(_same_dim(a, b) for a, b in zip(i.shape, ids.shape)) for _, i in rest
            ):
                continue  # word and segment ids must provably have one [batch, seq] shape
            table = _position_slice(pos_i, ids)
            if table is not None:  # [1, S]; the kernel's default positions are 0..S-1
                omit = bool(np.array_equal(table.ravel(), np.arange(table.shape[1])))
            elif (
                ids_like(pos_i)
                and _same_dim(pos_i.shape[1], ids.shape[1])
                and (pos_i.shape[0] == 1 or _same_dim(pos_i.shape[0], ids.shape[0]))
            ):
                omit = False
            else:
                continue
            rest.sort(key=lambda p: -p[0].shape[0] if isinstance(p[0].shape[0], int) else 0)
            word, seg = rest[0], rest[1] if len(rest) > 1 else None
            return word, seg, (pos_t, pos_i), omit
        return "no Gather reads positions [1 or batch, seq] aligned with the ids"

    def check(
        self, context, t0, i0, t1, i1, gamma, beta, ln, t2=None, i2=None, **outs
    ) -> pattern.MatchResult:
        result = pattern.MatchResult()
        gathers = [outs["e0"], outs["e1"]] + ([outs["e2"]] if self._three else [])
        if any(g.producer().attributes.get_int("axis", 0) != 0 for g in gathers):
            return result.fail("Gather axis is not 0")
        tables = [t0, t1] + ([t2] if self._three else [])
        indices = [i0, i1] + ([i2] if self._three else [])
        roles = self._roles(tables, indices)
        if isinstance(roles, str):
            return result.fail(roles)
        hidden = tables[0].shape[1]
        for v in (gamma, beta):
            if v.dtype != ir.DataType.FLOAT or v.shape is None or v.shape.rank() != 1 or v.shape[0] != hidden:
                return result.fail("gamma/beta must be float [hidden]", v)
        norm = ln.producer()
        if (
            norm.attributes.get_int("axis", -1) not in (-1, 2)
            or norm.attributes.get_int("stash_type", 1) != 1
        ):
            return result.fail("LayerNormalization must normalize the last axis in float", ln)
        if len(norm.outputs) > 1 and any(o.uses() for o in norm.outputs[1:]):
            return result.fail("LayerNormalization mean/inv_std_dev outputs are used", ln)
        return result

    def rewrite(self, op, t0, i0, t1, i1, gamma, beta, ln, t2=None, i2=None, **_):
        tables = [t0, t1] + ([t2] if self._three else [])
        indices = [i0, i1] + ([i2] if self._three else [])
        (word_t, word_i), seg, (pos_t, pos_i), omit = self._roles(tables, indices)

        def int32(v: ir.Value) -> ir.Value:
            return v if v.dtype == ir.DataType.INT32 else op.Cast(v, to=ir.DataType.INT32)

        inputs = [
            int32(word_i),
            int32(seg[1]) if seg else None,
            word_t,
            pos_t,
            seg[0] if seg else None,
            gamma,
            beta,
        ]
        if not omit:
            inputs += [None, int32(pos_i)]
        epsilon = ln.producer().attributes.get_float("epsilon", 1e-5)
        out, _mask_index = op.EmbedLayerNormalization(
            *inputs, epsilon=epsilon, _domain="com.microsoft", _outputs=2
        )
        return out


_rules = pattern.RewriteRuleSet(
    [
        _EmbedLayerNorm.rule("EmbedLayerNorm3", three=True),
        _EmbedLayerNorm.rule("EmbedLayerNorm2", three=False),
    ],
    commute=True,
)


@register("fuse-embed-layernorm")
class FuseEmbedLayerNorm(RewritePass):
    """BERT-style embeddings -> EmbedLayerNormalization (com.microsoft), int64 ids cast to int32.

        Gather(word, ids) + Gather(type, seg) + Gather(pos, Slice(arange[1, P], 0, S, axis=1))
            -> LayerNormalization(g, b)        ==>   EmbedLayerNormalization(ids, seg, word, pos, type, g, b)

    Positions that are not the 0..S-1 prefix of an arange table are passed as position_ids ([1 or B, S]);
    two Gathers (no token types, DistilBERT) fuse too. No mask is given: the attention mask stays on the
    Attention nodes (mask_index from a mask sum would assume right padding), so output 1 is unused.
    """

    rules = _rules
