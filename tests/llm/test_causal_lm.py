"""causal-lm compile: the paged step graph's greedy tokens equal Hugging Face generate(), through ModelRunner."""

from __future__ import annotations

import json

import numpy as np
import pytest

from precast.errors import InputError, ModelLoadError
from precast.runtime.llm import ModelRunner
from precast.runtime.llm.runners.factory import runner_on
from tests.helpers import run_with_imports_blocked

PROMPTS = ["def wrap(text, width=70):", "import os\nclass Formatter:\n    def __init__(self, fill):", "x"]
NEW_TOKENS = 36


class TrivialAllocator:
    """Hands out blocks from a shuffled free list; no sharing, no freeing (enough for a test)."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))

    def grow(self, table: list[int], tokens: int, block_size: int) -> None:
        while len(table) * block_size < tokens:
            table.append(int(self.free.pop()))


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, chunk: int = 7) -> list[list[int]]:
    """All requests together: chunked prefill (``chunk`` tokens a step), then batched decode."""
    spec, alloc = runner.spec, TrivialAllocator(runner.num_blocks)
    tables: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]  # tokens not yet in the cache
    done = [0] * len(prompts)  # tokens in the cache
    out: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in out):
        live = [i for i, o in enumerate(out) if len(o) < new_tokens]
        take = [pending[i][:chunk] for i in live]
        s = max(len(t) for t in take)
        ids = np.full((len(live), s), spec.pad_id, dtype=np.int64)
        pos = np.zeros((len(live), s), dtype=np.int64)
        for r, (i, t) in enumerate(zip(live, take)):
            ids[r, : len(t)] = t
            pos[r, : len(t)] = np.arange(done[i], done[i] + len(t))
            alloc.grow(tables[i], done[i] + len(t), spec.block_size)
        maxb = max(len(tables[i]) for i in live)
        bt = np.zeros((len(live), maxb), dtype=np.int64)
        for r, i in enumerate(live):
            bt[r, : len(tables[i])] = tables[i]
        logits = runner.step(ids, pos, [done[i] for i in live], [len(t) for t in take], bt)
        for r, (i, t) in enumerate(zip(live, take)):
            done[i] += len(t)
            pending[i] = pending[i][len(t) :]
            if not pending[i]:  # the prompt is in: this logit row predicts the next token
                tok = int(np.argmax(logits[r]))
                out[i].append(tok)
                pending[i] = [tok]
    return out


def hf_greedy(folder, prompt: list[int], new_tokens: int, argmax_eos: bool = False) -> list[int]:
    """HF generate()'s greedy tokens, EOS suppressed until ``new_tokens``; ``argmax_eos``: the argmax every
    step, EOS included (what precast gives with ignore_eos)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    if argmax_eos:
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=None if argmax_eos else new_tokens,
            pad_token_id=0,
        )
    return ids[0, len(prompt) :].tolist()


def compile_llm(folder, out):
    from precast.compiler.driver import CompileOptions, compile_model

    return compile_model(str(folder), out, CompileOptions(targets=("ort-cpu",), task="causal-lm"))


@pytest.fixture(scope="module")
def llama_artifact(compiled, tiny_llama_dir):
    return compiled(tiny_llama_dir, targets=("ort-cpu",), task="causal-lm")


@pytest.fixture(scope="module")
def gpt2_artifact(compiled, tiny_gpt2_dir):
    return compiled(tiny_gpt2_dir, targets=("ort-cpu",), task="causal-lm")


def _encode(result, texts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(result.output / "tokenizer" / "tokenizer.json"))
    return [tok.encode(t).ids for t in texts]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_greedy_matches_hf_generate(which, request):
    result = request.getfixturevalue(f"{which}_artifact")
    folder = request.getfixturevalue(f"tiny_{which}_dir")
    prompts = _encode(result, PROMPTS)
    runner = ModelRunner.from_artifact(result.output, num_blocks=64)
    ours = greedy(runner, prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        # min_new_tokens in HF only masks EOS; our loop never stops early, so check EOS never won.
        expected = hf_greedy(folder, prompt, NEW_TOKENS)
        assert got == expected, f"prompt {prompt[:5]}...: {got} != {expected}"
    # Batching and chunking do not change results: each request alone, prefilled in one step.
    alone = greedy(
        ModelRunner.from_artifact(result.output, num_blocks=64), [prompts[1]], NEW_TOKENS, chunk=1000
    )
    assert alone[0] == ours[1]


@pytest.mark.slow
def test_manifest_llm_block_and_tokenizer(llama_artifact, tiny_llama_dir):
    m = json.loads((llama_artifact.output / "manifest.json").read_text())
    llm = m["llm"]
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert (llm["architecture"], llm["layers"], llm["heads"], llm["kv_heads"], llm["head_size"]) == (
        "llama",
        config["num_hidden_layers"],
        4,
        2,
        16,
    )
    # Head size 16 takes GroupQueryAttention: the mapped layout, blocks of whole 4 KiB pages (64 x 16 x 4 B).
    assert llm["kv_layout"] == "mapped" and llm["kv_inputs"][1] == ["past_key.1", "past_value.1"]
    assert llm["kv_outputs"][0] == ["present_key.0", "present_value.0"] and llm["block_size"] == 64
    assert llm["eos_ids"] == [config["eos_token_id"]] and llm["bos_id"] == config["bos_token_id"]
    assert "llm" not in m["source"] and m["parity"]["ok"]
    assert (llama_artifact.output / llm["tokenizer"]).is_file() and llm["tokenizer"] in m["extra_files"]
    names = [i["name"] for i in m["io"]["inputs"]]
    # GroupQueryAttention's own lengths are inputs: no graph nodes derive them
    assert names[:6] == [
        "input_ids",
        "positions",
        "seqlens_k",
        "total_sequence_length",
        "last_index",
        "past_key.0",
    ]
    # Verified on a batched decode step (pasts 20, 3, 37), the presents over each row's valid length.
    assert set(m["parity"]["outputs"]) >= {"logits", "present_key.0", "present_value.1"}
    assert m["parity"]["kv_valid"]["lengths"] == ["seqlens_k"] and m["parity"]["kv_valid"]["offset"] == 1


@pytest.mark.slow
def test_gpt2_keeps_the_gather_layout(gpt2_artifact):
    llm = json.loads((gpt2_artifact.output / "manifest.json").read_text())["llm"]
    assert llm["kv_layout"] == "paged" and llm["kv_inputs"][0] == ["key_cache.0", "value_cache.0"]


@pytest.mark.slow
def test_from_artifact_takes_its_options_by_position_as_before(llama_artifact):
    """ModelRunner.from_artifact(path, num_blocks, threads, verify, spinning): positional, as the release before
    the runner factory took them; an unknown option is still refused."""
    runner = ModelRunner.from_artifact(llama_artifact.output, 4, 1, True, False)
    assert runner.num_blocks == 4 and runner.spin_switch is None
    with pytest.raises(TypeError):
        ModelRunner.from_artifact(llama_artifact.output, 4, threads=1, sping=False)


@pytest.mark.slow
def test_runner_rejects_bad_steps(llama_artifact):
    runner = ModelRunner.from_artifact(llama_artifact.output, num_blocks=4)
    ok = {
        "input_ids": [[5, 6]],
        "positions": [[0, 1]],
        "past_lens": [0],
        "new_lens": [2],
        "block_tables": [[1]],
    }
    runner.step(**ok)
    for bad, needle in [
        ({"new_lens": [3]}, "new_lens"),
        ({"input_ids": [[5, 9999]]}, "token ids"),
        ({"block_tables": [[7]]}, "block_tables"),
        ({"past_lens": [63]}, "blocks in its table"),
        ({"past_lens": [1000], "block_tables": [[0] * 70]}, "max context"),
    ]:
        with pytest.raises(InputError, match=needle):
            runner.step(**{**ok, **bad})


@pytest.mark.slow
def test_runner_decode_fast_path_writes_the_same_slots(gpt2_artifact):
    """Gather layout: the batch-1 decode fast path (one slot, basic indexing) writes what the general scatter writes."""
    fast = ModelRunner.from_artifact(gpt2_artifact.output, num_blocks=6)
    slow = ModelRunner.from_artifact(gpt2_artifact.output, num_blocks=6)
    slow.key_cache[0] = slow.key_cache[0].copy()  # a replaced pool array: the layer-by-layer path
    prompt = {"input_ids": [list(range(3, 20))], "positions": [list(range(17))], "past_lens": [0]}
    for r in (fast, slow):
        r.step(**prompt, new_lens=[17], block_tables=[[4, 1]])
    for pos in (17, 18):  # block 1 offsets 1 and 2
        step = {"input_ids": [[7]], "positions": [[pos]], "past_lens": [pos], "new_lens": [1]}
        a = fast.step(**step, block_tables=[[4, 1]])
        b = slow.step(**step, block_tables=[[4, 1]])
        np.testing.assert_array_equal(a, b)
    for i in range(fast.spec.layers):
        np.testing.assert_array_equal(fast.key_cache[i], slow.key_cache[i])
        np.testing.assert_array_equal(fast.value_cache[i], slow.value_cache[i])
    assert np.abs(fast.key_cache[1][1, :, 2]).sum() > 0 and not fast.key_cache[1][1, :, 3].any()


def test_unknown_architecture_names_supported(tmp_path):
    from precast.compiler.frontends.source import load_source

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MyLM"]}))  # no model_type
    with pytest.raises(ModelLoadError, match=r"'\?'.*llama, mistral, qwen2, gpt2"):
        load_source(str(tmp_path), task="causal-lm")


def test_model_runner_imports_without_torch():
    r = run_with_imports_blocked(
        """
        from precast.runtime.llm import ModelRunner, LLMSpec
        assert 'precast.compiler' not in sys.modules
        """,
        blocked=("torch", "onnx_ir", "onnxscript", "transformers"),
    )
    assert r.returncode == 0, r.stderr


class _TorchSession:
    """The torch paged decoder behind ModelRunner's session interface (no export: fast)."""

    def __init__(self, module, layers: int):
        from precast.compiler.decoder.causal_lm import step_reference

        self.run_all = step_reference(module, layers)

    def run(self, names, feeds):
        out = self.run_all(feeds)
        return [out[n] for n in names]


@pytest.mark.parametrize("model_type,head_dim,layout", [("qwen2", 24, "paged"), ("mistral", 16, "mapped")])
def test_llama_family_paged_math_matches_hf(model_type, head_dim, layout, tmp_path):
    """Qwen2 (QKV biases) and Mistral through the decoders: greedy == HF generate(). A head size that
    GroupQueryAttention cannot take (24) compiles to the in-graph gather layout."""
    from precast.compiler.decoder.causal_lm import build_paged_decoder, llm_block
    from precast.runtime.llm import LLMSpec
    from tests.llm.fixtures import build_llama

    folder = build_llama(
        tmp_path / model_type, seed=1, model_type=model_type, num_hidden_layers=1, head_dim=head_dim
    )
    config = json.loads((folder / "config.json").read_text())
    _, module = build_paged_decoder(folder, model_type)
    spec = LLMSpec.from_json(llm_block(folder, config, module))
    assert spec.kv_layout == layout
    runner = runner_on(_TorchSession(module, spec.layers), spec, num_blocks=32)  # (by its layout)
    prompts = [[5, 9, 33, 7, 100, 41, 2, 8, 19, 300], [77, 3]]
    ours = greedy(runner, prompts, 32, chunk=4)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(folder, prompt, 32)


@pytest.mark.slow
def test_kv_layout_option_forces_the_gather_layout_and_rejects_misfits(
    tiny_llama_dir, tiny_gpt2_dir, llama_artifact, cli, tmp_path
):
    """--kv-layout paged on a Llama: the in-graph gather layout (any host), same greedy tokens as mapped."""
    out = tmp_path / "paged"
    res = cli(
        "compile", str(tiny_llama_dir), "--task", "causal-lm", "--kv-layout", "paged", "-o", str(out), "-q"
    )
    assert res.code == 0, res.err
    llm = json.loads((out / "manifest.json").read_text())["llm"]
    assert llm["kv_layout"] == "paged" and llm["kv_inputs"][0] == ["key_cache.0", "value_cache.0"]
    prompt = [[5, 9, 33, 7, 100, 41]]
    paged = greedy(ModelRunner.from_artifact(out, num_blocks=16), prompt, 12)
    assert paged == greedy(ModelRunner.from_artifact(llama_artifact.output, num_blocks=16), prompt, 12)
    bad = cli(
        "compile",
        str(tiny_gpt2_dir),
        "--task",
        "causal-lm",
        "--kv-layout",
        "mapped",
        "-o",
        str(tmp_path / "x"),
    )
    assert bad.code == 1 and "GPT-2 takes 'paged'" in bad.err and "Traceback" not in bad.err
    bad = cli("compile", str(tiny_llama_dir), "--kv-layout", "paged", "-o", str(tmp_path / "y"))
    assert bad.code == 1 and "--task causal-lm only" in bad.err
