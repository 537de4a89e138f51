"""The decoders bench_llm.py times, and each engine's build of them (one folder per model under --work).

    bench      bench_llm_step.py's Llama: hidden 512, 8 layers, 8 / 4 heads, vocab 32000 (~160 MB fp32)
    small256   hidden 256, 4 layers, 4 / 2 heads (head 64), intermediate 704, vocab 32000
    small384   hidden 384, 6 layers, 6 / 2 heads (head 64), intermediate 1024, vocab 32000

    dsv2       DeepSeek-V2's shape scaled down (issue 41): multi-head latent attention (latent 128 + rope 32
               per token; K heads 96 = 64 nope + 32 rope, V heads 64; queries through a rank-192 LoRA), 8
               layers of hidden 512, the first dense, the rest MoE: 16 routed experts (4 a token) + 2 shared,
               vocab 32000 (~110M parameters). (DeepSeek-V2-Lite has no query LoRA, and llama.cpp loads a
               DeepSeek-V2 without one only at Lite's 26 or 27 layers: this keeps the LoRA instead.)
    mamba130m  Mamba-130m's shape (issue 41): 24 Mamba layers of hidden 768 (inner 1536, state 16, conv 4,
               dt rank 48), tied embeddings, vocab 50280 (~130M parameters)

Llama-style ones: tied embeddings, seeded random weights at HF's default init (0.02); dsv2: the tests'
build_causal_lm (N(0, 0.1), so the router spreads tokens over its experts); mamba130m too. The 512-token BPE tokenizer of
tests/llm/fixtures.py (the bench feeds token ids 5..500, which that tokenizer has).
Builds run once and are cached by their output file: precast (this interpreter), onnxruntime-genai's builder
(--genai-python), optimum-cli's OpenVINO export (--ov-python), llama.cpp's HF converter (--llamacpp-python).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_BASE = {
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
MODELS: dict[str, dict] = {
    "bench": {
        **_BASE,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "small256": {
        **_BASE,
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small384": {
        **_BASE,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
    },
    "dsv2": {
        "model_type": "deepseek_v2",
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 192,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "moe_intermediate_size": 352,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
    },
    "mamba130m": {
        "model_type": "mamba",
        "vocab_size": 50280,
        "max_position_embeddings": 2048,  # (Mamba has no position limit: the engine's context)
        "hidden_size": 768,
        "num_hidden_layers": 24,
        "state_size": 16,
        "expand": 2,
        "intermediate_size": 1536,  # (expand x hidden: set, or the fixtures' tiny default would win)
        "conv_kernel": 4,
        "time_step_rank": 48,
        "tie_word_embeddings": True,
    },
}
# INT4 on every engine: block (group) 32, every linear layer; precast and genai with accuracy level 4.
OV_INT4 = ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"]

__all__ = [
    "MODELS",
    "describe",
    "model_dir",
    "build_folder",
    "build_precast",
    "build_genai",
    "build_ov",
    "build_gguf",
]


def describe(name: str) -> str:
    c = MODELS[name]
    if c.get("model_type") == "mamba":
        return (
            f"{name}: Mamba, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, state "
            f"{c['state_size']}, expand {c['expand']}, vocab {c['vocab_size']}"
        )
    return (
        f"{name}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}"
    )


def model_dir(work: Path, name: str) -> Path:
    """Where a model's builds live: the bench model keeps bench_llm.py's old layout (work itself)."""
    return work if name == "bench" else work / name


def build_folder(work: Path, name: str) -> Path:
    folder = model_dir(work, name) / ("llama-512" if name == "bench" else "hf")
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.llm.fixtures import build_causal_lm, build_llama

        print(f"building the model folder {folder}", flush=True)
        config = dict(MODELS[name])
        model_type = config.pop("model_type", None)
        if model_type is None:
            build_llama(folder, **config)
        else:
            build_causal_lm(folder, model_type, seed=0, **config)
    return folder


# precast builds: (target, passes, accuracy budget, target options). INT4 on OpenVINO: NNCF group 32, every
# linear layer (optimum-intel's export below keeps the same), with the u8 KV cache OpenVINO GenAI uses by default.
PRECAST_BUILDS = {
    # Random weights make INT4 error large (logits cosine ~0.98 vs fp32): its compiles use cosine>=0.95.
    "fp32": ("ort-cpu", "default", None, {}),
    "int4": ("ort-cpu", "default,quantize-int4{accuracy_level=4}", "cosine>=0.95", {}),
    "ov-fp32": ("openvino", None, None, {}),
    # OpenVINO GenAI's defaults on optimum's fp32 export: bf16 compute where the CPU has it (the hint falls
    # back to f32 where it has not) and an f16 KV cache (optimum-intel writes KV_CACHE_PRECISION=f16 into that
    # IR's runtime_options; its INT4 IR has none: the CPU default u8); held to the default budget.
    "ov-bf16": ("openvino", None, None, {"inference_precision": "bf16", "kv_cache_precision": "f16"}),
    "ov-int4": (
        "openvino",
        None,
        "cosine>=0.95",
        {"weights": "int4", "group_size": "32", "kv_cache_precision": "u8", "inference_precision": "bf16"},
    ),
}


# mamba130m's 24 layers of N(0, 0.1) weights grow logits to where float32 reordering (the RMSNorm fusion)
# moves near-zero ones by ~5e-4, past the default atol 1e-4 while cosine stays 1.000000: its parity atol
MODEL_ATOL = {"mamba130m": 2e-3}


def build_precast(work: Path, name: str, prec: str) -> Path | str:
    """The artifact's path, or why there is none (one line)."""
    from precast.compiler.driver import CompileOptions, compile_model

    target, passes, budget, options = PRECAST_BUILDS[prec]
    path = model_dir(work, name) / f"precast-{prec}"
    if not (path / "manifest.json").is_file():
        print(f"compiling precast {name} {prec} ({target} {passes or ''} {options or ''})", flush=True)
        try:
            opts = CompileOptions(
                targets=(target,),
                task="causal-lm",
                passes=passes,
                accuracy_budget=budget,
                target_options=options,
                atol=MODEL_ATOL.get(name),
            )
            compile_model(str(build_folder(work, name)), path, opts)
        except Exception as e:  # noqa: BLE001 - report and go on with the other rows
            return f"compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return path


def _run(cmd: list[str], what: str) -> str | None:
    print(f"building {what}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"{what} failed (exit {p.returncode}: {tail[0][:200]})"
    return None


def build_genai(work: Path, name: str, prec: str, python: str) -> Path | str:
    path = model_dir(work, name) / f"genai-{prec}"
    if not (path / "genai_config.json").is_file():
        cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(build_folder(work, name))]
        err = _run([*cmd, "-o", str(path), "-p", prec, "-e", "cpu"], f"genai {name} {prec}")
        if err:
            return err
    return path


def build_ov(work: Path, name: str, prec: str, python: str) -> Path | str:
    """optimum-intel's export (what OpenVINO GenAI loads): fp32 weights, or INT4 through NNCF (data-free)."""
    path = model_dir(work, name) / f"ov-{prec}"
    if not (path / "openvino_model.xml").is_file():
        cli = str(Path(python).parent / "optimum-cli")
        fmt = OV_INT4 if prec == "int4" else ["--weight-format", "fp32"]
        cmd = [
            cli,
            "export",
            "openvino",
            "--model",
            str(build_folder(work, name)),
            "--task",
            "text-generation-with-past",
        ]
        err = _run([*cmd, *fmt, str(path)], f"OpenVINO {name} {prec}")
        if err:
            return err
    return path


def build_gguf(work: Path, name: str, prec: str, python: str) -> Path | str:
    """llama.cpp's converter to an f32 GGUF, then its quantizer to Q4_0 (bench_llm_llamacpp.py, in python)."""
    path = model_dir(work, name) / f"llamacpp-{prec}.gguf"
    if not path.is_file():
        here = Path(__file__).resolve().parent / "bench_llm_llamacpp.py"
        err = _run(
            [python, str(here), "convert", str(build_folder(work, name)), str(path), prec],
            f"GGUF {name} {prec}",
        )
        if err:
            return err
    return path
