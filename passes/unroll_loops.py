"""Unroll ONNX Loop nodes with a constant trip count into straight-line code (then fold/fuse as usual)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from precast.compiler.registry import Pass, PassResult, register


def _const_scalar(value: ir.Value | None):
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return tensor.numpy().reshape(()).item()


def _always_true(cond_out: ir.Value, cond_in: ir.Value) -> bool:
    """The body's condition output keeps the loop running: cond_in passed through, or constant true."""
    if cond_out is cond_in:
        return True
    producer = cond_out.producer()
    if producer is not None and producer.op_type == "Identity" and producer.inputs[0] is cond_in:
        return True
    return _const_scalar(cond_out) is True


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _why_not(loop: ir.Node, max_trip: int) -> str | None:
    body = loop.attributes["body"].as_graph()
    if body.initializers:
        return "body has initializers"
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for n in body for a in n.attributes.values()):
        return "body has nested subgraphs"
    trip = _const_scalar(loop.inputs[0] if loop.inputs else None)
    if trip is None:
        return "trip count is not constant"
    if not 0 < trip <= max_trip:
        return f"trip count {trip} outside 1..{max_trip}"
    cond = loop.inputs[1] if len(loop.inputs) > 1 else None
    if cond is not None and _const_scalar(cond) is not True:
        return "initial condition is not constant true"
    if not _always_true(body.outputs[0], body.inputs[1]):
        return "body may exit early"
    return None


def _unroll(graph: ir.Graph, loop: ir.Node) -> None:
    body = loop.attributes["body"].as_graph()
    trip = int(_const_scalar(loop.inputs[0]))
    carried = list(loop.inputs[2:])
    n_carried = len(carried)
    scans: list[list[ir.Value]] = [[] for _ in body.outputs[1 + n_carried :]]
    new_nodes: list[ir.Node] = []
    prefix = loop.name or "loop"
    true = _const(graph, f"{prefix}/true", np.array(True))
    for i in range(trip):
        iter_num = _const(graph, f"{prefix}/iter{i}", np.array(i, dtype=np.int64))
        mapping: dict[ir.Value, ir.Value] = {body.inputs[0]: iter_num, body.inputs[1]: true}
        mapping.update(zip(body.inputs[2:], carried))
        for j, node in enumerate(body):
            # Values from the enclosing scope are not in `mapping` and are used as they are.
            inputs = [mapping.get(v, v) if v is not None else None for v in node.inputs]
            clone = ir.Node(
                node.domain, node.op_type, inputs, list(node.attributes.values()),
                overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                name=f"{prefix}/iter{i}/{node.name or f'{node.op_type}_{j}'}",
            )
            for old, new in zip(node.outputs, clone.outputs):
                new.name = f"{prefix}/iter{i}/{old.name}"
                new.shape, new.type = old.shape, old.type
                mapping[old] = new
            new_nodes.append(clone)
        outs = [mapping.get(v, v) for v in body.outputs]
        carried = outs[1 : 1 + n_carried]
        for k, v in enumerate(outs[1 + n_carried :]):
            scans[k].append(v)
    results = list(carried)
    axes = _const(graph, f"{prefix}/axis0", np.array([0], dtype=np.int64))
    for k, per_iter in enumerate(scans):
        pieces = []
        for i, v in enumerate(per_iter):
            unsq = ir.Node("", "Unsqueeze", [v, axes], name=f"{prefix}/scan{k}/unsqueeze{i}")
            new_nodes.append(unsq)
            pieces.append(unsq.outputs[0])
        concat = ir.Node("", "Concat", pieces, [ir.AttrInt64("axis", 0)], name=f"{prefix}/scan{k}/concat")
        new_nodes.append(concat)
        results.append(concat.outputs[0])
    graph.insert_before(loop, new_nodes)
    for old, new in zip(loop.outputs, results):
        if old.is_graph_output():
            # Keep the graph output's name: route it through an Identity named like the Loop output.
            ident = ir.Node("", "Identity", [new], name=f"{prefix}/out/{old.name}")
            graph.insert_before(loop, ident)
            ident.outputs[0].shape, ident.outputs[0].type = old.shape, old.type
            old.replace_all_uses_with(ident.outputs[0], replace_graph_outputs=True)
            ident.outputs[0].name = old.name
        else:
            old.replace_all_uses_with(new)
    graph.remove(loop, safe=True)


@register("unroll-loops")
class UnrollLoops(Pass):
    """ONNX Loop with a constant trip count <= max_trip -> the body repeated inline.

        Loop(M=3, cond=true, v0) { i, c, v -> c, f(v, i), s(v, i) }
            ==>   v1 = f(v0, 0); v2 = f(v1, 1); v3 = f(v2, 2); scan = Concat(Unsqueeze(s0), ..., axis=0)
    """

    @dataclass(frozen=True)
    class Options:
        max_trip: int = 16

    def call(self, model: ir.Model) -> PassResult:
        unrolled, kept = 0, {}
        for node in list(model.graph):
            if node.op_type != "Loop" or node.domain != "":
                continue
            reason = _why_not(node, self.options.max_trip)
            if reason:
                kept[node.name or "Loop"] = reason
                continue
            _unroll(model.graph, node)
            unrolled += 1
        stats: dict = {"unrolled": unrolled}
        if kept:
            stats["kept"] = len(kept)
        return PassResult(model, stats)
