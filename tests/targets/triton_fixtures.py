"""Artifacts for the triton target's tests, built once per session (the tiny Llama export takes ~25 s)."""

from __future__ import annotations

from pathlib import Path

from precast.compiler.driver import CompileOptions, compile_model
from tests.helpers import save, tiny_mlp

__all__ = ["llama_triton", "mlp_triton", "staged_mlp_triton"]

_BUILT: dict[str, Path] = {}


def mlp_triton(tmp_path_factory, **options: str) -> Path:
    key = "mlp:" + ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    if key not in _BUILT:
        d = tmp_path_factory.mktemp("triton-mlp")
        src = save(tiny_mlp(), d / "mlp.onnx")
        opts = {"model_name": "mlp", **options}
        compile_model(str(src), d / "art", CompileOptions(targets=("triton",), target_options=opts))
        _BUILT[key] = d / "art"
    return _BUILT[key]


def staged_mlp_triton(tmp_path_factory, **options: str) -> Path:
    """tiny_mlp compiled with the triton target's default pipeline + ``split-stages{n=2}``: an ensemble of two
    stage models (``mlp_staged`` by default), the same source as ``mlp_triton``'s."""
    from precast.targets.triton import Triton

    key = "staged-mlp:" + ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    if key not in _BUILT:
        d = tmp_path_factory.mktemp("triton-staged-mlp")
        src = save(tiny_mlp(), d / "mlp.onnx")
        opts = CompileOptions(
            targets=("triton",),
            passes=Triton.default_pipeline + ",split-stages{n=2}",
            target_options={"model_name": "mlp_staged", **options},
        )
        compile_model(str(src), d / "art", opts)
        _BUILT[key] = d / "art"
    return _BUILT[key]


def llama_triton(tmp_path_factory) -> Path:
    """A tiny Llama (seeded random weights, local BPE tokenizer) compiled with --task causal-lm -t triton."""
    if "llama" not in _BUILT:
        from tests.llm.fixtures import build_llama

        d = tmp_path_factory.mktemp("triton-llama")
        folder = build_llama(d / "tiny-llama")
        opts = CompileOptions(targets=("triton",), task="causal-lm", target_options={"model_name": "llama"})
        compile_model(str(folder), d / "art", opts)
        _BUILT["llama"] = d / "art"
    return _BUILT["llama"]
