"""Custom torch op for the mapped decoder, exported to ONNX Runtime's fused kernel (com.microsoft).

A torch reference (the parity reference, any batch shape) plus a translation that the dynamo exporter
uses instead of decomposing it:

    precast::mapped_gqa(qkv [B,S,(H+2KV)*D], positions [B,S], cos, sin [C',D/2], past_key, past_value [B,KV,C,D],
                        seqlens_k [B] int32, total int32, window) -> (out [B,S,H*D], present_key, present_value)
        ==>  GroupQueryAttention(packed qkv, past_key, past_value, seqlens_k, total, cos, sin,
                                 do_rotary=1, local_window_size=window)                     (1 node per layer)

    precast::last_token(hidden [B,S,E], index [B,1] int64) -> [B,E]   ==>  GatherND(batch_dims=1)   (1 node)

    precast::moe(x [T,H], top_k_index [T,K], top_k_weights [T,K], fc1 [E,2I,H] gate/up interleaved,
                 fc2 [E,H,I], biases, K, alpha, beta, limit) -> [T,H]          ==>  MoE(swiglu, k=K) (a few nodes)

The last is any step's (not only the mapped decoder's): see ``moe``.

present = past with the new tokens' K (after rotary) / V written at rows past_lens[b] .. past_lens[b]+S-1;
rows past those are unspecified (ONNX Runtime copies only the valid past when past and present are distinct
buffers). The runtime binds past and present to the SAME buffer (a request's mapped view of the paged
pool, see runtime/llm/runners/mapped_kv.py): GroupQueryAttention then reads the past in place and writes only the
new rows, which is how onnxruntime-genai runs it, with no per-step copy of the cache.

seqlens_k[b] = past_lens[b] + S - 1 and total = max(past_lens) + S, as GroupQueryAttention reads them:
query s of row b attends to rows [0, past_lens[b] + s]. ORT's CPU kernel refuses S > 1 with B > 1 when a
past is given, so a graph with this op runs prefill one request at a time (the manifest says so with
``"batched_prefill": false``; ModelRunner splits such steps), and it needs head_size % 16 == 0
(``supports_gqa``). The op is registered once, on import (compile side only).
"""

from __future__ import annotations

import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op

__all__ = ["MOE_TRANSLATIONS", "TRANSLATIONS", "last_token", "mapped_gqa", "moe", "supports_gqa"]

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


_INT, _FLOAT, _STRING = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT, OpSchema.AttrType.STRING
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
    {
        "num_heads": _INT,
        "kv_num_heads": _INT,
        "scale": _FLOAT,
        "do_rotary": _INT,
        "rotary_interleaved": _INT,
        "local_window_size": _INT,
    },
)


# --- precast::mapped_gqa ----------------------------------------------------------------------------


def _rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, s, nd = x.shape
    half = cos.shape[1]
    xs = x.reshape(b, s, nd // (2 * half), 2 * half)
    c, sn = cos[positions][:, :, None], sin[positions][:, :, None]  # [B,S,1,D/2]
    x1, x2 = xs[..., :half], xs[..., half:]
    return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1).reshape(b, s, nd)


@torch.library.custom_op("precast::mapped_gqa", mutates_args=())
def mapped_gqa(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total: torch.Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary + attention of packed qkv [B,S,(H+2KV)*D] over each row's past (rows [0, past_lens[b]) of
    past_key/value [B,KV,C,D]) and its new tokens; returns (out [B,S,H*D], present_key, present_value), the
    presents being the pasts with the new rows written in. ``window`` > 0: a query sees only the keys less
    than ``window`` positions back (HF's sliding window); <= 0: no window. The reference (any B, S)."""
    b, s, _ = qkv.shape
    d = past_key.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = _rope(q, positions, cos, sin), _rope(k, positions, cos, sin)
    past_lens = seqlens_k.long() - (s - 1)
    rows = past_lens[:, None] + torch.arange(s)[None, :]  # [B,S]: where the new tokens go
    new_k = k.reshape(b, s, kv_heads, d).transpose(1, 2)  # [B,KV,S,D]
    new_v = v.reshape(b, s, kv_heads, d).transpose(1, 2)
    at = rows[:, None, :, None].expand(b, kv_heads, s, d)
    keys = past_key.scatter(2, at, new_k)  # [B,KV,C,D]
    values = past_value.scatter(2, at, new_v)
    g = heads // kv_heads
    qg = q.reshape(b, s, kv_heads, g, d).permute(0, 2, 3, 1, 4)  # [B,KV,G,S,D]: head i reads KV head i // G
    scores = torch.matmul(qg, keys[:, :, None].transpose(-1, -2)) * scale  # [B,KV,G,S,C]
    j = torch.arange(keys.shape[2])
    ok = j[None, None, :] <= rows[:, :, None]  # [B,S,C]: causal over past + new
    if window > 0:
        ok = ok & (j[None, None, :] > rows[:, :, None] - window)
    mask = ok[:, None, None]  # [B,1,1,S,C]
    probs = torch.softmax(torch.where(mask, scores, torch.full_like(scores, _NEG)), dim=-1)
    out = torch.matmul(probs, values[:, :, None])  # [B,KV,G,S,D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, s, heads * d), keys, values


@mapped_gqa.register_fake
def _(qkv, positions, cos, sin, past_key, past_value, seqlens_k, total, heads, kv_heads, scale, window):
    b, s, _ = qkv.shape
    d = past_key.shape[-1]
    return qkv.new_empty((b, s, heads * d)), torch.empty_like(past_key), torch.empty_like(past_value)


def _mapped_gqa_onnx(
    qkv,
    positions,
    cos,
    sin,
    past_key,
    past_value,
    seqlens_k,
    total,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int,
):
    # Packed QKV straight from the projection, rotary inside (as onnxruntime-genai's graphs). No
    # position_ids: the kernel derives them from its lengths (past_b + s for a prompt chunk over a past,
    # s for a first prompt, seqlens_k[b] for a decode row), which is what the runtime's positions are, and
    # its derived-position path is ~4% faster per decode step than reading position_ids (measured, INT4).
    return _GQA(
        qkv,
        None,
        None,
        past_key,
        past_value,
        seqlens_k,
        total,
        cos,
        sin,
        None,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=scale,
        do_rotary=1,
        # the kernel's window is HF's: window keys, the query's own included (measured: test_mapped_window)
        local_window_size=window if window > 0 else None,  # None: no attribute (the kernel's -1)
    )


# --- precast::last_token --------------------------------------------------------------------------


@torch.library.custom_op("precast::last_token", mutates_args=())
def last_token(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden [B,S,E] at rows index [B,Q] of each batch row -> [B*Q,E], row b's Q rows back to back: each
    request's last real new token (Q = 1), or the last Q of a speculative verification row."""
    from precast.compiler.decoder.paged_decoder import rows_at

    return rows_at(hidden, index).reshape(-1, hidden.shape[2])


@last_token.register_fake
def _(hidden, index):
    return hidden.new_empty((hidden.shape[0] * index.shape[1], hidden.shape[2]))


def _last_token_onnx(hidden, index):
    rows = op.GatherND(hidden, op.Unsqueeze(index, [-1]), batch_dims=1)  # [B,Q,E]
    return op.Reshape(rows, op.Concat(op.Constant(value_ints=[-1]), op.Shape(hidden, start=2), axis=0))


# --- precast::moe ----------------------------------------------------------------------------------
_MOE = _msft_op(
    "MoE",
    [
        "input",
        "router_probs",
        "fc1_experts_weights",
        "fc1_experts_bias?",
        "fc2_experts_weights",
        "fc2_experts_bias?",
    ],
    ["output"],
    {
        "k": _INT,
        "activation_type": _STRING,
        "swiglu_fusion": _INT,
        "activation_alpha": _FLOAT,
        "activation_beta": _FLOAT,
        "swiglu_limit": _FLOAT,
        "normalize_routing_weights": _INT,
    },
)
_NOT_PICKED = -1.0e4  # the router logit of an expert a token did not pick (softmax: exp(-1e4) == 0)


@torch.library.custom_op("precast::moe", mutates_args=())
def moe(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_bias: torch.Tensor | None,
    k: int,
    alpha: float,
    beta: float,
    limit: float,
) -> torch.Tensor:
    """A SwiGLU mixture of experts that computes only the experts each token picked (the model's own router
    chose them and their weights): out[t] = sum_k w[t,k] * (fc2[e] @ h + fc2_bias[e]), e = top_k_index[t,k]
    (k < ``k``), where [g, u] = fc1[e] @ x[t] + fc1_bias[e] with fc1's rows interleaved (gate row i at 2i,
    up row i at 2i+1) and h = g' * sigmoid(alpha * g') * (u' + beta); with ``limit`` > 0, g' = min(g, limit)
    and u' = clamp(u, -limit, limit) (gpt-oss), else g' = g, u' = u (alpha 1, beta 0: silu(g) * u). The
    reference loops over the picks; ONNX Runtime's MoE kernel runs it (_moe_onnx): 7x faster than every
    expert on every token at one token, 3x at 256 (16 experts, 4 a token, hidden 512: measured)."""
    out = torch.zeros_like(x)
    for j in range(k):
        e = top_k_index[:, j]
        gu = torch.matmul(fc1[e], x[:, :, None])[..., 0]  # [T,2I]
        if fc1_bias is not None:
            gu = gu + fc1_bias[e]
        g, u = gu[:, 0::2], gu[:, 1::2]
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        h = g * torch.sigmoid(alpha * g) * (u + beta)
        y = torch.matmul(fc2[e], h[:, :, None])[..., 0]
        if fc2_bias is not None:
            y = y + fc2_bias[e]
        out = out + top_k_weights[:, j, None] * y
    return out


@moe.register_fake
def _(x, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, k, alpha, beta, limit):
    return torch.empty_like(x)


def _moe_onnx(
    x,
    top_k_index,
    top_k_weights,
    fc1,
    fc2,
    fc1_bias,
    fc2_bias,
    k: int,
    alpha: float,
    beta: float,
    limit: float,
):
    # The kernel routes by itself (softmax over router logits, top k): logits log(w) at the picked experts
    # and -1e4 elsewhere make its picks the model's and its weights w / sum(w); times sum(w) after, the
    # model's own weights. The weights are summed per expert first (a router may list an expert twice, e.g.
    # with a zero weight) and an expert of weight 0 counts as not picked. Routers give weights >= 0 (softmax,
    # sigmoid); a negative one would be dropped, and the compile's parity check would fail it.
    rows = op.Concat(op.Shape(x, start=0, end=1), op.Shape(fc1, start=0, end=1), axis=0)
    zeros = op.Expand(op.Constant(value_float=0.0), rows)
    per_expert = op.ScatterElements(zeros, top_k_index, top_k_weights, axis=1, reduction="add")  # [T,E]
    picked = op.Greater(per_expert, op.Constant(value_float=0.0))
    logits = op.Where(picked, op.Log(per_expert), op.Constant(value_float=_NOT_PICKED))
    out = _MOE(
        x,
        logits,
        fc1,
        fc1_bias,
        fc2,
        fc2_bias,
        k=k,
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=alpha,
        activation_beta=beta,
        swiglu_limit=limit if limit > 0 else None,  # (None: no attribute, no clamp)
        normalize_routing_weights=0,
    )
    kept = op.Where(picked, per_expert, zeros)
    return op.Mul(out, op.ReduceSum(kept, op.Constant(value_ints=[1]), keepdims=1))


MOE_TRANSLATIONS = {torch.ops.precast.moe.default: _moe_onnx}
TRANSLATIONS = {
    torch.ops.precast.mapped_gqa.default: _mapped_gqa_onnx,
    torch.ops.precast.last_token.default: _last_token_onnx,
    **MOE_TRANSLATIONS,
}
