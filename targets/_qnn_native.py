"""The ort-qnn steps that call into Qualcomm's QNN libraries; each runs in a child process.

``precast.targets.isolated`` runs these (entries ``qnn-placement`` and ``qnn-compile``): the HTP compiler
segfaults on some graphs, and a crash must cost the child, not the compile. Payloads and results are JSON.
Everything here imports only onnxruntime and precast.runtime, so the child starts in about a second.
"""

from __future__ import annotations

from typing import Any

from precast.errors import first_line
from precast.runtime.backends.ep_plugin import node_assignment, plugin_session_options

__all__ = ["placement", "compile_ep_context"]

EP = "QNNExecutionProvider"


def _options(payload: dict[str, Any], *, cpu_fallback: bool, log_level: int):
    so = plugin_session_options(EP, payload["provider_options"], "QnnHtp", cpu_fallback=cpu_fallback)
    so.log_severity_level = log_level  # the parent reads the child's stderr for the nodes QNN refused
    return so


def placement(payload: dict[str, Any]) -> dict[str, Any]:
    """Which EP each node lands on, from a session that may fall back to the CPU (nothing is written).

    {"model": path, "provider_options": {...}} -> {"assignment": {ep: ["name (Op)", ...]}, "error": None}, or
    {"assignment": None, "error": "..."} when QNN refuses the session (it also finalizes the HTP graph)."""
    import onnxruntime as ort

    # With the fallback on, QNN hands the graph-input Quantize / output Dequantize to the CPU by default; the
    # compile (fallback off) keeps them on the HTP, so the check does too.
    payload = {
        **payload,
        "provider_options": {"offload_graph_io_quantization": "0", **payload["provider_options"]},
    }
    # Verbose: QNN logs "Validation FAILED for N nodes in OrtNodeUnit (Op)" with the names and the reason;
    # that is the only record of the refused nodes when the session then fails to finalize the HTP graph.
    so = _options(payload, cpu_fallback=True, log_level=0)
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    try:
        session = ort.InferenceSession(payload["model"], sess_options=so)
    except Exception as e:
        return {"assignment": None, "error": _ort_message(e)}
    return {"assignment": node_assignment(session), "error": None}


def compile_ep_context(payload: dict[str, Any]) -> dict[str, Any]:
    """{"src", "dst", "provider_options"} -> the EP-context model at dst; {"error": None | "..."}."""
    import onnxruntime as ort

    # Errors: with the fallback off QNN logs its one-line "Unsupported nodes in QNN EP" list before it fails
    so = _options(payload, cpu_fallback=False, log_level=3)
    flags = ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED
    try:
        compiler = ort.ModelCompiler(so, payload["src"], embed_compiled_data_into_model=True, flags=flags)
        compiler.compile_to_file(payload["dst"])
    except Exception as e:
        return {"error": _ort_message(e)}
    return {"error": None}


def _ort_message(e: Exception) -> str:
    # "[ONNXRuntimeError] : 11 : EP_FAIL : Failed to finalize QNN graph. Error: ..." -> from "Failed" on
    text = first_line(e)
    return text.split(" : ", 3)[-1] if text.startswith("[ONNXRuntimeError]") else text
