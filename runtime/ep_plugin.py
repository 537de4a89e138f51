"""ONNX Runtime sessions on plugin execution providers (QNN today), with no silent CPU fallback.

A plugin EP ships as its own pip package beside plain ``onnxruntime`` (``onnxruntime-qnn``); the runtime
registers its library, builds the session on the plugin's devices with ``session.disable_cpu_ep_fallback=1``
and then checks which EP each node landed on, so an "NPU" artifact can never quietly run on the CPU.

The manifest's target block names the plugin::

    "backend": "onnxruntime", "providers": ["QNNExecutionProvider"],
    "ep_plugin": {"ep": "QNNExecutionProvider", "package": "onnxruntime_qnn", "backend_lib": "QnnHtp"},
    "provider_options": {...}, "session": {"config": {...}}, "static_shapes": {"x": [2, 8]}
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from precast.runtime.errors import ArtifactError, InputError, TargetUnavailableError

__all__ = ["PluginSession", "create_plugin_session", "node_assignment", "plugin_available", "register_plugin"]

_REGISTERED: dict[str, str] = {}  # ep name -> library path, registered once per process


def _plugin_module(package: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        return None


def plugin_available(ep: str, package: str) -> tuple[bool, str]:
    """(ok, reason): can this host load the plugin EP (package importable, library present, a device)?"""
    try:
        import onnxruntime as ort
    except ImportError:
        return False, "onnxruntime is not installed"
    if not hasattr(ort, "register_execution_provider_library"):
        return False, f"onnxruntime {ort.__version__} has no plugin EP support (needs >= 1.22)"
    mod = _plugin_module(package)
    if mod is None:
        return False, f"python package '{package}' is not installed (pip install {package.replace('_', '-')})"
    lib = mod.get_library_path()
    if not os.path.isfile(lib):
        return False, f"{package} has no EP library at {lib}"
    try:
        register_plugin(ep, package)
    except Exception as e:  # a broken plugin must not take the caller down
        return False, f"{ep} library failed to register: {str(e).splitlines()[0]}"
    if not [d for d in ort.get_ep_devices() if d.ep_name == ep]:
        return False, f"{ep} reports no devices on this host"
    return True, ""


def register_plugin(ep: str, package: str) -> str:
    """Register the plugin's EP library with onnxruntime (idempotent); return the library path."""
    import onnxruntime as ort

    if ep in _REGISTERED:
        return _REGISTERED[ep]
    mod = _plugin_module(package)
    if mod is None:
        raise TargetUnavailableError(
            f"{ep} needs the python package '{package}' (pip install {package.replace('_', '-')})"
        )
    lib = mod.get_library_path()
    try:
        ort.register_execution_provider_library(ep, lib)
    except Exception as e:
        if "already registered" not in str(e):
            raise TargetUnavailableError(f"cannot register {ep} from {lib}: {str(e).splitlines()[0]}") from e
    _REGISTERED[ep] = lib
    return lib


def plugin_session_options(
    ep: str, package: str, provider_options: Mapping[str, str], backend_lib: str | None
):
    """SessionOptions with the plugin EP's devices added (and the backend library resolved to a path)."""
    import onnxruntime as ort

    register_plugin(ep, package)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep]
    if not devices:
        raise TargetUnavailableError(f"{ep} reports no devices on this host")
    opts = {k: str(v) for k, v in provider_options.items()}
    if backend_lib:
        mod = _plugin_module(package)
        opts["backend_path"] = os.path.join(os.path.dirname(mod.get_library_path()), f"lib{backend_lib}.so")
    so = ort.SessionOptions()
    so.add_provider_for_devices(devices, opts)
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def node_assignment(session) -> dict[str, list[str]]:
    """EP name -> node names it runs (needs ``session.record_ep_graph_assignment_info=1``)."""
    out: dict[str, list[str]] = {}
    for sub in session.get_provider_graph_assignment_info():
        out.setdefault(sub.ep_name, []).extend(f"{n.name} ({n.op_type})" for n in sub.get_nodes())
    return out


class PluginSession:
    """An InferenceSession whose inputs must match the shapes the EP compiled for (checked up front)."""

    def __init__(self, session, ep: str, static_shapes: Mapping[str, Sequence[int]] | None, assignment):
        self._session = session
        self.ep = ep
        self.static_shapes = {k: tuple(v) for k, v in (static_shapes or {}).items()}
        self.assignment = assignment

    def get_providers(self) -> list[str]:
        return [self.ep]

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]):
        for name, shape in self.static_shapes.items():
            if name in feeds and tuple(feeds[name].shape) != shape:
                raise InputError(
                    f"input '{name}': this {self.ep} artifact was compiled for shape {list(shape)}, "
                    f"got {list(feeds[name].shape)} (recompile with --dim to change it)"
                )
        return self._session.run(list(names), dict(feeds))


def create_plugin_session(root: Path, target: dict, threads: int | None = None) -> PluginSession:
    import onnxruntime as ort

    plugin = target.get("ep_plugin") or {}
    ep, package = plugin.get("ep"), plugin.get("package")
    if not ep or not package:
        raise ArtifactError(f"artifact {root}: target block 'ep_plugin' needs 'ep' and 'package'")
    so = plugin_session_options(ep, package, target.get("provider_options", {}), plugin.get("backend_lib"))
    so.log_severity_level = 3
    if threads is not None:
        so.intra_op_num_threads = threads
    for key, value in (target.get("session", {}).get("config") or {}).items():
        if key != "session.disable_cpu_ep_fallback":  # always on for plugin EPs (set above)
            so.add_session_config_entry(str(key), str(value))
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    model_file = root / target.get("model", "model.onnx")
    try:
        session = ort.InferenceSession(str(model_file), sess_options=so)
    except Exception as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise TargetUnavailableError(f"artifact {root}: {ep} cannot load {model_file.name}: {first}") from e
    assignment = node_assignment(session)
    elsewhere = {k: v for k, v in assignment.items() if k != ep}
    if elsewhere:
        other, nodes = next(iter(elsewhere.items()))
        raise TargetUnavailableError(
            f"artifact {root}: {len(nodes)} node(s) are not on {ep} but on {other}: {', '.join(nodes[:5])}"
        )
    return PluginSession(session, ep, target.get("static_shapes"), assignment)
