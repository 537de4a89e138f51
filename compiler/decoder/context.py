"""The context a causal LM's step graph serves, as its config and modules state it: the rotary type, the
largest position (capped where longrope would switch factors), and sliding windows.

Split from causal_lm.py: these read a config (or the loaded modules) and decide nothing about the export.
"""

from __future__ import annotations

from precast.artifact.llm_spec import LIMITS

__all__ = ["ROPE_TYPES", "freeze_rotary", "layer_windows", "max_positions", "rope_kind", "windowed"]

# Rotary types the step graph computes exactly: the model's own rotary module at its fixed frequencies (and
# yarn / longrope attention factor). 'dynamic' rescales only past max_position_embeddings and 'longrope'
# switches to its long factors only past original_max_position_embeddings: within the compiled context
# (the latter capped there) both are fixed too; see freeze_rotary.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _rope_parameters(config: dict) -> dict:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling if isinstance(scaling, dict) else {}


def rope_kind(config: dict) -> str:
    scaling = _rope_parameters(config)
    return scaling.get("rope_type", scaling.get("type", "default"))


def freeze_rotary(hf) -> None:
    """dynamic / longrope rotary modules re-derive their frequencies from each forward's largest position
    (a data-dependent branch / buffer write the exporter cannot take). Within the compiled context that
    update is the identity (dynamic grows only past max_position_embeddings; longrope picks its short
    factors up to original_max_position_embeddings, where max_positions caps the context), so the graph
    runs the module at the frequencies it was built with."""
    for mod in hf.modules():
        kind = getattr(mod, "rope_type", None)
        if isinstance(kind, str) and (kind == "longrope" or "dynamic" in kind) and hasattr(mod, "inv_freq"):
            mod.rope_type = "default"  # read by transformers' dynamic_rope_update; the rest is unchanged


def layer_windows(hf) -> list[int]:
    """Each layer's sliding window as the model's attention applies it, -1 for none (Qwen2: per layer, from
    its layer types; Mistral: the config's, on every layer)."""
    windows = []
    for layer in hf.model.layers:
        attn = layer.self_attn
        w = (
            attn.sliding_window
            if hasattr(attn, "sliding_window")
            else getattr(hf.config, "sliding_window", None)
        )
        windows.append(int(w) if w else -1)
    return windows


# Configs with a top-level original_max_position_embeddings field (its default here) that transformers copies
# over rope_parameters' own (standardize_rope_params): Phi-3 switches to its long factors past that one.
TOP_LEVEL_ORIGINAL = {"phi3": 4096, "phi4_multimodal": 4096}


def max_positions(config: dict) -> int:
    ctx = int(
        config.get("max_position_embeddings")
        or config.get("n_positions")
        or config.get("max_seq_len")
        or 2048
    )
    if rope_kind(config) == "longrope":  # beyond it HF switches to the long factors mid-sequence
        rope = _rope_parameters(config)
        original = rope.get("original_max_position_embeddings") or config.get(
            "original_max_position_embeddings"
        )
        if config.get("model_type") in TOP_LEVEL_ORIGINAL:  # HF: its config's own field wins over rope's
            original = (
                config.get("original_max_position_embeddings") or TOP_LEVEL_ORIGINAL[config["model_type"]]
            )
        ctx = min(ctx, int(original or ctx))
    # The runtime refuses a larger context (LLMSpec LIMITS): serving more than 2^20 positions is not a
    # CPU engine's job, and an artifact claiming it cannot be told from a hostile one.
    return min(ctx, LIMITS["max_context"])


def windowed(config: dict) -> bool:
    """A sliding window that a full-context request would outgrow (the generic path masks it)."""
    window = config.get("sliding_window")
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window"):
        return False
    return bool(window) and int(window) < max_positions(config)
