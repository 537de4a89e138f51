"""Staged models: the graph ``split-stages`` annotated, materialised as N standalone stage graphs.

    is_staged(model)        -> bool: the model carries a split-stages plan
    stage_models(model)     -> [Stage]: one standalone ir.Model per stage, in order
    write_stages(model, dir, save) -> StagesSpec: stages/stage_<k>.onnx written, the manifest's block

Stage k's graph inputs are the model inputs its nodes read plus the boundary tensors earlier stages produce
for it; its outputs are what later stages read and the model outputs it computes. A boundary tensor that
a stage after the next one reads is *passed through* the stages between (each lists it as input and
output), so a runner that hands stage k's outputs to stage k+1 only has everything each stage needs.
A model output stays an output of the stage that computes it (a causal LM's per-layer KV outputs leave
from their layer's stage).

Constants are not boundary tensors: a stage that reads one (an initializer, a Constant node, anything
computed from constants only) holds its own copy, and ``Stage.bytes`` counts it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from precast.artifact.stages_spec import StageEntry, StagesSpec
from precast.errors import PipelineError
from precast.ir.stage_cuts import constant_values, top_level_reads

# Where split-stages writes its plan (model metadata) and each node's stage (node metadata).
STAGE_KEY = "precast.stage"
PLAN_KEY = "precast.stages"

__all__ = ["Stage", "is_staged", "stage_plan", "stage_models", "write_stages", "STAGES_DIR"]

STAGES_DIR = "stages"


@dataclass(frozen=True)
class Stage:
    """One stage: its standalone model, the tensor names it reads and writes (in the model's graph order),
    the bytes of the constants it holds, and (from the plan) its layer range and profiled time."""

    index: int
    model: ir.Model
    inputs: list[str]
    outputs: list[str]
    bytes: int
    layers: list[int] | None = None
    time_ms: float | None = None

    def entry(self, path: str) -> StageEntry:
        """The manifest record of this stage, its model file at ``path`` (relative to the artifact)."""
        return StageEntry(
            model=path,
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            bytes=self.bytes,
            layers=self.layers,
            time_ms=self.time_ms,
        )


def is_staged(model: ir.Model) -> bool:
    """Whether ``split-stages`` annotated ``model`` (its plan is in the model's metadata)."""
    return PLAN_KEY in model.metadata_props


def stage_plan(model: ir.Model) -> dict:
    """The plan split-stages recorded: ``{"n", "by", "bytes", "boundaries", "layers"?, "time_ms"?}``."""
    if not is_staged(model):
        raise PipelineError("the model has no split-stages plan (run the split-stages pass last)")
    return json.loads(model.metadata_props[PLAN_KEY])


def stage_models(model: ir.Model) -> list[Stage]:
    """The annotated model as ``n`` standalone stage models (the annotated model is not changed, except that
    boundary tensors without a type get one from shape inference)."""
    plan = stage_plan(model)
    graph = model.graph
    n = int(plan["n"])
    routes = _Routes.of(graph, n)
    _fill_types(
        model, [routes.by_id[i] for k in range(1, n) for i in routes.ins[k] if i not in routes.feedable]
    )
    order = _value_order(graph)
    layers = plan.get("layers")
    times = plan.get("time_ms")
    stages = []
    for k in range(n):
        if not routes.outs[k]:
            raise PipelineError(f"split-stages: stage {k} computes nothing a later stage or the model needs")
        in_vals = [routes.by_id[i] for i in sorted(routes.ins[k], key=order.__getitem__)]
        out_vals = [routes.by_id[i] for i in sorted(routes.outs[k], key=order.__getitem__)]
        stage_model = _stage_model(model, k, in_vals, out_vals)
        stages.append(
            Stage(
                index=k,
                model=stage_model,
                inputs=[v.name for v in in_vals],
                outputs=[v.name for v in out_vals],
                bytes=_bytes(stage_model.graph),
                layers=list(layers[k]) if layers else None,
                time_ms=float(times[k]) if times else None,
            )
        )
    return stages


class _Routes:
    """Which values each stage reads (``ins``) and writes (``outs``), keyed by id (dicts as ordered sets):
    a boundary tensor goes out of the stage that computes it and into each stage up to the one that reads it;
    a model input goes into the stage that reads it; a model output out of the stage that computes it."""

    def __init__(self, graph: ir.Graph, n: int):
        self.n = n
        self.by_id: dict[int, ir.Value] = {}
        self.ins: list[dict[int, None]] = [{} for _ in range(n)]
        self.outs: list[dict[int, None]] = [{} for _ in range(n)]
        self.feedable = {id(v) for v in graph.inputs if v.name not in graph.initializers}

    @classmethod
    def of(cls, graph: ir.Graph, n: int) -> _Routes:
        nodes = list(graph)
        stage_of = [_stage_of(node, n) for node in nodes]
        reads = [top_level_reads(node, graph) for node in nodes]
        constant = constant_values(graph, nodes, reads)
        made_in: dict[int, int] = {id(o): k for node, k in zip(nodes, stage_of) for o in node.outputs}
        routes = cls(graph, n)
        for node, k, rd in zip(nodes, stage_of, reads):
            for v in rd:
                routes.by_id[id(v)] = v
                if id(v) in routes.feedable:
                    routes.ins[k][id(v)] = None
                elif id(v) not in constant and id(v) in made_in:  # (a constant: the stage gets its own copy)
                    routes.boundary(node, v, made_in[id(v)], k)
        for v in graph.outputs:
            routes.by_id[id(v)] = v
            k = made_in.get(id(v), n - 1)
            if id(v) in routes.feedable:
                routes.ins[k][id(v)] = None
            routes.outs[k][id(v)] = None
        routes.keep_inputs(graph)
        return routes

    def boundary(self, node: ir.Node, v: ir.Value, src: int, k: int) -> None:
        """``node`` of stage ``k`` reads ``v``, which stage ``src`` computes."""
        if src > k:
            raise PipelineError(
                f"split-stages: node '{node.name}' of stage {k} reads '{v.name}', which stage {src} computes"
            )
        if src < k:
            self.outs[src][id(v)] = None
            for j in range(src + 1, k):  # passed through
                self.ins[j][id(v)] = None
                self.outs[j][id(v)] = None
            self.ins[k][id(v)] = None

    def keep_inputs(self, graph: ir.Graph) -> None:
        """Model inputs no stage reads stay inputs, of stage 0: the model's IO signature is kept."""
        read = {i for k in range(self.n) for i in self.ins[k]}
        for v in graph.inputs:  # an input nothing reads stays the model's input (the IO signature lists it)
            if id(v) in self.feedable and id(v) not in read:
                self.by_id[id(v)] = v
                self.ins[0][id(v)] = None
        for (
            v
        ) in graph.inputs:  # an input no node reads (a causal LM's 'positions' in the mapped layout) stays
            if not any(id(v) in stage_ins for stage_ins in self.ins):  # an input, of stage 0
                self.by_id[id(v)] = v
                self.ins[0][id(v)] = None


def _value_order(graph: ir.Graph) -> dict[int, int]:
    """id -> position: inputs first, then values in graph order (the order a stage lists its IO in)."""
    order: dict[int, int] = {}
    for v in graph.inputs:
        order.setdefault(id(v), len(order))
    for node in graph:
        for o in node.outputs:
            order.setdefault(id(o), len(order))
    return order


def _stage_model(model: ir.Model, k: int, in_vals: list[ir.Value], out_vals: list[ir.Value]) -> ir.Model:
    """Stage ``k`` as a standalone model: the subgraph between its values, the source model's metadata."""
    graph = model.graph
    sub = ir.convenience.extract(graph, inputs=in_vals, outputs=out_vals)
    _initializers_in_source_order(sub, graph)
    sub.name = f"{graph.name or 'model'}_stage_{k}"
    stage_model = ir.Model(
        sub,
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        producer_version=model.producer_version,
        domain=model.domain,
        model_version=model.model_version,
        functions=list(model.functions.values()),
    )
    stage_model.metadata_props.update({k_: v for k_, v in model.metadata_props.items() if k_ != PLAN_KEY})
    stage_model.metadata_props[STAGE_KEY] = str(k)
    return stage_model


def write_stages(
    model: ir.Model, out_dir: Path, save: Callable[[ir.Model, Path], list[str]], suffix: str = ".onnx"
) -> StagesSpec:
    """Write each stage as ``stages/stage_<k><suffix>`` under ``out_dir`` with ``save(model, path)``; return the
    manifest's ``stages`` block."""
    plan = stage_plan(model)
    folder = Path(out_dir) / STAGES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for stage in stage_models(model):
        rel = f"{STAGES_DIR}/stage_{stage.index}{suffix}"
        save(stage.model, Path(out_dir) / rel)
        entries.append(stage.entry(rel))
    return StagesSpec(n=int(plan["n"]), by=str(plan["by"]), stages=entries)


def _stage_of(node: ir.Node, n: int) -> int:
    raw = node.metadata_props.get(STAGE_KEY)
    if raw is None:
        raise PipelineError(
            f"split-stages: node '{node.name}' ({node.op_type}) has no stage: split-stages must be the last pass"
        )
    if not raw.isdigit() or not 0 <= int(raw) < n:
        raise PipelineError(f"split-stages: node '{node.name}' has stage '{raw}', not in 0..{n - 1}")
    return int(raw)


def _initializers_in_source_order(sub: ir.Graph, graph: ir.Graph) -> None:
    """onnx_ir's extract() collects a subgraph's initializers in a set (an order that changes from run to run):
    put them back in the source graph's order, so one model compiled twice gives byte-identical stage files."""
    rank = {name: i for i, name in enumerate(graph.initializers)}
    values = sorted(sub.initializers.values(), key=lambda v: (rank.get(v.name, len(rank)), v.name))
    sub.initializers.clear()
    for v in values:
        sub.register_initializer(v)


def _bytes(graph: ir.Graph) -> int:
    total = sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        attr = node.attributes.get("value")
        if node.op_type == "Constant" and attr is not None and attr.type == ir.AttributeType.TENSOR:
            total += attr.as_tensor().nbytes
    return int(total)


def _fill_types(model: ir.Model, boundary: list[ir.Value]) -> None:
    """Boundary tensors become graph inputs, which need a type: infer the missing ones on a copy."""
    missing = [v for v in boundary if v.type is None]
    if not missing:
        return
    import onnx

    proto = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model), data_prop=True)
    inferred = {vi.name: vi for vi in [*proto.graph.value_info, *proto.graph.output]}
    for v in missing:
        vi = inferred.get(v.name)
        if vi is None or not vi.type.HasField("tensor_type"):
            raise PipelineError(f"split-stages: cannot infer the type of boundary tensor '{v.name}'")
        v.type = ir.TensorType(ir.DataType(vi.type.tensor_type.elem_type))
        if vi.type.tensor_type.HasField("shape"):
            v.shape = ir.Shape([d.dim_param or d.dim_value or None for d in vi.type.tensor_type.shape.dim])
