"""Where a graph can be cut into pipeline stages, and which cuts balance them (used by ``split-stages``).

A cut at position ``p`` (the graph's nodes in order) puts ``nodes[:p]`` before it. The tensors that *cross*
it are the non-constant values produced before ``p`` that a node at or after ``p`` reads. A model output
leaves from the stage that computes it (a causal LM's per-layer KV outputs from their layer's stage), and
graph inputs never cross: every stage reads the model's inputs it needs directly. Constant values
(initializers, ``Constant`` nodes, anything computed from constants only) never cross either: a stage that
reads one gets its own copy.

Cut candidates:
  * named layers: when the nodes' module scopes (torch export), node names (legacy export) or initializer
    names carry a layer index (``encoder.layer.3``, ``model.layers.3``, ``transformer.h.3``) in increasing
    node order, one candidate per gap between layer k's last node and layer k+1's first: the latest
    position in that gap where the fewest tensors cross;
  * otherwise (structural): every position with weights on both sides where the fewest tensors cross.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

__all__ = ["CutAnalysis", "analyse", "balance", "constant_values", "top_level_reads"]

_LAYER = re.compile(r"(?:^|[./])(\d+)[./]")  # an initializer's name: encoder.layer.3.output.dense.bias
_SCOPE = re.compile(r"'[\w.]*?\.(\d+)'")  # the first module scope ending in an index: 'encoder.layer.3'
_NODE_NAME = re.compile(r"(?:^|/)[A-Za-z_]\w*\.(\d+)(?=/)")  # /encoder/layer.3/attention/self/MatMul
# Ops whose output is not a function of their inputs: never folded into "constant", never duplicated.
_NONDETERMINISTIC = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}


def top_level_reads(node: ir.Node, graph: ir.Graph) -> list[ir.Value]:
    """The values of ``graph`` a top-level node reads: its inputs and what its subgraphs capture."""
    seen: dict[int, ir.Value] = {}
    for v in node.inputs:
        if v is not None:
            seen.setdefault(id(v), v)
    for attr in node.attributes.values():
        subs = []
        if attr.type == ir.AttributeType.GRAPH:
            subs = [attr.as_graph()]
        elif attr.type == ir.AttributeType.GRAPHS:
            subs = list(attr.as_graphs())
        for sub in subs:
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                for v in inner.inputs:
                    if v is not None and v.graph is graph:
                        seen.setdefault(id(v), v)
    return list(seen.values())


def constant_values(graph: ir.Graph, nodes: list[ir.Node], reads: list[list[ir.Value]]) -> set[int]:
    """id() of every value that is a constant: initializers (also one listed as a graph input: precast's IO
    signature leaves those out, so nothing feeds them) and the outputs of deterministic nodes that read
    constants only (a Constant node reads nothing)."""
    constant = {id(v) for v in graph.initializers.values()}
    for node, rd in zip(nodes, reads):
        if node.op_type not in _NONDETERMINISTIC and all(id(v) in constant for v in rd):
            constant.update(id(o) for o in node.outputs)
    return constant


def _tensor_bytes(node: ir.Node) -> int:
    attr = node.attributes.get("value")
    if node.op_type == "Constant" and attr is not None and attr.type == ir.AttributeType.TENSOR:
        return int(attr.as_tensor().nbytes)
    return 0


@dataclass
class CutAnalysis:
    """Per node (graph order): the weight bytes it reads first and its layer; per position: crossing counts."""

    nodes: list[ir.Node]
    reads: list[list[ir.Value]]
    constant: set[int]  # id() of constant values
    first_bytes: np.ndarray  # bytes of the constants each node is the first reader of
    layer: list[int | None]  # the layer a node belongs to (None: outside the named layers)
    crossing: np.ndarray  # crossing[p]: tensors live across a cut before node p (p in 0..N), graph inputs too
    candidates: list[int]  # positions p (1..N-1) where a stage may start
    candidate_layers: list[int] | None  # named layers: the first layer after each candidate

    def crossing_at(self, p: int) -> list[str]:
        """Names of the tensors crossing a cut before node ``p``."""
        before = {id(o) for n in self.nodes[:p] for o in n.outputs}
        names: dict[str, None] = {}
        for reads in self.reads[p:]:
            for v in reads:
                if id(v) in before and id(v) not in self.constant:
                    names.setdefault(v.name, None)
        return list(names)


def analyse(graph: ir.Graph) -> CutAnalysis:
    nodes = list(graph)
    n = len(nodes)
    reads = [top_level_reads(node, graph) for node in nodes]
    constant = constant_values(graph, nodes, reads)
    # Bytes: each constant is charged to its first reader (duplicates are counted when stages are built).
    first_bytes = np.zeros(n, dtype=np.float64)
    charged: set[int] = set()
    for i, (node, rd) in enumerate(zip(nodes, reads)):
        for v in rd:
            if v.const_value is not None and id(v) not in charged:
                charged.add(id(v))
                first_bytes[i] += v.const_value.nbytes
        first_bytes[i] += _tensor_bytes(node)
    # Crossing counts: a value produced at a and last read at b crosses every cut p with a < p <= b.
    produced_at = {id(o): i for i, node in enumerate(nodes) for o in node.outputs}
    last = dict.fromkeys(produced_at, -1)
    for i, rd in enumerate(reads):
        for v in rd:
            if id(v) in last:
                last[id(v)] = max(last[id(v)], i)
    # Graph inputs count as live until their last reader: they never cross (each stage reads them), but a
    # residual that is still a graph input (the first layer's) makes a point inside that layer no narrower.
    for v in graph.inputs:
        if id(v) not in constant and id(v) not in produced_at:
            produced_at[id(v)] = -1
            last[id(v)] = max((i for i, rd in enumerate(reads) if any(u is v for u in rd)), default=-1)
    diff = np.zeros(n + 2, dtype=np.int64)
    for vid, a in produced_at.items():
        b = last[vid]
        if vid in constant or b <= a:
            continue
        diff[a + 1] += 1
        diff[b + 1] -= 1
    crossing = np.cumsum(diff)[: n + 1]
    layer = [_layer_of(node, rd) for node, rd in zip(nodes, reads)]
    named = _named_candidates(layer, crossing)
    if named is not None:
        candidates, cand_layers = named
    else:
        candidates, cand_layers = _structural_candidates(first_bytes, crossing), None
    return CutAnalysis(nodes, reads, constant, first_bytes, layer, crossing, candidates, cand_layers)


def _layer_of(node: ir.Node, reads: list[ir.Value]) -> int | None:
    """The layer a node belongs to: from the torch exporter's module scopes (``encoder.layer.2`` in
    ``pkg.torch.onnx.name_scopes``, kept through precast's fusions), else a legacy-exporter node name
    (``/encoder/layer.2/attention/...``), else the initializers it reads (``model.layers.2.mlp...``)."""
    if m := _SCOPE.search(node.metadata_props.get("pkg.torch.onnx.name_scopes", "")):
        return int(m.group(1))
    if m := _NODE_NAME.search(node.name or ""):
        return int(m.group(1))
    found = [int(m.group(1)) for v in reads if v.is_initializer() and (m := _LAYER.search(v.name or ""))]
    return max(found) if found else None


def _named_candidates(layer: list[int | None], crossing: np.ndarray) -> tuple[list[int], list[int]] | None:
    """One cut per gap between consecutive named layers; None when the names do not give a layer order."""
    seq = [(i, k) for i, k in enumerate(layer) if k is not None]
    distinct = sorted({k for _, k in seq})
    if len(distinct) < 2 or any(k2 < k1 for (_, k1), (_, k2) in zip(seq, seq[1:])):
        return None
    last_of: dict[int, int] = {}
    first_of: dict[int, int] = {}
    for i, k in seq:
        first_of.setdefault(k, i)
        last_of[k] = i
    cuts, after = [], []
    for k1, k2 in zip(distinct, distinct[1:]):
        lo, hi = last_of[k1] + 1, first_of[k2]
        gap = crossing[lo : hi + 1]
        # the latest narrowest point: weightless nodes after layer k's last weight (a residual Add, a
        # weightless tail of the layer) stay with layer k
        cuts.append(hi - int(np.argmin(gap[::-1])))
        after.append(k2)
    return cuts, after


def _structural_candidates(cost: np.ndarray, crossing: np.ndarray) -> list[int]:
    n = len(cost)
    csum = np.concatenate([[0.0], np.cumsum(cost)])
    inner = [p for p in range(1, n) if csum[p] > 0 and csum[n] - csum[p] > 0]
    if not inner:
        return []
    least = min(int(crossing[p]) for p in inner)
    out, seen = [], set()
    for p in inner:
        if crossing[p] == least and csum[p] not in seen:  # one cut per distinct split of the weights
            seen.add(csum[p])
            out.append(p)
    return out


def balance(cost: np.ndarray, candidates: list[int], n_stages: int) -> list[int]:
    """The ``n_stages - 1`` candidate positions that minimise the sum of squared stage costs (so the stages
    come out as equal as the cut points allow)."""
    total = np.concatenate([[0.0], np.cumsum(cost)])
    points = [0, *candidates, len(cost)]
    c = total[points]
    m = len(points)
    scale = max(float(c[-1]), 1.0)
    c = c / scale
    inf = np.inf
    dp = np.full((n_stages + 1, m), inf)
    back = np.zeros((n_stages + 1, m), dtype=np.int64)
    dp[0, 0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(1, m):
            seg = dp[s - 1, :j] + (c[j] - c[:j]) ** 2
            i = int(np.argmin(seg))
            dp[s, j], back[s, j] = seg[i], i
    cuts, j = [], m - 1
    for s in range(n_stages, 0, -1):
        j = int(back[s, j])
        cuts.append(j)
    cuts = sorted(cuts)[1:]  # drop the start (index 0)
    return [points[j] for j in cuts]
