"""Keep rewritten graphs valid for the model's opset.

Rewrites (onnxscript's constant folder, precast's loop unrolling) emit ``Unsqueeze`` / ``Squeeze`` / ``Split``
/ ``ReduceSum`` with axes (or split sizes) as a second input, the form opset 13 introduced (18 for the other
reductions). A model that imports an older default-domain opset needs them as an attribute, or ONNX Runtime
refuses to load it ("INVALID_GRAPH ... Unsqueeze").

    Unsqueeze(x, Constant axes)   ==>   Unsqueeze(x) {axes = [...]}        (opset < 13 only)
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["axes_as_attributes"]

# op -> (first opset with the input form, the attribute the older form uses)
_INPUT_FORM = {
    "Unsqueeze": (13, "axes"),
    "Squeeze": (13, "axes"),
    "Split": (13, "split"),
    "ReduceSum": (13, "axes"),
    **{
        f"Reduce{r}": (18, "axes")
        for r in ("Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum", "LogSumExp", "SumSquare")
    },
}


def _const_ints(value: ir.Value | None) -> list[int] | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else [int(v) for v in tensor.numpy().reshape(-1)]


def axes_as_attributes(model: ir.Model) -> list[ir.Node]:
    """Move constant axes / split inputs into attributes where the model's opset predates the input form.

    Returns the nodes that could not be moved (their input is computed): the model is invalid for its opset.
    """
    opset = model.opset_imports.get("", 0)
    stuck = []
    for node in list(model.graph.all_nodes()):
        form = _INPUT_FORM.get(node.op_type) if node.domain == "" else None
        if form is None or opset >= form[0] or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        values = _const_ints(node.inputs[1])
        if values is None:  # a computed input has no older form
            stuck.append(node)
            continue
        node.replace_input_with(1, None)
        node.resize_inputs(1)
        node.attributes[form[1]] = ir.AttrInt64s(form[1], values)
    return stuck
