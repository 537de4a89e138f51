"""Shared test helpers: run models with ONNX Runtime, list op types, build tiny models."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

__all__ = ["ort_run", "op_types", "make_model", "to_ir", "save", "tiny_mlp", "run_with_imports_blocked"]


def to_ir(model) -> ir.Model:
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return ir.serde.deserialize_model(model)
    return ir.load(str(model))


def ort_run(model, feeds: Mapping[str, np.ndarray], level: str = "disable") -> list[np.ndarray]:
    """Run with ONNX Runtime (optimizations off by default, so the graph runs as written)."""
    import onnxruntime as ort

    if isinstance(model, ir.Model):
        data = ir.serde.serialize_model(model).SerializeToString()
    elif isinstance(model, onnx.ModelProto):
        data = model.SerializeToString()
    else:
        data = str(model)
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


def op_types(model) -> list[str]:
    m = to_ir(model)
    return [n.op_type for n in m.graph]


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[tuple[str, int, list]],
    outputs: Sequence[tuple[str, int, list | None]],
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = 18,
    extra_opsets: Mapping[str, int] | None = None,
) -> ir.Model:
    """Build an ir.Model from onnx.helper nodes; inputs/outputs are (name, TensorProto dtype, shape)."""
    graph = helper.make_graph(
        list(nodes),
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset)] + [
        helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()
    ]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="precast-tests")
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


def save(model: ir.Model, path: Path) -> Path:
    ir.save(model, path)
    return path


def tiny_mlp(seed: int = 0, hidden: int = 16) -> ir.Model:
    """x[batch,8] -> MatMul -> Add -> Relu -> MatMul -> y[batch,4], with a foldable Constant chain."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("Identity", ["h2"], ["h3"], name="ident"),
        helper.make_node(
            "Constant", [], ["two"], name="c2", value=numpy_helper.from_array(np.array(2.0, np.float32))
        ),
        helper.make_node("Mul", ["w2", "two"], ["w2x2"], name="fold_me"),
        helper.make_node("MatMul", ["h3", "w2x2"], ["y"], name="mm2"),
    ]
    inits = {
        "w1": rng.standard_normal((8, hidden)).astype(np.float32),
        "b1": rng.standard_normal(hidden).astype(np.float32),
        "w2": rng.standard_normal((hidden, 4)).astype(np.float32),
    }
    return make_model(
        nodes, [("x", TensorProto.FLOAT, ["batch", 8])], [("y", TensorProto.FLOAT, ["batch", 4])], inits
    )


COMPILER_MODULES = (
    "torch",
    "onnx_ir",
    "onnxscript",
    "onnx",
    "transformers",
    "precast.ir",
    "precast.compiler",
    "precast.passes",
    "precast.targets",
)


def one_line_error(r, code: int, *needles: str) -> str:
    """A CLI result (code, out, err) that failed with ``code`` and exactly one 'error: ...' line on stderr
    naming each of ``needles``, and no traceback; returns that line."""
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == code, (r.code, r.out, r.err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.err, r.err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def run_with_imports_blocked(body: str, blocked: Sequence[str] = COMPILER_MODULES, timeout: int = 120):
    """Run ``body`` in a fresh interpreter where importing any of ``blocked`` (or a submodule) fails.

    The runtime's dependency rule: what runs in production must never import the compiler's stack.
    """
    prelude = textwrap.dedent(
        f"""
        import sys
        class _Block:
            BLOCKED = {tuple(blocked)!r}
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in self.BLOCKED):
                    raise ImportError("blocked for the test: " + name)
                return None
        sys.meta_path.insert(0, _Block())
        """
    )
    code = prelude + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )


def edit_manifest(root: Path, change) -> Path:
    """``change(manifest)`` applied to ``root``'s manifest.json, written back as is (no hashes redone)."""
    import json

    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def tiny_llm_block(**changes) -> dict:
    """A complete, valid manifest ``llm`` block (one layer, paged KV), for tests that edit manifests."""
    block = {
        "architecture": "llama",
        "model_type": "llama",
        "layers": 1,
        "heads": 1,
        "kv_heads": 1,
        "head_size": 16,
        "hidden": 16,
        "vocab": 512,
        "max_context": 64,
        "block_size": 16,
        "kv_layout": "paged",
        "kv_inputs": [["k", "v"]],
        "kv_outputs": [["k_out", "v_out"]],
        "bos_id": None,
        "eos_ids": [2],
        "pad_id": 0,
        "tokenizer": "tokenizer/tokenizer.json",
        "batched_prefill": True,
    }
    return {**block, **changes}


def randomize_weights_(model):
    """Test weights N(0, 0.1) everywhere, norm weights around 1 (the default init leaves biases at 0 and
    attention near uniform, so a broken mask would barely move the outputs). In place; returns the model."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            torch.nn.init.normal_(p, 0, 0.1)
            if "norm" in name.lower() and name.endswith("weight"):
                p.add_(1.0)
    return model
