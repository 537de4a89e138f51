"""Artifacts for the triton target's tests, built once per session (the tiny Llama export takes ~25 s)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from precast.artifact.manifest import dump_json, sha256_file
from precast.compiler.driver import CompileOptions, compile_model
from tests.helpers import make_model, save, tiny_mlp

__all__ = [
    "llama_triton",
    "masked_stack",
    "mlp_triton",
    "staged_llama_triton",
    "staged_masked_triton",
    "staged_mlp_triton",
]

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


def masked_stack(layers: int = 3, width: int = 8, seed: int = 0):
    """x[batch,w] float, m[batch,w] int64 -> mask = Cast(m); h = Relu(h @ W_i + b_i) * mask per layer -> y.

    Every layer reads the mask stage 0 computes: split in 3, stage 1 passes it through to stage 2.
    Weights N(0, 0.1), initializers named ``layers.<i>.*`` (the layer boundaries split-stages finds)."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Cast", ["m"], ["mask"], to=TensorProto.FLOAT, name="cast_mask")]
    inits, h = {}, "x"
    for i in range(layers):
        w, b, out = f"layers.{i}.weight", f"layers.{i}.bias", "y" if i == layers - 1 else f"h{i + 1}"
        inits[w] = rng.normal(0, 0.1, (width, width)).astype(np.float32)
        inits[b] = rng.normal(0, 0.1, width).astype(np.float32)
        nodes += [
            helper.make_node("MatMul", [h, w], [f"mm{i}"], name=f"layers.{i}.mm"),
            helper.make_node("Add", [f"mm{i}", b], [f"add{i}"], name=f"layers.{i}.add"),
            helper.make_node("Relu", [f"add{i}"], [f"relu{i}"], name=f"layers.{i}.relu"),
            helper.make_node("Mul", [f"relu{i}", "mask"], [out], name=f"layers.{i}.mul"),
        ]
        h = out
    ins = [("x", TensorProto.FLOAT, ["batch", width]), ("m", TensorProto.INT64, ["batch", width])]
    return make_model(nodes, ins, [("y", TensorProto.FLOAT, ["batch", width])], inits)


def staged_masked_triton(tmp_path_factory, **options: str) -> Path:
    """masked_stack() split in 3 (``split-stages{n=3}``): an ensemble ``masked`` of three stage models."""
    from precast.targets.triton import Triton

    key = "staged-masked:" + ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    if key not in _BUILT:
        d = tmp_path_factory.mktemp("triton-staged-masked")
        src = save(masked_stack(), d / "masked.onnx")
        opts = CompileOptions(
            targets=("triton",),
            passes=Triton.default_pipeline + ",split-stages{n=3}",
            target_options={"model_name": "masked", **options},
        )
        compile_model(str(src), d / "art", opts)
        _BUILT[key] = d / "art"
    return _BUILT[key]


def llama_triton(tmp_path_factory, staged: bool = False) -> Path:
    """A tiny Llama (seeded random weights, local BPE tokenizer) compiled with --task causal-lm -t triton
    (``staged``: with ``default,split-stages{n=2}``, model ``llama_staged``)."""
    key = "llama-staged" if staged else "llama"
    if key not in _BUILT:
        from tests.llm.fixtures import build_llama

        d = tmp_path_factory.mktemp("triton-" + key)
        folder = build_llama(d / "tiny-llama")
        opts = CompileOptions(
            targets=("triton",),
            task="causal-lm",
            passes="default,split-stages{n=2}" if staged else None,
            target_options={"model_name": key.replace("-", "_")},
        )
        compile_model(str(folder), d / "art", opts)
        _BUILT[key] = d / "art"
    return _BUILT[key]


def staged_llama_triton(tmp_path_factory) -> Path:
    return llama_triton(tmp_path_factory, staged=True)


def with_model_py(art: Path, dest: Path, name: str, source: Path) -> Path:
    """``art`` copied to ``dest`` with ``name``'s model.py replaced by ``source`` (the manifest re-hashed)."""
    if not dest.exists():
        shutil.copytree(art, dest)
    rel = f"model_repository/{name}/1/model.py"
    shutil.copyfile(source, dest / rel)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["files"][rel] = sha256_file(dest / rel)
    dump_json(manifest, dest / "manifest.json")
    return dest

