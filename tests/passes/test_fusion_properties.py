"""Property: the ort-cpu default pipeline keeps the numbers of random small transformer-ish graphs."""

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from precast.ir.pipeline import PassManager, parse_pipeline
from precast.targets.ort_cpu import OrtCpu
from tests.helpers import make_model, ort_run

D = 8
PIECES = [
    "add",
    "mul",
    "relu",
    "matmul",
    "matmul_bias",
    "layernorm",
    "ln_op",
    "gelu_erf",
    "gelu_tanh",
    "residual_ln",
]


def _build(pieces: list[str], seed: int):
    rng = np.random.default_rng(seed)
    nodes, inits = [], {}
    cur = "x"

    def const(name, value):
        inits[name] = np.asarray(value, np.float32)
        return name

    for k, piece in enumerate(pieces):
        p = f"p{k}_"
        out = f"{p}out"
        vec = lambda n: const(p + n, rng.standard_normal(D))  # noqa: E731, B023 (called inside this iteration only)
        if piece == "add":
            nodes.append(helper.make_node("Add", [cur, vec("b")], [out]))
        elif piece == "mul":
            nodes.append(helper.make_node("Mul", [cur, vec("s")], [out]))
        elif piece == "relu":
            nodes.append(helper.make_node("Relu", [cur], [out]))
        elif piece in ("matmul", "matmul_bias"):
            w = const(p + "w", rng.standard_normal((D, D)) / math.sqrt(D))
            nodes.append(helper.make_node("MatMul", [cur, w], [out if piece == "matmul" else p + "mm"]))
            if piece == "matmul_bias":
                nodes.append(helper.make_node("Add", [p + "mm", vec("b")], [out]))
        elif piece in ("layernorm", "residual_ln"):
            src = cur
            if piece == "residual_ln":
                nodes.append(helper.make_node("Add", [cur, "x"], [p + "res"]))
                src = p + "res"
            axes = p + "axes"
            inits[axes] = np.array([-1], np.int64)
            nodes += [
                helper.make_node("ReduceMean", [src, axes], [p + "m"], keepdims=1),
                helper.make_node("Sub", [src, p + "m"], [p + "d"]),
                helper.make_node("Mul", [p + "d", p + "d"], [p + "d2"]),
                helper.make_node("ReduceMean", [p + "d2", axes], [p + "v"], keepdims=1),
                helper.make_node("Add", [p + "v", const(p + "eps", 1e-5)], [p + "ve"]),
                helper.make_node("Sqrt", [p + "ve"], [p + "sd"]),
                helper.make_node("Div", [p + "d", p + "sd"], [p + "n"]),
                helper.make_node("Mul", [p + "n", vec("g")], [p + "ng"]),
                helper.make_node("Add", [p + "ng", vec("b")], [out]),
            ]
        elif piece == "ln_op":
            nodes.append(helper.make_node("LayerNormalization", [cur, vec("g"), vec("b")], [out], axis=-1))
        elif piece == "gelu_erf":
            nodes += [
                helper.make_node("Div", [cur, const(p + "k", math.sqrt(2))], [p + "t"]),
                helper.make_node("Erf", [p + "t"], [p + "e"]),
                helper.make_node("Add", [p + "e", const(p + "one", 1.0)], [p + "e1"]),
                helper.make_node("Mul", [cur, p + "e1"], [p + "xe"]),
                helper.make_node("Mul", [p + "xe", const(p + "h", 0.5)], [out]),
            ]
        else:  # gelu_tanh, as onnx Gelu(approximate=tanh)
            nodes.append(helper.make_node("Gelu", [cur], [out], approximate="tanh"))
        cur = out
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    F = TensorProto.FLOAT
    return make_model(
        nodes, [("x", F, ["batch", "seq", D])], [("y", F, ["batch", "seq", D])], inits, opset=20
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=6), st.integers(0, 1000), st.integers(1, 3))
def test_default_pipeline_keeps_numbers(pieces, seed, batch):
    model = _build(pieces, seed)
    feeds = {"x": np.random.default_rng(seed).standard_normal((batch, 5, D)).astype(np.float32)}
    expected = ort_run(model, feeds)[0]
    optimized = PassManager(parse_pipeline(OrtCpu.default_pipeline)).run(model)
    np.testing.assert_allclose(ort_run(optimized, feeds)[0], expected, rtol=1e-4, atol=1e-4)
