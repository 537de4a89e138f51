"""Frontends: turn what the user points at (ONNX file, ``module:callable``, local HF folder) into a Source."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from precast.artifact.manifest import TensorSpec
from precast.errors import ModelLoadError, UsageError, first_line
from precast.runtime.option_text import option_groups
from precast.runtime.progress import reporter

__all__ = ["Source", "load_source", "locate_source", "parse_input_spec", "hash_files"]

Reference = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Source:
    kind: str  # "onnx" | "torch" | "hf"
    name: str
    model: ir.Model
    sha256: str
    reference: Reference | None = None  # torch forward; None => ORT on the unoptimized source graph
    reference_name: str = "onnxruntime (unoptimized source graph)"
    ship_files: dict[str, Path] = field(default_factory=dict)  # artifact-relative name -> file to copy
    info: dict = field(default_factory=dict)  # -> manifest "source" block; info["llm"] -> top-level "llm"
    sample_feeds: dict[str, np.ndarray] | None = None  # verification feeds when generated ones make no sense
    # A target's own lowering of the source, which it builds instead of the ONNX graph (causal-lm:
    # "openvino" -> lowering(progress) -> (ov.Model with PagedAttention, its llm block); compiler/decoder/ov_decoder.py)
    lowerings: dict[str, Callable] = field(default_factory=dict)


_SPEC = re.compile(r"^\s*([A-Za-z_][\w.:/-]*)\s*:\s*([a-z0-9]+)\s*\[([^\]]*)\]\s*$")
_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


def parse_input_spec(text: str) -> TensorSpec:
    """``input_ids:int64[batch,seq]`` -> TensorSpec (ints are static dims, names are symbolic)."""
    expected = "NAME:DTYPE[dim,dim,...], e.g. 'input_ids:int64[batch,seq]'"
    name, dtype, dims = option_groups(_SPEC, text, "--input", expected)
    if dtype not in _DTYPES:
        raise UsageError(
            f"bad --input '{text}': unknown dtype '{dtype}' (one of {', '.join(sorted(_DTYPES))})"
        )
    shape: list[int | str] = []
    for d in (x.strip() for x in dims.split(",") if x.strip()):
        if d.isdigit():
            shape.append(int(d))
        elif re.fullmatch(r"[A-Za-z_]\w*", d):
            shape.append(d)
        else:
            raise UsageError(f"bad --input '{text}': dim '{d}' must be an integer or a name")
    return TensorSpec(name, dtype, tuple(shape))


def hash_files(paths: list[Path], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        rel = p.relative_to(root).as_posix() if root else p.name
        h.update(rel.encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def load_source(
    spec: str,
    *,
    inputs: list[TensorSpec] | None = None,
    task: str | None = None,
    dims: dict[str, int] | None = None,
    kv_layout: str | None = None,
    progress=None,
) -> Source:
    """Dispatch on what ``spec`` names: an .onnx file, a folder with config.json, or ``module:callable``.

    ``kv_layout`` ('mapped' | 'paged', None = the model's best) applies to ``task='causal-lm'`` only.
    ``progress`` (precast.runtime.progress) hears the steps of a torch export: import, weights, export."""
    report = reporter(progress)
    if kv_layout is not None and task != "causal-lm":
        raise UsageError(f"--kv-layout {kv_layout} applies to --task causal-lm only")
    kind, path = locate_source(spec)
    if kind == "hf":
        from precast.compiler.frontends.hf_source import load_hf_folder

        return load_hf_folder(path, task=task, dims=dims, kv_layout=kv_layout, progress=report)
    if kind == "onnx":
        _no_export_options(path, task, inputs)
        return load_onnx(path)
    from precast.compiler.frontends.torch_source import load_torch_callable

    return load_torch_callable(spec, inputs or [], dims=dims, progress=report)


def locate_source(spec: str) -> tuple[str, Path]:
    """What ``spec`` names, without reading it: ("hf", folder), ("onnx", file) or ("torch", Path(spec)).

    A folder is a Hugging Face model (config.json) or holds exactly one .onnx file; ModelLoadError otherwise."""
    path = Path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        onnx_files = sorted(path.glob("*.onnx"))
        if len(onnx_files) == 1:
            return "onnx", onnx_files[0]
        raise ModelLoadError(
            f"{path}: a folder must hold a Hugging Face model (config.json) or exactly one .onnx file"
        )
    if path.suffix == ".onnx" or path.exists():
        return "onnx", path
    if ":" in spec and os.path.sep not in spec.split(":", 1)[0]:
        return "torch", path
    raise ModelLoadError(
        f"model not found: '{spec}' (expected an .onnx file, a Hugging Face folder, or module:callable)"
    )


def _no_export_options(path: Path, task: str | None, inputs) -> None:
    """--task and --input steer an export; an ONNX file is already exported, and ignoring them would hide a
    mistake (a wrong path, or the wrong model)."""
    if task is not None:
        raise UsageError(f"--task applies to Hugging Face folders; {path} is an ONNX file")
    if inputs:
        raise UsageError(f"--input applies to PyTorch callables; {path} is an ONNX file")


def load_onnx(path: Path) -> Source:
    import onnx
    from google.protobuf.message import DecodeError

    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a folder, not an ONNX file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not an ONNX model or truncated protobuf ({type(e).__name__})") from e
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"{path}: not an ONNX model (no graph, no outputs)")
    base = path.parent.resolve()
    files = [path.resolve()]
    for tensor in _proto_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((kv.value for kv in tensor.external_data if kv.key == "location"), None)
        if location is None:
            raise ModelLoadError(f"{path}: tensor '{tensor.name}' has external data without a location")
        ext = (base / location).resolve()  # symlinks resolved: a link out of the folder is outside too
        if base not in ext.parents:
            raise ModelLoadError(f"{path}: external data '{location}' points outside the model folder")
        if not ext.is_file():
            raise ModelLoadError(f"{path}: external data file '{location}' is missing")
        if ext not in files:
            files.append(ext)
    try:
        model = ir.load(str(path))
        # Bring external weights into memory: passes and the reference run work on in-memory models.
        ir.external_data.load_to_model(model)
        _load_attribute_tensors(model, base)
    except Exception as e:  # onnx_ir raises several types on malformed graphs
        raise ModelLoadError(f"{path}: malformed ONNX graph ({first_line(e)})") from e
    return Source("onnx", path.stem, model, hash_files(files, base))


def _proto_tensors(proto):
    """Every TensorProto of a ModelProto that may hold external data: initializers (sparse ones too) and
    tensor attributes, in the main graph, every subgraph and every function."""
    import onnx

    def of_attr(attr):
        kind = onnx.AttributeProto
        if attr.type == kind.TENSOR:
            yield attr.t
        elif attr.type == kind.TENSORS:
            yield from attr.tensors
        elif attr.type == kind.SPARSE_TENSOR:
            yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
        elif attr.type == kind.SPARSE_TENSORS:
            for sp in attr.sparse_tensors:
                yield from (sp.values, sp.indices)
        elif attr.type == kind.GRAPH:
            yield from of_graph(attr.g)
        elif attr.type == kind.GRAPHS:
            for g in attr.graphs:
                yield from of_graph(g)

    def of_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                yield from of_attr(attr)

    def of_graph(graph):
        yield from graph.initializer
        for sp in graph.sparse_initializer:
            yield from (sp.values, sp.indices)
        yield from of_nodes(graph.node)

    yield from of_graph(proto.graph)
    for fn in proto.functions:
        yield from of_nodes(fn.node)


def _load_attribute_tensors(model: ir.Model, base: Path) -> None:
    """Tensor attributes with external data (a Constant's ``value``) into memory, read from the model's folder.

    onnx_ir's load_to_model brings initializers only; an attribute left external would be serialized as a
    reference that ONNX Runtime resolves against the working directory (or, in the artifact, not at all).
    Their locations were checked against the folder above.
    """
    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for name, attr in list(node.attributes.items()):
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    node.attributes[name] = ir.AttrTensor(name, _in_memory(attr.value, base))
                elif attr.type == ir.AttributeType.TENSORS and any(
                    isinstance(t, ir.ExternalTensor) for t in attr.value
                ):
                    tensors = [
                        _in_memory(t, base) if isinstance(t, ir.ExternalTensor) else t for t in attr.value
                    ]
                    node.attributes[name] = ir.AttrTensors(name, tensors)


def _in_memory(tensor: ir.ExternalTensor, base: Path) -> ir.Tensor:
    ext = ir.ExternalTensor(
        tensor.location,
        tensor.offset,
        tensor.length,
        tensor.dtype,
        shape=tensor.shape,
        name=tensor.name,
        base_dir=base,
    )
    data = ext.numpy().copy()
    ext.release()
    return ir.Tensor(data, dtype=tensor.dtype, name=tensor.name)
