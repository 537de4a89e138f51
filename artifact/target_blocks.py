"""The manifest's ``target`` block: one record per backend, chosen by the block's ``backend`` key.

``target_block_from_json`` picks the record class from a fixed table precast owns (the manifest never
chooses code): ``onnxruntime`` -> ``OrtBlock`` (``QnnBlock`` for the ``ort-qnn`` target, ``TritonBlock``
for ``triton``), ``openvino`` -> ``OpenVINOBlock``, ``tensorrt`` / ``tensorrt-plan`` -> ``TensorRTBlock``;
a multi-target index's ``{"name": "multi"}`` is an ``IndexTargetBlock``. A backend this runtime does not
know reads as an ``UnknownBackendBlock`` (its own keys kept, unread) and fails at load with "not supported
by this runtime" (exit 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from precast.artifact.schema import Record, type_name
from precast.errors import ArtifactError

__all__ = [
    "TargetBlock",
    "SessionSettings",
    "EPPlugin",
    "OrtBlock",
    "QnnBlock",
    "TritonBlock",
    "OpenVINOBlock",
    "TensorRTBlock",
    "IndexTargetBlock",
    "UnknownBackendBlock",
    "target_block_from_json",
]

ORT = "onnxruntime"


@dataclass(frozen=True)
class TargetBlock(Record):
    """What every target block has. ``requires``: the runtime packages and versions it was built with;
    ``notes``: what the target wants the user to know (printed at compile time)."""

    name: str
    backend: str = ORT
    model: str | None = None
    device: str | None = None
    precision: str | None = None
    requires: dict[str, str] | None = None
    notes: list[str] | None = None

    DEFAULT_MODEL = "model.onnx"

    @property
    def model_file(self) -> str:
        """The model file (relative to the artifact), the backend's default when the block names none."""
        return self.model if self.model is not None else self.DEFAULT_MODEL


@dataclass(frozen=True)
class SessionSettings(Record):
    """ONNX Runtime session settings. ``config``: session config entries (plugin EPs allow-list them)."""

    graph_optimization_level: str | None = None
    intra_op_num_threads: int | None = None
    config: dict[str, str] | None = None
    huge_pages: bool | None = None  # False: keep the weights on 4 KiB pages (runtime/hugepages.py)


@dataclass(frozen=True)
class EPPlugin(Record):
    """A plugin execution provider from precast's allow-list (runtime/backends/ep_plugin.py); ``package`` is
    informational and must match the allow-list's."""

    ep: str
    package: str | None = None
    backend_lib: str | None = None


@dataclass(frozen=True)
class OrtBlock(TargetBlock):
    """ONNX Runtime (``ort-cpu``). ``provider_options`` (plugin EPs) and ``static_shapes`` (input name ->
    the shape an NPU compiled for) are plain objects, checked by runtime/backends/ep_plugin.py."""

    providers: list[str] | None = None
    session: SessionSettings | None = None
    offline_ort_level: str | None = None
    ep_plugin: EPPlugin | None = None
    provider_options: dict | None = None
    static_shapes: dict[str, list[int]] | None = None

    @property
    def provider_list(self) -> list[str]:
        return list(self.providers) if self.providers is not None else ["CPUExecutionProvider"]

    @property
    def session_settings(self) -> SessionSettings:
        return self.session if self.session is not None else SessionSettings()


@dataclass(frozen=True)
class QnnBlock(OrtBlock):
    """``ort-qnn``: the QNN HTP plugin. ``quantization``, ``htp`` and ``placement`` ({on_htp, nodes}) are
    build records for people and tools; the runtime does not read them. ``buckets`` (several static sequence
    lengths, one EP-context model each) is read by runtime/buckets.py."""

    quantization: dict | None = None
    htp: dict | None = None
    placement: dict | None = None
    buckets: dict | None = None


@dataclass(frozen=True)
class TritonBlock(OrtBlock):
    """``triton``: a Triton model repository; ``triton`` (repository, model names, batching) is read by
    Triton's python model, not by this runtime, and stays a plain object."""

    triton: dict | None = None


@dataclass(frozen=True)
class OpenVINOBlock(TargetBlock):
    """OpenVINO IR. ``config``: OpenVINO properties (allow-listed by runtime/backends/openvino.py)."""

    weights: str | None = None
    config: dict[str, str | int | float] | None = None

    DEFAULT_MODEL = "model.xml"


@dataclass(frozen=True)
class TensorRTBlock(TargetBlock):
    """A TensorRT engine (``backend: tensorrt``) or a build plan (``tensorrt-plan``: the prepared ONNX and
    ``plan``, built into an engine on the GPU host). ``profiles``: input -> {min, opt, max} shapes.
    The engine's keys (``onnx``, ``tensorrt_version``, ``compute_capability``) are written by
    targets/trt_engine_builder.py, which runs without precast on the GPU host and so writes plain JSON."""

    profiles: dict[str, dict[str, list[int]]] | None = None
    prepared_with: str | None = None  # the tool and version that prepared the ONNX
    onnx: str | None = None
    plan: str | None = None
    engine_built: bool | None = None
    why_plan: str | None = None
    verified_as: str | None = None
    tensorrt_version: str | None = None
    compute_capability: str | None = None

    DEFAULT_MODEL = "model.engine"

    @property
    def is_plan(self) -> bool:
        return self.backend == "tensorrt-plan"


@dataclass(frozen=True)
class IndexTargetBlock(Record):
    """The ``target`` of a multi-target index: only its name (``multi``); each sub-artifact has its own."""

    name: str


@dataclass(frozen=True)
class UnknownBackendBlock(TargetBlock):
    """A block whose ``backend`` this runtime does not know (a newer precast's, or misspelt): the common keys
    are checked, the backend's own are kept unread (``backend_keys``) and written back as they were. The
    manifest reads (inspect, integrity, a multi-target index falls back past it); a session for it fails
    with "backend '...' is not supported by this runtime" (exit 4), as before the typed schema."""

    backend_keys: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: object, where: str, path: str = "") -> UnknownBackendBlock:
        if not isinstance(obj, dict):
            return super().from_json(obj, where, path)  # the base's "must be a JSON object"
        common = {f.name for f in fields(TargetBlock)}
        block = TargetBlock.from_json({k: v for k, v in obj.items() if k in common}, where, path)
        own = {k: v for k, v in obj.items() if k not in common}
        return cls(**{f.name: getattr(block, f.name) for f in fields(TargetBlock)}, backend_keys=own)

    def to_json(self) -> dict:
        out = super().to_json()
        del out["backend_keys"]
        return {**out, **self.backend_keys}


INDEX_TARGET = "multi"
_BY_BACKEND: dict[str, type[TargetBlock]] = {
    ORT: OrtBlock,
    "openvino": OpenVINOBlock,
    "tensorrt": TensorRTBlock,
    "tensorrt-plan": TensorRTBlock,
}
_ORT_BY_TARGET: dict[str, type[OrtBlock]] = {"ort-qnn": QnnBlock, "triton": TritonBlock}


def target_block_from_json(obj: object, where: str) -> TargetBlock | IndexTargetBlock:
    if not isinstance(obj, dict):
        raise ArtifactError(f"{where}: 'target' must be a JSON object, got {type_name(obj)}")
    if "name" not in obj:
        raise ArtifactError(f"{where}: target block: missing required key 'name'")
    name, backend = obj["name"], obj.get("backend", ORT)
    if not isinstance(name, str) or not isinstance(backend, str):
        raise ArtifactError(f"{where}: target block: 'name' and 'backend' must be strings")
    block_where = f"{where}: target block '{name}'"
    if name == INDEX_TARGET and "backend" not in obj:
        return IndexTargetBlock.from_json(obj, block_where)
    cls = _BY_BACKEND.get(backend, UnknownBackendBlock)
    if cls is OrtBlock:
        cls = _ORT_BY_TARGET.get(name, OrtBlock)
    return cls.from_json(obj, block_where)
