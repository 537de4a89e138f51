"""--task causal-lm on families that needed more than the attention interface (issue 39, item 4), and the
refusal of encoder-decoder configs.

    mpt     ALiBi with its own slopes; its model builds a mask unconditionally -> attention and model swapped
    xglm    sinusoidal positions, attention computed in its own code -> attention swapped
    llama4  complex rotary (no export) -> rotary and attention swapped: real rotary, chunked attention (8),
            a NoPE layer with temperature tuning, a dense and a MoE layer

Each: a tiny seeded model (N(0, 0.1) weights, norms perturbed), compiled with the CLI, greedy 32 tokens
through the engine (two requests batched, one reusing the other's cached prefix) == HF generate().
"""

from __future__ import annotations

import json

import pytest

from tests.llm.fixtures import build_causal_lm
from tests.llm.test_generic_decoders import TEXTS, assert_batched_greedy_matches_hf

SWAPPED = ["mpt", "xglm", "llama4_text"]


@pytest.mark.parametrize(
    "config,task",
    [
        (
            {
                "model_type": "whisper",
                "d_model": 64,
                "num_mel_bins": 80,
                "is_encoder_decoder": True,
                "architectures": ["WhisperForConditionalGeneration"],
            },
            "automatic-speech-recognition",
        ),
        ({"model_type": "t5", "d_model": 64, "is_encoder_decoder": True}, "text2text-generation"),
    ],
)
def test_an_encoder_decoder_is_refused_in_one_line_naming_its_task(config, task, cli, tmp_path):
    """Whisper has a decoder-only class (WhisperForCausalLM) transformers would load for causal-lm; the
    config says encoder-decoder, so the compile stops before loading anything: exit 1, one line."""
    folder = tmp_path / config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    res = cli("compile", folder, "--task", "causal-lm", "-o", tmp_path / "art")
    lines = res.err.strip().splitlines()
    assert res.code == 1 and len(lines) == 1, res.err
    assert f"its task is {task}" in lines[0] and "encoder-decoder" in lines[0], lines[0]
    assert "compile it without --task" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SWAPPED)
def test_swapped_attention_greedy_matches_hf_generate(model_type, cli, tmp_path):
    folder = build_causal_lm(tmp_path / model_type, model_type, seed=3)
    out = tmp_path / "art"
    res = cli("compile", folder, "-o", out, "--task", "causal-lm", "--target", "ort-cpu", "-q")
    assert res.code == 0, res.err
    llm = json.loads((out / "manifest.json").read_text())["llm"]
    assert (llm["architecture"], llm["kv_layout"], llm["layers"], llm["hidden"]) == (
        "generic",
        "paged",
        2,
        64,
    )
    assert llm["max_context"] == 256
    # prompts over one block (16): a shared prefix, and positions where ALiBi / sinusoids differ per token
    assert_batched_greedy_matches_hf(out, folder, TEXTS[0], 16, model_type)


@pytest.mark.parametrize("model_type,feature", [("mpt", "alibi_slopes"), ("llama4_text", "attention_chunk")])
def test_a_swap_without_its_feature_fails_the_check_against_hf(model_type, feature, tmp_path, monkeypatch):
    """What the swap carries is what the model computes: MPT's ALiBi slopes, Llama 4's attention chunks (8,
    the check's prompt is 24). Without it the pre-export check is exit 2; with it, it passes."""
    import precast.compiler.decoder.generic_decoder as gd
    from precast.compiler.decoder.causal_lm import build_paged_decoder
    from precast.errors import ParityError

    folder = build_causal_lm(tmp_path / model_type, model_type, seed=3)
    right = gd.precast_paged_attention

    def without(*args, **kwargs):
        kwargs.pop(feature, None)
        return right(*args, **kwargs)

    monkeypatch.setattr(gd, "precast_paged_attention", without)
    with pytest.raises(ParityError, match="differ from the model's own forward") as e:
        build_paged_decoder(folder, model_type)
    assert e.value.exit_code == 2
    monkeypatch.setattr(gd, "precast_paged_attention", right)
    build_paged_decoder(folder, model_type)
