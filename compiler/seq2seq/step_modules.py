"""Encoder-decoder models as two step graphs, exported from the Hugging Face model's own modules.

    encoder graph   input_ids, attention_mask [B,E]  (text)            the model's own encoder, then each
                    input_features [B,mels,frames]  (Whisper)          decoder layer's own cross-attention
                      -> cross_key.i, cross_value.i [B,H,E',D]         K/V projections (E' = encoder length)

    decoder step    input_ids, positions [B,S], past_lens, new_lens [B], block_tables [B,MAXB],
                    key_cache.i / value_cache.i [NB,H,bs,D]  (self-attention K/V: the engine's paged pool)
                    cross_key.i / cross_value.i [B,H,E',D], encoder_mask [B,E']  (the second cache kind)
                      -> logits [B,V] (each row's last real token), new_key.i / new_value.i [B,H,S,D]

The decoder step is the model's own forward (embeddings, layer norms, feed-forwards, its lm head and
final_logits_bias / T5's rescaling) with two things swapped in, as the causal-LM path does:

- ``precast_seq2seq`` in transformers' attention registry. Self-attention reads the past from the pool
  through the block tables and masks by lengths (per row: requests of different lengths batch together);
  cross-attention reads the K/V handed in (the model's cache object is pre-filled with them and marked
  updated, which is how transformers itself reuses cross K/V after the first step) masked by encoder_mask.
  T5's relative position bias is recomputed per row from the positions with the model's own bucket
  function and embedding (transformers computes it from one shared cache length).
- a pre-hook on the decoder's position embedding that hands it the step's per-row positions (BART, Marian
  and Whisper compute positions from the cache length, one for the whole batch).

torch is imported by the caller (compile side only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from precast.compiler.decoder.generic_decoder import set_attention
from precast.compiler.decoder.paged_decoder import attention_mask as paged_mask
from precast.compiler.decoder.paged_decoder import gather_past, last_token
from precast.errors import ModelLoadError

__all__ = ["ATTN", "DecoderStep", "EncoderStep", "Seq2SeqShape", "prepare"]

ATTN = "precast_seq2seq"
_NEG = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class Seq2SeqShape:
    layers: int
    heads: int
    head_size: int
    d_model: int
    vocab: int


@dataclass
class _Step:
    positions: torch.Tensor
    past_lens: torch.Tensor
    block_tables: torch.Tensor
    key_caches: list
    value_caches: list
    encoder_mask: torch.Tensor
    new_keys: dict = field(default_factory=dict)
    new_values: dict = field(default_factory=dict)


_ACTIVE: _Step | None = None


@contextlib.contextmanager
def _active(step: _Step):
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, step
    try:
        yield step
    finally:
        _ACTIVE = prev


def _t5_bias(module: nn.Module, positions: torch.Tensor, past_lens: torch.Tensor, p: int) -> torch.Tensor:
    """T5's decoder relative bias [B,H,S,P+S] per row: bucket(key position - query position) -> embedding."""
    b = positions.shape[0]
    k_pos = torch.cat([torch.arange(p)[None, :].expand(b, p), positions], dim=1)  # [B,P+S]
    rel = k_pos[:, None, :] - positions[:, :, None]  # [B,S,P+S]
    buckets = module._relative_position_bucket(
        rel,
        bidirectional=False,
        num_buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
    )
    return module.relative_attention_bias(buckets).permute(0, 3, 1, 2)


def seq2seq_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
):
    """q [B,H,S,D]; self: new k/v [B,H,S,D] (past from the pool); cross: k/v [B,H,E,D] -> ([B,S,H,D], None)."""
    step = _ACTIVE
    role = getattr(module, "_precast_role", None)
    if step is None or role is None:
        raise ModelLoadError(
            f"{type(module).__name__}: attention outside the decoder's self/cross attention modules "
            "(this encoder-decoder architecture is not supported)"
        )
    kind, i = role
    s = query.shape[2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    bias = None
    if kind == "cross":
        keys, values = key, value
        mask = (step.encoder_mask[:, None, None, :] > 0).expand(-1, 1, s, -1)
    else:
        step.new_keys[i], step.new_values[i] = key, value
        keys = torch.cat([gather_past(step.key_caches[i], step.block_tables), key], dim=2)
        values = torch.cat([gather_past(step.value_caches[i], step.block_tables), value], dim=2)
        p = keys.shape[2] - s
        mask = paged_mask(step.past_lens, s, p)
        t5 = getattr(module, "_precast_t5_bias", None)
        if t5 is not None:
            bias = _t5_bias(t5[0], step.positions, step.past_lens, p)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    if bias is not None:
        scores = scores + bias
    scores = torch.where(mask, scores, torch.full_like(scores, _NEG))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN, seq2seq_attention)


def _decoder_layers(hf: nn.Module) -> list[nn.Module]:
    dec = hf.get_decoder()
    for name in ("layers", "block"):  # BART / Marian / Whisper / Pegasus; T5
        layers = getattr(dec, name, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise ModelLoadError(f"{type(hf).__name__}: its decoder has no 'layers' or 'block' list")


_SELF = ("self_attn", "SelfAttention")
_CROSS = ("encoder_attn", "EncDecAttention")


def prepare(hf: nn.Module, where: str) -> Seq2SeqShape:
    """Tag each decoder layer's self/cross attention module with its role and index (what the attention
    function reads), hook the position embedding, register the attention: -> the decoder's shape."""
    _register()
    layers = _decoder_layers(hf)
    t5_bias = None
    heads = head = None
    for i, layer in enumerate(layers):
        found = {}
        for name, mod in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in _SELF:
                found["self"] = mod
            elif leaf in _CROSS:
                found["cross"] = mod
        if set(found) != {"self", "cross"}:
            raise ModelLoadError(
                f"{where}: decoder layer {i} has no self-attention + cross-attention pair "
                f"(looked for {_SELF} and {_CROSS}); this encoder-decoder architecture is not supported"
            )
        for kind, mod in found.items():
            object.__setattr__(mod, "_precast_role", (kind, i))
        sa = found["self"]
        if getattr(sa, "has_relative_attention_bias", False):  # T5: layer 0 owns the decoder's bias
            t5_bias = sa
        if t5_bias is not None:
            object.__setattr__(sa, "_precast_t5_bias", (t5_bias,))  # (a tuple: not a registered submodule)
        h = getattr(sa, "num_heads", None) or getattr(sa, "n_heads", None)
        d = getattr(sa, "head_dim", None) or getattr(sa, "key_value_proj_dim", None)
        if h is None or d is None:
            raise ModelLoadError(
                f"{where}: cannot read the heads / head size of decoder layer {i}'s attention"
            )
        if (heads, head) not in ((None, None), (h, d)):
            raise ModelLoadError(f"{where}: decoder layers with different head shapes are not supported")
        heads, head = int(h), int(d)
    cfg = hf.config
    d_model = int(getattr(cfg, "d_model", 0) or getattr(cfg, "hidden_size", 0))
    vocab = int(hf.get_output_embeddings().weight.shape[0])
    return Seq2SeqShape(len(layers), heads, head, d_model, vocab)


class _PositionHook:
    """Forward hook of the decoder's position embedding (an nn.Embedding: BART's learned one with its offset,
    Marian's sinusoidal table, Whisper's): the embedding of the step's per-row positions [B,S] instead of the
    cache-length arange transformers gives it (one for the whole batch)."""

    def __init__(self):
        self.positions: torch.Tensor | None = None

    def __call__(self, module, _args, output):
        if self.positions is None:
            return None
        offset = int(getattr(module, "offset", 0) or 0)
        return nn.functional.embedding(self.positions + offset, module.weight).to(output.dtype)


class DecoderStep(nn.Module):
    """The decoder step graph's module (module doc): the model's own forward over the paged pool."""

    def __init__(self, hf: nn.Module, shape: Seq2SeqShape, where: str):
        super().__init__()
        self.hf, self.shape = hf, shape
        self._new_lens: torch.Tensor | None = None
        self._head_seen = False
        head = hf.get_output_embeddings()
        head.register_forward_pre_hook(self._head_input)
        self._positions = _PositionHook()
        emb = getattr(hf.get_decoder(), "embed_positions", None)
        if emb is not None:
            if not isinstance(emb, nn.Embedding):
                raise ModelLoadError(
                    f"{where}: the decoder's position embedding is a {type(emb).__name__}, not an embedding table"
                )
            emb.register_forward_hook(self._positions)

    def _head_input(self, _module, args):
        if self._new_lens is None:
            return None
        self._head_seen = True
        return (last_token(args[0], self._new_lens)[:, None], *args[1:])

    def forward(
        self,
        input_ids,
        positions,
        past_lens,
        new_lens,
        block_tables,
        key_caches,
        value_caches,
        cross_keys,
        cross_values,
        encoder_mask,
    ):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        cross = DynamicCache()
        for i, (k, v) in enumerate(zip(cross_keys, cross_values)):
            cross.update(k, v, i)
        cache = EncoderDecoderCache(DynamicCache(), cross)
        cache.is_updated = {i: True for i in range(self.shape.layers)}
        step = _Step(positions, past_lens, block_tables, list(key_caches), list(value_caches), encoder_mask)
        # (the encoder output is never read: every layer's cross K/V comes from the cache; a [B,E,1] stand-in)
        stand_in = encoder_mask[:, :, None].to(torch.float32)
        self._new_lens, self._positions.positions, self._head_seen = new_lens, positions, False
        set_attention(self.hf, ATTN)
        try:
            with _active(step):
                out = self.hf(
                    encoder_outputs=(stand_in,),
                    decoder_input_ids=input_ids,
                    cache=cache,
                    use_cache=True,
                )
        finally:
            self._new_lens = self._positions.positions = None
        if not self._head_seen:
            raise ModelLoadError(f"{type(self.hf).__name__}: its forward does not call its lm head module")
        n = self.shape.layers
        if sorted(step.new_keys) != list(range(n)):
            raise ModelLoadError(f"{type(self.hf).__name__}: not every decoder layer ran its self-attention")
        logits = out.logits[:, -1]
        return (logits, *[t for i in range(n) for t in (step.new_keys[i], step.new_values[i])])


class EncoderStep(nn.Module):
    """The encoder graph's module: the model's encoder, then every decoder layer's cross K/V, read from the
    cache transformers itself fills on the first decoder step (the rest of that step is dead code)."""

    def __init__(self, hf: nn.Module, shape: Seq2SeqShape, speech: bool):
        super().__init__()
        self.hf, self.shape, self.speech = hf, shape, speech

    def forward(self, x, mask=None):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        set_attention(self.hf, "eager")
        if self.speech:  # x: input_features [B,mels,frames]
            enc = self.hf.get_encoder()(input_features=x).last_hidden_state
        else:  # x: input_ids [B,E], mask: attention_mask [B,E]
            enc = self.hf.get_encoder()(input_ids=x, attention_mask=mask).last_hidden_state
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.zeros(enc.shape[0], 1, dtype=torch.long)
        self.hf(
            encoder_outputs=(enc,), attention_mask=mask, decoder_input_ids=start, cache=cache, use_cache=True
        )
        layers = cache.cross_attention_cache.layers
        if len(layers) != self.shape.layers:
            raise ModelLoadError(
                f"{type(self.hf).__name__}: the decoder filled {len(layers)} cross-attention caches"
            )
        return tuple(t for layer in layers for t in (layer.keys, layer.values))
