"""PyTorch frontend: ``package.module:callable`` returning an ``nn.Module``, plus ``--input`` specs."""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

import onnx_ir as ir

from precast.artifact.manifest import TensorSpec
from precast.compiler.frontends.source import Source
from precast.compiler.frontends.torch_export import (
    export_module,
    import_torch,
    sample_dims,
    torch_reference,
)
from precast.errors import ModelLoadError, UsageError, first_line
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = ["load_torch_callable"]


def load_torch_callable(
    spec: str,
    inputs: list[TensorSpec],
    dims: dict[str, int] | None = None,
    progress: ProgressReporter = SILENT,
) -> Source:
    progress.step("importing torch")
    torch = import_torch()
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"bad model '{spec}': expected package.module:callable")
    if not inputs:
        raise UsageError(f"compiling '{spec}' needs --input specs, e.g. --input 'x:float32[batch,16]'")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own code failing at import
        raise ModelLoadError(
            f"cannot import module '{module_name}' for '{spec}': {first_line(e, with_type=True)}"
        ) from e
    try:
        factory = getattr(mod, attr)
    except AttributeError:
        raise ModelLoadError(f"module '{module_name}' has no attribute '{attr}'") from None
    if isinstance(factory, torch.nn.Module):
        module = factory
    elif callable(factory):
        try:
            module = factory()
        except Exception as e:  # the user's code: name it, do not call it a precast bug
            raise ModelLoadError(f"'{spec}' raised {first_line(e, with_type=True)}") from e
    else:
        raise ModelLoadError(f"'{spec}' is a {type(factory).__name__}, not a torch.nn.Module or a callable")
    if not isinstance(module, torch.nn.Module):
        raise ModelLoadError(f"'{spec}' returned {type(module).__name__}, expected a torch.nn.Module")
    module.eval()
    dims = sample_dims(inputs, dims)
    model = export_module(module, inputs, None, dims, progress)
    output_names = [v.name for v in model.graph.outputs]
    digest = hashlib.sha256(ir.serde.serialize_model(model).SerializeToString(deterministic=True)).hexdigest()
    ref = torch_reference(module, [s.name for s in inputs], output_names)
    return Source(
        "torch", attr, model, digest, reference=ref, reference_name="torch (eager)", info={"callable": spec}
    )
