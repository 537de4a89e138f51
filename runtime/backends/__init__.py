"""Backend sessions for artifacts, behind one ``Session`` protocol.

Each backend module registers a factory under the backend names its target blocks carry
(``register_backend("openvino")``); ``create_session`` looks the block's ``backend`` up in ``BACKENDS``.
Which modules may register is fixed here (``_BACKEND_MODULES``): the manifest picks an entry of a table
precast owns, never a module to import.
"""

from __future__ import annotations

import importlib
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from precast.artifact.manifest import model_path
from precast.artifact.target_blocks import OrtBlock, SessionSettings, TargetBlock
from precast.errors import ArtifactError, TargetUnavailableError, UsageError, first_line
from precast.runtime.hal import (  # (re-exported: the HAL owns them)
    TARGET_NAMES,
    check_target_name,
)
from precast.runtime.hugepages import collapse_new_memory

__all__ = [
    "BACKENDS",
    "Session",
    "SessionFactory",
    "register_backend",
    "check_threads",
    "check_target_name",
    "create_session",
    "ort_session_options",
    "OPT_LEVELS",
    "TARGET_NAMES",
    "explain_ort_error",
]

OPT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


MAX_THREADS = 256


def check_threads(threads) -> None:
    """A caller's intra-op thread count: None (the artifact's setting) or an int in 1..MAX_THREADS."""
    if threads is None:
        return
    if (
        isinstance(threads, bool)
        or not isinstance(threads, numbers.Integral)
        or not 1 <= threads <= MAX_THREADS
    ):
        raise UsageError(f"threads must be an integer in 1..{MAX_THREADS} (or None), got {threads!r}")


@runtime_checkable
class Session(Protocol):
    """What the runtime needs of a backend session: ``run(output names, feeds) -> arrays`` (in that order),
    the providers it runs on, and ``native``: the backend's own object, for the fast paths that need more
    than ``run`` (each backend's session class types it: ONNX Runtime's C++ session under an OrtSession,
    runtime/backends/ort_session.py; OpenVINO's CompiledModel; TensorRT's ICudaEngine). The IO metadata is the
    manifest's ``io`` block (checked against the session where the backend can say, see
    model._check_io_matches)."""

    def run(self, output_names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list: ...

    def get_providers(self) -> list[str]: ...

    @property
    def native(self) -> object: ...


SessionFactory = Callable[[Path, TargetBlock, "int | None"], Session]
BACKENDS: dict[str, SessionFactory] = {}
# The modules that register backends besides this one (each imports its vendor package lazily).
_BACKEND_MODULES = ("precast.runtime.backends.openvino", "precast.runtime.backends.tensorrt")


def register_backend(*names: str) -> Callable[[SessionFactory], SessionFactory]:
    def deco(factory: SessionFactory) -> SessionFactory:
        for name in names:
            BACKENDS[name] = factory
        return factory

    return deco


def create_session(
    root: Path, target: TargetBlock, threads: int | None = None, spinning: bool | None = None
) -> Session:
    """A session of the target's backend; ``spinning`` reaches ONNX Runtime CPU sessions only (see load)."""
    for module in _BACKEND_MODULES:
        importlib.import_module(module)  # cheap: vendor packages are imported by the factories
    factory = BACKENDS.get(target.backend)
    if factory is None:
        raise TargetUnavailableError(
            f"artifact {root}: backend '{target.backend}' is not supported by this runtime"
        )
    if spinning is not None and factory is create_ort_session:
        return factory(root, target, threads, spinning=spinning)
    return factory(root, target, threads)


def ort_session_options(
    settings: SessionSettings | Mapping | None = None,
    threads: int | None = None,
    spinning: bool | None = None,
):
    """SessionOptions from a target block's settings (or the compiler's ``{"graph_optimization_level": ...}``)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if settings is None or isinstance(settings, Mapping):
        settings = SessionSettings.from_json(dict(settings or {}), "session settings")
    level = settings.graph_optimization_level or "all"
    if level not in OPT_LEVELS:
        raise ArtifactError(f"manifest: unknown graph_optimization_level {level!r}")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[level])
    stored = settings.intra_op_num_threads or 0
    if not 0 <= stored <= MAX_THREADS:
        raise ArtifactError(
            f"manifest: intra_op_num_threads must be an integer in 0..{MAX_THREADS}, got {stored!r}"
        )
    n = threads if threads is not None else stored
    so.intra_op_num_threads = n
    so.inter_op_num_threads = 1
    # fatal only: ORT logs a failed run (a Gather index out of range, ...) as an error of its own before it
    # raises, and precast reports that exception in one line (level 3 printed both)
    so.log_severity_level = 4
    if spinning is not None:  # (None: ONNX Runtime's default, spinning)
        for pool in ("intra_op", "inter_op"):
            so.add_session_config_entry(f"session.{pool}.allow_spinning", "1" if spinning else "0")
    return so


@register_backend("onnxruntime")
def create_ort_session(
    root: Path, target: TargetBlock, threads: int | None = None, spinning: bool | None = None
) -> Session:
    if not isinstance(target, OrtBlock):  # target_block_from_json maps "onnxruntime" to OrtBlock
        raise TypeError(f"an onnxruntime session needs an OrtBlock, got {type(target).__name__}")
    if target.ep_plugin is not None:
        from precast.runtime.backends.ep_plugin import create_plugin_session

        return create_plugin_session(root, target, threads)
    import onnxruntime as ort

    from precast.runtime.backends.ort_session import OrtSession

    model_file = model_path(root, target)
    providers = target.provider_list
    available = set(ort.get_available_providers())
    missing = [p for p in providers if p not in available]
    if missing:
        raise TargetUnavailableError(
            f"artifact {root} needs execution provider {missing[0]}, which this onnxruntime lacks "
            f"(available: {', '.join(sorted(available))})"
        )
    settings = target.session_settings
    so = ort_session_options(settings, threads, spinning)
    try:
        # weights and prepacked copies on 2 MiB pages: fewer TLB walks per token (runtime/hugepages.py)
        with collapse_new_memory(settings.to_json()):
            return OrtSession(str(model_file), sess_options=so, providers=providers)
    except Exception as e:  # ORT raises its own exception types; keep the first line
        node, op, first = explain_ort_error(e)
        culprit = f" (node '{node}', op {op})" if node else (f" (op {op})" if op else "")
        raise ArtifactError(
            f"artifact {root}: onnxruntime cannot load {model_file.name}{culprit}: {first}"
        ) from e


_NODE_RE = re.compile(r'In Node, \("([^"]*)", ([\w.]+), "([^"]*)"')
_FATAL_RE = re.compile(r"Fatal error: ([\w.]*):(\w+)\(")
_IMPL_RE = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")


def explain_ort_error(e: BaseException) -> tuple[str | None, str | None, str]:
    """(node name, op type, first line) from an onnxruntime load error, when it names them."""
    text = str(e)
    first = first_line(e).replace("[ONNXRuntimeError] : ", "")
    if m := _NODE_RE.search(text):
        return m.group(1), (m.group(3) + "::" if m.group(3) else "") + m.group(2), first
    if m := _IMPL_RE.search(text):
        return m.group(3), m.group(1), first
    if m := _FATAL_RE.search(text):
        return None, (m.group(1) + "::" if m.group(1) else "") + m.group(2), first
    return None, None, first
