"""Target ``ort-qnn``: Qualcomm NPUs (HTP) through ONNX Runtime's QNN execution provider plugin.

    fp32 graph --quantize (static INT8 QDQ, calibrated)--> QDQ graph --fix shapes--> static QDQ graph
      --ModelCompiler (QNN EP, htp_arch, soc_model)--> model.onnx holding one EPContext node (the HTP binary)

The HTP runs static shapes only, so every symbolic dim is pinned to the compile's sample feed shapes
(``--dim`` picks them). The EP-context binary is compiled offline on x86 Linux with the ``onnxruntime-qnn``
package (it installs beside plain onnxruntime) and reloads on the device, or on x86 through HTP emulation.

The vendor steps run in child processes (``precast.compiler.isolated``; QNN's HTP compiler segfaults on some
graphs): first a **placement check** -- a session that may fall back to the CPU, recording which EP each node
lands on -- and only when every node lands on the HTP the EP-context compile. A refused node, a vendor error
or a crash in either stage is exit 5 naming the target, the stage (and the signal) and the refused nodes.

The default pipeline quantizes with the ``quantize-int8{mode=static,format=qdq}`` pass (calibrated on
``--calibration`` data or, without it, the sample feeds; its options set types and per-channel). A pipeline
without a quantize pass still gets INT8: the build then applies ONNX Runtime's QNN recipe
(``get_qnn_qdq_config`` + ``quantize``, uint8 activations and weights) on the same calibration feeds.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from precast.compiler.calibration import FeedsReader
from precast.compiler.isolated import run_isolated
from precast.runtime.ep_plugin import plugin_available
from precast.runtime.errors import (
    NativeCrashError,
    PassFailedError,
    TargetUnavailableError,
    UnsupportedOpError,
    UsageError,
)
from precast.runtime.progress import SILENT
from precast.targets.base import Availability, Target, register_target

__all__ = ["OrtQnn"]

EP = "QNNExecutionProvider"
PACKAGE = "onnxruntime_qnn"


def _version(pkg: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "missing"


@contextlib.contextmanager
def _quiet():
    # ORT's quantizer prints "consider pre-processing" warnings through the root logger for every model.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def _has_qdq(model: onnx.ModelProto) -> bool:
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def parse_shapes(text: str) -> dict[str, list[int]]:
    """'x=2x8;mask=2x16' -> {'x': [2, 8], 'mask': [2, 16]}."""
    out: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, dims = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            raise UsageError(
                f"target 'ort-qnn' option shapes: expected NAME=2x8[;NAME=...], got '{part}'"
            ) from None
    return out


@register_target("ort-qnn")
class OrtQnn(Target):
    summary = (
        "Qualcomm NPU (HTP) via the onnxruntime-qnn EP plugin: static INT8 QDQ, EP-context compiled offline"
    )
    # Static graph first (pin dims, fold the shape arithmetic), then lower what the HTP refuses, quantize last.
    # uint8 weights: QNN's HTP LayerNorm refuses an int8 scale (backendValidateOpConfig error 3110).
    default_pipeline = (
        "pin-dims,fold-constants,infer-shapes,eliminate-dead-code,lower-gathernd,lower-where-constants,"
        "quantize-int8{mode=static,format=qdq,weight=uint8}"
    )
    precision = "int8"
    option_defaults = {
        "htp_arch": "73",  # v73 (Snapdragon 8 Gen 2 / X Elite); 68, 69, 73, 75, 79, 81
        "soc_model": "0",  # 0 = let QNN pick; e.g. 60 (SM8650), 57 (SM8550)
        "shapes": "",  # NAME=2x8;... ; default: the sample feeds' shapes
        "timeout_s": 900,  # per vendor step (placement check, EP-context compile) in its child process
    }

    @classmethod
    def can_build(cls) -> Availability:
        ok, why = plugin_available(EP)
        return Availability(ok, why)

    @classmethod
    def can_run(cls) -> Availability:
        return cls.can_build()

    def build(self, model: ir.Model, out_dir: Path) -> dict:
        proto = ir.serde.serialize_model(model)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            tmpdir = Path(tmp)
            quantization = {"format": "QDQ", "by": "pipeline (quantize pass; see its stats)"}
            if not _has_qdq(proto):
                proto, calibration = self._quantize(proto, tmpdir)
                quantization = {
                    "format": "QDQ",
                    "by": "ort-qnn build (onnxruntime QNN recipe, uint8/uint8)",
                    "calibration": calibration,
                }
            shapes = self._static_shapes(proto)
            proto = _fix_shapes(proto, shapes)
            onnx.save(proto, tmpdir / "static_qdq.onnx")
            placement = self._check_placement(tmpdir / "static_qdq.onnx")
            self._compile(tmpdir / "static_qdq.onnx", out_dir / "model.onnx")
        return {
            "name": self.name,
            "backend": "onnxruntime",
            "model": "model.onnx",
            "providers": [EP],
            "device": "npu",
            "precision": self.precision,
            "ep_plugin": {"ep": EP, "package": PACKAGE, "backend_lib": "QnnHtp"},
            "provider_options": {},
            "session": {"config": {"session.disable_cpu_ep_fallback": "1"}},
            "static_shapes": shapes,
            "quantization": quantization,
            "htp": {"arch": self.options["htp_arch"], "soc_model": self.options["soc_model"]},
            "placement": placement,
            "requires": {
                "onnxruntime": _version("onnxruntime"),
                "onnxruntime-qnn": _version("onnxruntime-qnn"),
            },
            "notes": [
                f"INT8 QDQ by {quantization['by']}; HTP input shapes pinned to {shapes}; "
                f"placement check: {placement['on_htp']} of {placement['nodes']} nodes on the HTP"
            ],
        }

    def _calibration(self, proto: onnx.ModelProto) -> tuple[list[dict[str, np.ndarray]], str]:
        ctx = self.context
        feeds = getattr(ctx, "calibration_feeds", None)
        if feeds:
            ctx.extra["calibration_used"] = True
            return list(feeds), f"calibration data ({len(feeds)} batches)"
        sample = getattr(ctx, "sample_feeds", None)
        if not sample:
            raise UsageError("target 'ort-qnn' needs calibration data: pass --calibration feeds.npz")
        return [dict(sample)], "sample feeds (1 batch; pass --calibration for representative ranges)"

    def _quantize(self, proto: onnx.ModelProto, tmpdir: Path) -> tuple[onnx.ModelProto, str]:
        from onnxruntime.quantization import QuantType, quantize
        from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

        batches, how = self._calibration(proto)
        src, dst = tmpdir / "fp32.onnx", tmpdir / "qdq.onnx"
        onnx.save(proto, src)
        reader = FeedsReader(batches, getattr(self.context, "progress", SILENT))
        try:
            with _quiet():
                config = get_qnn_qdq_config(
                    str(src), reader, activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8
                )
                quantize(str(src), str(dst), config)
        except Exception as e:
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise PassFailedError(f"target 'ort-qnn': static INT8 QDQ quantization failed: {first}") from e
        return onnx.load(str(dst)), how

    def _static_shapes(self, proto: onnx.ModelProto) -> dict[str, list[int]]:
        inits = {i.name for i in proto.graph.initializer}
        names = [i.name for i in proto.graph.input if i.name not in inits]
        given = parse_shapes(self.options["shapes"])
        sample = getattr(self.context, "sample_feeds", None) or {}
        shapes = {}
        for name in names:
            if name in given:
                shapes[name] = given[name]
            elif name in sample:
                shapes[name] = [int(d) for d in np.shape(sample[name])]
            else:
                raise UsageError(
                    f"target 'ort-qnn' needs a static shape for input '{name}': --target-option shapes={name}=..."
                )
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise UsageError(
                f"target 'ort-qnn' option shapes names '{unknown[0]}', not an input ({', '.join(names)})"
            )
        return shapes

    def _provider_options(self) -> dict[str, str]:
        return {"htp_arch": self.options["htp_arch"], "soc_model": self.options["soc_model"]}

    def _isolated(self, entry: str, stage: str, payload: dict):
        """Run a QNN step in a child; a crash or hang is exit 5 naming the stage and QNN's refused nodes."""
        what = f"target 'ort-qnn' stage '{stage}'"
        try:
            return what, run_isolated(entry, payload, what=what, timeout=self.options["timeout_s"])
        except NativeCrashError as e:
            refused = unsupported_in_log(e.stderr_tail)
            msg = f"{e.message}; QNN listed {_refused(refused)}" if refused else e.message
            raise NativeCrashError(msg, signal=e.signal, stderr_tail=e.stderr_tail) from None
        except TargetUnavailableError as e:
            raise TargetUnavailableError(f"target 'ort-qnn' cannot be built on this host: {e}") from None

    def _check_placement(self, model: Path) -> dict[str, int]:
        """Every node must land on the HTP; otherwise exit 5 naming the ones that would not (nothing compiled)."""
        payload = {"model": str(model), "provider_options": self._provider_options()}
        what, child = self._isolated("qnn-placement", "placement check", payload)
        assignment, error = child.value["assignment"], child.value["error"]
        if assignment is None:
            refused = unsupported_in_log(child.stderr_tail)
            if refused:
                raise UnsupportedOpError(
                    f"{what}: {_refused(refused)}, and QNN failed on the rest: {error}; nothing was compiled"
                )
            raise PassFailedError(
                f"{what}: QNN accepted every node but failed to build the HTP graph: {error}"
            )
        total = sum(len(nodes) for nodes in assignment.values())
        elsewhere = [node for ep, nodes in assignment.items() if ep != EP for node in nodes]
        if elsewhere:
            raise UnsupportedOpError(
                f"{what}: {_refused(elsewhere, total)} (they would fall back to the CPU); nothing was compiled"
            )
        return {"on_htp": len(assignment.get(EP, [])), "nodes": total}

    def _compile(self, src: Path, dst: Path) -> None:
        payload = {"src": str(src), "dst": str(dst), "provider_options": self._provider_options()}
        what, child = self._isolated("qnn-compile", "EP-context compile", payload)
        if child.value["error"]:
            refused = unsupported_in_log(child.stderr_tail)
            extra = f"; QNN listed {_refused(refused)}" if refused else ""
            raise PassFailedError(f"{what} failed: {child.value['error']}{extra}")
        leftover = [
            f"{n.name} ({n.op_type})" for n in onnx.load(str(dst)).graph.node if n.op_type != "EPContext"
        ]
        if leftover:
            raise UnsupportedOpError(f"{what}: {_refused(leftover)}")


_PASS = re.compile(r"GetCapability pass \d+")
_FAILED = re.compile(
    r"Validation FAILED for \d+ nodes in OrtNodeUnit \((\S+)\) :\n((?:\tOperator type: .*\n)+)\tREASON : (.*)"
)
_UNIT_NODE = re.compile(r"\tOperator type: (\S+) Node name: (.*?) Node index: \d+")
_UNSUPPORTED_LINE = re.compile(r"Unsupported nodes in QNN EP: (.*)")
_NODE = re.compile(r"\{ name: ([^,]*), type: ([^ }]*) \}")


def unsupported_in_log(log: str) -> list[str]:
    """'name (Op)' of each node QNN's last capability pass refused ([] when none), read from its log:

    verbose:  Validation FAILED for 5 nodes in OrtNodeUnit (LayerNormalization) :
              <tab>Operator type: LayerNormalization Node name: node_layer_norm Node index: 142 ...
    error:    Unsupported nodes in QNN EP: { name: node_view_1, type: Reshape }{ name: ...
    """
    last_pass = list(_PASS.finditer(log))
    verbose = log[last_pass[-1].start() :] if last_pass else log
    refused = []
    for unit_op, members, _reason in _FAILED.findall(verbose):
        nodes = _UNIT_NODE.findall(members)
        # A QDQ node unit lists its Q/DQ neighbours too: name the unit's own op
        name = next((n for op, n in nodes if op == unit_op), nodes[0][1])
        refused.append(f"{name} ({unit_op})")
    if refused:
        return list(dict.fromkeys(refused))
    lines = _UNSUPPORTED_LINE.findall(log)
    return [f"{name} ({op})" for name, op in _NODE.findall(lines[-1])] if lines else []


def _refused(nodes: list[str], total: int | None = None) -> str:
    """'3 node(s) not supported by the QNN HTP (Reshape 2, Shape 1): a (Reshape), ... and 1 more'."""
    ops = Counter(node.rsplit("(", 1)[-1].rstrip(")") for node in nodes)
    by_op = ", ".join(f"{op} {n}" for op, n in ops.most_common())
    shown = ", ".join(nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
    of = f" of {total}" if total else ""
    return f"{len(nodes)}{of} node(s) not supported by the QNN HTP ({by_op}): {shown}"


def _fix_shapes(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_input_shape_fixed

    for name, shape in shapes.items():
        make_input_shape_fixed(proto.graph, name, shape)
    fix_output_shapes(proto)
    return onnx.shape_inference.infer_shapes(proto)
