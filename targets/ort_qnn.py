"""Target ``ort-qnn``: Qualcomm NPUs (HTP) through ONNX Runtime's QNN execution provider plugin.

    fp32 graph --quantize (static INT8 QDQ, calibrated)--> QDQ graph --fix shapes--> static QDQ graph
      --ModelCompiler (QNN EP, htp_arch, soc_model)--> model.onnx holding one EPContext node (the HTP binary)

The HTP runs static shapes only, so every symbolic dim is pinned to the compile's sample feed shapes
(``--dim`` picks them). The EP-context binary is compiled offline on x86 Linux with the ``onnxruntime-qnn``
package (it installs beside plain onnxruntime) and reloads on the device, or on x86 through HTP emulation.

The default pipeline quantizes with the ``quantize-int8{mode=static,format=qdq}`` pass (calibrated on
``--calibration`` data or, without it, the sample feeds; its options set types and per-channel). A pipeline
without a quantize pass still gets INT8: the build then applies ONNX Runtime's QNN recipe
(``get_qnn_qdq_config`` + ``quantize``, uint8 activations and weights) on the same calibration feeds.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from precast.compiler.calibration import FeedsReader
from precast.runtime.ep_plugin import plugin_available, plugin_session_options
from precast.runtime.errors import PassFailedError, TargetUnavailableError, UsageError
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
    default_pipeline = "infer-shapes,fold-constants,eliminate-dead-code,quantize-int8{mode=static,format=qdq}"
    precision = "int8"
    option_defaults = {
        "htp_arch": "73",  # v73 (Snapdragon 8 Gen 2 / X Elite); 68, 69, 73, 75, 79, 81
        "soc_model": "0",  # 0 = let QNN pick; e.g. 60 (SM8650), 57 (SM8550)
        "shapes": "",  # NAME=2x8;... ; default: the sample feeds' shapes
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
            "requires": {
                "onnxruntime": _version("onnxruntime"),
                "onnxruntime-qnn": _version("onnxruntime-qnn"),
            },
            "notes": [f"INT8 QDQ by {quantization['by']}; HTP input shapes pinned to {shapes}"],
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

    def _compile(self, src: Path, dst: Path) -> None:
        import onnxruntime as ort

        options = {"htp_arch": self.options["htp_arch"], "soc_model": self.options["soc_model"]}
        try:
            so = plugin_session_options(EP, options, "QnnHtp")
        except TargetUnavailableError as e:
            raise TargetUnavailableError(f"target 'ort-qnn' cannot be built on this host: {e}") from e
        so.log_severity_level = 3
        flags = ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED
        try:
            compiler = ort.ModelCompiler(so, str(src), embed_compiled_data_into_model=True, flags=flags)
            compiler.compile_to_file(str(dst))
        except Exception as e:
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise PassFailedError(f"target 'ort-qnn': QNN EP-context compile failed: {first}") from e
        leftover = [
            f"{n.name} ({n.op_type})" for n in onnx.load(str(dst)).graph.node if n.op_type != "EPContext"
        ]
        if leftover:
            raise PassFailedError(
                f"target 'ort-qnn': {len(leftover)} node(s) not supported by the QNN HTP: {', '.join(leftover[:5])}"
            )


def _fix_shapes(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_input_shape_fixed

    for name, shape in shapes.items():
        make_input_shape_fixed(proto.graph, name, shape)
    fix_output_shapes(proto)
    return onnx.shape_inference.infer_shapes(proto)
