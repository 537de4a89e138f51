"""Rotary variants (issue 15): each rope type compiles and generates exactly what HF generate() does.

linear / llama3 / yarn are fixed frequency changes (yarn also scales cos/sin by its attention factor);
dynamic rescales only past max_position_embeddings (the compiled context) and longrope switches to its long
factors only past original_max_position_embeddings, where the compiled context is capped. Tiny Llama-family
models with N(0, 0.1) weights; two requests batched, one reusing the other's cached prefix.
"""

from __future__ import annotations

import json

import pytest

from tests.llm.fixtures import build_causal_lm, build_llama
from tests.llm.test_generic_decoders import TEXTS, assert_batched_greedy_matches_hf

HALF = 8  # head size 16: 8 rotary frequencies
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.5 * i for i in range(HALF)],
        "long_factor": [4.0 + 2.0 * i for i in range(HALF)],
        "original_max_position_embeddings": 128,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}
# (model type, rope, kv layout or None for the default, expected step graph)
CASES = [
    ("llama", "linear", None, "mapped"),
    ("llama", "llama3", None, "mapped"),
    ("llama", "yarn", None, "mapped"),
    ("llama", "longrope", None, "mapped"),
    ("llama", "dynamic", None, "mapped"),
    ("llama", "dynamic", "paged", "paged"),  # rotary in the graph: the frequency update must be skipped
    ("mistral", "longrope", "paged", "paged"),
    ("qwen2", "yarn", "paged", "generic"),  # use_sliding_window + paged: the generic path
    ("phi3", "longrope", None, "generic"),  # Phi-3's own rope type, on the generic path
]


@pytest.fixture(scope="session")
def rope_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    cache: dict = {}

    def get(model_type: str, rope: str):
        key = (model_type, rope)
        if key not in cache:
            extra = {}
            if model_type == "qwen2":
                extra = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
            params = {**ROPES[rope], "rope_theta": 10000.0}
            folder = root / f"{model_type}-{rope}"
            if model_type == "phi3":
                # Phi3Config keeps its own top-level original_max_position_embeddings (default 4096)
                cache[key] = build_causal_lm(
                    folder, "phi3", seed=5, rope_parameters=params, original_max_position_embeddings=128
                )
            else:
                cache[key] = build_llama(
                    folder, seed=5, model_type=model_type, rope_parameters=params, **extra
                )
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type,rope,kv_layout,graph", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES]
)
def test_rope_variant_greedy_matches_hf_generate(model_type, rope, kv_layout, graph, rope_dirs, tmp_path):
    from precast.compiler.driver import CompileOptions, compile_model

    folder = rope_dirs(model_type, rope)
    opts = CompileOptions(targets=("ort-cpu",), task="causal-lm", kv_layout=kv_layout)
    out = compile_model(str(folder), tmp_path / "art", opts).output
    llm = json.loads((out / "manifest.json").read_text())["llm"]
    assert (llm["architecture"] == "generic") == (graph == "generic")
    assert llm["kv_layout"] == ("mapped" if graph == "mapped" else "paged")
    # longrope: capped where HF would switch to the long factors; the others keep the model's context
    assert llm["max_context"] == (128 if rope == "longrope" else 256)
    # block 64 on the mapped layout: the prompt must outgrow a block to share one (+ 32 new: within longrope's 128)
    assert_batched_greedy_matches_hf(out, folder, TEXTS[0] * 3, llm["block_size"], f"{model_type}/{rope}")


def test_unknown_rope_type_is_refused(tmp_path):
    from precast.compiler.frontends.source import load_source
    from precast.errors import ModelLoadError

    config = {"model_type": "llama", "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"rope type 'mrope' is not supported.*supported: default"):
        load_source(str(tmp_path), task="causal-lm")


@pytest.mark.parametrize(
    "top,nested",
    [(None, 128), (128, 4096), (4096, 128), (None, None), (64, None)],
    ids=["nested-only", "top-smaller", "top-larger", "neither", "top-only"],
)
def test_longrope_cap_is_where_hf_switches_for_phi3(top, nested):
    """Phi3Config's own original_max_position_embeddings (default 4096) overrides rope_parameters': the cap
    must be HF's switch point (a larger cap generated with the short factors where HF uses the long ones)."""
    import copy

    import transformers

    from precast.compiler.decoder.context import max_positions as _max_positions

    rope = {**ROPES["longrope"], "rope_theta": 10000.0}
    rope.pop("original_max_position_embeddings")
    if nested is not None:
        rope["original_max_position_embeddings"] = nested
    config = {"model_type": "phi3", "max_position_embeddings": 8192, "rope_scaling": rope}
    config.update(hidden_size=2 * HALF * 4, num_attention_heads=4)  # head size 2 * HALF: the factors' length
    if top is not None:
        config["original_max_position_embeddings"] = top
    hf = transformers.Phi3Config(**copy.deepcopy({k: v for k, v in config.items() if k != "model_type"}))
    switch = hf.rope_parameters["original_max_position_embeddings"]
    assert _max_positions(config) == min(8192, switch)
