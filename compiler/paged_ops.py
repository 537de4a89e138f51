"""Custom torch ops for the paged decoder, exported to ONNX Runtime's fused kernels (com.microsoft).

Two ops, each a torch reference (the parity reference, any batch shape) plus a translation that the
dynamo exporter uses instead of decomposing it:

    precast::rotary(x [B,S,N*D], positions [B,S], cos [C,D/2], sin [C,D/2])   ==>  RotaryEmbedding (1 node)
    precast::paged_gqa(qkv [B,S,(H+2KV)*D], positions, cos, sin, key_cache, value_cache [NB,KV,bs,D],
                       block_tables [B,MAXB], seqlens_k [B] int32, total int32) -> (out, new_k, new_v)
        ==>  Gather(pool as [NB*KV,bs,D], block*KV+kv) -> Reshape [B,KV,MAXB*bs,D]  (past K and V, no Transpose)
             GroupQueryAttention(packed qkv, past_k, past_v, seqlens_k, total, cos, sin, positions, do_rotary=1)
             GatherElements(present, positions) -> new_k / new_v [B,KV,S,D]  (the new tokens' rows)
    This is onnxruntime-genai's layer shape (packed QKV, rotary inside GQA) over a paged pool: per layer
    7 nodes between the QKV projection and o_proj, where Split + 2 RotaryEmbedding + Gather/Transpose
    + output Transposes took 13. Rows of padding tokens in new_k/new_v are unspecified.

seqlens_k[b] = past_lens[b] + S - 1 and total = max(past_lens) + S, as GroupQueryAttention reads them:
query s of row b attends to past [0, past_lens[b]) and new tokens [0, s]. ORT's CPU kernel refuses
S > 1 with B > 1 when a past is given, so a graph with this op runs prefill one request at a time
(the manifest says so with ``"batched_prefill": false``; ModelRunner splits such steps), and it needs
head_size % 16 == 0 (``supports_gqa``). The ops are registered once, on import (compile side only).
"""

from __future__ import annotations

import math

import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op

__all__ = ["TRANSLATIONS", "paged_gqa", "rotary", "supports_gqa"]

_MSFT = onnxscript.values.Opset("com.microsoft", 1)
_NEG = torch.finfo(torch.float32).min


def supports_gqa(head_size: int) -> bool:
    """ORT's CPU GroupQueryAttention kernel needs head_size % 16 == 0."""
    return head_size % 16 == 0


def _msft_op(name: str, inputs: list[str], outputs: list[str], attrs: dict[str, OpSchema.AttrType]):
    """An onnxscript Op of domain com.microsoft with a minimal schema (onnx ships no contrib schemas)."""
    opt = OpSchema.FormalParameterOption.Optional
    params = [
        OpSchema.FormalParameter(
            n.rstrip("?"),
            f"T{i}",
            param_option=opt if n.endswith("?") else OpSchema.FormalParameterOption.Single,
        )
        for i, n in enumerate(inputs)
    ]
    outs = [OpSchema.FormalParameter(n, f"O{i}") for i, n in enumerate(outputs)]
    types = ["tensor(float)", "tensor(float16)", "tensor(int32)", "tensor(int64)"]
    constraints = [(f"T{i}", types, "") for i in range(len(inputs))] + [
        (f"O{i}", types, "") for i in range(len(outputs))
    ]
    attributes = [OpSchema.Attribute(k, t, "", required=False) for k, t in attrs.items()]
    schema = OpSchema(
        name,
        "com.microsoft",
        1,
        inputs=params,
        outputs=outs,
        type_constraints=constraints,
        attributes=attributes,
    )
    return onnxscript.values.Op(_MSFT, name, schema)


_INT, _FLOAT = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT
_ROTARY = _msft_op(
    "RotaryEmbedding",
    ["input", "position_ids", "cos_cache", "sin_cache"],
    ["output"],
    {"interleaved": _INT, "num_heads": _INT, "rotary_embedding_dim": _INT, "scale": _FLOAT},
)
_GQA = _msft_op(
    "GroupQueryAttention",
    [
        "query",
        "key?",
        "value?",
        "past_key?",
        "past_value?",
        "seqlens_k",
        "total_sequence_length",
        "cos_cache?",
        "sin_cache?",
        "position_ids?",
    ],
    ["output", "present_key", "present_value"],
    {"num_heads": _INT, "kv_num_heads": _INT, "scale": _FLOAT, "do_rotary": _INT, "rotary_interleaved": _INT},
)


# --- precast::rotary -------------------------------------------------------------------------------


@torch.library.custom_op("precast::rotary", mutates_args=())
def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation rotary (HF's rotate_half) of x [B,S,N*D] at positions [B,S]; cos/sin [C, D/2]."""
    b, s, nd = x.shape
    half = cos.shape[1]
    xs = x.view(b, s, nd // (2 * half), 2 * half)
    c, sn = cos[positions][:, :, None], sin[positions][:, :, None]  # [B,S,1,D/2]
    x1, x2 = xs[..., :half], xs[..., half:]
    return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1).reshape(b, s, nd)


@rotary.register_fake
def _(x, positions, cos, sin):
    return torch.empty_like(x)


def _rotary_onnx(x, positions, cos, sin):
    # RotaryEmbedding reads num_heads from the cache width when the input is [B,S,N*D].
    return _ROTARY(x, positions, cos, sin, interleaved=0)


# --- precast::paged_gqa ----------------------------------------------------------------------------


def _rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, s, nd = x.shape
    half = cos.shape[1]
    xs = x.reshape(b, s, nd // (2 * half), 2 * half)
    c, sn = cos[positions][:, :, None], sin[positions][:, :, None]  # [B,S,1,D/2]
    x1, x2 = xs[..., :half], xs[..., half:]
    return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1).reshape(b, s, nd)


@torch.library.custom_op("precast::paged_gqa", mutates_args=())
def paged_gqa(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_k: torch.Tensor,
    total: torch.Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary + attention of packed qkv [B,S,(H+2KV)*D] over the pool's past (through block_tables) and the new
    tokens; returns (out [B,S,H*D], new_k [B,KV,S,D] after rotary, new_v [B,KV,S,D]). The reference (any B, S)."""
    b, s, _ = qkv.shape
    d = key_cache.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = _rope(q, positions, cos, sin), _rope(k, positions, cos, sin)
    past_lens = seqlens_k.long() - (s - 1)
    blocks = key_cache[block_tables]  # [B,MAXB,KV,bs,D]
    p = blocks.shape[1] * blocks.shape[3]
    pk = blocks.permute(0, 2, 1, 3, 4).reshape(b, kv_heads, p, d)
    pv = value_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(b, kv_heads, p, d)
    new_k = k.reshape(b, s, kv_heads, d).transpose(1, 2)
    new_v = v.reshape(b, s, kv_heads, d).transpose(1, 2)
    keys = torch.cat([pk, new_k], dim=2)  # [B,KV,P+S,D]
    values = torch.cat([pv, new_v], dim=2)
    g = heads // kv_heads
    qg = q.reshape(b, s, kv_heads, g, d).permute(0, 2, 3, 1, 4)  # [B,KV,G,S,D]: head i reads KV head i // G
    scores = torch.matmul(qg, keys[:, :, None].transpose(-1, -2)) * scale  # [B,KV,G,S,P+S]
    j = torch.arange(p)
    past_ok = (j[None, :] < past_lens[:, None])[:, None, None, None, :].expand(b, 1, 1, s, p)
    t = torch.arange(s)
    causal = (t[None, :] <= t[:, None])[None, None, None].expand(b, 1, 1, s, s)
    mask = torch.cat([past_ok, causal], dim=-1)
    probs = torch.softmax(torch.where(mask, scores, torch.full_like(scores, _NEG)), dim=-1)
    out = torch.matmul(probs, values[:, :, None])  # [B,KV,G,S,D]
    return (
        out.permute(0, 3, 1, 2, 4).reshape(b, s, heads * d),
        new_k.clone(memory_format=torch.contiguous_format),
        new_v.clone(memory_format=torch.contiguous_format),
    )  # clones: outputs may not alias qkv


@paged_gqa.register_fake
def _(
    qkv, positions, cos, sin, key_cache, value_cache, block_tables, seqlens_k, total, heads, kv_heads, scale
):
    b, s, _ = qkv.shape
    d = key_cache.shape[-1]
    new = qkv.new_empty((b, kv_heads, s, d))
    return qkv.new_empty((b, s, heads * d)), new, torch.empty_like(new)


def _paged_gqa_onnx(
    qkv,
    positions,
    cos,
    sin,
    key_cache,
    value_cache,
    block_tables,
    seqlens_k,
    total,
    heads: int,
    kv_heads: int,
    scale: float,
):
    # Past K/V without a Transpose: the pool [NB,KV,bs,D] viewed as [NB*KV,bs,D] and gathered at
    # block*KV + kv_head ([B,KV,MAXB] rows) comes out [B,KV,MAXB,bs,D] = BNSH after a free Reshape.
    bs, d = key_cache.shape[2], key_cache.shape[3]
    rows = op.Add(
        op.Mul(op.Unsqueeze(block_tables, op.Constant(value_ints=[1])), op.Constant(value_int=kv_heads)),
        op.Constant(value=_int64_tensor(list(range(kv_heads)), [1, kv_heads, 1])),
    )
    pool = op.Constant(value_ints=[-1, bs, d])
    bnsh = op.Constant(value_ints=[0, 0, -1, d])
    past_k = op.Reshape(op.Gather(op.Reshape(key_cache, pool), rows, axis=0), bnsh)
    past_v = op.Reshape(op.Gather(op.Reshape(value_cache, pool), rows, axis=0), bnsh)
    # Packed QKV straight from the projection, rotary inside (as onnxruntime-genai's graphs).
    out, present_k, present_v = _GQA(
        qkv,
        None,
        None,
        past_k,
        past_v,
        seqlens_k,
        total,
        cos,
        sin,
        positions,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=scale,
        do_rotary=1,
    )
    # New token s of row b sits at present[b, :, positions[b, s]] (its absolute position = past_lens + s).
    at = op.Expand(
        op.Unsqueeze(positions, op.Constant(value_ints=[1, 3])), op.Constant(value_ints=[1, kv_heads, 1, d])
    )
    return out, op.GatherElements(present_k, at, axis=2), op.GatherElements(present_v, at, axis=2)


def _int64_tensor(values: list[int], dims: list[int]):
    import onnx

    return onnx.helper.make_tensor("value", onnx.TensorProto.INT64, dims, values)


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)


TRANSLATIONS = {
    torch.ops.precast.rotary.default: _rotary_onnx,
    torch.ops.precast.paged_gqa.default: _paged_gqa_onnx,
}
