"""Families whose attention code bypasses transformers' attention interface: Falcon (before transformers
5.25, which moved it onto the interface: then nothing is swapped), BLOOM, MPT and XGLM; and Llama 4, which
uses the interface but with a complex-valued rotary the exporter cannot take, and chunked attention.

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
    mpt     Wqkv -> (clip) -> chunk -> precast_paged_attention(alibi_slopes = mpt's slopes) -> out_proj;
            and MptModel's forward (its unconditional mask, None here) -> wte -> blocks -> norm_f
    xglm    q_proj * scaling, k_proj, v_proj -> precast_paged_attention(scaling 1) -> out_proj
    llama4  (its rotary module -> cos, sin, positions: its complex freqs_cis does not export)
            q/k/v_proj -> rotary in reals (RoPE layers) -> qk_norm -> temperature tuning (NoPE layers)
            -> precast_paged_attention(attention_chunk on its chunked layers) -> o_proj
    deepseek_v2  (its rotary module -> (cos, sin) in reals, and its module's apply_rotary_emb takes them:
            the complex freqs_cis does not export); the attention itself is on the interface (MLA: K 48, V 32)

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


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama 4's complex rotary, in reals: x [B,S,H,D] as D/2 pairs (a, b) = a + ib, times cos + i sin."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, :, None], sin[:, :, None]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).type_as(x)


def _llama4_rotary_forward(self, x, position_ids):
    """In a step: (cos, sin, positions) for _llama4_forward, instead of the complex freqs_cis (which the
    exporter cannot take); the same frequencies and attention scaling."""
    from precast.compiler.decoder.generic_decoder import in_step

    if not in_step():
        return self.precast_own_forward(x, position_ids)
    freqs = position_ids[..., None].float() * self.inv_freq.float()
    return torch.cos(freqs) * self.attention_scaling, torch.sin(freqs) * self.attention_scaling, position_ids


def _deepseek_rotary_forward(self, x, position_ids):
    """In a step: DeepSeek-V2's freqs_cis as reals, [B,S,D/2,2] (cos, sin) times its attention scaling."""
    from precast.compiler.decoder.generic_decoder import in_step

    if not in_step():
        return self.precast_own_forward(x, position_ids)
    freqs = position_ids[..., None].float() * self.inv_freq.float()
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1) * self.attention_scaling


def _patch_deepseek_rotary(module) -> None:
    """DeepSeek-V2's module-level apply_rotary_emb, taking the real (cos, sin) form too (idempotent)."""
    own = module.apply_rotary_emb
    if getattr(own, "precast", False):
        return

    def apply_rotary_emb(xq, xk, freqs_cis):
        if freqs_cis.is_complex():
            return own(xq, xk, freqs_cis)
        cos, sin = freqs_cis[..., 0][:, None], freqs_cis[..., 1][:, None]  # [B,1,S,D/2] over q/k [B,H,S,D]

        def rot(x):
            a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)

        return rot(xq), rot(xk)

    apply_rotary_emb.precast = True
    module.apply_rotary_emb = apply_rotary_emb


def _llama4_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    from precast.compiler.decoder.generic_decoder import (
        in_step,
        precast_paged_attention,
    )

    if not in_step():
        return self.precast_own_forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    cos, sin, positions = position_embeddings
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape)
    if self.use_rope:
        q, k = _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
    if self.config.use_qk_norm and self.use_rope:  # (where the model builds its qk_norm)
        q, k = self.qk_norm(q), self.qk_norm(k)
    if self.attn_temperature_tuning and not self.use_rope:  # per absolute position, as HF's cache length + i
        scales = (
            torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        )
        q = (q * scales[..., None, None]).to(q.dtype)
    chunked = self.config.layer_types[self.layer_idx] == "chunked_attention"
    out, _ = precast_paged_attention(
        self,
        *(t.transpose(1, 2) for t in (q, k, v)),
        None,
        scaling=self.scaling,
        attention_chunk=self.config.attention_chunk_size if chunked else None,
    )
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def _bloom_slopes(model: nn.Module, heads: int) -> torch.Tensor:
    """Bloom's own per-head ALiBi slopes: its alibi tensor for positions [0, 1] is [0, slope_h]."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.transformer
    ones = torch.ones(1, 2, dtype=torch.long)
    return base.build_alibi_tensor(ones, heads, torch.float32)[:, 0, 1].clone()


def _mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    from precast.compiler.decoder.generic_decoder import (
        in_step,
        precast_paged_attention,
    )

    if not in_step():
        return self.precast_own_forward(hidden_states, position_bias, cache, attention_mask, **kwargs)
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    b, s, _ = qkv.shape
    q, k, v = (t.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    out, _ = precast_paged_attention(
        self, q, k, v, None, scaling=self.softmax_scale, alibi_slopes=self.precast_slopes
    )
    return self.out_proj(out.reshape(b, s, -1)), None


def _mpt_model_forward(self, input_ids=None, *args, **kwargs):
    """MptModel builds its causal mask unconditionally (``create_causal_mask(...).to(bool)``), which is None
    for an attention implementation without a mask function: in a step, the blocks run without it (the swapped
    attention masks by the step's lengths, and adds the ALiBi bias itself)."""
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    from precast.compiler.decoder.generic_decoder import in_step

    if not in_step():
        return self.precast_own_forward(input_ids, *args, **kwargs)
    hidden = self.wte(input_ids)
    for block in self.blocks:
        hidden, _ = block(hidden, position_bias=None, attention_mask=None)
    return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.norm_f(hidden))


def _xglm_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    from precast.compiler.decoder.generic_decoder import (
        in_step,
        precast_paged_attention,
    )

    if not in_step():
        return self.precast_own_forward(hidden_states, key_value_states, cache, attention_mask, **kwargs)
    if key_value_states is not None:
        raise ModelLoadError("xglm with cross-attention is not supported for task causal-lm")
    b, s, _ = hidden_states.shape

    def heads(t):
        return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    q = heads(self.q_proj(hidden_states) * self.scaling)  # scaled before the product, as XGLM does
    k, v = heads(self.k_proj(hidden_states)), heads(self.v_proj(hidden_states))
    out, _ = precast_paged_attention(self, q, k, v, None, scaling=1.0)
    return self.out_proj(out.reshape(b, s, self.embed_dim)), None


def _bloom_slopes(model: nn.Module, heads: int) -> torch.Tensor:
    """Bloom's own per-head ALiBi slopes: its alibi tensor for positions [0, 1] is [0, slope_h]."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.transformer
    ones = torch.ones(1, 2, dtype=torch.long)
    return base.build_alibi_tensor(ones, heads, torch.float32)[:, 0, 1].clone()


def _mpt_slopes(model: nn.Module, heads: int) -> torch.Tensor:
    """MPT's own per-head slopes, as its forward builds them (alibi_bias_max left at its default there): its
    alibi tensor over 2 positions is [-slope_h, 0]."""
    alibi = model.get_decoder().build_mpt_alibi_tensor(heads, 2)
    return (alibi[:, 0, 1] - alibi[:, 0, 0]).float().clone()


def _bypasses_interface(mod: nn.Module) -> bool:
    """Whether this attention module computes attention itself (its forward takes bloom's / old falcon's
    ``alibi`` argument) rather than calling transformers' attention interface, which precast hooks already."""
    return "alibi" in inspect.signature(type(mod).forward).parameters


def _swap(mod: nn.Module, forward) -> None:
    mod.precast_own_forward = mod.forward
    mod.forward = types.MethodType(forward, mod)


def swap_attention(hf: nn.Module) -> int:
    """Point Falcon / BLOOM / MPT / XGLM / Llama 4 attention modules at precast's paged attention, and DeepSeek-V2's rotary at reals (idempotent)
    -> how many modules swapped."""
    model_type = getattr(hf.config, "model_type", None)
    if model_type not in ("falcon", "bloom", "mpt", "xglm", "llama4_text", "deepseek_v2"):
        return 0
    if model_type == "deepseek_v2":
        _patch_deepseek_rotary(inspect.getmodule(type(hf)))
    n = 0
    for mod in hf.modules():
        name = type(mod).__name__
        if hasattr(mod, "precast_own_forward"):
            continue
        if name in ("FalconAttention", "BloomAttention") and not _bypasses_interface(mod):
            continue  # (transformers 5.25 moved Falcon onto the attention interface)
        if name == "FalconAttention":
            _swap(mod, _falcon_forward)
        elif name == "BloomAttention":
            mod.precast_slopes = _bloom_slopes(hf, mod.num_heads)
            _swap(mod, _bloom_forward)
        elif name == "MptAttention":
            mod.precast_slopes = _mpt_slopes(hf, mod.n_heads)
            _swap(mod, _mpt_forward)
        elif name == "MptModel":
            _swap(mod, _mpt_model_forward)
        elif name == "XGLMAttention":
            _swap(mod, _xglm_forward)
        elif name == "Llama4TextAttention":
            _swap(mod, _llama4_forward)
        elif name == "Llama4TextRotaryEmbedding":
            _swap(mod, _llama4_rotary_forward)
        elif name == "DeepseekV2RotaryEmbedding":
            _swap(mod, _deepseek_rotary_forward)
        else:
            continue
        n += 1
    return n
