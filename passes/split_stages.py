"""``split-stages``: plan N consecutive pipeline stages at layer boundaries and annotate the graph with them.

    embeddings, layer 0..5, pooler                    split-stages{n=2}
    ---------------------------------------  ==>   stage 0: embeddings, layers 0-2 | h_2, mask' | stage 1: layers 3-5, pooler

The pass cuts nothing: it *annotates*. Every top-level node gets ``metadata_props["precast.stage"] = "k"``
and the model gets ``metadata_props["precast.stages"]``, the plan as JSON (n, by, per stage: layers,
bytes, time). ``precast.ir.stages.stage_models`` then materialises the N standalone stage graphs,
and targets that run stages write them (``stages/stage_<k>.onnx``). Because a later pass would add nodes
without a stage, the pipeline refuses any pass after this one.

Cut points (ir/stage_cuts.py) sit where the fewest tensors cross, between layers when initializer
names number them (a transformer's hidden state and its mask-derived tensors cross), else at the
structural narrowest points. The N stages are balanced by initializer bytes (``by=bytes``) or by per-node
time from an ONNX Runtime profile of the graph on the compile's sample feeds (``by=time``).

Constants (initializers, Constant nodes and what is computed from constants only) never cross a cut: one
read by several stages is **duplicated** into each of them, and each stage's ``bytes`` counts its copy.
Stats: ``{"stages": n, "bytes": [per stage], "boundary_tensors": tensors crossing the cuts, summed}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_ir as ir

from precast.errors import PassOptionError
from precast.ir.registry import Pass, PassResult, option, register
from precast.ir.stage_cuts import CutAnalysis, analyse, balance
from precast.ir.stages import PLAN_KEY, STAGE_KEY

__all__ = ["SplitStages", "STAGE_KEY", "PLAN_KEY"]



@register("split-stages")
class SplitStages(Pass):
    """Annotate N consecutive pipeline stages, cut at layer boundaries, balanced by weight bytes or time."""

    must_be_last = True  # parse_pipeline refuses a pass after it

    @dataclass(frozen=True)
    class Options:
        n: int = option(2, "number of stages (>= 2)")
        by: Literal["bytes", "time"] = option(
            "bytes", "balance the stages by initializer bytes or profiled time"
        )

        def __post_init__(self) -> None:
            if self.n < 2:
                raise PassOptionError(f"pass 'split-stages' option 'n' must be >= 2, got {self.n}")

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        cuts = analyse(graph)
        possible = len(cuts.candidates) + 1
        if possible < self.options.n:
            name = self.context.source_name or graph.name or "model"
            what = (
                f"has {possible} layers"
                if cuts.candidate_layers is not None
                else f"has {possible - 1} cut points"
            )
            raise PassOptionError(
                f"pass 'split-stages' option 'n': model '{name}' {what}, so at most {possible} stages; "
                f"got n={self.options.n}"
            )
        times = self._node_times(model) if self.options.by == "time" else None
        cost = times if times is not None else cuts.first_bytes
        chosen = balance(cost, cuts.candidates, self.options.n)
        starts = [0, *chosen]
        ends = [*chosen, len(cuts.nodes)]
        for k, (a, b) in enumerate(zip(starts, ends)):
            for node in cuts.nodes[a:b]:
                node.metadata_props[STAGE_KEY] = str(k)
        plan = _plan(self.options, cuts, starts, ends, times)
        model.metadata_props[PLAN_KEY] = json.dumps(plan, sort_keys=True)
        from precast.ir.stages import (
            stage_models,  # the exact bytes (with duplicates) and boundaries
        )

        stages = stage_models(model)
        plan["bytes"] = [s.bytes for s in stages]
        model.metadata_props[PLAN_KEY] = json.dumps(plan, sort_keys=True)
        boundary = sum(len(cuts.crossing_at(p)) for p in chosen)
        return PassResult(
            model, True, {"stages": self.options.n, "bytes": plan["bytes"], "boundary_tensors": boundary}
        )

    def _node_times(self, model: ir.Model) -> np.ndarray:
        from precast.ir.parity import io_signature, make_sample_feeds
        from precast.passes._stage_profile import node_times_us

        feeds = self.context.sample_feeds
        if not feeds:
            feeds = make_sample_feeds(model, io_signature(model)[0])
        return node_times_us(model, feeds)


def _plan(options, cuts: CutAnalysis, starts, ends, times) -> dict:
    """The plan recorded on the model: n, by, the tensors crossing each cut, layers and time per stage."""
    layers = None
    if cuts.candidate_layers is not None:
        named = sorted({k for k in cuts.layer if k is not None})
        first = {p: k for p, k in zip(cuts.candidates, cuts.candidate_layers)}
        bounds = [named[0], *(first[p] for p in starts[1:]), named[-1] + 1]
        layers = [[bounds[k], bounds[k + 1]] for k in range(len(starts))]
    plan: dict = {
        "n": options.n,
        "by": options.by,
        "boundaries": [cuts.crossing_at(p) for p in starts[1:]],
    }
    if layers is not None:
        plan["layers"] = layers
    if times is not None:
        plan["time_ms"] = [round(float(times[a:b].sum()) / 1000, 4) for a, b in zip(starts, ends)]
    return plan
