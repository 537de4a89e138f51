"""Tiny causal-LM folders for tests and benchmarks: seeded random weights, a local byte-level BPE tokenizer.

``build_llama(dir)`` / ``build_gpt2(dir)`` write a Hugging Face folder (config.json, model.safetensors,
tokenizer.json); nothing comes from a hub. The tokenizer is trained on a few stdlib sources.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

__all__ = [
    "GENERIC_TINY",
    "GENERIC_VARIANTS",
    "GPT2_TINY",
    "LLAMA_TINY",
    "build_causal_lm",
    "build_gpt2",
    "build_llama",
    "train_tokenizer",
]

LLAMA_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    # HF's default 0.02 leaves attention near uniform, so attention bugs would not change the tokens.
    "initializer_range": 0.1,
}
GPT2_TINY = {
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 256,
    "initializer_range": 0.1,
}

_SPECIALS = ["<|endoftext|>", "<s>", "</s>"]


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on a few stdlib modules (deterministic for a given Python)."""
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    sys.path.insert(0, scripts)
    try:
        from train_tiny_lm import bpe_tokenizer
    finally:
        sys.path.remove(scripts)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text(encoding="utf-8") for n in ("textwrap.py", "string.py", "bisect.py")]
    return bpe_tokenizer(texts, vocab_size, _SPECIALS)


def _save(model, tok, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def build_llama(folder: Path, seed: int = 0, model_type: str = "llama", **overrides) -> Path:
    """A Llama-style folder (``model_type`` llama | mistral | qwen2) with seeded random weights."""
    import torch
    import transformers

    tok = train_tokenizer()
    cfg_cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[model_type]
    model_cls = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
        model_type
    ]
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    kw = {**LLAMA_TINY, "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos, **overrides}
    config = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    return _save(model, tok, folder)


def build_gpt2(folder: Path, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    tok = train_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    config = transformers.GPT2Config(**{**GPT2_TINY, **overrides}, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    return _save(model, tok, folder)


_TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}
# Per architecture: what differs from _TINY (names, GQA where the family has it, the feature under test).
GENERIC_TINY = {
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "phi3": {"num_key_value_heads": 2, "pad_token_id": 0},
    "gemma": {"num_key_value_heads": 2, "head_dim": 16},
    "granite": {
        "num_key_value_heads": 2,
        "embedding_multiplier": 2.0,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.3,
    },
    # alternating sliding (window 8) / global layers, attention and final logit softcaps
    "gemma2": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
    },
    "olmo": {"num_key_value_heads": 2, "clip_qkv": 2.0},
    "olmo2": {"num_key_value_heads": 2},
    "stablelm": {"num_key_value_heads": 2, "partial_rotary_factor": 0.25},
    "gpt_neox": {"rotary_pct": 0.5},
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "rotary_dim": 8},
    "phi": {"partial_rotary_factor": 0.5, "qk_layernorm": True},
    "starcoder2": {"num_key_value_heads": 2, "sliding_window": 8},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "pad_token_id": 1},
    "gemma3_text": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "mistral": {"num_key_value_heads": 2, "sliding_window": 8},
    "qwen2": {
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
        "layer_types": ["full_attention", "sliding_attention"],
    },
    # mixtures of experts: 4 experts, top-2 (the generic path evaluates every expert, routing in-graph)
    "mixtral": {
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
    },
    "qwen2_moe": {
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_moe": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    # FalconConfig's defaults: rotary, parallel attention, multi-query (one KV head)
    "falcon": {"bias": True},
    # ALiBi (slope per head * key position); no max_position_embeddings of its own
    "bloom": {"n_layer": 2, "n_head": 4},
    # ALiBi (MPT's own slopes), its mask built unconditionally; attention swapped (attention_swaps.py)
    "mpt": {"max_seq_len": 256},
    # sinusoidal positions, attention computed in its own code (swapped)
    "xglm": {"ffn_dim": 128, "pad_token_id": 1, "init_std": 0.1},
    # complex rotary (swapped for a real one), chunked attention (chunk 8) on layer 0, a NoPE layer with
    # temperature tuning (floor_scale 8: acts from position 7), a dense layer and a MoE layer (4 experts)
    "llama4_text": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8,
        "layer_types": ["chunked_attention", "full_attention"],
        "no_rope_layers": [1, 0],
        "floor_scale": 8,
    },
}
# Other configurations of a family in GENERIC_TINY: name -> (model_type, overrides)
GENERIC_VARIANTS = {
    # Falcon-40B style: grouped KV heads (2), two layer norms per parallel block
    "falcon-new-arch": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    # Falcon-RW style: one KV head per query head, sequential attention then MLP
    "falcon-mha": ("falcon", {"multi_query": False, "parallel_attn": False}),
}


def build_causal_lm(folder: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """A tiny ``model_type`` folder (GENERIC_TINY) with seeded N(0, 0.1) weights; norms' weights perturbed too,
    so a model that reads them wrongly shows."""
    import torch
    import transformers

    tok = train_tokenizer()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    kw = {**_TINY, "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos}
    if model_type in GENERIC_VARIANTS:
        model_type, variant = GENERIC_VARIANTS[model_type]
        overrides = {**variant, **overrides}
    kw.update(GENERIC_TINY.get(model_type, {}), **overrides)
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms and biases: not their constant init
                p.add_(torch.randn_like(p) * 0.1)
    return _save(model, tok, folder)
