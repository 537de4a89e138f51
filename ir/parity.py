"""Verification: run the reference and the compiled artifact on the same sample feeds and compare."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from precast.artifact.manifest import TensorSpec
from precast.errors import UsageError
from precast.runtime.verify import Tolerance, compare_outputs

__all__ = [
    "Tolerance",
    "io_signature",
    "make_sample_feeds",
    "compare_outputs",
    "ort_run_model",
    "DEFAULT_TOL",
    "MAX_SAMPLE_BYTES",
    "check_sample_size",
]

# Generated sample (and export example) feeds stop here, in all: a model may claim any static size, and a
# MemoryError halfway through is a crash, not an answer. Bigger feeds come from the user (--sample-inputs).
MAX_SAMPLE_BYTES = 1 << 30


DEFAULT_TOL = {
    "fp32": Tolerance(1e-4, 1e-3, 0.9999),
    "fp16": Tolerance(1e-2, 1e-2, 0.999),
    # INT8 error is a few quantization steps of each tensor's own range, so no absolute bound fits every
    # model: the budget is the cosine of each output against the fp32 reference (atol None = cosine only).
    "int8": Tolerance(None, None, 0.99),
}


def _dtype_name(t: ir.TypeProtocol | None) -> str:
    """numpy's name for a tensor's element type; ``seq(...)`` / ``optional(...)`` around it for those types."""
    if isinstance(t, ir.SequenceType):
        return f"seq({_dtype_name(t.elem_type)})"
    if isinstance(t, ir.OptionalType):
        return f"optional({_dtype_name(t.elem_type)})"
    if t is None or not isinstance(t, ir.TensorType):
        return "unknown"
    try:
        return np.dtype(t.dtype.numpy()).name
    except Exception:
        return str(t.dtype).lower()


def _shape(v: ir.Value) -> tuple | None:
    if v.shape is None:
        return None
    return tuple(
        d if isinstance(d, int) else (d.value if getattr(d, "value", None) else None) for d in v.shape
    )


def io_signature(model: ir.Model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    init = set(model.graph.initializers)
    ins = [
        TensorSpec(v.name, _dtype_name(v.type), _shape(v)) for v in model.graph.inputs if v.name not in init
    ]
    outs = [TensorSpec(v.name, _dtype_name(v.type), _shape(v)) for v in model.graph.outputs]
    return ins, outs


def _index_bound(model: ir.Model, name: str) -> int | None:
    """If ``name`` feeds the indices of a Gather over a constant table, the table's size along the axis."""
    bound = None
    for node in model.graph.all_nodes():
        if (
            node.op_type == "Gather"
            and len(node.inputs) > 1
            and node.inputs[1] is not None
            and node.inputs[1].name == name
        ):
            data = node.inputs[0]
            axis = node.attributes.get_int("axis", 0)
            if data is not None and data.shape is not None and isinstance(data.shape[axis], int):
                bound = data.shape[axis] if bound is None else min(bound, data.shape[axis])
    return bound


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # a dtype numpy does not name (bfloat16 without ml_dtypes): count it as 4 bytes
        return 4


def check_sample_size(
    shapes: Sequence[tuple[str, Sequence[int], str]], what: str = "sample data", hint: str = ""
) -> None:
    """Raise UsageError before allocating when (name, concrete shape, dtype) arrays would pass MAX_SAMPLE_BYTES.

    The message names the input that crosses the cap, its shape, dtype and bytes, then ``hint``.
    """
    total = 0
    for name, shape, dtype in shapes:
        need = math.prod(int(d) for d in shape) * _itemsize(dtype)
        total += need
        if total > MAX_SAMPLE_BYTES:
            before = f", {_size(total)} with the inputs before it" if total != need else ""
            raise UsageError(
                f"input '{name}': {[int(d) for d in shape]} {dtype} needs {_size(need)} of {what}{before} "
                f"(precast generates at most {MAX_SAMPLE_BYTES / 2**30:.1f} GiB){hint}"
            )


def make_sample_feeds(
    model: ir.Model, specs: Sequence[TensorSpec], dims: Mapping[str, int] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds from the IO signature: symbolic dims from ``dims`` (default batch-like 2, others 16).

    Integer inputs that index an embedding table stay in range; masks are ones; type ids zeros.
    """
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        if spec.dtype.startswith(("seq(", "optional(")) or spec.dtype == "unknown":
            raise UsageError(
                f"input '{spec.name}' is of type {spec.dtype}: precast generates tensor feeds only; pass your own "
                "sample feeds (CompileOptions.sample_inputs, a list of arrays for a sequence)"
            )
        if spec.shape is None:
            raise UsageError(f"input '{spec.name}' has unknown rank: pass --sample-inputs feeds.npz")
        shape = []
        for i, d in enumerate(spec.shape):
            if isinstance(d, int):
                shape.append(d)
            else:
                key = d or f"{spec.name}_{i}"
                if key not in dims:
                    dims[key] = 2 if i == 0 else 16
                shape.append(dims[key])
        shapes[spec.name] = shape
    check_sample_size(
        [(s.name, shapes[s.name], s.dtype) for s in specs],
        hint="; pass your own feeds with --sample-inputs feeds.npz"
        + (
            " or smaller --dim sizes"
            if any(isinstance(d, str) or d is None for s in specs for d in s.shape)
            else ""
        ),
    )
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = shapes[spec.name]
        lname = spec.name.lower()
        if spec.dtype == "object":  # string tensors: short distinct words
            arr = np.array([f"s{i}" for i in range(math.prod(shape))], dtype=object).reshape(shape)
        elif spec.dtype == "bool":
            arr = np.asarray(rng.random(shape) > 0.5)  # a 0-d comparison is a numpy.bool scalar, not an array
        elif spec.dtype.startswith(("int", "uint")):
            if "mask" in lname:
                arr = np.ones(shape, dtype=spec.dtype)
            elif "type" in lname or "segment" in lname:
                arr = np.zeros(shape, dtype=spec.dtype)
            else:
                hi = _index_bound(model, spec.name) or 100
                arr = rng.integers(0, hi, size=shape).astype(spec.dtype)
        else:
            arr = rng.standard_normal(shape).astype(spec.dtype)
        feeds[spec.name] = arr
    return feeds


def ort_run_model(
    model: ir.Model, feeds: Mapping[str, np.ndarray], level: str = "disable"
) -> dict[str, np.ndarray]:
    """Run an in-memory IR model with ONNX Runtime (the reference for ONNX sources)."""
    import onnxruntime as ort

    from precast.runtime.backends import OPT_LEVELS

    proto = ir.serde.serialize_model(model)
    data = proto.SerializeToString()
    so = ort.SessionOptions()  # the reference: no artifact settings, default threads, quiet
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[level])
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, dict(feeds))))
