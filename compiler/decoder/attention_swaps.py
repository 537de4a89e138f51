"""Families whose attention code bypasses transformers' attention interface: Falcon (before transformers
5.25, which moved it onto the interface: then nothing is swapped) and BLOOM.

Their attention modules compute the attention product themselves instead of calling
``ALL_ATTENTION_FUNCTIONS``. ``swap_attention`` replaces each such module's ``forward`` (on the instance) with
one that keeps the model's own projections, head split, rotary and output projection and hands q/k/v to
precast's paged attention, exactly where a family on the interface would. Outside a precast step (the
eager reference of ``check_against_hf``) the model's own forward runs, so the pre-export check compares
against the model's real attention.

    falcon  query_key_value -> split (grouped KV for new_decoder_architecture, one KV head for multi_query)
            -> the model's rotary -> precast_paged_attention -> dense
    bloom   query_key_value -> split -> precast_paged_attention(alibi_slopes = bloom's slopes) -> dense
            -> + residual                (ALiBi: score += slope[h] * key position, as bloom's alibi tensor)

Falcon with ``alibi=True`` is refused before this (causal_lm._check_architecture): transformers' own eager and
sdpa attention disagree for it, so there is no reference to match.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from precast.errors import ModelLoadError

__all__ = ["swap_attention"]


def _falcon_forward(self, hidden_states, alibi, attention_mask, *args, position_embeddings=None, **kwargs):
    from precast.compiler.decoder.generic_decoder import (
        in_step,
        precast_paged_attention,
    )

    if not in_step():
        return self.precast_own_forward(
            hidden_states, alibi, attention_mask, *args, position_embeddings=position_embeddings, **kwargs
        )
    if alibi is not None:
        raise ModelLoadError("falcon with alibi=True is not supported for task causal-lm")
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    qkv = self.query_key_value(hidden_states)
    b, s, _ = qkv.shape
    h, d = self.num_heads, self.head_dim
    if self.new_decoder_architecture:  # per KV group: G query heads, then its key, then its value
        kv = self.num_kv_heads
        grouped = qkv.view(b, s, kv, h // kv + 2, d)
        q, k, v = grouped[:, :, :, :-2].reshape(b, s, h, d), grouped[:, :, :, -2], grouped[:, :, :, -1]
    elif self.multi_query:  # H query heads, one key, one value
        q, k, v = qkv.view(b, s, h + 2, d).split([h, 1, 1], dim=2)
    else:  # per head: query, key, value
        split = qkv.view(b, s, h, 3, d)
        q, k, v = split[..., 0, :], split[..., 1, :], split[..., 2, :]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out, _ = precast_paged_attention(self, q, k, v, None, scaling=self.inv_norm_factor)
    return self.dense(out.reshape(b, s, h * d)), None


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, *args, **kwargs):
    from precast.compiler.decoder.generic_decoder import (
        in_step,
        precast_paged_attention,
    )

    if not in_step():
        return self.precast_own_forward(hidden_states, residual, alibi, attention_mask, *args, **kwargs)
    from transformers.models.bloom.modeling_bloom import dropout_add

    q, k, v = self._reshape(self.query_key_value(hidden_states))  # [B,H,S,D] each
    b, h, s, d = q.shape
    out, _ = precast_paged_attention(
        self, q, k, v, None, scaling=self.inv_norm_factor, alibi_slopes=self.precast_slopes
    )
    out = self.dense(out.reshape(b, s, h * d))
    return dropout_add(out, residual, self.hidden_dropout, self.training), None


def _bloom_slopes(model: nn.Module, heads: int) -> torch.Tensor:
    """Bloom's own per-head ALiBi slopes: its alibi tensor for positions [0, 1] is [0, slope_h]."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.transformer
    ones = torch.ones(1, 2, dtype=torch.long)
    return base.build_alibi_tensor(ones, heads, torch.float32)[:, 0, 1].clone()


def _bypasses_interface(mod: nn.Module) -> bool:
    """Whether this attention module computes attention itself (its forward takes bloom's / old falcon's
    ``alibi`` argument) rather than calling transformers' attention interface, which precast hooks already."""
    return "alibi" in inspect.signature(type(mod).forward).parameters


def swap_attention(hf: nn.Module) -> int:
    """Point Falcon / BLOOM attention modules at precast's paged attention (idempotent) -> how many swapped."""
    model_type = getattr(hf.config, "model_type", None)
    if model_type not in ("falcon", "bloom"):
        return 0
    n = 0
    for mod in hf.modules():
        name = type(mod).__name__
        if name not in ("FalconAttention", "BloomAttention") or hasattr(mod, "precast_own_forward"):
            continue
        if not _bypasses_interface(mod):  # (transformers 5.25 moved Falcon onto the attention interface)
            continue
        mod.precast_own_forward = mod.forward
        if name == "FalconAttention":
            mod.forward = types.MethodType(_falcon_forward, mod)
        else:
            mod.precast_slopes = _bloom_slopes(hf, mod.num_heads)
            mod.forward = types.MethodType(_bloom_forward, mod)
        n += 1
    return n
