"""4-bit embedding tables for quantize-int4: Gather -> GatherBlockQuantized (com.microsoft).

    untied:  Gather(W[V,E] fp32, ids)                       ==>  GatherBlockQuantized(W_q4, ids, scales)
    tied:    Gather(Transpose(Wt[E,V]), ids), MatMul(h, Wt)  ==>  MatMulNBits(h, Wt_q, scales)
                                                                 GatherBlockQuantized(Reshape(Wt_q [V, E/2]), ids,
                                                                                      Reshape(scales [V, E/block]))

Row v of the lm head's MatMulNBits weight holds vocab row v blocked along E, exactly the layout
GatherBlockQuantized reads (uint8, two levels a byte, quantize_axis=1), so a tied model stores its table
once, in 4 bits (onnxruntime-genai's shared-embedding layout). Untied tables, and tied ones whose head was
kept fp32, are quantized by ONNX Runtime's own Gather quantizer (round-to-nearest; GPTQ has no Hessian for a
lookup). Only 2-D float32 tables of at least ``min_elements`` are taken: small Gathers (shapes, indices,
little position tables) stay as they are.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["TiedTable", "find_tables", "quantize_tables"]


@dataclass(frozen=True)
class TiedTable:
    """A Gather reading Transpose(wt) where wt [E, V] is also the weight of the MatMul producing ``head_output``."""

    gather: str  # Gather node name
    transpose_output: str
    weight: str  # wt, the [E, V] initializer
    head_output: str  # the lm head MatMul's output name


def _float_2d(t: onnx.TensorProto | None, min_elements: int) -> bool:
    return (
        t is not None
        and t.data_type == onnx.TensorProto.FLOAT
        and len(t.dims) == 2
        and t.dims[0] * t.dims[1] >= min_elements
    )


def _gather_axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def find_tables(
    proto: onnx.ModelProto, min_elements: int, exclude: Collection[str] = ()
) -> tuple[list[str], list[TiedTable]]:
    """Names of Gathers on large [V, E] float initializers, and the tied Gather(Transpose(lm head weight)) pairs."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    head_of = {
        n.input[1]: n.output[0]
        for n in g.node
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.input) == 2 and n.input[1] in inits
    }
    untied, tied = [], []
    for node in g.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or _gather_axis(node) != 0:
            continue
        if node.name in exclude or not node.name:
            continue
        data = node.input[0]
        if _float_2d(inits.get(data), min_elements):
            untied.append(node.name)
            continue
        tr = producers.get(data)
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        perm = [list(a.ints) for a in tr.attribute if a.name == "perm"]
        if perm not in ([], [[1, 0]]) or not _float_2d(inits[tr.input[0]], min_elements):
            continue
        tied.append(TiedTable(node.name, data, tr.input[0], head_of.get(tr.input[0], "")))
    return untied, tied


def _used(graph: onnx.GraphProto) -> set[str]:
    """Every name a node reads, subgraphs included (a Loop body may read an outer initializer)."""
    names = {o.name for o in graph.output}
    for n in graph.node:
        names.update(n.input)
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                names |= _used(sub)
    return names


def _drop_unused(proto: onnx.ModelProto, tied: list[TiedTable], tables: set[str]) -> None:
    """Remove the tied Transposes nobody reads any more, then those of ``tables`` nobody reads."""
    g = proto.graph
    used = _used(g)
    for t in tied:
        tr = [n for n in g.node if n.op_type == "Transpose" and t.transpose_output in n.output]
        if tr and t.transpose_output not in used:
            g.node.remove(tr[0])
    used = _used(g)
    keep = [t for t in g.initializer if t.name in used or t.name not in tables]
    del g.initializer[:]
    g.initializer.extend(keep)


def _share_head(proto: onnx.ModelProto, t: TiedTable, block: int) -> bool:
    """Rewire the tied Gather onto the head's MatMulNBits bytes; False when the head was not quantized."""
    g = proto.graph
    head = next((n for n in g.node if n.op_type == "MatMulNBits" and n.output[0] == t.head_output), None)
    if head is None or len(head.input) > 3 and head.input[3]:
        return False  # head kept fp32 (excluded), or asymmetric: its packed zero points differ per op
    attrs = {a.name: a.i for a in head.attribute}
    if attrs.get("bits", 4) != 4 or attrs.get("block_size") != block:
        return False
    e, v = attrs["K"], attrs["N"]
    nb = -(-e // block)
    gather = next(n for n in g.node if n.name == t.gather)
    p = t.gather
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([v, nb * block // 2], np.int64), p + "_data_shape"),
            numpy_helper.from_array(np.array([v, nb], np.int64), p + "_scales_shape"),
        ]
    )
    nodes = [
        helper.make_node(
            "Reshape", [head.input[1], p + "_data_shape"], [p + "_data"], name=p + "_ReshapeData"
        ),
        helper.make_node(
            "Reshape", [head.input[2], p + "_scales_shape"], [p + "_scales"], name=p + "_ReshapeScales"
        ),
    ]
    out = gather.output[0]
    padded = nb * block != e
    nodes.append(
        helper.make_node(
            "GatherBlockQuantized",
            [p + "_data", gather.input[1], p + "_scales"],
            [p + "_padded" if padded else out],
            name=p + "_Q4",
            domain="com.microsoft",
            bits=4,
            block_size=block,
            gather_axis=0,
            quantize_axis=1,
        )
    )
    if padded:  # MatMulNBits pads each row to whole blocks: gather the padded rows, cut the padding off
        g.initializer.extend(
            [
                numpy_helper.from_array(np.array([v], np.int64), f"{p}_{k}")
                for k, v in (("start", 0), ("end", e), ("axis", -1))
            ]
        )
        nodes.append(
            helper.make_node(
                "Slice", [p + "_padded", p + "_start", p + "_end", p + "_axis"], [out], name=p + "_Slice"
            )
        )
    at = list(g.node).index(gather)
    g.node.remove(gather)
    for k, n in enumerate(nodes):
        g.node.insert(at + k, n)
    return True


def quantize_tables(
    proto: onnx.ModelProto, untied: list[str], tied: list[TiedTable], block: int, symmetric: bool
) -> tuple[onnx.ModelProto, dict]:
    """Quantize the tables ``find_tables`` found (before the MatMuls were quantized) in the quantized model."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    quantizer = DefaultWeightOnlyQuantizer(
        DefaultWeightOnlyQuantConfig(
            block_size=block,
            is_symmetric=symmetric,
            op_types_to_quantize=("Gather",),
            quant_axes=(("Gather", 1),),
        )
    )
    g = proto.graph
    tables = {t.weight for t in tied} | {n.input[0] for n in g.node if n.name in set(untied)}
    shared = 0
    for t in tied:
        if _share_head(proto, t, block):
            shared += 1
            continue
        # No quantized head to share: materialize this Gather's own [V, E] table; ONNX Runtime quantizes it below.
        wt = next(x for x in g.initializer if x.name == t.weight)
        table = numpy_helper.from_array(
            np.ascontiguousarray(numpy_helper.to_array(wt).T), t.weight + "_table"
        )
        g.initializer.append(table)
        tables.add(table.name)
        gather = next(n for n in g.node if n.name == t.gather)
        gather.input[0] = table.name
        untied.append(t.gather)
    for name in untied:
        i, node = next((i, n) for i, n in enumerate(g.node) if n.name == name)
        with np.errstate(invalid="ignore", divide="ignore"):  # an all-zero block (a padding row) has scale 0
            (new,) = quantizer.quantize_gather(node, [g])
        g.node.remove(node)
        g.node.insert(i, new)
    _drop_unused(proto, tied, tables)
    if (untied or shared) and not any(op.domain == "com.microsoft" for op in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto, {"embeddings": len(untied) + shared, "embeddings_shared": shared}
