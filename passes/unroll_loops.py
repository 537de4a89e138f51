"""Unroll ONNX Loop (constant trip count) and Scan (static sequence length) into straight-line code."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from precast.ir.registry import Pass, PassResult, option, register
from precast.passes._opset_compat import axes_as_attributes


def _const_scalar(value: ir.Value | None):
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return tensor.numpy().reshape(()).item()


def _static_dim(value: ir.Value | None):
    """Gather(Shape(x), k) / Squeeze(Shape(x, start=k, end=k+1)) where x's dim k is static -> that size."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "" or node.op_type not in ("Gather", "Squeeze"):
        return None
    shape_node = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    if shape_node is None or shape_node.op_type != "Shape" or shape_node.inputs[0].shape is None:
        return None
    dims = list(shape_node.inputs[0].shape)
    dims = dims[shape_node.attributes.get_int("start", 0) : shape_node.attributes.get_int("end", len(dims))]
    if node.op_type == "Gather":
        k = _const_scalar(node.inputs[1])
        if (
            node.attributes.get_int("axis", 0) != 0
            or not isinstance(k, int)
            or not -len(dims) <= k < len(dims)
        ):
            return None
        dim = dims[k]
    else:
        if len(dims) != 1:
            return None
        dim = dims[0]
    return dim if isinstance(dim, int) else None


def _trip_count(value: ir.Value | None):
    """A constant trip count, also one read from a static dim (a torch.jit.script `range(x.size(1))`)."""
    trip = _const_scalar(value)
    return trip if trip is not None else _static_dim(value)


def _hoist_initializers(graph: ir.Graph, body: ir.Graph, prefix: str) -> dict[ir.Value, ir.Value]:
    """The body's initializers (constants lifted by fold-constants) as outer-graph initializers."""
    return {v: _const(graph, f"{prefix}/{v.name}", v.const_value.numpy()) for v in body.initializers.values()}


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
    value = ir.Value(
        name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def _body_why_not(node: ir.Node) -> str | None:
    body = node.attributes["body"].as_graph()
    if any(v.const_value is None for v in body.initializers.values()):
        return "body has initializers without values"
    if any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for n in body
        for a in n.attributes.values()
    ):
        return "body has nested subgraphs"
    return None


def _why_not(loop: ir.Node, max_trip: int) -> str | None:
    body = loop.attributes["body"].as_graph()
    reason = _body_why_not(loop)
    if reason:
        return reason
    trip = _trip_count(loop.inputs[0] if loop.inputs else None)
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


def _inline_body(
    body: ir.Graph, mapping: dict[ir.Value, ir.Value], prefix: str, new_nodes: list[ir.Node]
) -> list:
    """Clone ``body``'s nodes with its inputs bound by ``mapping``; returns the values of its outputs."""
    for j, node in enumerate(body):
        # Values from the enclosing scope are not in `mapping` and are used as they are.
        inputs = [mapping.get(v, v) if v is not None else None for v in node.inputs]
        clone = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            list(node.attributes.values()),
            overload=node.overload,
            num_outputs=len(node.outputs),
            version=node.version,
            name=f"{prefix}/{node.name or f'{node.op_type}_{j}'}",
        )
        for old, new in zip(node.outputs, clone.outputs):
            new.name = f"{prefix}/{old.name}"
            new.shape, new.type = old.shape, old.type
            mapping[old] = new
        new_nodes.append(clone)
    return [mapping.get(v, v) for v in body.outputs]


def _stack(
    graph: ir.Graph, per_iter: list[ir.Value], axis: int, name: str, new_nodes: list[ir.Node]
) -> ir.Value:
    """Concat(Unsqueeze(v_0, axis), ..., axis): the per-iteration values stacked on a new axis."""
    axes = _const(graph, f"{name}/axes", np.array([axis], dtype=np.int64))
    pieces = []
    for i, v in enumerate(per_iter):
        unsq = ir.Node("", "Unsqueeze", [v, axes], name=f"{name}/unsqueeze{i}")
        new_nodes.append(unsq)
        pieces.append(unsq.outputs[0])
    concat = ir.Node("", "Concat", pieces, [ir.AttrInt64("axis", axis)], name=f"{name}/concat")
    new_nodes.append(concat)
    return concat.outputs[0]


def _replace(
    graph: ir.Graph, node: ir.Node, new_nodes: list[ir.Node], results: list[ir.Value], prefix: str
) -> None:
    """Insert ``new_nodes`` before ``node``, route its outputs to ``results`` and remove it."""
    graph.insert_before(node, new_nodes)
    for old, new in zip(node.outputs, results):
        if old.is_graph_output():
            # Keep the graph output's name: route it through an Identity named like the node's output.
            ident = ir.Node("", "Identity", [new], name=f"{prefix}/out/{old.name}")
            graph.insert_before(node, ident)
            ident.outputs[0].shape, ident.outputs[0].type = old.shape, old.type
            old.replace_all_uses_with(ident.outputs[0], replace_graph_outputs=True)
            ident.outputs[0].name = old.name
        else:
            old.replace_all_uses_with(new)
    graph.remove(node, safe=True)


def _unroll(graph: ir.Graph, loop: ir.Node) -> None:
    body = loop.attributes["body"].as_graph()
    trip = int(_trip_count(loop.inputs[0]))
    carried = list(loop.inputs[2:])
    n_carried = len(carried)
    scans: list[list[ir.Value]] = [[] for _ in body.outputs[1 + n_carried :]]
    new_nodes: list[ir.Node] = []
    prefix = loop.name or "loop"
    true = _const(graph, f"{prefix}/true", np.array(True))
    consts = _hoist_initializers(graph, body, prefix)
    for i in range(trip):
        iter_num = _const(graph, f"{prefix}/iter{i}", np.array(i, dtype=np.int64))
        mapping: dict[ir.Value, ir.Value] = {**consts, body.inputs[0]: iter_num, body.inputs[1]: true}
        mapping.update(zip(body.inputs[2:], carried))
        outs = _inline_body(body, mapping, f"{prefix}/iter{i}", new_nodes)
        carried = outs[1 : 1 + n_carried]
        for k, v in enumerate(outs[1 + n_carried :]):
            scans[k].append(v)
    results = list(carried)
    for k, per_iter in enumerate(scans):
        results.append(_stack(graph, per_iter, 0, f"{prefix}/scan{k}", new_nodes))
    _replace(graph, loop, new_nodes, results, prefix)


def _scan_attrs(scan: ir.Node) -> tuple[int, int, list[int], list[int], list[int], list[int]]:
    """(states, scan inputs, input axes, input directions, output axes, output directions), defaults filled."""
    body = scan.attributes["body"].as_graph()
    m = scan.attributes.get_int("num_scan_inputs", 0)
    n = len(scan.inputs) - m
    k = len(body.outputs) - n
    ints = scan.attributes.get_ints
    return (
        n,
        m,
        list(ints("scan_input_axes", None) or [0] * m),
        list(ints("scan_input_directions", None) or [0] * m),
        list(ints("scan_output_axes", None) or [0] * k),
        list(ints("scan_output_directions", None) or [0] * k),
    )


def _scan_length(scan: ir.Node) -> int | str:
    """The static sequence length all scan inputs share, or why there is none."""
    n, _, in_axes, *_ = _scan_attrs(scan)
    lengths = set()
    for x, axis in zip(scan.inputs[n:], in_axes):
        if x is None or x.shape is None or not -x.shape.rank() <= axis < x.shape.rank():
            return "scan input shape unknown"
        dim = x.shape[axis]
        if not isinstance(dim, int):
            return "sequence length is not static"
        lengths.add(dim)
    return lengths.pop() if len(lengths) == 1 else "scan inputs differ in length or there are none"


def _why_not_scan(scan: ir.Node, max_trip: int) -> str | None:
    opset = scan.version or (scan.graph.opset_imports.get("", 0) if scan.graph is not None else 0)
    if opset < 9:
        return "Scan-8 (batched, sequence_lens) form"
    reason = _body_why_not(scan)
    if reason:
        return reason
    length = _scan_length(scan)
    if isinstance(length, str):
        return length
    if not 0 < length <= max_trip:
        return f"sequence length {length} outside 1..{max_trip}"
    return None


def _unroll_scan(graph: ir.Graph, scan: ir.Node) -> None:
    body = scan.attributes["body"].as_graph()
    n, _, in_axes, in_dirs, out_axes, out_dirs = _scan_attrs(scan)
    length = _scan_length(scan)
    assert isinstance(length, int)
    states = list(scan.inputs[:n])
    scans: list[list[ir.Value]] = [[] for _ in body.outputs[n:]]
    new_nodes: list[ir.Node] = []
    prefix = scan.name or "scan"
    consts = _hoist_initializers(graph, body, prefix)
    for i in range(length):
        mapping: dict[ir.Value, ir.Value] = {**consts, **dict(zip(body.inputs[:n], states))}
        for j, (x, axis, rev) in enumerate(zip(scan.inputs[n:], in_axes, in_dirs)):
            # Gather with a scalar index drops the scanned axis: the body sees one slice.
            t = _const(
                graph, f"{prefix}/iter{i}/t{j}", np.array(length - 1 - i if rev else i, dtype=np.int64)
            )
            take = ir.Node(
                "", "Gather", [x, t], [ir.AttrInt64("axis", axis)], name=f"{prefix}/iter{i}/slice{j}"
            )
            take.outputs[0].name = f"{prefix}/iter{i}/#scan_input{j}"
            new_nodes.append(take)
            mapping[body.inputs[n + j]] = take.outputs[0]
        outs = _inline_body(body, mapping, f"{prefix}/iter{i}", new_nodes)
        states = outs[:n]
        for k, v in enumerate(outs[n:]):
            scans[k].append(v)
    results = list(states)
    for k, (per_iter, axis, rev) in enumerate(zip(scans, out_axes, out_dirs)):
        # Reverse scan outputs: iteration i's value lands at position L-1-i.
        results.append(
            _stack(graph, per_iter[::-1] if rev else per_iter, axis, f"{prefix}/scan{k}", new_nodes)
        )
    _replace(graph, scan, new_nodes, results, prefix)


@register("unroll-loops")
class UnrollLoops(Pass):
    """ONNX Loop with a constant trip count / Scan with a static sequence length <= max_trip -> inline body.

        Loop(M=3, cond=true, v0) { i, c, v -> c, f(v, i), s(v, i) }
            ==>   v1 = f(v0, 0); v2 = f(v1, 1); v3 = f(v2, 2); scan = Concat(Unsqueeze(s0), ..., axis=0)
        Scan(h0, xs[L=2, ...]) { h, x -> g(h, x), y(h, x) }
            ==>   h1 = g(h0, Gather(xs, 0)); h2 = g(h1, Gather(xs, 1)); ys = Concat(Unsqueeze(y0), Unsqueeze(y1))
    Scan's input/output axes and directions are honoured (reverse: slice L-1-i, stack in reverse).
    """

    @dataclass(frozen=True)
    class Options:
        max_trip: int = option(16, "unroll a Loop / Scan only up to this many iterations")

    def call(self, model: ir.Model) -> PassResult:
        unrolled, kept = 0, {}
        checks = {"Loop": (_why_not, _unroll), "Scan": (_why_not_scan, _unroll_scan)}
        for index, node in enumerate(list(model.graph)):
            if node.op_type not in checks or node.domain != "":
                continue
            if not node.name:  # the name prefixes the unrolled values: unnamed nodes get distinct ones
                node.name = f"{node.op_type.lower()}_{index}"
            why_not, unroll = checks[node.op_type]
            reason = why_not(node, self.options.max_trip)
            if reason:
                kept[node.name or node.op_type] = reason
                continue
            unroll(model.graph, node)
            unrolled += 1
        if unrolled:
            axes_as_attributes(model)  # the stacking Unsqueezes take constant axes: always movable
        stats: dict = {"unrolled": unrolled}
        if kept:
            stats["kept"] = len(kept)
        return PassResult(model, unrolled > 0, stats)
