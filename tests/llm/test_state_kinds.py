"""Decoders whose state is not one plain K/V per layer (issue 41): gpt-oss's attention sinks and DeepSeek-V2 / V3's
multi-head latent attention (the pool holds each token's compressed latent + rotary key) through the generic paged path, and a
one-line refusal naming the family and the layer kind for what the engine cannot hold yet (state-space and
hybrid models)."""

from __future__ import annotations

import pytest

from tests.llm.fixtures import build_causal_lm

pytest.importorskip("transformers")

NEW = 32
# gpt-oss, tiny: 4 experts (2 a token: routed to several), alternating sliding (8) / full layers, YaRN rotary
# scaled from 8 positions, attention sinks (1-D: build_causal_lm perturbs them N(0, 0.1) like the norms)
GPT_OSS = dict(
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "rope_theta": 150000.0,
        "truncate": False,
    },
)
TEXTS = [
    "def wrap(text, width=70):\n    return [line for line in text.split()]",
    "import os\nclass Formatter:",
    "x = 1",
    "while True:\n    pass\n" * 3,
    "# a comment that is longer than the window of eight tokens",
    "a, b = b, a",
    "for i in range(10):\n    print(i)",
    "return None",
]


DEEPSEEK = dict(
    kv_lora_rank=16,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    n_shared_experts=1,
    num_key_value_heads=4,
)
# hybrid and state-space families (recurrent state in per-request slots): tiny configs
RECURRENT = {
    "mamba": dict(state_size=8, expand=2, conv_kernel=4),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=8, expand=2, n_groups=1, conv_kernel=4),
    "jamba": dict(
        num_experts=2,
        num_experts_per_tok=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_dt_rank=8,
        num_key_value_heads=2,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"], num_key_value_heads=2),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "falcon_h1": dict(
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
    ),
}

SERVED = {
    "gpt_oss": GPT_OSS,
    # multi-head latent attention: 4 heads of K 48 (32 nope + 16 rope), V 32 over a latent of 16 (+ 16 rope);
    # MoE 4 experts, 2 a token
    "deepseek_v2": dict(DEEPSEEK, q_lora_rank=None),  # (its complex rotary runs in reals in the step)
    "deepseek_v3": dict(DEEPSEEK, q_lora_rank=24, n_group=1, topk_group=1),
    **RECURRENT,
}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_causal_lm(tmp_path_factory.mktemp("oss") / "gpt-oss", "gpt_oss", seed=3, **GPT_OSS)


def _reference(folder, model_type: str, prompt: list[int]) -> list[int]:
    """HF's greedy tokens. DeepSeek-V2: its own forward without a cache, token by token (transformers 5.25's
    cached generate() drifts from that forward after a few tokens on this model; precast matches the forward)."""
    from tests.llm.test_causal_lm import hf_greedy

    if model_type != "deepseek_v2":  # argmax every step, EOS included (as precast with ignore_eos)
        return hf_greedy(folder, prompt, NEW, argmax_eos=True)
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_served_state_kinds_greedy_matches_hf(model_type, cli, tmp_path):
    """Greedy 32 tokens == HF: each prompt alone, all 8 batched (lengths 4-27, past gpt-oss's window), and
    under a 6-block pool that preempts, with one request cancelled mid-way: the others' tokens unchanged."""
    from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

    folder = build_causal_lm(tmp_path / model_type, model_type, seed=3, **SERVED[model_type])
    out = tmp_path / "art"
    res = cli("compile", folder, "-o", out, "--task", "causal-lm", "--target", "ort-cpu", "-q")
    assert res.code == 0, res.err
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)
    eng = Engine.load(out, num_blocks=64)
    try:
        prompts = [eng.tokenizer.encode(t) for t in TEXTS]
        assert max(map(len, prompts)) > 2 * GPT_OSS["sliding_window"]
        want = [_reference(folder, model_type, p) for p in prompts]
        assert [eng.generate([p], params)[0].token_ids for p in prompts[:2]] == want[:2]
        assert [c.token_ids for c in eng.generate(prompts, params)] == want
    finally:
        eng.close()
    eng = Engine.load(out, num_blocks=6, config=SchedulerConfig(max_num_batched_tokens=16))
    try:
        handles = [eng.submit(p, params) for p in prompts]
        for _ in range(6):
            eng.step()
        assert eng.cancel(handles[3].request_id)
        eng.run_until_done()
        assert eng.metrics().preemptions > 0
        for i, h in enumerate(handles):
            if i != 3:
                assert h.result().token_ids == want[i], i
    finally:
        eng.close()


def test_gpt_oss_without_its_sinks_fails_the_check_against_hf(gpt_oss, monkeypatch):
    """The sinks are what the model computes: dropped, the pre-export check against the model's own forward
    is exit 2 (ParityError)."""
    import precast.compiler.decoder.generic_decoder as gd
    from precast.compiler.decoder.causal_lm import build_paged_decoder
    from precast.errors import ParityError

    right = gd.precast_paged_attention

    def without(*args, **kwargs):
        kwargs.pop("s_aux", None)
        kwargs.pop("sinks", None)
        return right(*args, **kwargs)

    monkeypatch.setattr(gd, "precast_paged_attention", without)
    with pytest.raises(ParityError, match="differ from the model's own forward"):
        build_paged_decoder(gpt_oss, "gpt_oss")


@pytest.mark.parametrize(
    "model_type,needle",
    [
        ("gpt_oss", "'gpt_oss' has attention sinks"),
        ("deepseek_v3", "'deepseek_v3' has multi-head latent attention"),
    ],
)
def test_openvino_refuses_what_its_paged_attention_cannot_hold_naming_it(model_type, needle, cli, tmp_path):
    folder = build_causal_lm(tmp_path / model_type, model_type, seed=3, **SERVED[model_type])
    res = cli("compile", folder, "-o", tmp_path / "ov", "--task", "causal-lm", "--target", "openvino", "-q")
    lines = res.err.strip().splitlines()
    assert res.code != 0 and len(lines) == 1, res.err
    assert needle in lines[0] and "ort-cpu serves it" in lines[0], lines[0]


def test_a_multi_target_compile_writes_ort_cpu_and_inspect_shows_why_openvino_is_not_there(cli, tmp_path):
    folder = build_causal_lm(tmp_path / "gpt_oss", "gpt_oss", seed=3, **GPT_OSS)
    out = tmp_path / "both"
    res = cli(
        "compile",
        folder,
        "-o",
        out,
        "--task",
        "causal-lm",
        "--target",
        "ort-cpu",
        "--target",
        "openvino",
        "-q",
    )
    assert res.code != 0 and "wrote the other target(s) ort-cpu" in res.err, res.err
    shown = cli("inspect", out)
    assert shown.code == 0
    assert "openvino: not built" in shown.out and "attention sinks" in shown.out, shown.out


@pytest.mark.slow
def test_mla_pool_holds_the_latent_not_expanded_k_and_v(cli, tmp_path):
    """DeepSeek's pool: one K head of kv_lora_rank + rope floats a token and layer, no V pool (the values are
    the latent), against 2 x heads x (nope + rope) floats expanded (V padded to K): 12x less here."""
    from precast.runtime.llm import Engine

    config = SERVED["deepseek_v2"]
    folder = build_causal_lm(tmp_path / "dsv2", "deepseek_v2", seed=3, **config)
    out = tmp_path / "art"
    assert cli("compile", folder, "-o", out, "--task", "causal-lm", "--target", "ort-cpu", "-q").code == 0
    eng = Engine.load(out, num_blocks=8)
    try:
        spec, runner = eng.runner.spec, eng.runner
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        assert (spec.kv_heads, spec.head_size, spec.value_head_size) == (1, latent, 0)
        per_token = runner.kv_bytes // (runner.num_blocks * spec.block_size)
        assert per_token == spec.layers * latent * 4
        heads = 4  # (the fixtures' num_attention_heads)
        expanded = spec.layers * 2 * heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) * 4
        assert expanded == 12 * per_token
    finally:
        eng.close()
