"""ONNX shape inference over the whole graph, merged into the IR with each value's full type.

onnx-ir 1.1's ShapeInferencePass merges only ``dtype`` and ``shape``: a value whose type was unset and that
ONNX infers as a sequence or an optional (an If or Loop output, say) becomes a *tensor* of the element type,
and ONNX Runtime then refuses the model ("Type (tensor(float)) ... does not match expected type
(seq(tensor(float)))"). This pass runs the same ``onnx.shape_inference.infer_shapes`` and merges the whole
inferred type. Large initializers are left out of the proto handed to ONNX (their type and shape stay, as
graph inputs), as onnx-ir does, so models past protobuf's 2 GB limit infer too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from precast.ir.registry import Pass, PassResult, option, register

logger = logging.getLogger(__name__)

_BIG = 1024  # bytes: initializers larger than this travel as typed inputs, without their data


def _known_shapes(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() for v in n.outputs if v.shape is not None)


def _slim_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto whose big initializers are typed graph inputs without data (model unchanged)."""
    graph = model.graph
    saved = []
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or tensor.nbytes <= _BIG:
            continue
        if value.shape is None:
            value.shape = tensor.shape
        if value.dtype is None:
            value.dtype = tensor.dtype
        added = value not in graph.inputs
        if added:
            graph.inputs.append(value)
        graph.initializers.pop(name)
        value.const_value = None
        saved.append((value, tensor, added))
    try:
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor, added in saved:
            value.const_value = tensor
            graph.register_initializer(value)
            if added:
                graph.inputs.remove(value)


def _merge(model: ir.Model, inferred: onnx.ModelProto) -> int:
    """Copy inferred types and shapes onto values that lack them (or know less); return how many changed."""
    changed = 0
    inferred_model = ir.serde.deserialize_model(inferred)
    for original, new in zip(model.graphs(), inferred_model.graphs()):
        known = ir.convenience.create_value_mapping(new)
        for name, value in ir.convenience.create_value_mapping(original).items():
            other = known.get(name)
            if other is None or other.type is None:
                continue
            if value.type is None or (
                isinstance(value.type, ir.TensorType)
                and isinstance(other.type, ir.TensorType)
                and value.dtype != other.dtype
            ):
                value.type = other.type
                changed += 1
            if (
                other.shape is not None
                and value.shape != other.shape
                and isinstance(value.type, ir.TensorType)
            ):
                value.shape = other.shape
                changed += 1
    return changed


@register("infer-shapes")
class InferShapes(Pass):
    """Infer value shapes and types with ONNX shape inference (strict mode off: unknown ops are kept)."""

    @dataclass(frozen=True)
    class Options:
        data_prop: bool = option(
            True, "propagate constant shape values through Shape/Gather/Concat (ONNX data propagation)"
        )

    def call(self, model: ir.Model) -> PassResult:
        before = _known_shapes(model)
        try:
            inferred = onnx.shape_inference.infer_shapes(
                _slim_proto(model), check_type=False, strict_mode=False, data_prop=self.options.data_prop
            )
        except Exception as e:  # ONNX's inference is best effort: a model it cannot infer is left as it is
            logger.warning("shape inference failed (%s); model left unchanged", e)
            return PassResult(model, False, {"shapes_known": before, "new": 0})
        _merge(model, inferred)
        known = _known_shapes(model)
        return PassResult(model, known > before, {"shapes_known": known, "new": known - before})
