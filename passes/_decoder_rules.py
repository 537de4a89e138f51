"""Decoder attention rules for what torch.onnx (dynamo) emits for a Hugging Face Llama without KV cache.

onnxscript's ORT rules expect the older export: cos/sin from ``MatMul(inv_freq, position_ids)`` and
attention with past KV plus an ``attention_mask`` input. The dynamo export of a plain forward differs:

    pos[1,S] -> Unsqueeze(-1) -> Cast -> Mul(inv_freq[E]) -> Concat(f,f) -> Cos/Sin -> Unsqueeze(1)
    repeat-kv + SDPA(mask) where mask is built from Shape(input_ids) only (causal, packed-sequence check)

These rules extend onnxscript's (subclassing where they fit) rather than re-deriving them:
  CosSinCacheMul:  the Mul form above -> com.microsoft RotaryEmbedding(x, pos[B,S], cos[P,E], sin[P,E])
  GqaNoPast:       rotary Q/K + repeat-kv + SDPA(causal mask) -> GroupQueryAttention(do_rotary=1), no past
The mask is accepted only when it depends on input *shapes* alone and, evaluated with ONNX Runtime on
several (batch, sequence) sizes, equals the causal mask (0 on and below the diagonal, <= -1e4 above).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.cos_sin_cache import CosSinCacheFusion
from onnxscript.rewriter.ort_fusions.gqa import GroupQueryAttention

from precast.passes._rewrite import bind_shape, dim, has_rank, scalar_value

__all__ = ["cos_sin_cache_mul_rules", "gqa_no_past_rules", "is_causal_mask"]

_PRIVATE = "ai.onnxruntime._fusion"


class CosSinCacheMul(CosSinCacheFusion):
    """freqs = Cast(Unsqueeze(pos, -1)) * inv_freq  (an outer product written as a broadcast Mul)."""

    def __init__(self) -> None:
        super().__init__("CosSinCacheMul")
        self._positions: dict[tuple, ir.Value] = {}

    def cleanup(self) -> None:
        super().cleanup()
        self._positions.clear()

    def pattern(self, op, x, inv_freq, position_ids, axes, interleaved, num_heads):
        pos = op.Cast(op.Unsqueeze(position_ids, axes), to=ir.DataType.FLOAT)
        freqs = op.Mul(pos, inv_freq)  # [B,S,1] * [E] = [B,S,E]
        emb = op.Concat(freqs, freqs, axis=-1)
        cos_4d = op.Unsqueeze(op.Cos(emb), [1])
        sin_4d = op.Unsqueeze(op.Sin(emb), [1])
        return op.RotaryEmbedding(
            x, cos_4d, sin_4d, interleaved=interleaved, num_heads=num_heads, _domain=_PRIVATE
        )

    def check(self, context, x, inv_freq, position_ids, axes, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not has_rank(position_ids, 2) or scalar_value(axes) not in (2, -1):
            return result.fail("position_ids is not [B,S] unsqueezed on the last axis", position_ids)
        if inv_freq.const_value is None or inv_freq.const_value.size != (inv_freq.shape or [0])[-1]:
            return result.fail("inv_freq is not a constant vector", inv_freq)
        if not has_rank(x, 4) or x.dtype != ir.DataType.FLOAT:
            return result.fail("x is not a float32 [B,H,S,D] tensor", x)
        return result

    def rewrite(self, op, x, inv_freq, position_ids, interleaved, num_heads, **_):
        if inv_freq not in self._inv_freq_cos_sin_cache:
            self._inv_freq_cos_sin_cache[inv_freq] = self._compute_dynamic_freqs(
                op, inv_freq, position_ids, None
            )
        cos_2d, sin_2d = self._inv_freq_cos_sin_cache[inv_freq]
        return op.RotaryEmbedding(
            x,
            self._batch_positions(op, x, position_ids),
            cos_2d,
            sin_2d,
            interleaved=interleaved,
            num_heads=num_heads,
            _domain="com.microsoft",
        )

    def _batch_positions(self, op, x: ir.Value, position_ids: ir.Value) -> ir.Value:
        """ORT's RotaryEmbedding wants position_ids [B,S]; the export builds them as [1,S]."""
        if dim(position_ids, 0) != 1 or dim(x, 0) == 1:
            return position_ids
        # Same symbolic batch and sequence dims => the same runtime sizes, so one Expand serves all.
        key = (position_ids, str(dim(x, 0)), str(dim(x, 2)))
        if key not in self._positions:
            batch = op.Shape(x, start=0, end=1)
            self._positions[key] = op.Expand(
                position_ids, op.Concat(batch, op.Constant(value_ints=[1]), axis=0)
            )
        return self._positions[key]


class GqaNoPast(GroupQueryAttention):
    """onnxscript's GQA pattern without past KV; the causal mask is proved by evaluation, not by shape."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "GQANoPast"

    def pattern(self, op, query_BSD, key_BSDkv, value_BSDkv, position_ids, cos, sin, mask):
        q = op.Transpose(
            op.Reshape(query_BSD, pattern.ANY_VALUE, _outputs=["query_BSHDh"]), perm=[0, 2, 1, 3]
        )
        k = op.Transpose(
            op.Reshape(key_BSDkv, pattern.ANY_VALUE, _outputs=["key_BSHkvDh"]), perm=[0, 2, 1, 3]
        )
        v = op.Transpose(op.Reshape(value_BSDkv, pattern.ANY_VALUE), perm=[0, 2, 1, 3])
        q = op.RotaryEmbedding(q, position_ids, cos, sin, _domain="com.microsoft", _outputs=["query_rope"])
        k = op.RotaryEmbedding(k, position_ids, cos, sin, _domain="com.microsoft", _outputs=["key_rope"])
        k_rep = op.Reshape(op.Expand(op.Unsqueeze(k, [2]), pattern.ANY_VALUE), pattern.ANY_VALUE)
        v_rep = op.Reshape(op.Expand(op.Unsqueeze(v, [2]), pattern.ANY_VALUE), pattern.ANY_VALUE)
        attn = op.SDPA(q, k_rep, v_rep, mask, key_format="BHSd", _domain=_PRIVATE, _outputs=["sdpa"])
        out = op.Reshape(op.Transpose(attn, perm=[0, 2, 1, 3]), pattern.ANY_VALUE)
        return out, k, v

    def check(
        self,
        context,
        query_BSD,
        key_BSDkv,
        value_BSDkv,
        query_BSHDh,
        key_BSHkvDh,
        query_rope,
        key_rope,
        mask,
        **_,
    ):
        result = pattern.MatchResult()
        dims: dict = {}
        for val, names in (
            (query_BSD, ["B", "S", "D"]),
            (key_BSDkv, ["B", "S", "Dkv"]),
            (value_BSDkv, ["B", "S", "Dkv"]),
            (query_BSHDh, ["B", "S", "H", "Dh"]),
            (key_BSHkvDh, ["B", "S", "Hkv", "Dh"]),
        ):
            if not bind_shape(dims, val, names):
                return result.fail("query/key/value shapes do not line up", val)
        if not all(isinstance(dims[d], int) for d in ("H", "Hkv", "Dh")) or dims["H"] % dims["Hkv"]:
            return result.fail("head counts are not static multiples", query_BSHDh)
        self.num_heads, self.kv_num_heads = dims["H"], dims["Hkv"]
        qa, ka = query_rope.producer().attributes, key_rope.producer().attributes
        if qa.get_int("interleaved", 0) != ka.get_int("interleaved", 0):
            return result.fail("rotary interleaving differs between query and key", query_rope)
        self._interleaved = qa.get_int("interleaved", 0)
        if not is_causal_mask(context.model, mask, query_BSD):
            return result.fail("mask is not provably the plain causal mask", mask)
        return result

    def rewrite(self, op, query_BSD, key_BSDkv, value_BSDkv, cos, sin, sdpa, **_):
        # No past and no padding: every row holds S tokens, so seqlens_k = S-1 and total = S.
        shape = op.Shape(query_BSD, start=0, end=2)  # [B, S]
        seq = op.Cast(op.Slice(shape, [1], [2]), to=ir.DataType.INT32)
        total = op.Squeeze(seq)
        seqlens_k = op.Expand(op.Sub(seq, _int32(op, 1)), op.Slice(shape, [0], [1]))
        scale = sdpa.producer().attributes.get_float("scale", None)
        extra = {} if scale is None else {"scale": scale}
        return op.GroupQueryAttention(
            query_BSD,
            key_BSDkv,
            value_BSDkv,
            None,
            None,
            seqlens_k,
            total,
            cos,
            sin,
            num_heads=self.num_heads,
            kv_num_heads=self.kv_num_heads,
            do_rotary=1,
            rotary_interleaved=self._interleaved,
            _domain="com.microsoft",
            _outputs=3,
            **extra,
        )


def _int32(op, v: int) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array([v], dtype=np.int32)))


# ---- the causal-mask proof ---------------------------------------------------------------------------
_SIZES = (1, 2, 3, 5, 8)
_mask_cache: dict[int, bool] = {}


def is_causal_mask(model: ir.Model, mask: ir.Value, query_BSD: ir.Value) -> bool:
    """True when ``mask`` is a function of input shapes only and evaluates to the causal [.,1,S,S] mask."""
    if mask is None or mask.shape is None or mask.shape.rank() != 4:
        return False
    if not (mask.shape[-1] == mask.shape[-2] == dim(query_BSD, 1)):
        return False
    key = id(mask)
    if key not in _mask_cache:
        _mask_cache.clear()  # one model at a time; ids are only stable while it is alive
        _mask_cache[key] = _evaluates_causal(model, mask)
    return _mask_cache[key]


def _slice(mask: ir.Value) -> tuple[list[ir.Node], list[ir.Value]] | None:
    """The nodes computing ``mask`` and the graph inputs they read (through Shape only), or None."""
    nodes: dict[ir.Node, None] = {}
    inputs: dict[ir.Value, None] = {}
    stack = [mask]
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None:
            if v.const_value is None:
                return None  # graph inputs are only allowed behind Shape (handled below)
            continue
        if node in nodes:
            continue
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return None
        nodes[node] = None
        if (
            node.op_type == "Shape"
            and node.inputs[0].producer() is None
            and node.inputs[0].const_value is None
        ):
            inputs[node.inputs[0]] = None
            continue
        stack.extend(i for i in node.inputs if i is not None)
    return list(nodes), list(inputs)


def _evaluates_causal(model: ir.Model, mask: ir.Value) -> bool:
    import onnx
    import onnxruntime as ort
    from onnx import helper

    found = _slice(mask)
    if found is None:
        return False
    nodes, inputs = found
    order = {n: i for i, n in enumerate(model.graph)}
    if any(n not in order for n in nodes):
        return False
    nodes.sort(key=order.__getitem__)
    consts = {
        i
        for n in nodes
        for i in n.inputs
        if i is not None and i.const_value is not None and i.producer() is None
    }
    graph = helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "mask",
        [helper.make_tensor_value_info(v.name, v.dtype.value, None) for v in inputs],
        [helper.make_tensor_value_info(mask.name, mask.dtype.value, None)],
        [_renamed(v) for v in consts],
    )
    proto = helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    )
    proto.ir_version = 10
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - ORT's errors share no base class; unprovable => not causal
        return False
    symbols = sorted({str(d) for v in inputs for d in v.shape or () if not isinstance(d, int)})
    for sizes in itertools.product(_SIZES, repeat=len(symbols)):
        env = dict(zip(symbols, sizes))
        feeds = {}
        for v in inputs:
            shape = [d if isinstance(d, int) else env[str(d)] for d in v.shape or ()]
            feeds[v.name] = np.zeros(shape, dtype=v.dtype.numpy())
        try:
            (out,) = sess.run([mask.name], feeds)
        except Exception:  # noqa: BLE001 - as above
            return False
        s = out.shape[-1]
        if out.ndim != 4 or out.shape[1] != 1 or out.shape[2] != s:
            return False
        causal = np.tril(np.ones((s, s), bool))
        if not (np.all(out[..., causal] == 0) and np.all(out[..., ~causal] <= -1e4)):
            return False
    return True


def _renamed(v: ir.Value):
    t = ir.serde.serialize_tensor(v.const_value)
    t.name = v.name
    return t


cos_sin_cache_mul_rules = pattern.RewriteRuleSet([CosSinCacheMul.rule()])
gqa_no_past_rules = pattern.RewriteRuleSet([GqaNoPast.rule()])
