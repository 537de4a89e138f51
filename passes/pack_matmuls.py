"""Sibling MatMuls of one input -> one MatMul over the concatenated weights, then Split (a gated MLP's gate/up).

    MatMul(x, W1[K,N1]) ; MatMul(x, W2[K,N2])   ==>   Split(MatMul(x, concat(W1, W2)[K, N1+N2]), [N1, N2])

A SwiGLU MLP (Llama, Mistral, Qwen, Gemma, ...) projects one normalized activation twice, gate and up; the
attention fusion packs Q|K|V already (onnxscript's packed-QKV rules), nothing packs these two. At batch-1
decode each projection is a small GEMV whose cost is mostly the kernel's dispatch to the thread pool, so one
wider call is cheaper than two: measured on bench_llm.py's small256 decoder (hidden 256, INT4, 2 threads,
interleaved): 433 -> 422 us per decode step, a median of 4 pairs (benchmarks/README.md). The numbers are those
of the separate products: each output column is still one dot product over K; quantize-int4 later quantizes
each column by blocks along K (GPTQ: each column with the input's Hessian, which the siblings share), so the
packed MatMulNBits holds the same bytes as the two it replaces.

Only plain MatMuls with a constant rank-2 float weight of the same K and dtype pack; an activation of rank 1
(a vector times a matrix) and a weight that is also something else's input (a tied table) are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from precast.ir.registry import Pass, PassResult, option, register

__all__ = ["PackMatMuls"]

_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def _weight(node: ir.Node) -> ir.Value | None:
    """The constant rank-2 float weight of a plain MatMul that may pack (else None)."""
    if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
        return None
    a, w = node.inputs
    if a is None or w is None or w.const_value is None or w.is_graph_input() or w.is_graph_output():
        return None
    if len(w.const_value.shape) != 2 or w.const_value.dtype not in _FLOATS:
        return None
    if a.shape is not None and len(a.shape) < 2:
        return None  # (a vector: MatMul drops the axis, Split's axis would differ)
    if len(w.uses()) != 1 or node.outputs[0].is_graph_output():
        return None
    return w


@register("pack-matmuls")
class PackMatMuls(Pass):
    """MatMuls that share their input and have constant rank-2 weights of one K -> one MatMul + Split.

        MatMul(x, W1) ; MatMul(x, W2) ; ...   ==>   Split(MatMul(x, concat(W1, W2, ...)), [N1, N2, ...])

    Gated MLPs' gate and up projections (Q|K|V are packed by fuse-attention). Exact: every output column is
    the same dot product over K. ``max_n`` bounds the packed width (a huge output dimension gains nothing).
    """

    @dataclass(frozen=True)
    class Options:
        max_n: int = option(65536, "largest packed output dimension (sum of the siblings' N)")

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        groups: dict[ir.Value, list[ir.Node]] = {}
        for node in graph:
            if _weight(node) is not None:
                groups.setdefault(node.inputs[0], []).append(node)
        packed = replaced = 0
        for x, nodes in groups.items():
            by_k: dict[tuple, list[ir.Node]] = {}
            for node in nodes:
                w = node.inputs[1].const_value
                by_k.setdefault((w.shape[0], w.dtype), []).append(node)
            for siblings in by_k.values():
                if len(siblings) < 2:
                    continue
                widths = [n.inputs[1].const_value.shape[1] for n in siblings]
                if sum(widths) > self.options.max_n:
                    continue
                self._pack(graph, x, siblings, widths, packed)
                packed += 1
                replaced += len(siblings)
        return PassResult(model, packed > 0, {"packed": packed, "matmuls_replaced": replaced})

    @staticmethod
    def _pack(graph: ir.Graph, x: ir.Value, siblings: list[ir.Node], widths: list[int], k: int) -> None:
        first = siblings[0]
        name = f"{first.name or 'matmul'}/packed{k}"
        weights = np.concatenate([n.inputs[1].const_value.numpy() for n in siblings], axis=1)
        w = ir.Value(
            name=f"{name}/weight",
            shape=ir.Shape(weights.shape),
            type=ir.TensorType(first.inputs[1].const_value.dtype),
            const_value=ir.tensor(weights, name=f"{name}/weight"),
        )
        graph.register_initializer(w)
        split_sizes = ir.Value(
            name=f"{name}/split",
            shape=ir.Shape([len(widths)]),
            type=ir.TensorType(ir.DataType.INT64),
            const_value=ir.tensor(np.array(widths, dtype=np.int64), name=f"{name}/split"),
        )
        graph.register_initializer(split_sizes)
        mm = ir.Node("", "MatMul", [x, w], name=name, num_outputs=1)
        out = mm.outputs[0]
        out.name = f"{name}/out"
        out.type = first.outputs[0].type
        if first.outputs[0].shape is not None:
            dims = list(first.outputs[0].shape)
            out.shape = ir.Shape([*dims[:-1], int(sum(widths))])
        split = ir.Node(
            "",
            "Split",
            [out, split_sizes],
            attributes=[ir.AttrInt64("axis", -1)],
            name=f"{name}/split",
            num_outputs=len(siblings),
        )
        graph.insert_before(first, [mm, split])
        for node, piece in zip(siblings, split.outputs):
            old = node.outputs[0]
            piece.name, piece.type, piece.shape = f"{old.name}/part", old.type, old.shape
            old.replace_all_uses_with(piece)
            olds = node.inputs[1]
            graph.remove(node, safe=True)
            if not olds.uses() and olds.name in graph.initializers:
                graph.initializers.pop(olds.name)
