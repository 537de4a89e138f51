"""Paged decoders: one forward step of a Hugging Face causal LM over a paged KV pool, as torch modules.

The step graph (precast's LLM contract, issue 5), for B requests with S new tokens each:

    input_ids, positions [B,S]  past_lens, new_lens [B]  block_tables [B,MAXB]  key_cache.i/value_cache.i [NB,KV,bs,D]
      per layer:  q,k,v = proj(norm(x)); rotary(q,k) at positions (llama)
                  past_k = key_cache[block_tables] -> [B,KV,MAXB*bs,D]   (first past_lens[b] valid)
                  attend q over cat(past_k, k) with a length+causal mask; GQA by repeating KV heads
      logits [B,V] of the last real new token (new_lens-1);  new_key.i/new_value.i [B,KV,S,D]

The pool is read only in the graph: the runtime scatters new_key/new_value into it after the step.
That is the general layout (GPT-2, and head sizes ONNX Runtime's GroupQueryAttention cannot take).

When the head size allows (paged_ops.supports_gqa), a Llama-family model compiles to MappedLlama instead
(kv_layout "mapped"): per layer one GroupQueryAttention over past/present [B,KV,C,D] that the runtime
binds to each request's mapped view of the same paged pool (runtime/llm/runners/mapped_kv.py), so the step
neither gathers nor scatters K/V; Q/K/V are packed into one projection (gate/up are not: see MappedLlama).
The modules hold the Hugging Face model's own submodules (norms, projections, MLP, rotary), so
weights and numerics are the model's own; only the attention and cache plumbing are new.
torch is imported by the caller (this module is only imported on the compile side).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MappedLlama", "PagedGPT2", "PagedLlama", "last_token", "paged_attention"]

_NEG = torch.finfo(torch.float32).min


def gather_past(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[NB,KV,bs,D] pool, [B,MAXB] tables -> [B,KV,MAXB*bs,D] (each request's blocks, in order)."""
    blocks = cache[block_tables]  # [B, MAXB, KV, bs, D]
    b, maxb, kv, bs, d = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(b, kv, maxb * bs, d)


def attention_mask(past_lens: torch.Tensor, s: int, p: int) -> torch.Tensor:
    """Bool [B,1,S,P+S]: key j < P is valid iff j < past_lens[b]; new key t valid for query s iff t <= s."""
    j = torch.arange(p, device=past_lens.device)
    past_ok = (j[None, :] < past_lens[:, None])[:, None, None, :]  # [B,1,1,P]
    t = torch.arange(s, device=past_lens.device)
    causal = (t[None, :] <= t[:, None])[None, None]  # [1,1,S,S]
    b = past_lens.shape[0]
    return torch.cat([past_ok.expand(b, 1, s, p), causal.expand(b, 1, s, s)], dim=-1)


def paged_attention(q, k, v, key_cache, value_cache, block_tables, mask, scaling: float) -> torch.Tensor:
    """q [B,H,S,D], new k/v [B,KV,S,D] -> attention output [B,S,H*D] over past (from the pool) + new."""
    keys = torch.cat([gather_past(key_cache, block_tables), k], dim=2)
    values = torch.cat([gather_past(value_cache, block_tables), v], dim=2)
    b, h, s, d = q.shape
    kv = k.shape[1]
    if h != kv:  # grouped KV heads: head i reads KV head i // (H/KV), as HF's repeat_kv
        n = keys.shape[2]
        keys = keys[:, :, None].expand(b, kv, h // kv, n, d).reshape(b, h, n, d)
        values = values[:, :, None].expand(b, kv, h // kv, n, d).reshape(b, h, n, d)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    scores = torch.where(mask, scores, torch.full_like(scores, _NEG))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [B,H,S,D]
    return out.transpose(1, 2).reshape(b, s, h * d)


def rows_at(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B,S,E] -> [B,Q,E]: row b's tokens index[b, :] (int64 [B,Q])."""
    b, q = index.shape
    return torch.gather(hidden, 1, index.view(b, q, 1).expand(b, q, hidden.shape[-1]))


def last_token(hidden: torch.Tensor, new_lens: torch.Tensor) -> torch.Tensor:
    """[B,S,E] -> [B,E] at index new_lens-1 of each row."""
    return rows_at(hidden, (new_lens - 1)[:, None]).squeeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _packed(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear computing cat([l(x) for l in linears], -1): one weight read per step instead of several."""
    out = sum(lin.out_features for lin in linears)
    bias = any(lin.bias is not None for lin in linears)
    packed = nn.Linear(linears[0].in_features, out, bias=bias)
    with torch.no_grad():
        packed.weight.copy_(torch.cat([lin.weight for lin in linears], 0))
        if bias:
            packed.bias.copy_(
                torch.cat(
                    [lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]
                )
            )
    return packed


class _LlamaBody(nn.Module):
    """The Hugging Face Llama-family model's own modules and head counts, shared by both decoders."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        body = hf_model.model
        self.embed = body.embed_tokens
        self.layers = body.layers
        self.norm = body.norm
        self.lm_head = hf_model.lm_head
        cfg = hf_model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = self.layers[0].self_attn.head_dim


class PagedLlama(_LlamaBody):
    """Llama / Mistral / Qwen2 (RMSNorm, rotary, SwiGLU, grouped KV heads) over a paged KV pool (in-graph gather)."""

    kv_layout = "paged"

    def __init__(self, hf_model: nn.Module):
        super().__init__(hf_model)
        self.rotary = hf_model.model.rotary_emb

    def forward(
        self, input_ids, positions, past_lens, new_lens, block_tables, key_caches: list, value_caches: list
    ):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        p = block_tables.shape[1] * key_caches[0].shape[2]
        cos, sin = self.rotary(x, positions)  # [B,S,D]
        cos, sin = cos[:, None], sin[:, None]
        mask = attention_mask(past_lens, s, p)
        present: list = []  # each layer's new K and V, in the step's output order
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            a = paged_attention(q, k, v, key_caches[i], value_caches[i], block_tables, mask, self.scaling)
            x = x + attn.o_proj(a)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            present += (k, v)
        logits = self.lm_head(last_token(self.norm(x), new_lens))
        return (logits, *present)

    @property
    def scaling(self) -> float:
        return float(self.layers[0].self_attn.scaling)


class MappedLlama(_LlamaBody):
    """Llama / Mistral / Qwen2 over per-request KV views [B,KV,C,D] (kv_layout "mapped", see the docstring)."""

    kv_layout = "mapped"
    multi_logits = True  # last_index [B,Q] -> logits [B*Q,V] (speculative verification)

    def __init__(self, hf_model: nn.Module, max_context: int | None = None, windows: list[int] | None = None):
        """``windows``: each layer's sliding window (-1: none), masked by GroupQueryAttention's
        local_window_size, so a windowed Mistral / Qwen2 keeps its whole context."""
        super().__init__(hf_model)
        body, cfg = hf_model.model, hf_model.config
        self.scaling = float(self.layers[0].self_attn.scaling)
        self.windows = list(windows) if windows is not None else [-1] * len(self.layers)
        ctx = int(max_context or cfg.max_position_embeddings)
        with torch.no_grad():  # the model's own rotary module at every position: [C, D/2] tables
            cos, sin = body.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(ctx)[None])
        half = self.head_dim // 2
        self.register_buffer("cos_cache", cos[0, :, :half].float().contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin[0, :, :half].float().contiguous(), persistent=False)
        self.qkv = nn.ModuleList(
            _packed([la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj]) for la in self.layers
        )
        # gate and up stay two projections (forward): packing them too would need a Split after the one
        # MatMul, which costs more per decode step than the extra MatMul dispatch (profiled: ~12 us per Split).

        # The head as MatMul on its own [E, V] copy (not Gemm on the embedding table it may be tied to),
        # so weight-only quantization can take it: at batch 1 it is the largest weight read per token.
        self.register_buffer("lm_head_t", self.lm_head.weight.detach().t().contiguous(), persistent=False)
        # Tied: the embedding reads Transpose(lm_head_t) instead of its own [V, E] table, so the artifact
        # stores the table once (ONNX Runtime folds the Transpose in memory at load; quantize-int4 turns
        # the pair into MatMulNBits + GatherBlockQuantized over the same 4-bit bytes).
        self.tied = self.lm_head.weight.data_ptr() == self.embed.weight.data_ptr()

    def forward(
        self, input_ids, positions, seqlens_k, total_sequence_length, last_index, past_keys, past_values
    ):
        """GroupQueryAttention's own lengths come in as inputs (the runtime computes them: no graph nodes):
        seqlens_k [B] int32 = past_lens + S - 1, total_sequence_length [] int32 = max(past_lens) + S, and
        last_index [B,Q] int64: the rows whose logits the step returns, [B*Q, V] (Q = 1: new_lens - 1, each
        request's last real new token; Q > 1: a speculative verification row's last Q tokens)."""
        from precast.compiler.decoder.paged_ops import last_token, mapped_gqa

        x = nn.functional.embedding(input_ids, self.lm_head_t.t()) if self.tied else self.embed(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            a, k, v = mapped_gqa(
                self.qkv[i](layer.input_layernorm(x)),
                positions,
                self.cos_cache,
                self.sin_cache,
                past_keys[i],
                past_values[i],
                seqlens_k,
                total_sequence_length,
                self.heads,
                self.kv_heads,
                self.scaling,
                self.windows[i],
            )
            x = x + layer.self_attn.o_proj(a)
            h, mlp = layer.post_attention_layernorm(x), layer.mlp
            x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
            presents += [k, v]
        logits = torch.matmul(last_token(self.norm(x), last_index), self.lm_head_t)
        if self.lm_head.bias is not None:
            logits = logits + self.lm_head.bias
        return (logits, *presents)


class PagedGPT2(nn.Module):
    """GPT-2 (learned positions, LayerNorm, fused QKV Conv1D, GELU MLP) over a paged KV pool."""

    kv_layout = "paged"

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        body = hf_model.transformer
        self.wte, self.wpe, self.blocks, self.ln_f = body.wte, body.wpe, body.h, body.ln_f
        self.lm_head = hf_model.lm_head
        cfg = hf_model.config
        self.heads = self.kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head

    def forward(
        self, input_ids, positions, past_lens, new_lens, block_tables, key_caches: list, value_caches: list
    ):
        x = self.wte(input_ids) + self.wpe(positions)
        b, s, e = x.shape
        p = block_tables.shape[1] * key_caches[0].shape[2]
        mask = attention_mask(past_lens, s, p)
        present: list = []  # each layer's new K and V, in the step's output order
        for i, block in enumerate(self.blocks):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(x)).split(e, dim=2)
            q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            a = paged_attention(
                q, k, v, key_caches[i], value_caches[i], block_tables, mask, float(attn.scaling)
            )
            x = x + attn.c_proj(a)
            x = x + block.mlp(block.ln_2(x))
            present += (k, v)
        logits = self.lm_head(last_token(self.ln_f(x), new_lens))
        return (logits, *present)
