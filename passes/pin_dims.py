"""Pin every symbolic input dim to the compile's sample-feed shapes; shape inference then makes the graph static.

For backends that run static shapes only (the QNN HTP): once ``batch`` and ``sequence`` are numbers, the
shape-computing subgraphs a dynamo export leaves (Shape -> Gather -> Range / Expand / Concat -> Reshape) have
constant inputs, and ``fold-constants`` removes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from precast.errors import PassFailedError
from precast.ir.registry import Pass, PassFacts, PassResult, option, register
from precast.passes.infer_shapes import InferShapes

__all__ = ["PinDims"]


def _symbolic(shape: ir.Shape | None) -> bool:
    return shape is not None and any(not isinstance(d, int) for d in shape)


def symbolic_io(graph: ir.Graph) -> dict[str, tuple[int | str | None, ...]]:
    """Each graph input's and output's shape, a symbolic dim by its name (what ``PassFacts.symbolic_io`` holds)."""
    return {
        v.name: tuple(d if isinstance(d, int) else d.value for d in v.shape)
        for v in [*graph.inputs, *graph.outputs]
        if v.shape is not None and v.name not in graph.initializers
    }


@register("pin-dims")
class PinDims(Pass):
    """Symbolic input dims -> the sample feeds' sizes, everywhere the same symbol appears; then infer shapes.

        input_ids [batch, sequence] + sample feed (1, 128)       ==>  input_ids [1, 128]
        Shape(x) -> Gather(1) -> Range(0, .) -> Expand ...        ==>  static shapes (fold-constants folds them)

    The sizes come from the pass context's sample feeds: the shapes the compile verifies with, and so the
    shapes a static-shape artifact must be built for. A symbol bound to two sizes is an error.
    """

    @dataclass(frozen=True)
    class Options:
        infer: bool = option(True, "run shape inference afterwards, so static shapes reach every value")

    def call(self, model: ir.Model) -> PassResult:
        feeds = self.context.sample_feeds
        if not feeds:
            raise PassFailedError("pin-dims needs the compile's sample feeds (it pins dims to their shapes)")
        graph = model.graph
        # The symbolic shapes before pinning: a target that builds several sizes of one dim (ort-qnn sequence
        # buckets) reads which axis of each input and output that dim is.
        facts = PassFacts(symbolic_io=symbolic_io(graph))
        sizes: dict[str, int] = {}
        pinned_inputs = 0
        for value in graph.inputs:
            if value.name in graph.initializers or not isinstance(value.type, ir.TensorType):
                continue
            if value.name not in feeds:
                raise PassFailedError(f"pin-dims: no sample feed for input '{value.name}'")
            shape = tuple(int(d) for d in np.shape(feeds[value.name]))
            if value.shape is not None:
                if len(value.shape) != len(shape):
                    raise PassFailedError(
                        f"pin-dims: input '{value.name}' has rank {len(value.shape)}, its feed {list(shape)}"
                    )
                for dim, size in zip(value.shape, shape):
                    if isinstance(dim, int):
                        if dim != size:
                            raise PassFailedError(
                                f"pin-dims: input '{value.name}' has dim {dim}, its sample feed {size}"
                            )
                    elif dim.value is not None:
                        bound = sizes.setdefault(dim.value, size)
                        if bound != size:
                            raise PassFailedError(
                                f"pin-dims: dim '{dim.value}' is {bound} in one sample feed and {size} in "
                                f"'{value.name}'"
                            )
            if _symbolic(value.shape) or value.shape is None:
                pinned_inputs += 1
            value.shape = ir.Shape(shape)
        # The same names on other values (outputs, intermediates the exporter annotated) take the same sizes.
        for g in model.graphs():
            values = [*g.outputs, *(out for node in g for out in node.outputs)]
            for value in values:
                if _symbolic(value.shape):
                    value.shape = ir.Shape(
                        [sizes.get(d.value, d) if not isinstance(d, int) else d for d in value.shape]
                    )
        if self.options.infer:
            model = InferShapes()(model).model
        values = {id(v): v for g in model.graphs() for v in [*g.outputs, *(o for n in g for o in n.outputs)]}
        left = sum(1 for v in values.values() if _symbolic(v.shape))
        dims = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
        stats = {"inputs_pinned": pinned_inputs, "dims": dims, "symbolic_left": left}
        return PassResult(model, pinned_inputs > 0, stats, facts)
