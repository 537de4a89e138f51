"""decoder_context: what a causal LM's config says about the context its step graph serves (no model needed)."""

from __future__ import annotations

from precast.artifact.llm_spec import LIMITS
from precast.compiler.decoder.context import (
    ROPE_TYPES,
    max_positions,
    rope_kind,
    windowed,
)


def test_rope_kind_reads_either_config_field():
    assert rope_kind({}) == "default"
    assert rope_kind({"rope_scaling": {"type": "linear"}}) == "linear"
    assert rope_kind({"rope_parameters": {"rope_type": "yarn"}}) == "yarn"
    assert {"default", "longrope", "dynamic"} <= set(ROPE_TYPES)


def test_max_positions_caps_longrope_and_the_runtime_limit():
    assert max_positions({"n_positions": 1024}) == 1024
    longrope = {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "longrope"}}
    assert max_positions({**longrope, "original_max_position_embeddings": 4096}) == 4096
    assert max_positions({"model_type": "phi3", **longrope}) == 4096  # its top-level default
    assert max_positions({"max_position_embeddings": 1 << 30}) == LIMITS["max_context"]


def test_windowed_only_when_a_full_context_outgrows_the_window():
    assert windowed({"sliding_window": 64, "max_position_embeddings": 128})
    assert not windowed({"sliding_window": 256, "max_position_embeddings": 128})
    assert not windowed({"model_type": "qwen2", "sliding_window": 64, "max_position_embeddings": 128})
