"""Tiny graphs in the shapes real exporters produce, and one checker for fusion passes."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from tests.helpers import make_model, op_types, ort_run

F = TensorProto.FLOAT
D = 16  # feature size


def _c(name: str, value) -> helper.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, F, [], [float(value)]))


def layernorm(pow_exp: float = 2.0, shared: bool = False, bias: bool = True, seed: int = 0):
    """x -> ReduceMean -> Sub -> Pow -> ReduceMean -> Add(eps) -> Sqrt -> Div -> Mul(g) -> Add(b)  (PyTorch export)."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        _c("p", pow_exp),
        helper.make_node("Pow", ["d", "p"], ["d2"]),
        helper.make_node("ReduceMean", ["d2", "axes"], ["v"], keepdims=1),
        _c("eps", 1e-5),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Div", ["d", "s"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["y0" if bias else "y"]),
    ]
    if bias:
        nodes.append(helper.make_node("Add", ["y0", "b"], ["y"]))
    outputs = [("y", F, ["batch", "seq", D])] + ([("d", F, ["batch", "seq", D])] if shared else [])
    inits = {
        "axes": np.array([-1], np.int64),
        "g": rng.standard_normal(D).astype(np.float32),
        "b": rng.standard_normal(D).astype(np.float32),
    }
    return make_model(nodes, [("x", F, ["batch", "seq", D])], outputs, inits)


def rmsnorm(pow_exp: float = 2.0, shared: bool = False, scale_shape=(D,)):
    """x * Reciprocal(Sqrt(ReduceMean(x^2) + eps)) * w   (Llama export)."""
    nodes = [
        _c("p", pow_exp),
        helper.make_node("Pow", ["x", "p"], ["x2"]),
        helper.make_node("ReduceMean", ["x2", "axes"], ["ms"], keepdims=1),
        _c("eps", 1e-6),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["r"]),
        helper.make_node("Reciprocal", ["r"], ["ir"]),
        helper.make_node("Mul", ["x", "ir"], ["n"]),
        helper.make_node("Mul", ["w", "n"], ["y"]),
    ]
    outputs = [("y", F, ["batch", "seq", D])] + ([("ms", F, ["batch", "seq", 1])] if shared else [])
    inits = {
        "axes": np.array([-1], np.int64),
        "w": np.random.default_rng(1).standard_normal(scale_shape).astype(np.float32),
    }
    return make_model(nodes, [("x", F, ["batch", "seq", D])], outputs, inits)


def gelu(kind: str = "erf", bias: bool = True, const: float | None = None, shared: bool = False):
    """[Add(bias)] -> erf GELU (x/sqrt2 -> Erf -> +1 -> *x -> *0.5) or tanh GELU."""
    x = "xb" if bias else "x"
    nodes = [helper.make_node("Add", ["x", "b"], ["xb"])] if bias else []
    if kind == "erf":
        nodes += [
            _c("k", const or math.sqrt(2.0)),
            helper.make_node("Div", [x, "k"], ["t"]),
            helper.make_node("Erf", ["t"], ["e"]),
            _c("one", 1.0),
            helper.make_node("Add", ["e", "one"], ["e1"]),
            helper.make_node("Mul", [x, "e1"], ["xe"]),
            _c("half", 0.5),
            helper.make_node("Mul", ["xe", "half"], ["y"]),
        ]
        inner = "e"
    else:
        nodes += [
            _c("three", 3.0),
            helper.make_node("Pow", [x, "three"], ["x3"]),
            _c("k1", const or 0.044715),
            helper.make_node("Mul", ["k1", "x3"], ["x3k"]),
            helper.make_node("Add", [x, "x3k"], ["u"]),
            _c("k2", math.sqrt(2 / math.pi)),
            helper.make_node("Mul", ["k2", "u"], ["u2"]),
            helper.make_node("Tanh", ["u2"], ["t"]),
            _c("one", 1.0),
            helper.make_node("Add", ["t", "one"], ["t1"]),
            _c("half", 0.5),
            helper.make_node("Mul", ["half", "t1"], ["h"]),
            helper.make_node("Mul", [x, "h"], ["y"]),
        ]
        inner = "t"
    outputs = [("y", F, ["batch", "seq", D])] + ([(inner, F, ["batch", "seq", D])] if shared else [])
    inits = {"b": np.random.default_rng(2).standard_normal(D).astype(np.float32)} if bias else {}
    return make_model(nodes, [("x", F, ["batch", "seq", D])], outputs, inits)


def skip_layernorm(rank: int = 3, bias: bool = True, shared: bool = False):
    """Add(x, skip) [-> Add(bias)] -> LayerNormalization(g, b)   (BERT residual)."""
    shape = ["batch", "seq", D] if rank == 3 else ["batch", D]
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Add", ["x", "skip"], ["s0"])]
    if bias:
        nodes.append(helper.make_node("Add", ["s0", "bias"], ["s"]))
    ln_in = "s" if bias else "s0"
    nodes.append(helper.make_node("LayerNormalization", [ln_in, "g", "b"], ["y"], axis=-1, epsilon=1e-5))
    outputs = [("y", F, shape)] + ([(ln_in, F, shape)] if shared else [])
    inits = {k: rng.standard_normal(D).astype(np.float32) for k in ("g", "b", "bias")}
    return make_model(nodes, [("x", F, shape), ("skip", F, shape)], outputs, inits)


def matmul_add(rank: int = 2, bias_shape=(D,)):
    shape = ["batch", 8] if rank == 2 else ["batch", "seq", 8]
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    inits = {
        "w": rng.standard_normal((8, D)).astype(np.float32),
        "b": rng.standard_normal(bias_shape).astype(np.float32),
    }
    out_shape = None
    return make_model(nodes, [("x", F, shape)], [("y", F, out_shape)], inits)


def feeds_for(model, batch: int = 3, seq: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for v in model.graph.inputs:
        shape = [
            batch if d == "batch" else seq if d == "seq" else d
            for d in (str(d) if not isinstance(d, int) else d for d in v.shape)
        ]
        out[v.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def check_fusion(
    pass_cls,
    model,
    n: int,
    new_ops: list[str],
    key: str = "fused",
    options: dict | None = None,
    batches=(3, 1),
):
    """Fuses n times, introduces new_ops, keeps ORT's numbers at each batch size, and is idempotent."""
    feeds = [feeds_for(model, batch=b, seed=b) for b in batches]
    expected = [ort_run(model, f) for f in feeds]
    result = pass_cls(**(options or {}))(model.clone())
    assert result.stats[key] == n, result.stats
    ops = op_types(result.model)
    for op in new_ops:
        assert op in ops, ops
    for f, e in zip(feeds, expected):
        got = ort_run(result.model, f)
        for g, x in zip(got, e):
            np.testing.assert_allclose(g, x, rtol=1e-4, atol=1e-5)
    again = pass_cls(**(options or {}))(result.model)
    assert again.stats[key] == 0 and op_types(again.model) == ops
    return result.model
