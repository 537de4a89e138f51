"""OpenVINO backend: runs an artifact's IR (model.xml/.bin) with the ``openvino`` package (optional, lazy).

Compiled blobs are host-specific, so they never go into the artifact: they are cached per host under
``$PRECAST_CACHE_DIR/openvino`` (default ``~/.cache/precast/openvino``) and reused on the next load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LIMITS
from precast.artifact.manifest import model_path
from precast.artifact.target_blocks import OpenVINOBlock
from precast.errors import ArtifactError, TargetUnavailableError, first_line
from precast.runtime.backends import register_backend

__all__ = ["OpenVINOSession", "cache_dir", "create_openvino_session", "openvino_available"]


def cache_dir() -> Path:
    base = os.environ.get("PRECAST_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "precast")
    return Path(base) / "openvino"


def openvino_available(device: str = "CPU") -> tuple[bool, str]:
    try:
        import openvino as ov
    except ImportError:
        return False, "python package 'openvino' is not installed (pip install openvino)"
    devices = ov.Core().available_devices
    if not any(d == device or d.startswith(device + ".") for d in devices):
        return False, f"OpenVINO sees no {device} device (has: {', '.join(devices) or 'none'})"
    return True, ""


class OpenVINOSession:
    """``run(names, feeds)`` / ``get_providers()`` like an ORT session, over an OpenVINO compiled model."""

    def __init__(self, compiled, device: str):
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        self.device = device
        self._outputs = {o.get_any_name(): o for o in compiled.outputs}

    @property
    def native(self):  # -> openvino.CompiledModel (the OpenVINO step runner makes its own infer request)
        """The compiled model this session runs (Session.native)."""
        return self._compiled

    def get_providers(self) -> list[str]:
        return [f"OpenVINO:{self.device}"]

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        results = self._request.infer(dict(feeds))
        return [np.array(results[self._outputs[n]], copy=True) for n in names]


# Properties an artifact may set: hints and precisions only. Others name files or libraries (CACHE_DIR,
# extensions) or would let an untrusted manifest pick what the process writes or loads.
ALLOWED_CONFIG = frozenset(
    {
        "INFERENCE_PRECISION_HINT",
        "PERFORMANCE_HINT",
        "PERFORMANCE_HINT_NUM_REQUESTS",
        "EXECUTION_MODE_HINT",
        "NUM_STREAMS",
        "INFERENCE_NUM_THREADS",
        "KV_CACHE_PRECISION",
        "KEY_CACHE_PRECISION",
        "VALUE_CACHE_PRECISION",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE",
        "ENABLE_CPU_PINNING",
        "ENABLE_HYPER_THREADING",
        "SCHEDULING_CORE_TYPE",
    }
)


def _checked_config(root: Path, config: object) -> dict[str, str]:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ArtifactError(f"artifact {root}: target 'config' must be a JSON object")
    out = {}
    for key, value in config.items():
        if key not in ALLOWED_CONFIG:
            raise ArtifactError(
                f"artifact {root}: OpenVINO property {key!r} is not allowed in an artifact "
                f"(allowed: {', '.join(sorted(ALLOWED_CONFIG))})"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ArtifactError(f"artifact {root}: OpenVINO property {key!r} must be a string or number")
        out[key] = str(value)
    return out


PA_RT_INFO = "precast_paged_attention"  # compiler/decoder/ov_decoder.py writes it


def restore_paged_attention_info(model, where: str = "OpenVINO IR") -> int:
    """The CPU plugin needs each PagedAttention node's head counts in its rt_info, which the IR does not
    keep per node: precast's causal-lm IR stores them once in the model's rt_info -> nodes updated.

    The IR is untrusted: the plugin sizes the KV pool from these numbers, so they must be in LIMITS and
    multiply to the width of every node's key and value inputs (num_kv_heads x head_size) where the graph
    fixes it. ``where``: the IR file, named by the errors."""
    nodes = [op for op in model.get_ordered_ops() if op.get_type_name() == "PagedAttentionExtension"]
    if not nodes or not model.has_rt_info([PA_RT_INFO, "num_kv_heads"]):
        return 0
    try:
        kv = int(model.get_rt_info([PA_RT_INFO, "num_kv_heads"]).astype(str))
        head = int(model.get_rt_info([PA_RT_INFO, "head_size"]).astype(str))
    except (RuntimeError, ValueError) as e:
        raise ArtifactError(f"{where}: bad {PA_RT_INFO} rt_info ({first_line(e)})") from e
    for key, value in (("num_kv_heads", kv), ("head_size", head)):
        limit = LIMITS["kv_heads" if key == "num_kv_heads" else "head_size"]
        if not 1 <= value <= limit:
            raise ArtifactError(f"{where}: rt_info '{PA_RT_INFO}.{key}' must be in [1, {limit}], got {value}")
    for node in nodes:
        for port, what in ((1, "key"), (2, "value")):  # [tokens, num_kv_heads * head_size]
            shape = node.input_value(port).get_partial_shape()
            width = shape[shape.rank.get_length() - 1] if shape.rank.is_static else None
            if width is not None and width.is_static and width.get_length() != kv * head:
                raise ArtifactError(
                    f"{where}: rt_info '{PA_RT_INFO}.num_kv_heads' x '{PA_RT_INFO}.head_size' = {kv} x "
                    f"{head} does not match the graph: PagedAttention node {node.get_friendly_name()!r} "
                    f"takes {what}s of {shape}"
                )
    for node in nodes:
        rt = node.get_rt_info()
        rt["num_k_heads"] = rt["num_v_heads"] = kv
        rt["k_head_size"] = rt["v_head_size"] = head
    return len(nodes)


@register_backend("openvino")
def create_openvino_session(root: Path, target: OpenVINOBlock, threads: int | None = None) -> OpenVINOSession:
    device = target.device or "CPU"
    ok, why = openvino_available(device)
    if not ok:
        raise TargetUnavailableError(f"artifact {root}: {why}")
    import openvino as ov

    xml = model_path(root, target)
    if not xml.is_file():
        raise ArtifactError(f"artifact {root}: OpenVINO IR '{xml.name}' is missing")
    core = ov.Core()
    config = _checked_config(root, target.config)
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    cache = cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        core.set_property({"CACHE_DIR": str(cache)})
    except OSError:
        pass  # a read-only home only costs the cache, not correctness
    try:
        # The device's plugin registers its own ops (PagedAttentionExtension, opset "extension") with the
        # core when it loads; read_model of an IR holding them fails before that.
        core.get_property(device, "FULL_DEVICE_NAME")
        model = core.read_model(str(xml))
        restore_paged_attention_info(model, str(xml))
        compiled = core.compile_model(model, device, config)
    except ArtifactError:
        raise
    except Exception as e:
        raise ArtifactError(
            f"artifact {root}: OpenVINO cannot compile {xml.name} for {device}: {first_line(e)}"
        ) from e
    return OpenVINOSession(compiled, device)
