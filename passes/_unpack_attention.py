"""Packed com.microsoft Attention -> three projection MatMuls + MultiHeadAttention, before INT8 quantization.

ONNX Runtime's quantizer skips an Attention node that has ``qkv_hidden_sizes`` or an ``attention_bias``
input (QAttention has neither), which is what precast's fuse-attention emits: the Q/K/V projections, a
quarter of a BERT layer's MatMul work, then stay fp32. Unpacked, they are plain MatMuls with constant
weights, which quantize_dynamic turns into MatMulInteger (ORT fuses those into MatMulIntegerToFloat).
On all-MiniLM-L6-v2 this is the difference between ~1.3x and ~1.5x over the fp32 artifact at batch 8
(benchmarks/bench_quant.py); QAttention with a mask_index was slower than this on the same CPU.

    Attention(x, W[D,3H], b[3H], mask_index?, attention_bias?)
        ==>  MatMul(x, Wq), MatMul(x, Wk), MatMul(x, Wv) -> MultiHeadAttention(q, k, v, b, mask, bias)

Only the plain encoder form is rewritten: constant weights, no past/present, not unidirectional, no
rotary, equal Q/K/V sizes, mask_index of rank 2 or 3 (what MultiHeadAttention's key_padding_mask takes).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["unpack_attention"]

_MS = "com.microsoft"
_KEEP_ATTRS = ("num_heads", "scale", "mask_filter_value")
_ALLOWED_ATTRS = {*_KEEP_ATTRS, "qkv_hidden_sizes", "unidirectional", "do_rotary"}


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


def _unpackable(node: ir.Node) -> bool:
    if node.domain != _MS or node.op_type != "Attention":
        return False
    attrs = node.attributes
    if set(attrs) - _ALLOWED_ATTRS or attrs.get_int("unidirectional", 0) or attrs.get_int("do_rotary", 0):
        return False
    w, b = _input(node, 1), _input(node, 2)
    if w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return False
    hidden3 = w.const_value.shape[1]
    if hidden3 % 3 or (b is not None and (b.const_value is None or tuple(b.const_value.shape) != (hidden3,))):
        return False
    sizes = attrs.get_ints("qkv_hidden_sizes", None)
    if sizes is not None and (len(sizes) != 3 or len(set(sizes)) != 1 or 3 * sizes[0] != hidden3):
        return False
    if _input(node, 4) is not None or _input(node, 6) is not None:  # past / past_sequence_length
        return False
    if len(node.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return False
    mask = _input(node, 3)
    return mask is None or (mask.shape is not None and mask.shape.rank() in (2, 3))


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    while name in graph.initializers:
        name += "_"
    tensor = ir.tensor(np.ascontiguousarray(array), name=name)
    value = ir.Value(
        name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def unpack_attention(model: ir.Model, skip: set[str] | frozenset[str] = frozenset()) -> int:
    """Rewrite every unpackable top-level Attention node (not named in ``skip``) in place; returns the count."""
    graph = model.graph
    done = 0
    for node in list(graph):
        if node.name in skip or not _unpackable(node):
            continue
        x, w_val, b_val = node.inputs[0], node.inputs[1], _input(node, 2)
        w = w_val.const_value.numpy()
        hidden = w.shape[1] // 3
        base = node.name or f"attention_{done}"
        projections = []
        for i, part in enumerate("qkv"):
            weight = _const(graph, f"{base}/{part}_weight", w[:, i * hidden : (i + 1) * hidden])
            projections.append(ir.Node("", "MatMul", [x, weight], name=f"{base}/{part}_proj"))
        attrs = [a for k, a in node.attributes.items() if k in _KEEP_ATTRS]
        mha_inputs = [p.outputs[0] for p in projections] + [b_val, _input(node, 3), _input(node, 5)]
        while mha_inputs and mha_inputs[-1] is None:
            mha_inputs.pop()
        mha = ir.Node(_MS, "MultiHeadAttention", mha_inputs, attrs, name=f"{base}/mha")
        mha.outputs[0].shape, mha.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
        ir.convenience.replace_nodes_and_values(
            graph, node, [node], [*projections, mha], [node.outputs[0]], [mha.outputs[0]]
        )
        if not w_val.uses() and not w_val.is_graph_output() and w_val.name in graph.initializers:
            graph.initializers.pop(w_val.name)
        done += 1
    return done
