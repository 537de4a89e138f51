"""Triton model configurations (config.pbtxt) from precast IO signatures: plain data in, text out.

Triton's batching convention: when ``max_batch_size > 0`` the leading (batch) dim is left out of every
input's and output's ``dims``. precast strips it only when every input and output starts with the *same*
symbolic dim (``batch``), which is what Triton's dynamic batcher needs to stack requests; otherwise the
model gets ``max_batch_size: 0`` and full dims (``-1`` for every symbolic dim).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from precast.artifact.manifest import TensorSpec
from precast.errors import UsageError

__all__ = [
    "TRITON_DTYPES",
    "EnsembleStep",
    "ModelConfig",
    "TensorConfig",
    "render_config",
    "shared_batch_dim",
    "tensor_configs",
]

# numpy dtype name -> Triton data type (model_config.proto DataType).
TRITON_DTYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
    "object": "TYPE_STRING",
    "bytes": "TYPE_STRING",
}


@dataclass(frozen=True)
class TensorConfig:
    name: str
    data_type: str  # TYPE_*
    dims: tuple[int, ...]  # -1 = variable
    reshape: tuple[int, ...] | None = None  # set for scalars: dims [1] reshaped to []
    optional: bool = False


@dataclass(frozen=True)
class EnsembleStep:
    """One step of an ensemble: a model, and which ensemble tensor feeds each of its inputs / receives each
    of its outputs (``{model tensor name: ensemble tensor name}``)."""

    model_name: str
    input_map: dict[str, str]
    output_map: dict[str, str]
    model_version: int = -1  # -1: the latest version the server loaded


@dataclass
class ModelConfig:
    name: str
    inputs: list[TensorConfig]
    outputs: list[TensorConfig]
    platform: str | None = None  # "onnxruntime_onnx", "ensemble"
    backend: str | None = None  # "python"
    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int | None = None  # None: no dynamic batcher
    instance_count: int = 1
    instance_kind: str = "KIND_CPU"
    decoupled: bool = False
    default_model_filename: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    ensemble_steps: list[EnsembleStep] = field(default_factory=list)  # platform "ensemble" only

    @property
    def is_ensemble(self) -> bool:
        return self.platform == "ensemble"


def shared_batch_dim(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str | None:
    """The symbolic leading dim every input and output shares (Triton's batch dim), else None."""
    firsts = {s.shape[0] if s.shape else None for s in (*inputs, *outputs)}
    if len(firsts) == 1:
        (first,) = firsts
        if isinstance(first, str):
            return first
    return None


def _dims(spec: TensorSpec, drop_batch: bool) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    if spec.shape is None:
        raise UsageError(
            f"target 'triton': tensor '{spec.name}' has unknown rank; Triton needs dims "
            "(give the input a shape with --input, or run infer-shapes)"
        )
    dims = tuple(d if isinstance(d, int) else -1 for d in spec.shape)
    if drop_batch:
        dims = dims[1:]
    if not dims:  # Triton wants at least one dim: a scalar is [1] reshaped to []
        return (1,), ()
    return dims, None


def tensor_configs(specs: Sequence[TensorSpec], drop_batch: bool) -> list[TensorConfig]:
    out = []
    for spec in specs:
        if spec.dtype not in TRITON_DTYPES:
            raise UsageError(
                f"target 'triton': tensor '{spec.name}' has dtype {spec.dtype}, which Triton cannot carry"
            )
        dims, reshape = _dims(spec, drop_batch)
        out.append(TensorConfig(spec.name, TRITON_DTYPES[spec.dtype], dims, reshape))
    return out


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _ints(values: Sequence[int]) -> str:
    return "[ " + ", ".join(str(int(v)) for v in values) + " ]"


def _tensor_block(t: TensorConfig) -> list[str]:
    lines = ["  {", f"    name: {_q(t.name)}", f"    data_type: {t.data_type}", f"    dims: {_ints(t.dims)}"]
    if t.reshape is not None:
        lines.append(f"    reshape: {{ shape: {_ints(t.reshape)} }}")
    if t.optional:
        lines.append("    optional: true")
    lines.append("  }")
    return lines


def _list_block(key: str, tensors: Sequence[TensorConfig]) -> list[str]:
    lines = [f"{key} ["]
    for i, t in enumerate(tensors):
        block = _tensor_block(t)
        if i < len(tensors) - 1:
            block[-1] += ","
        lines += block
    return lines + ["]"]


def _map_entries(key: str, mapping: dict[str, str]) -> list[str]:
    return [f"      {key} {{ key: {_q(k)} value: {_q(v)} }}" for k, v in mapping.items()]


def _ensemble_block(steps: Sequence[EnsembleStep]) -> list[str]:
    lines = ["ensemble_scheduling {", "  step ["]
    for i, step in enumerate(steps):
        lines += [
            "    {",
            f"      model_name: {_q(step.model_name)}",
            f"      model_version: {int(step.model_version)}",
        ]
        lines += _map_entries("input_map", step.input_map) + _map_entries("output_map", step.output_map)
        lines.append("    }," if i < len(steps) - 1 else "    }")
    return lines + ["  ]", "}"]


def render_config(cfg: ModelConfig) -> str:
    """config.pbtxt text (protobuf text format of inference.ModelConfig); deterministic."""
    if bool(cfg.platform) == bool(cfg.backend):
        raise ValueError("a Triton model config names exactly one of platform / backend")
    lines = [f"name: {_q(cfg.name)}"]
    lines.append(f"platform: {_q(cfg.platform)}" if cfg.platform else f"backend: {_q(cfg.backend)}")
    lines.append(f"max_batch_size: {int(cfg.max_batch_size)}")
    if cfg.default_model_filename:
        lines.append(f"default_model_filename: {_q(cfg.default_model_filename)}")
    lines += _list_block("input", cfg.inputs)
    lines += _list_block("output", cfg.outputs)
    if cfg.is_ensemble:  # the ensemble scheduler runs it: no batcher or instances of its own
        if not cfg.ensemble_steps:
            raise ValueError(f"ensemble '{cfg.name}' has no steps")
        return "\n".join([*lines, *_ensemble_block(cfg.ensemble_steps)]) + "\n"
    if cfg.ensemble_steps:
        raise ValueError(f"model '{cfg.name}' has ensemble steps but platform '{cfg.platform}'")
    if cfg.max_queue_delay_us is not None and cfg.max_batch_size > 0:
        lines.append("dynamic_batching {")
        if cfg.preferred_batch_sizes:
            lines.append(f"  preferred_batch_size: {_ints(cfg.preferred_batch_sizes)}")
        lines.append(f"  max_queue_delay_microseconds: {int(cfg.max_queue_delay_us)}")
        lines.append("}")
    lines += [
        "instance_group [",
        "  {",
        f"    count: {int(cfg.instance_count)}",
        f"    kind: {cfg.instance_kind}",
        "  }",
        "]",
    ]
    if cfg.decoupled:
        lines.append("model_transaction_policy {\n  decoupled: true\n}")
    lines.append("version_policy: { latest: { num_versions: 1 } }")
    for key, value in sorted(cfg.parameters.items()):
        lines.append(f"parameters: {{\n  key: {_q(key)}\n  value: {{ string_value: {_q(value)} }}\n}}")
    return "\n".join(lines) + "\n"
