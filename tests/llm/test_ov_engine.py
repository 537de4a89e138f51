"""The OpenVINO backend of the LLM engine: ``--target openvino --task causal-lm`` (PagedAttention step graph,
compiler/decoder/ov_decoder.py) run by OVStepRunner over the engine's own block pool, prefix cache and scheduler.

Tiny Llama (weights N(0, 0.1)): greedy == HF generate alone, 8 mixed-length requests batched, with prefix
reuse + copy on write and with preemption; the KV precisions' top-1 agreement with the f32 pool."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("openvino")

from precast.compiler.driver import CompileOptions, compile_model  # noqa: E402
from tests.llm.test_causal_lm import hf_greedy  # noqa: E402

NEW_TOKENS = 32
PROMPT_LENS = (5, 40, 70, 33, 12, 64, 100, 3)  # one to four 32-token blocks, mixed prefill and decode


def _compile(folder, out, **target_options):
    opts = CompileOptions(targets=("openvino",), task="causal-lm", target_options=target_options)
    return compile_model(str(folder), out, opts).output


@pytest.fixture(scope="module")
def ov_llama(compiled, tiny_llama_dir):
    return compiled(tiny_llama_dir, targets=("openvino",), task="causal-lm").output


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in PROMPT_LENS]


def _greedy():
    from precast.runtime.llm.sampler import SamplingParams

    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)


def _engine(path, num_blocks: int = 32):
    from precast.runtime.llm import Engine

    return Engine.load(path, num_blocks=num_blocks, threads=2)


def test_manifest_is_the_paged_attention_contract(ov_llama):
    m = json.loads((ov_llama / "manifest.json").read_text())
    llm = m["llm"]
    assert (llm["kv_layout"], llm["block_size"], llm["kv_outputs"]) == ("ov-paged", 32, [])
    assert llm["kv_inputs"] == [["key_cache.0", "value_cache.0"], ["key_cache.1", "value_cache.1"]]
    assert m["target"]["backend"] == "openvino" and m["target"]["config"]["KV_CACHE_PRECISION"] == "f32"
    assert [t["name"] for t in m["io"]["inputs"][:3]] == ["input_ids", "positions", "past_lens"]
    xml = (ov_llama / "model.xml").read_text()
    assert xml.count('type="PagedAttentionExtension"') == 2  # one per layer
    # The logits leave the lm head's MatMul through views only: no Gather copying [B, V] every step
    # (OpenVINO runs one as a reference kernel: 0.8 ms of a 21 ms 32-request step on the bench model).
    import openvino as ov

    core = ov.Core()
    core.get_property("CPU", "FULL_DEVICE_NAME")  # (the plugin registers PagedAttentionExtension)
    model = core.read_model(str(ov_llama / "model.xml"))
    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() in ("Squeeze", "Reshape", "Convert"):
        node = node.input_value(0).get_node()
    assert node.get_type_name() == "MatMul", node.get_type_name()
    # verified at compile on the sample step: logits and every new K/V row vs the torch reference
    outs = m["parity"]["outputs"]
    assert m["parity"]["ok"] and outs["logits"]["max_abs"] < 1e-4
    assert all(r["max_abs"] < 1e-4 for n, r in outs.items() if n.startswith("present_"))


def test_greedy_alone_matches_hf(ov_llama, tiny_llama_dir):
    prompt = _prompts()[2]
    eng = _engine(ov_llama)
    try:
        assert type(eng.runner).__name__ == "OVStepRunner"
        got = eng.generate([prompt], _greedy())[0].token_ids
    finally:
        eng.close()
    assert got == hf_greedy(tiny_llama_dir, prompt, NEW_TOKENS)


def test_eight_mixed_requests_batched_match_hf(ov_llama, tiny_llama_dir):
    prompts = _prompts(1)
    eng = _engine(ov_llama)
    try:
        done = eng.generate(prompts, _greedy())
        assert eng.counters.preemptions == 0
        steps = eng.counters.steps
    finally:
        eng.close()
    assert steps < 2 * NEW_TOKENS  # all eight in one batch: ~one step per token, not per request
    for prompt, c in zip(prompts, done):
        assert c.token_ids == hf_greedy(tiny_llama_dir, prompt, NEW_TOKENS), len(prompt)


def test_prefix_reuse_and_copy_on_write(ov_llama, tiny_llama_dir):
    prompt = _prompts(2)[5]  # 64 tokens: exactly two blocks, so the second request hits both
    assert len(prompt) == 64
    eng = _engine(ov_llama)
    try:
        h1 = eng.submit(prompt, _greedy())
        eng.step()
        h2 = eng.submit(prompt, _greedy())
        eng.step()
        t1, t2 = eng.kv.block_table(h1.request_id), eng.kv.block_table(h2.request_id)
        assert t1[0] == t2[0] and t1[1] != t2[1]  # first block shared, last one copied before the write
        assert eng.metrics().cow_copies == 1
        eng.run_until_done()
        assert h2.result().num_cached_prompt_tokens == 63
    finally:
        eng.close()
    want = hf_greedy(tiny_llama_dir, prompt, NEW_TOKENS)
    assert h1.result().token_ids == h2.result().token_ids == want


def test_preemption_resumes_token_identical(ov_llama, tiny_llama_dir):
    prompts = _prompts(3)
    eng = _engine(ov_llama, num_blocks=6)  # 6 x 32 tokens for eight requests of up to 132: preempts
    try:
        done = eng.generate(prompts, _greedy())
        assert eng.counters.preemptions > 0
    finally:
        eng.close()
    for prompt, c in zip(prompts, done):
        assert c.token_ids == hf_greedy(tiny_llama_dir, prompt, NEW_TOKENS), len(prompt)


def _teacher_forced_argmax(path, ids: list[int]) -> np.ndarray:
    """Next-token argmax at every position of ``ids``, prefilled in two chunks (the second reads the
    first's K/V back from the pool in the artifact's KV precision)."""
    from precast.runtime.llm.runners.openvino import OVStepRunner, step_feeds

    runner = OVStepRunner.from_artifact(path, num_blocks=8, threads=2)
    cut, table = len(ids) // 2, list(range(8))
    out = []
    for a, e in ((0, cut), (cut, len(ids))):
        feeds = step_feeds([ids[a:e]], [a], [table], runner.spec.block_size)
        feeds["logits_indices"] = np.arange(e - a, dtype=np.int64)  # every position's logits
        out.append(runner.run_step(feeds).argmax(-1))
    return np.concatenate(out)


@pytest.mark.parametrize(("kv", "min_top1"), [("f16", 0.99), ("u8", 0.95)])
def test_kv_precision_top1_agreement_with_f32(kv, min_top1, ov_llama, tiny_llama_dir, tmp_path):
    """KV_CACHE_PRECISION f16 / u8 (OpenVINO's per-block scales) vs the f32 pool, teacher-forced over 200
    tokens: measured here 1.0 (f16) and ~0.99 (u8) on this random-weight model."""
    art = _compile(tiny_llama_dir, tmp_path / kv, kv_cache_precision=kv)
    cfg = json.loads((art / "manifest.json").read_text())["target"]["config"]
    assert cfg["KV_CACHE_PRECISION"] == kv
    ids = np.random.default_rng(4).integers(0, 512, 200).tolist()
    ref, got = _teacher_forced_argmax(ov_llama, ids), _teacher_forced_argmax(art, ids)
    top1 = float(np.mean(ref == got))
    assert top1 >= min_top1, f"kv={kv}: top-1 agreement {top1:.3f} < {min_top1}"
    if kv == "u8":  # the u8 pool is a quarter of f32's (plus its scales)
        from precast.runtime.llm.runners.openvino import OVStepRunner

        sizes = [OVStepRunner.from_artifact(p, num_blocks=8).kv_bytes for p in (ov_llama, art)]
        assert sizes[1] < 0.5 * sizes[0]


def test_bf16_compute_is_budget_held_and_agrees_top1(ov_llama, tiny_llama_dir, tmp_path):
    """inference_precision=bf16 (OpenVINO GenAI's default compute where the CPU has it) + u8 KV: verified
    against the budget (cosine>=0.99; PagedAttention then needs a bf16 pool, past K/V rounded into it), the
    manifest says bf16, ``precast verify`` passes, and teacher-forced top-1 vs the f32 artifact is >= 0.95
    over 200 tokens (measured 0.975 on an AMX host). On a CPU without bf16 the hint falls back to f32."""
    from precast.runtime.verify import verify_artifact

    art = _compile(tiny_llama_dir, tmp_path / "bf16", inference_precision="bf16", kv_cache_precision="u8")
    m = json.loads((art / "manifest.json").read_text())
    assert m["target"]["precision"] == "bf16"
    assert m["target"]["config"]["INFERENCE_PRECISION_HINT"] == "bf16"
    assert m["parity"]["budget"]["budget"] == "cosine>=0.99" and m["parity"]["budget"]["ok"]
    assert m["parity"]["tolerance"]["atol"] is None  # not fp32's elementwise bound
    assert verify_artifact(str(art))["ok"]
    ids = np.random.default_rng(5).integers(0, 512, 200).tolist()
    top1 = float(np.mean(_teacher_forced_argmax(ov_llama, ids) == _teacher_forced_argmax(art, ids)))
    from precast.errors import UsageError

    with pytest.raises(UsageError, match="inference_precision=bf16 needs kv_cache_precision=u8 or f16"):
        _compile(tiny_llama_dir, tmp_path / "bf16-f32kv", inference_precision="bf16")
    print(f"bf16 top-1 {top1:.3f}")
    assert top1 >= 0.95, f"bf16 top-1 agreement {top1:.3f}"


def test_precast_verify_reruns_the_stored_step_and_runtime_needs_no_torch(ov_llama, tiny_llama_dir):
    """``precast verify`` re-runs the stored ort-cpu-contract feeds through the IR; the engine runs with the
    compiler's dependencies blocked (numpy + openvino only)."""
    from tests.helpers import run_with_imports_blocked

    prompt = _prompts()[0]
    r = run_with_imports_blocked(
        f"""
        from precast.runtime.llm import Engine
        from precast.runtime.llm.sampler import SamplingParams
        from precast.runtime.verify import verify_artifact
        assert verify_artifact({str(ov_llama)!r})["ok"]
        eng = Engine.load({str(ov_llama)!r}, num_blocks=8)
        out = eng.generate([{prompt!r}], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))
        bad = [k for k in sys.modules if k.split(".")[0] in ("torch", "onnx_ir", "onnxscript", "onnx")]
        assert not bad, bad
        print("TOKENS", out[0].token_ids)
        """
    )
    assert f"TOKENS {hf_greedy(tiny_llama_dir, prompt, 8)}" in r.stdout, r.stderr


@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3",  # q/k norms before the rotary
        "gpt_neox",  # partial rotary, fused qkv, parallel residual
        "qwen2_moe",  # experts (4, top-2) + a shared expert: the dense experts' batched MatMul on OpenVINO
    ],
)
def test_other_families_batched_match_hf(model_type, tmp_path):
    """The step graph is the family's own forward (tokens on the batch axis, one per row): three mixed-length
    requests batched == HF greedy. The MoE prompts' tokens are routed to every expert (checked in HF)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.llm.fixtures import build_causal_lm

    folder = build_causal_lm(tmp_path / model_type, model_type)
    prompts = _prompts(2)[:3]
    if model_type == "qwen2_moe":
        hf = AutoModelForCausalLM.from_pretrained(folder)
        picked = set()
        gate = hf.model.layers[0].mlp.gate
        hook = gate.register_forward_hook(lambda m, a, out: picked.update(out[-1].flatten().tolist()))
        with torch.no_grad():
            hf(torch.tensor([sum(prompts, [])]))
        hook.remove()
        assert picked == set(range(4)), picked
    art = _compile(folder, tmp_path / "ov")
    eng = _engine(art)
    try:
        done = eng.generate(prompts, dataclasses.replace(_greedy(), max_tokens=16))
    finally:
        eng.close()
    for prompt, c in zip(prompts, done):
        assert c.token_ids == hf_greedy(folder, prompt, 16), (model_type, len(prompt))


@pytest.mark.slow
def test_int4_weights_within_text_budget(tmp_path):
    """weights=int4 (NNCF, symmetric, group 32) on the tiny LM trained on the shipped text: held to a top-1
    budget on the calibration text against the fp32 graph (measured 0.97, ppl +0.2 of 54), not to fp32
    tolerances; the IR holds 4-bit weights."""
    pytest.importorskip("nncf")
    from tests.llm.trained_lm import texts, trained_lm_dir

    train, _ = texts()
    opts = CompileOptions(
        targets=("openvino",),
        task="causal-lm",
        target_options={"weights": "int4", "group_size": "32"},
        calibration_text=train[:40_000],
        accuracy_budget="top1>=0.9,ppl_delta<=1",
    )
    art = compile_model(str(trained_lm_dir()), tmp_path / "int4", opts).output
    m = json.loads((art / "manifest.json").read_text())
    text = m["parity"]["budget"]["metrics"]["logits@text"]
    assert m["target"]["precision"] == "int4" and m["parity"]["budget"]["ok"]
    assert text["top1"] >= 0.9 and text["ppl_delta"] <= 1
    assert (
        'element_type="i4"' in (art / "model.xml").read_text()
        or 'element_type="u4"' in (art / "model.xml").read_text()
    )


def test_multi_target_compile_ranks_backends_by_measured_speed(tiny_llama_dir, tmp_path, capsys):
    """ort-cpu + openvino in one compile: each target's serving speed is measured on this host after it
    verifies, the index's fallback_order puts the faster first, Engine.load opens it, prefer overrides."""
    from precast.compiler.decoder.llm_speed import speed_score
    from precast.runtime.llm import Engine
    from precast.runtime.llm.engine import llm_index_target

    opts = CompileOptions(targets=("ort-cpu", "openvino"), task="causal-lm")
    out = compile_model(str(tiny_llama_dir), tmp_path / "multi", opts).output
    index = json.loads((out / "manifest.json").read_text())
    speeds = {
        n: json.loads((out / n / "manifest.json").read_text())["parity"]["speed"]
        for n in ("ort-cpu", "openvino")
    }
    assert all(
        s["decode_b1_tok_s"] > 0 and s["batch8_tok_s"] > 0 and s["batch32_tok_s"] > 0 for s in speeds.values()
    )
    order = index["fallback_order"]
    assert sorted(order) == ["openvino", "ort-cpu"]
    assert speed_score(speeds[order[0]]) >= speed_score(speeds[order[1]])
    runner_of = {"openvino": "OVStepRunner", "ort-cpu": "MappedModelRunner"}
    assert llm_index_target(out) == out / order[0]
    prompt = _prompts()[1]
    want = hf_greedy(tiny_llama_dir, prompt, 8)
    for prefer in (None, order[1]):
        eng = Engine.load(out, num_blocks=16, prefer=prefer)
        try:
            assert type(eng.runner).__name__ == runner_of[prefer or order[0]]
            params = dataclasses.replace(_greedy(), max_tokens=8)
            assert eng.generate([prompt], params)[0].token_ids == want
        finally:
            eng.close()
    _loaders_rank_by_the_rate_at_their_load(out, runner_of, capsys)


def _loaders_rank_by_the_rate_at_their_load(out, runner_of, capsys):
    """Figures where ONNX Runtime leads alone and OpenVINO at 32 requests (as measured on the benchmark Llama,
    issue 43): generate (1 request) opens ort-cpu, serve's --max-num-seqs 64 and Engine.load(concurrency=32)
    open openvino, prefer overrides; figures that are not numbers leave the index's own order."""
    from precast.cli.main import main
    from precast.runtime.llm import Engine, SchedulerConfig
    from precast.runtime.llm.engine import llm_index_target
    from precast.runtime.llm.speculative import SpeculativeConfig
    from tests.helpers import edit_manifest

    capsys.readouterr()
    with pytest.raises(
        SystemExit
    ) as exited:  # precast generate: one request, the target measured fastest alone
        main(["generate", str(out), "hello", "--max-tokens", "2", "--json"])
    assert exited.value.code in (0, None)
    assert json.loads(capsys.readouterr().out)["target"] == llm_index_target(out, concurrency=1).name
    assert all(s["verify8_b1_tok_s"] > 0 for s in (_speed(out, n) for n in runner_of))
    # (and an 8-token verify row rate where OpenVINO leads: what a speculating engine alone ranks by too)
    figures = {
        "ort-cpu": {"decode_b1_tok_s": 100.0, "batch8_tok_s": 300.0, "batch32_tok_s": 400.0}
        | {"verify8_b1_tok_s": 200.0},
        "openvino": {"decode_b1_tok_s": 60.0, "batch8_tok_s": 250.0, "batch32_tok_s": 900.0}
        | {"verify8_b1_tok_s": 600.0},
    }
    for name, speed in figures.items():
        edit_manifest(out / name, lambda m, speed=speed: m["parity"].update(speed=speed))
    cases = [
        ({"concurrency": 1}, "ort-cpu"),
        ({"concurrency": 8}, "ort-cpu"),
        ({"concurrency": 32}, "openvino"),
        ({"config": SchedulerConfig(max_num_seqs=64)}, "openvino"),
        ({"concurrency": 32, "prefer": "ort-cpu"}, "ort-cpu"),
        ({"concurrency": 1, "speculative": SpeculativeConfig(method="ngram")}, "openvino"),
        ({"concurrency": 8, "speculative": SpeculativeConfig(method="ngram")}, "ort-cpu"),
    ]
    for kwargs, want in cases:
        eng = Engine.load(out, num_blocks=16, verify=False, **kwargs)
        try:
            assert type(eng.runner).__name__ == runner_of[want], kwargs
        finally:
            eng.close()
    assert llm_index_target(out, concurrency=1) == out / "ort-cpu"
    assert llm_index_target(out, concurrency=64) == out / "openvino"
    assert llm_index_target(out, concurrency=1, speculative=True) == out / "openvino"
    # a target without the verify figure (an older compile): all rank by their decode rate, one unit for all
    older = dict(figures["ort-cpu"])
    del older["verify8_b1_tok_s"]
    edit_manifest(out / "ort-cpu", lambda m: m["parity"].update(speed=older))
    assert llm_index_target(out, concurrency=1, speculative=True) == out / "ort-cpu"
    edit_manifest(out / "ort-cpu", lambda m: m["parity"].update(speed=figures["ort-cpu"]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["inspect", str(out)])
    assert exited.value.code in (0, None)
    shown = capsys.readouterr().out
    assert "at 1 request: ort-cpu" in shown and "at 32 requests: openvino" in shown, shown
    assert "at 1 request, speculating (--draft, --speculative): openvino" in shown, shown
    assert "1 in 8-token verify rows: 600" in shown, shown
    from precast.runtime.bench import BenchOptions, bench

    # precast bench on the index: the LLM engine over the target picked for its highest concurrency
    opts = BenchOptions(
        concurrency=(1, 32),
        duration_s=None,
        requests=2,
        warmup_s=0,
        prompt_len=8,
        output_len=4,
        num_blocks=16,
    )
    report = bench(out, opts)
    assert report.target == "openvino" and [lv.errors for lv in report.levels] == [0, 0], report
    order = json.loads((out / "manifest.json").read_text())["fallback_order"]
    edit_manifest(out / "openvino", lambda m: m["parity"].update(speed={"batch32_tok_s": "fast"}))
    assert llm_index_target(out, concurrency=64) == out / order[0]  # (not numbers: the index's order)


def _speed(out, name: str) -> dict:
    return json.loads((out / name / "manifest.json").read_text())["parity"]["speed"]
