"""ONNX Runtime sessions on plugin execution providers (QNN today), with no silent CPU fallback.

A plugin EP ships as its own pip package beside plain ``onnxruntime`` (``onnxruntime-qnn``); the runtime
registers its library, builds the session on the plugin's devices with ``session.disable_cpu_ep_fallback=1``
and then checks which EP each node landed on, so an "NPU" artifact can never quietly run on the CPU.

The manifest's target block names the plugin::

    "backend": "onnxruntime", "providers": ["QNNExecutionProvider"],
    "ep_plugin": {"ep": "QNNExecutionProvider", "package": "onnxruntime_qnn", "backend_lib": "QnnHtp"},
    "provider_options": {...}, "session": {"config": {...}}, "static_shapes": {"x": [2, 8]}

Trust: an artifact is untrusted data, so nothing in that block chooses code. The EP name selects an entry
of ``KNOWN_PLUGINS`` (precast's allow-list); its native library is located through the installed
distribution's file list in the site-packages directories (``importlib.metadata``), never by importing a
Python module (a module of the same name next to the working directory would run on import), and never
from a path or package name in the manifest. The backend library, provider options and session config
keys are allow-listed too: several QNN options and ORT config keys name files to load or write.
"""

from __future__ import annotations

import site
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import numpy as np

from precast.artifact.manifest import model_path
from precast.artifact.target_blocks import OrtBlock
from precast.errors import ArtifactError, InputError, TargetUnavailableError, first_line

__all__ = [
    "KNOWN_PLUGINS",
    "PluginSession",
    "PluginSpec",
    "create_plugin_session",
    "node_assignment",
    "plugin_available",
    "plugin_library",
    "register_plugin",
]


@dataclass(frozen=True)
class PluginSpec:
    """A plugin EP precast knows: the distribution that ships it and what a manifest may set for it."""

    distribution: str  # pip name, looked up in installed package metadata
    module: str  # import name, only to recognise the manifest's (informational) 'package' field
    library: str  # the EP library's base name (lib<name>.so / <name>.dll)
    backend_libs: frozenset[str]  # backend libraries the manifest may pick (the HTP, CPU, GPU backends)
    provider_options: frozenset[str]  # options without file paths
    session_config: frozenset[str]  # ORT session config keys an artifact may set


KNOWN_PLUGINS: dict[str, PluginSpec] = {
    "QNNExecutionProvider": PluginSpec(
        distribution="onnxruntime-qnn",
        module="onnxruntime_qnn",
        library="onnxruntime_providers_qnn",
        backend_libs=frozenset({"QnnHtp", "QnnCpu", "QnnGpu"}),
        provider_options=frozenset(
            {
                "htp_performance_mode",
                "htp_graph_finalization_optimization_mode",
                "htp_arch",
                "soc_model",
                "device_id",
                "vtcm_mb",
                "enable_htp_fp16_precision",
                "offload_graph_io_quantization",
                "qnn_context_priority",
                "rpc_control_latency",
                "enable_htp_shared_memory_allocator",
            }
        ),
        session_config=frozenset(
            {
                "session.disable_cpu_ep_fallback",
                "session.intra_op.allow_spinning",
                "session.set_denormal_as_zero",
            }
        ),
    ),
}

_REGISTERED: dict[str, str] = {}  # ep name -> library path, registered once per process


def _lib_file(base: str) -> str:
    return f"{base}.dll" if sys.platform == "win32" else f"lib{base}.so"


def _install_dirs() -> list[str]:
    """Where pip installs distributions: site-packages (and the user site), never '' or the cwd."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if Path(d).is_dir()]


@lru_cache(maxsize=None)
def _dist_files(distribution: str) -> dict[str, Path] | None:
    """File name -> absolute path for an installed distribution's files, or None when not installed."""
    for dist in metadata.distributions(path=_install_dirs()):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == distribution:
            return {f.name: Path(dist.locate_file(f)).resolve() for f in dist.files or ()}
    return None


def _spec(ep: object) -> PluginSpec:
    spec = KNOWN_PLUGINS.get(ep) if isinstance(ep, str) else None
    if spec is None:
        raise ArtifactError(
            f"execution provider plugin {ep!r} is not one precast loads (known: {', '.join(sorted(KNOWN_PLUGINS))})"
        )
    return spec


def plugin_library(ep: str, backend_lib: str | None = None) -> Path:
    """The EP's native library (or, with ``backend_lib``, that backend library) from the installed
    distribution; TargetUnavailableError when it is not installed."""
    spec = _spec(ep)
    files = _dist_files(spec.distribution)
    if files is None:
        raise TargetUnavailableError(
            f"{ep} needs the package '{spec.distribution}' (pip install {spec.distribution})"
        )
    if backend_lib is not None and backend_lib not in spec.backend_libs:
        raise ArtifactError(
            f"{ep}: backend library {backend_lib!r} is not allowed (one of {', '.join(sorted(spec.backend_libs))})"
        )
    name = _lib_file(backend_lib or spec.library)
    path = files.get(name)
    if path is None or not path.is_file():
        raise TargetUnavailableError(f"{spec.distribution} is installed but has no {name}")
    return path


def plugin_available(ep: str) -> tuple[bool, str]:
    """(ok, reason): can this host load the plugin EP (distribution installed, library present, a device)?"""
    try:
        import onnxruntime as ort
    except ImportError:
        return False, "onnxruntime is not installed"
    if not hasattr(ort, "register_execution_provider_library"):
        return False, f"onnxruntime {ort.__version__} has no plugin EP support (needs >= 1.22)"
    try:
        register_plugin(ep)
    except (TargetUnavailableError, ArtifactError) as e:
        return False, e.message
    except Exception as e:  # a broken plugin must not take the caller down
        return False, f"{ep} library failed to register: {first_line(e)}"
    if not [d for d in ort.get_ep_devices() if d.ep_name == ep]:
        return False, f"{ep} reports no devices on this host"
    return True, ""


def register_plugin(ep: str) -> str:
    """Register the plugin's EP library with onnxruntime (idempotent); return the library path."""
    import onnxruntime as ort

    if ep in _REGISTERED:
        return _REGISTERED[ep]
    lib = str(plugin_library(ep))
    try:
        ort.register_execution_provider_library(ep, lib)
    except Exception as e:
        if "already registered" not in str(e):
            raise TargetUnavailableError(f"cannot register {ep} from {lib}: {first_line(e)}") from e
    _REGISTERED[ep] = lib
    return lib


def plugin_session_options(
    ep: str, provider_options: Mapping[str, object], backend_lib: str | None, *, cpu_fallback: bool = False
):
    """SessionOptions with the plugin EP's devices added (and the backend library resolved to a path).

    ``cpu_fallback=True`` is for the compiler's placement check only (which nodes would the EP refuse?):
    artifacts always run with the fallback off."""
    import onnxruntime as ort

    spec = _spec(ep)
    if not isinstance(provider_options, Mapping):
        raise ArtifactError(f"{ep}: 'provider_options' must be a JSON object")
    for key, value in provider_options.items():
        if key not in spec.provider_options:
            raise ArtifactError(
                f"{ep}: provider option {key!r} is not allowed in an artifact "
                f"(allowed: {', '.join(sorted(spec.provider_options))})"
            )
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ArtifactError(f"{ep}: provider option {key!r} must be a string or number, got {value!r}")
    register_plugin(ep)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep]
    if not devices:
        raise TargetUnavailableError(f"{ep} reports no devices on this host")
    opts = {k: str(v) for k, v in provider_options.items()}
    if backend_lib:
        opts["backend_path"] = str(plugin_library(ep, backend_lib))
    so = ort.SessionOptions()
    so.add_provider_for_devices(devices, opts)
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if cpu_fallback else "1")
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

    @property
    def native(self):  # -> onnxruntime.InferenceSession
        """The ONNX Runtime session on the plugin EP (Session.native): its own IO binding, its EP info."""
        return self._session

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


def create_plugin_session(root: Path, target: OrtBlock, threads: int | None = None) -> PluginSession:
    import onnxruntime as ort

    plugin = target.ep_plugin
    if plugin is None:
        raise ArtifactError(f"artifact {root}: target block has no 'ep_plugin'")
    try:
        spec = _spec(plugin.ep)
        ep = plugin.ep
        if (plugin.package or spec.module) != spec.module:  # informational only; a mismatch is tampering
            raise ArtifactError(
                f"ep_plugin names package {plugin.package!r}; {ep} is loaded only from {spec.distribution}"
            )
        config = target.session_settings.config or {}
        for key in config:
            if key not in spec.session_config:
                raise ArtifactError(
                    f"session config key {key!r} is not allowed in an artifact "
                    f"(allowed: {', '.join(sorted(spec.session_config))})"
                )
        so = plugin_session_options(ep, target.provider_options or {}, plugin.backend_lib)
    except ArtifactError as e:
        raise ArtifactError(f"artifact {root}: {e.message}") from None
    so.log_severity_level = 3
    if threads is not None:
        so.intra_op_num_threads = threads
    for key, value in config.items():
        if key != "session.disable_cpu_ep_fallback":  # always on for plugin EPs (set above)
            so.add_session_config_entry(str(key), str(value))
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")

    def open_one(model_file: Path, static_shapes) -> PluginSession:
        try:
            session = ort.InferenceSession(str(model_file), sess_options=so)
        except Exception as e:
            raise TargetUnavailableError(
                f"artifact {root}: {ep} cannot load {model_file.name}: {first_line(e)}"
            ) from e
        assignment = node_assignment(session)
        elsewhere = {k: v for k, v in assignment.items() if k != ep}
        if elsewhere:
            other, nodes = next(iter(elsewhere.items()))
            raise TargetUnavailableError(
                f"artifact {root}: {len(nodes)} node(s) are not on {ep} but on {other}: {', '.join(nodes[:5])}"
            )
        return PluginSession(session, ep, static_shapes, assignment)

    buckets = getattr(target, "buckets", None)
    if buckets:  # several static sequence lengths (ort-qnn): runtime/buckets.py picks one per call
        from precast.runtime.buckets import BucketedSession, bucket_shapes

        return BucketedSession.open(
            root,
            buckets,
            lambda path, size: open_one(path, bucket_shapes(target.static_shapes, buckets, size)),
        )
    return open_one(model_path(root, target), target.static_shapes)
