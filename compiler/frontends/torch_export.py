"""torch.onnx (dynamo) export shared by the PyTorch and Hugging Face frontends. torch is imported lazily."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from precast.artifact.manifest import TensorSpec
from precast.errors import ExportError, UsageError, first_line
from precast.ir.parity import check_sample_size
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "import_torch",
    "export_module",
    "dynamo_export",
    "sample_dims",
    "torch_reference",
    "example_array",
]

_SAMPLE_SIZES = [2, 8, 5, 3, 7, 6, 4]


def import_torch():
    try:
        import torch
    except ImportError:
        raise UsageError(
            "exporting from PyTorch needs torch: pip install 'precast[export]' (torch==2.13.0)"
        ) from None
    return torch


def sample_dims(specs: Sequence[TensorSpec], overrides: dict[str, int] | None = None) -> dict[str, int]:
    """A distinct sample size per symbolic dim (distinct, so the exporter does not unify them)."""
    dims: dict[str, int] = {}
    sizes = iter(_SAMPLE_SIZES)
    for spec in specs:
        for d in spec.shape or ():
            if isinstance(d, str) and d not in dims:
                dims[d] = (overrides or {}).get(d) or next(sizes, 4)
    return dims


def example_array(spec: TensorSpec, dims: dict[str, int]) -> np.ndarray:
    shape = tuple(d if isinstance(d, int) else dims[d] for d in spec.shape or ())
    if spec.dtype.startswith(("int", "uint")):
        return np.ones(shape, dtype=spec.dtype)
    if spec.dtype == "bool":
        return np.ones(shape, dtype=bool)
    return np.random.default_rng(0).standard_normal(shape).astype(spec.dtype)


def export_module(
    module,
    inputs: Sequence[TensorSpec],
    output_names: Sequence[str] | None,
    dims: dict[str, int],
    progress: ProgressReporter = SILENT,
) -> ir.Model:
    shapes = [
        (s.name, [d if isinstance(d, int) else dims[d] for d in s.shape or ()], s.dtype) for s in inputs
    ]
    check_sample_size(
        shapes,
        what="example data to export",
        hint="; use smaller --dim sizes, or name the large dims in --input (e.g. 'x:float32[batch,seq]')",
    )
    torch = import_torch()
    examples = tuple(torch.from_numpy(example_array(s, dims)) for s in inputs)
    dynamic = {s.name: {i: d for i, d in enumerate(s.shape or ()) if isinstance(d, str)} for s in inputs}
    # dynamic_shapes is keyed by forward()'s parameter names; fall back to positional order.
    if _by_keyword(module, [s.name for s in inputs]):
        kwargs = {s.name: t for s, t in zip(inputs, examples)}
        args: tuple = ()
    else:
        kwargs, args = {}, examples
        dynamic = tuple(dynamic.values())  # type: ignore[assignment]
    return dynamo_export(
        module,
        args,
        kwargs=kwargs or None,
        input_names=[s.name for s in inputs],
        output_names=list(output_names) if output_names else None,
        dynamic_shapes=dynamic,
        progress=progress,
    )


def dynamo_export(module, args: tuple, progress: ProgressReporter = SILENT, **export_kwargs) -> ir.Model:
    """torch.onnx.export(dynamo=True, optimize=True), quiet, with a one-line ExportError on failure.

    The exporter's logs and stdout chatter are silenced; its host/torch metadata is dropped so the artifact
    does not depend on them.
    """
    torch = import_torch()
    progress.step(f"exporting {type(module).__name__} with torch.export (dynamo)")
    for name in ("torch.onnx", "torch._export", "torch.export", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # failures surface as one ExportError line
    try:
        with warnings.catch_warnings(), torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, dynamo=True, optimize=True, verbose=False, **export_kwargs
            )
    except Exception as e:
        root = e  # torch wraps the cause in a generic "Failed to export ... Next steps" message
        while root.__cause__ is not None:
            root = root.__cause__
        raise ExportError(
            f"torch.onnx.export failed for {type(module).__name__}: {first_line(root, with_type=True)}"
        ) from e
    model = program.model
    model.graph.name = model.graph.name or "main"
    model.metadata_props.clear()
    model.graph.metadata_props.clear()
    _drop_stack_traces(model)
    return model


def _drop_stack_traces(model) -> None:
    """Remove the exporter's per-node Python stack traces: they hold absolute source paths (where precast and
    transformers are installed), so the same model compiled from two installs gave different bytes."""
    import onnx_ir as ir

    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


def _by_keyword(module, names: Sequence[str]) -> bool:
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and all(n in params for n in names)


def torch_reference(module, input_names: Sequence[str], output_names: Sequence[str]):
    torch = import_torch()
    keyword = _by_keyword(module, input_names)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            tensors = {n: torch.from_numpy(np.asarray(feeds[n], order="C")) for n in input_names}
            out = module(**tensors) if keyword else module(*tensors.values())
        if hasattr(out, "to_tuple"):
            out = out.to_tuple()
        if isinstance(out, torch.Tensor):
            out = (out,)
        flat = [t for t in out if isinstance(t, torch.Tensor)]
        return {n: t.detach().cpu().numpy() for n, t in zip(output_names, flat)}

    return run
