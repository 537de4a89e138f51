"""Layer stacks for the split-stages tests, and a runner that chains stage models through ONNX Runtime."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import TensorProto, helper

from tests.helpers import make_model, ort_run

F = TensorProto.FLOAT


def residual_stack(
    layers: int = 6, hidden: int = 16, named: bool = True, skip: bool = False, tied: bool = False
):
    """x -> layers x (h + Relu(h @ W_i + b_i)) -> y, weights N(0, 0.1).

    ``named``: initializers ``layers.<i>.w`` (as an HF export names them), else ``w<i>``. ``skip``: a scale
    ``s = ReduceMean(h_0)`` computed after layer 0 is read again by the last layer (it must pass through the
    stages between). ``tied``: the last layer multiplies by ``tied.w`` too, which layer 0 also reads (one
    initializer in two stages).
    """
    rng = np.random.default_rng(0)
    nodes, inits = [], {}
    if tied:
        inits["tied.w"] = (rng.standard_normal((hidden, hidden)) * 0.1).astype(np.float32)
    h = "x"
    for i in range(layers):
        w, b = (f"layers.{i}.w", f"layers.{i}.b") if named else (f"w{i}", f"b{i}")
        inits[w] = (rng.standard_normal((hidden, hidden)) * 0.1).astype(np.float32)
        inits[b] = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
        src = h
        if tied and i in (0, layers - 1):
            nodes.append(helper.make_node("MatMul", [h, "tied.w"], [f"tw{i}"], name=f"tw{i}"))
            src = f"tw{i}"
        nodes += [
            helper.make_node("MatMul", [src, w], [f"mm{i}"], name=f"mm{i}"),
            helper.make_node("Add", [f"mm{i}", b], [f"ab{i}"], name=f"ab{i}"),
            helper.make_node("Relu", [f"ab{i}"], [f"r{i}"], name=f"r{i}"),
        ]
        out = f"r{i}"
        if skip and i == layers - 1:
            nodes.append(helper.make_node("Mul", [out, "s"], [f"rs{i}"], name="scale"))
            out = f"rs{i}"
        nodes.append(helper.make_node("Add", [h, out], [f"h{i}"], name=f"res{i}"))
        h = f"h{i}"
        if skip and i == 0:
            nodes.append(helper.make_node("ReduceMean", [h], ["s"], name="mean", keepdims=1))
    nodes.append(helper.make_node("Identity", [h], ["y"], name="out"))
    return make_model(nodes, [("x", F, ["batch", hidden])], [("y", F, ["batch", hidden])], inits)


def heavy_first_layer(layers: int = 6, hidden: int = 64, extra: int = 6):
    """Layers of equal weight bytes (h + Tanh(h @ W_i)), but layer 0 also does weightless work: ``extra``
    outer products of its activation, each reduced back (most of the model's time, none of its bytes)."""
    rng = np.random.default_rng(0)
    inits = {
        "ax_last": np.array([-1], np.int64),
        "ax_prev": np.array([-2], np.int64),
        "ax_red": np.array([2], np.int64),
    }
    nodes, h = [], "x"
    for i in range(layers):
        w = f"layers.{i}.w"
        inits[w] = (rng.standard_normal((hidden, hidden)) * 0.1).astype(np.float32)
        nodes += [
            helper.make_node("MatMul", [h, w], [f"mm{i}"]),
            helper.make_node("Tanh", [f"mm{i}"], [f"t{i}"]),
        ]
        cur = f"t{i}"
        for j in range(extra if i == 0 else 0):
            nodes += [
                helper.make_node("Unsqueeze", [cur, "ax_last"], [f"u{j}"]),
                helper.make_node("Unsqueeze", [cur, "ax_prev"], [f"v{j}"]),
                helper.make_node("Mul", [f"u{j}", f"v{j}"], [f"o{j}"]),
                helper.make_node("ReduceMean", [f"o{j}", "ax_red"], [f"q{j}"], keepdims=0),
            ]
            cur = f"q{j}"
        nodes.append(helper.make_node("Add", [h, cur], [f"h{i}"]))
        h = f"h{i}"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    return make_model(nodes, [("x", F, ["batch", hidden])], [("y", F, ["batch", hidden])], inits)


def run_chain(stages, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run Stage objects in order with ONNX Runtime, each fed exactly its listed inputs; every tensor any
    stage wrote, by name."""
    env = dict(feeds)
    for stage in stages:
        results = ort_run(stage.model, {name: env[name] for name in stage.inputs})
        env.update(zip(stage.outputs, results))
    return env
