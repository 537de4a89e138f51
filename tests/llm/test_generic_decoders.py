"""The generic decoder path (compiler/generic_decoder.py): the model's own forward with precast's paged attention.

Each architecture: a tiny seeded model (N(0, 0.1) weights, norms perturbed), compiled with --task causal-lm,
greedy through the engine (two requests batched, one of them reusing the other's cached prefix) == HF
generate(). Windowed and softcapped models get prompts longer than their window.
"""

from __future__ import annotations

import json

import pytest

from precast.runtime.errors import ModelLoadError, ParityError
from tests.llm.fixtures import build_causal_lm
from tests.llm.test_causal_lm import compile_llm, hf_greedy

ARCHS = [
    "qwen3",
    "phi3",
    "gemma",
    "granite",
    "gemma2",  # alternating sliding (8) / global layers, attention + final logit softcaps
    "olmo",
    "olmo2",
    "stablelm",  # partial rotary
    "gpt_neox",
    "gptj",  # partial rotary, interleaved
    "phi",
    "starcoder2",  # window 8
    "opt",  # learned positions
    "gemma3_text",  # sliding / full layers with their own rotary bases
    "mistral",  # window 8, smaller than the prompt: the generic path (the mapped one stops at the window)
    "qwen2",  # use_sliding_window on its second layer
]
NEW_TOKENS = 32
TEXTS = [
    "def wrap(text, width=70):\n    return [line for line in text.split()]",
    "import os\nclass Formatter:",
]


@pytest.fixture(scope="session")
def generic_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    cache: dict = {}

    def get(model_type: str):
        if model_type not in cache:
            cache[model_type] = build_causal_lm(root / model_type, model_type, seed=3)
        return cache[model_type]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ARCHS)
def test_generic_greedy_matches_hf_generate(model_type, generic_dirs, tmp_path):
    from precast.runtime.llm import Engine
    from precast.runtime.llm.sampler import SamplingParams

    folder = generic_dirs(model_type)
    out = compile_llm(folder, tmp_path / "art").output
    llm = json.loads((out / "manifest.json").read_text())["llm"]
    assert (llm["architecture"], llm["kv_layout"], llm["layers"]) == ("generic", "paged", 2)
    assert llm["max_context"] == 256  # windows are masked in the graph, not a limit on the context
    engine = Engine.load(out, num_blocks=32)
    try:
        first, second = (engine.tokenizer.encode(t) for t in TEXTS)
        assert len(first) > 16  # longer than the windows (8) and than one block (16): a prefix to share
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        engine.generate([first], params)
        extended = first[:17] + second
        done = engine.generate([extended, second], params)  # batched; `extended` reuses first's block 0
        assert engine.counters.prefix_hit_tokens >= 16
    finally:
        engine.close()
    for prompt, completion in zip((extended, second), done):
        expected = hf_greedy(folder, prompt, NEW_TOKENS)
        assert completion.token_ids == expected, f"{model_type}: {completion.token_ids} != {expected}"


@pytest.mark.parametrize("model_type,break_it", [("gemma2", "window"), ("qwen3", "causal")])
def test_a_wrong_mask_fails_the_check_against_hf(model_type, break_it, generic_dirs, monkeypatch):
    """The pre-export check compares with the model's own forward: a mask that drops the window, or the
    causal order, is a ParityError (exit 2), so an architecture the generic path gets wrong never ships."""
    import precast.compiler.generic_decoder as gd
    from precast.compiler.causal_lm import build_paged_decoder

    right = gd._mask
    if break_it == "window":
        monkeypatch.setattr(gd, "_mask", lambda pl, s, p, w: right(pl, s, p, None))
    else:
        monkeypatch.setattr(gd, "_mask", lambda pl, s, p, w: right(pl, s, p, w) | True)
    with pytest.raises(ParityError, match="differ from the model's own forward") as e:
        build_paged_decoder(generic_dirs(model_type), model_type)
    assert e.value.exit_code == 2
    monkeypatch.setattr(gd, "_mask", right)
    build_paged_decoder(generic_dirs(model_type), model_type)  # and the real mask passes


def test_generic_shape_is_read_off_the_model(generic_dirs):
    from precast.compiler.causal_lm import build_paged_decoder

    _, module = build_paged_decoder(generic_dirs("gemma2"), "gemma2")
    assert module.shape.windows == (8, None) and module.shape.softcaps == (5.0, 5.0)
    assert (module.shape.kv_heads, module.shape.head_size) == (2, 16)


@pytest.mark.parametrize("model_type", ["falcon", "bloom"])
def test_architectures_outside_the_attention_interface_are_refused(model_type, tmp_path):
    from precast.compiler.source import load_source

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ModelLoadError, match=rf"'{model_type}' is not supported.*attention"):
        load_source(str(tmp_path), task="causal-lm")


def test_generic_model_refuses_mapped_layout(generic_dirs):
    from precast.compiler.causal_lm import build_paged_decoder
    from precast.runtime.errors import UsageError

    with pytest.raises(UsageError, match="takes 'paged'"):
        build_paged_decoder(generic_dirs("qwen3"), "qwen3", kv_layout="mapped")
