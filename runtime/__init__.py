"""precast's thin runtime: numpy + the artifact's backend, each imported lazily (never torch, onnx_ir or the compiler)."""

from precast.artifact.manifest import SCHEMA_VERSION, TensorSpec
from precast.errors import (
    ArtifactError,
    InputError,
    IntegrityError,
    PrecastError,
    SchemaVersionError,
    TargetUnavailableError,
)
from precast.runtime.model import Model, load

__all__ = [
    "load",
    "Model",
    "TensorSpec",
    "SCHEMA_VERSION",
    "PrecastError",
    "ArtifactError",
    "IntegrityError",
    "SchemaVersionError",
    "InputError",
    "TargetUnavailableError",
]
