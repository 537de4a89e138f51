"""Custom torch ops for the paged decoder, exported to ONNX Runtime's fused kernels (com.microsoft).

Two ops, each a torch reference (the parity reference, any batch shape) plus a translation that the
dynamo exporter uses instead of decomposing it:

    precast::rotary(x [B,S,N*D], positions [B,S], cos [C,D/2], sin [C,D/2])   ==>  RotaryEmbedding (1 node)
    precast::paged_gqa(q [B,S,H*D], k, v [B,S,KV*D], key_cache, value_cache [NB,KV,bs,D],
                       block_tables [B,MAXB], seqlens_k [B] int32, total int32)
        ==>  Gather(pool, tables) -> Transpose -> Reshape [B,KV,MAXB*bs,D]   (past K and V, 3 nodes each)
             GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total)  (GQA without repeating KV heads)

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
    params = [OpSchema.FormalParameter(n.rstrip("?"), f"T{i}", param_option=opt if n.endswith("?") else
                                       OpSchema.FormalParameterOption.Single) for i, n in enumerate(inputs)]
    outs = [OpSchema.FormalParameter(n, f"O{i}") for i, n in enumerate(outputs)]
    types = ["tensor(float)", "tensor(float16)", "tensor(int32)", "tensor(int64)"]
    constraints = [(f"T{i}", types, "") for i in range(len(inputs))] + [(f"O{i}", types, "") for i in range(len(outputs))]
    attributes = [OpSchema.Attribute(k, t, "", required=False) for k, t in attrs.items()]
    schema = OpSchema(name, "com.microsoft", 1, inputs=params, outputs=outs, type_constraints=constraints,
                      attributes=attributes)
    return onnxscript.values.Op(_MSFT, name, schema)


_INT, _FLOAT = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT
_ROTARY = _msft_op("RotaryEmbedding", ["input", "position_ids", "cos_cache", "sin_cache"], ["output"],
                   {"interleaved": _INT, "num_heads": _INT, "rotary_embedding_dim": _INT, "scale": _FLOAT})
_GQA = _msft_op(
    "GroupQueryAttention",
    ["query", "key?", "value?", "past_key?", "past_value?", "seqlens_k", "total_sequence_length"],
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


@torch.library.custom_op("precast::paged_gqa", mutates_args=())
def paged_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seqlens_k: torch.Tensor, total: torch.Tensor, heads: int, kv_heads: int, scale: float,
) -> torch.Tensor:
    """Attention of q over the pool's past (through block_tables) and the new k/v; any B, S (the reference)."""
    b, s, _ = q.shape
    d = key_cache.shape[-1]
    past_lens = seqlens_k.long() - (s - 1)
    blocks = key_cache[block_tables]  # [B,MAXB,KV,bs,D]
    p = blocks.shape[1] * blocks.shape[3]
    pk = blocks.permute(0, 2, 1, 3, 4).reshape(b, kv_heads, p, d)
    pv = value_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(b, kv_heads, p, d)
    keys = torch.cat([pk, k.view(b, s, kv_heads, d).transpose(1, 2)], dim=2)  # [B,KV,P+S,D]
    values = torch.cat([pv, v.view(b, s, kv_heads, d).transpose(1, 2)], dim=2)
    g = heads // kv_heads
    qg = q.view(b, s, kv_heads, g, d).permute(0, 2, 3, 1, 4)  # [B,KV,G,S,D]: head i reads KV head i // G
    scores = torch.matmul(qg, keys[:, :, None].transpose(-1, -2)) * scale  # [B,KV,G,S,P+S]
    j = torch.arange(p)
    past_ok = (j[None, :] < past_lens[:, None])[:, None, None, None, :].expand(b, 1, 1, s, p)
    t = torch.arange(s)
    causal = (t[None, :] <= t[:, None])[None, None, None].expand(b, 1, 1, s, s)
    mask = torch.cat([past_ok, causal], dim=-1)
    probs = torch.softmax(torch.where(mask, scores, torch.full_like(scores, _NEG)), dim=-1)
    out = torch.matmul(probs, values[:, :, None])  # [B,KV,G,S,D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, s, heads * d)


@paged_gqa.register_fake
def _(q, k, v, key_cache, value_cache, block_tables, seqlens_k, total, heads, kv_heads, scale):
    return torch.empty_like(q)


def _paged_gqa_onnx(q, k, v, key_cache, value_cache, block_tables, seqlens_k, total, heads: int, kv_heads: int,
                    scale: float):
    shape = op.Constant(value_ints=[0, 0, -1, key_cache.shape[-1]])
    past_k = op.Reshape(op.Transpose(op.Gather(key_cache, block_tables, axis=0), perm=[0, 2, 1, 3, 4]), shape)
    past_v = op.Reshape(op.Transpose(op.Gather(value_cache, block_tables, axis=0), perm=[0, 2, 1, 3, 4]), shape)
    out, _present_k, _present_v = _GQA(q, k, v, past_k, past_v, seqlens_k, total, num_heads=heads,
                                       kv_num_heads=kv_heads, scale=scale)
    return out


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)


TRANSLATIONS = {torch.ops.precast.rotary.default: _rotary_onnx, torch.ops.precast.paged_gqa.default: _paged_gqa_onnx}
