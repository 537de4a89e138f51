"""Shared by the quantize-* / convert-fp16 passes: IR <-> proto, node naming, the ``exclude`` option.

ONNX Runtime's quantizers work on ModelProto (or files); the passes hand them a proto and read the
result back into onnx_ir.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence

import onnx
import onnx_ir as ir

from precast.errors import PassOptionError

__all__ = ["quiet", "to_proto", "from_proto", "name_nodes", "resolve_exclude", "QUANTIZE_PASSES", "count_ops"]

# Passes that change precision: the driver verifies them with an accuracy budget, not fp32 tolerances.
QUANTIZE_PASSES = frozenset({"quantize-int8", "quantize-int4", "convert-fp16"})


def name_nodes(model: ir.Model) -> int:
    """Give every unnamed node a unique name (the quantizers key their configs by node name)."""
    taken = {n.name for n in model.graph.all_nodes() if n.name}
    named = 0
    for i, node in enumerate(model.graph.all_nodes()):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
            named += 1
    return named


def to_proto(model: ir.Model) -> onnx.ModelProto:
    name_nodes(model)
    return ir.serde.serialize_model(model)


def from_proto(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def resolve_exclude(model: ir.Model, exclude: Sequence[str], pass_name: str) -> list[str]:
    """Node names to keep at full precision: each item is a node name or an op type (all its nodes).

    An item that matches nothing is a user error: a typo would silently quantize the layer.
    """
    nodes = list(model.graph.all_nodes())
    by_name = {n.name for n in nodes}
    out: list[str] = []
    for item in exclude:
        if item in by_name:
            out.append(item)
            continue
        of_type = [n.name for n in nodes if n.op_type == item]
        if not of_type:
            import difflib

            close = difflib.get_close_matches(item, sorted(by_name | {n.op_type for n in nodes}), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise PassOptionError(
                f"pass '{pass_name}' option exclude: no node or op type named '{item}'{hint}"
            )
        out.extend(of_type)
    return sorted(set(out))


def count_ops(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in model.graph.all_nodes():
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def import_quietly(module: str):
    """Import ``module`` keeping the root logger as it was: ONNX Runtime's matmul_nbits_quantizer calls
    logging.basicConfig(level=INFO) on import, after which every library's INFO records (onnxscript's constant
    folding, onnx_ir's passes) were printed on stderr for the rest of the compile."""
    import importlib

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return importlib.import_module(module)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the quantizers' prints and root-logger warnings (they would corrupt ``--json`` stdout)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)
