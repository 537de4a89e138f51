"""Target ``ort-qnn``: Qualcomm NPUs (HTP) through ONNX Runtime's QNN execution provider plugin.

    fp32 graph --quantize (static INT8 QDQ, calibrated)--> QDQ graph --fix shapes--> static QDQ graph
      --ModelCompiler (QNN EP, htp_arch, soc_model)--> model.onnx holding one EPContext node (the HTP binary)

The HTP runs static shapes only, so every symbolic dim is pinned to the compile's sample feed shapes
(``--dim`` picks them). The EP-context binary is compiled offline on x86 Linux with the ``onnxruntime-qnn``
package (it installs beside plain onnxruntime) and reloads on the device, or on x86 through HTP emulation.

The vendor steps run in child processes (``precast.targets.isolated``; QNN's HTP compiler segfaults on some
graphs): first a **placement check** -- a session that may fall back to the CPU, recording which EP each node
lands on -- and only when every node lands on the HTP the EP-context compile. A refused node, a vendor error
or a crash in either stage is exit 5 naming the target, the stage (and the signal) and the refused nodes.

Quantization is ONNX Runtime's QNN recipe (``get_qnn_qdq_config`` + ``quantize``), applied by the build on
the static fp32 graph: **A16W8** by default -- uint16 activations, uint8 weights, and int16 (symmetric) weights
for the few MatMul/Gemm weights whose per-tensor 8-bit error is large (SQNR below 30 dB: outlier weights; in
MiniLM 8 of 37, the six FFN down-projections at 13-23 dB among them, the rest are at 34-41 dB). Options ``activations=u16|u8`` and ``weights=auto|u8|int16``. Why not
A8W8: a BERT's attention scores, its mask fill and the softmax share one activation scale each, and 8 bits
cannot resolve scores that span ~150 (MiniLM real-sentence embedding cosine 0.85 with u8, 0.99 with u16;
per-tensor 8-bit down-projection weights cost the last 0.01). Calibration: ``--calibration`` data, else
built-in sentences tokenized with the source's tokenizer and padded to the static shape, else the sample
feeds. A pipeline that already quantizes (a ``quantize-int8{mode=static,format=qdq}`` pass) is kept as is.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir

from precast.artifact.target_blocks import EPPlugin, QnnBlock, SessionSettings
from precast.errors import (
    NativeCrashError,
    PassFailedError,
    TargetUnavailableError,
    UnsupportedOpError,
    UsageError,
    first_line,
)
from precast.ir.calibration import FeedsReader, calibration_batches, used_user_data
from precast.ir.registry import PassContext
from precast.options import opt
from precast.passes._quantize_common import quiet
from precast.runtime.backends.ep_plugin import plugin_available
from precast.targets.base import (
    Availability,
    BuildContext,
    BuildResult,
    Target,
    register_target,
)
from precast.targets.isolated import run_isolated

__all__ = ["OrtQnn"]

EP = "QNNExecutionProvider"
PACKAGE = "onnxruntime_qnn"
WIDE_BELOW_DB = 30.0  # weights=auto: int16 for a weight whose per-tensor uint8 SQNR is below this (~5 bits)


def _version(pkg: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "missing"


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
        "Qualcomm NPU (HTP) via the onnxruntime-qnn EP plugin: static A16W8 QDQ, EP-context compiled offline, "
        "sequence buckets"
    )
    # Static graph (pin dims, fold the shape arithmetic), then lower what the HTP refuses; the build quantizes.
    # limit=1000: a finite attention-mask fill (-3.4e38 would take the whole range of the scores' scale;
    # 1000 below any score keeps softmax's padded weights at exp(-850) or less, i.e. 0).
    default_pipeline = (
        "pin-dims,fold-constants,infer-shapes,eliminate-dead-code,lower-gathernd,"
        "lower-where-constants{limit=1000}"
    )
    precision = "int8"

    @dataclass(frozen=True)
    class Options:
        activations: Literal["u16", "u8"] = opt(
            "u16", "activation quantization type (u16: A16, the accurate default)"
        )
        weights: Literal["auto", "u8", "int16"] = opt(
            "auto", f"auto: uint8, int16 for weights whose uint8 SQNR is below {WIDE_BELOW_DB:g} dB"
        )
        htp_arch: str = opt("73", "HTP arch: 68, 69, 73 (8 Gen 2 / X Elite), 75, 79, 81")
        soc_model: str = opt("0", "QNN SoC model (0: let QNN pick; 57 = SM8550)")
        shapes: str = opt("", "NAME=2x8;... (default: the sample feeds' shapes)")
        timeout_s: int = opt(900, "seconds per vendor step in its child process")
        buckets: str = opt(
            "",
            "sequence lengths, e.g. 64,128: one static model each; the runtime runs the smallest that fits",
        )
        bucket_dim: str = opt("sequence", "the symbolic input dim buckets size")

    def check_options(self) -> None:
        if self.options.weights == "int16" and self.options.activations == "u8":
            raise UsageError("target 'ort-qnn': weights=int16 needs activations=u16 (the HTP has no A8W16)")
        parse_shapes(self.options.shapes)
        self._bucket_sizes()

    @classmethod
    def can_build(cls) -> Availability:
        ok, why = plugin_available(EP)
        return Availability(ok, why)

    @classmethod
    def can_run(cls) -> Availability:
        return cls.can_build()

    def build(self, model: ir.Model, out_dir: Path, ctx: BuildContext) -> BuildResult:
        sizes = self._bucket_sizes()
        if not sizes:
            block, used = self._build_one(model, out_dir, "model.onnx", ctx.pass_context)
            return BuildResult(block, self.precision, calibration_used=used)
        dim = self.options.bucket_dim
        axes = self._bucket_axes(dim, ctx)
        inputs = {k: a for k, a in axes.items() if k in ctx.sample_feeds}
        outputs = {k: a for k, a in axes.items() if k not in inputs}
        blocks, models, used = {}, {}, False
        for size in sizes:
            models[size] = "model.onnx" if size == sizes[-1] else f"model_{dim}{size}.onnx"
            at = _context_at(ctx.pass_context, inputs, size)  # the feeds padded or cut to this size
            pinned = self._pinned_size(model, inputs)
            at_size = model if pinned == size else ctx.rerun_pipeline(at.sample_feeds)
            blocks[size], used_here = self._build_one(at_size, out_dir, models[size], at)
            used = used or used_here
        block = blocks[sizes[-1]]
        buckets = {
            "dim": dim,
            "sizes": sizes,
            "models": {str(s): models[s] for s in sizes},
            "inputs": inputs,
            "outputs": outputs,
            "placement": {str(s): blocks[s].placement for s in sizes},
        }
        notes = [*block.notes, f"sequence buckets {sizes} ({dim}): one EP-context model each"]
        block = dataclasses.replace(block, buckets=buckets, notes=notes)
        return BuildResult(block, self.precision, calibration_used=used)

    def _bucket_sizes(self) -> list[int]:
        text = self.options.buckets.strip()
        if not text:
            return []
        try:
            sizes = sorted({int(s) for s in text.replace(";", ",").split(",") if s.strip()})
        except ValueError:
            sizes = []
        if not sizes or sizes[0] < 1:
            raise UsageError(f"target 'ort-qnn' option buckets: expected sizes like 64,128, got '{text}'")
        return sizes

    @staticmethod
    def _bucket_axes(dim: str, ctx: BuildContext) -> dict[str, int]:
        """Input / output name -> the axis of symbolic dim ``dim`` (read by pin-dims before it pinned)."""
        io = ctx.facts.symbolic_io
        if io is None or ctx.rerun_pipeline is None:
            raise UsageError("target 'ort-qnn' option buckets needs a pipeline that starts with pin-dims")
        axes = {name: shape.index(dim) for name, shape in io.items() if dim in shape}
        if not any(name in ctx.sample_feeds for name in axes):
            dims = sorted({d for shape in io.values() for d in shape if isinstance(d, str)})
            raise UsageError(
                f"target 'ort-qnn' option buckets: no input has a dim '{dim}' (symbolic dims: "
                f"{', '.join(dims) or 'none'}); pick one with --target-option bucket_dim=NAME"
            )
        return axes

    @staticmethod
    def _pinned_size(model: ir.Model, inputs: dict[str, int]) -> int | None:
        for value in model.graph.inputs:
            if value.name in inputs and value.shape is not None:
                return value.shape[inputs[value.name]]
        return None

    def _build_one(
        self, model: ir.Model, out_dir: Path, filename: str, data: PassContext
    ) -> tuple[QnnBlock, bool]:
        """One EP-context model at ``filename``, calibrated on ``data``'s feeds; and whether that was the
        user's --calibration data."""
        proto = ir.serde.serialize_model(model)
        used = False
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            tmpdir = Path(tmp)
            quantization: dict = {"format": "QDQ", "by": "pipeline (quantize pass; see its stats)"}
            if not _has_qdq(proto):
                proto, info, used = self._quantize(model, proto, tmpdir, data)
                quantization = {"format": "QDQ", "by": "ort-qnn build (onnxruntime QNN recipe)", **info}
            shapes = self._static_shapes(proto, data.sample_feeds or {})
            proto = _fix_shapes(proto, shapes)
            onnx.save(proto, tmpdir / "static_qdq.onnx")
            placement = self._check_placement(tmpdir / "static_qdq.onnx")
            self._compile(tmpdir / "static_qdq.onnx", out_dir / filename)
        block = QnnBlock(
            name=self.name,
            model=filename,
            providers=[EP],
            device="npu",
            precision=self.precision,
            ep_plugin=EPPlugin(ep=EP, package=PACKAGE, backend_lib="QnnHtp"),
            provider_options={},
            session=SessionSettings(config={"session.disable_cpu_ep_fallback": "1"}),
            static_shapes=shapes,
            quantization=quantization,
            htp={"arch": self.options.htp_arch, "soc_model": self.options.soc_model},
            placement=placement,
            requires={
                "onnxruntime": _version("onnxruntime"),
                "onnxruntime-qnn": _version("onnxruntime-qnn"),
            },
            notes=[
                f"QDQ by {quantization['by']}{_precision(quantization)}; HTP input shapes pinned to {shapes}; "
                f"placement check: {placement['on_htp']} of {placement['nodes']} nodes on the HTP"
            ],
        )
        return block, used

    @staticmethod
    def _calibration(model: ir.Model, data: PassContext) -> tuple[list[dict[str, np.ndarray]], str, bool]:
        """The batches, how the manifest describes them, and whether they are the user's --calibration data."""
        from precast.ir.parity import io_signature

        batches, source = calibration_batches(data, io_signature(model)[0])
        how = {
            "calibration": f"calibration data ({len(batches)} batches)",
            "calibration-sentences": f"built-in sentences, tokenized and padded ({len(batches)} batches)",
            "sample-feeds": f"sample feeds ({len(batches)} batches, a padded mask copy included; "
            "pass --calibration for representative ranges)",
        }
        return batches, how.get(source, source), used_user_data(source)

    def _quantize(
        self, model: ir.Model, proto: onnx.ModelProto, tmpdir: Path, data: PassContext
    ) -> tuple[onnx.ModelProto, dict, bool]:
        from onnxruntime.quantization import QuantType, quantize
        from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

        self.check_options()
        activations, weights = self.options.activations, self.options.weights
        batches, how, used = self._calibration(model, data)
        wide = wide_weights(proto, weights if activations == "u16" else "u8")
        src, dst = tmpdir / "fp32.onnx", tmpdir / "qdq.onnx"
        onnx.save(proto, src)
        reader = FeedsReader(batches, data.progress)
        overrides = {name: [{"quant_type": QuantType.QInt16, "symmetric": True}] for name in wide}
        try:
            with quiet():
                config = get_qnn_qdq_config(
                    str(src),
                    reader,
                    activation_type={"u16": QuantType.QUInt16, "u8": QuantType.QUInt8}[activations],
                    weight_type=QuantType.QUInt8,
                    init_overrides=overrides or None,
                )
                quantize(str(src), str(dst), config)
        except Exception as e:
            raise PassFailedError(f"target 'ort-qnn': static QDQ quantization failed: {first_line(e)}") from e
        info = {
            "activations": "uint16" if activations == "u16" else "uint8",
            "weights": "uint8" + (f", int16 for {len(wide)} of {_weight_count(proto)}" if wide else ""),
            "int16_weights": sorted(wide),
            "calibration": how,
        }
        return onnx.load(str(dst)), info, used

    def _static_shapes(self, proto: onnx.ModelProto, sample: dict) -> dict[str, list[int]]:
        inits = {i.name for i in proto.graph.initializer}
        names = [i.name for i in proto.graph.input if i.name not in inits]
        given = parse_shapes(self.options.shapes)
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
        return {"htp_arch": self.options.htp_arch, "soc_model": self.options.soc_model}

    def _isolated(self, entry: str, stage: str, payload: dict):
        """Run a QNN step in a child; a crash or hang is exit 5 naming the stage and QNN's refused nodes."""
        what = f"target 'ort-qnn' stage '{stage}'"
        try:
            return what, run_isolated(entry, payload, what=what, timeout=self.options.timeout_s)
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


def _weights(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The constant 2-D weight of each MatMul / Gemm (input 1), by initializer name."""
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    found = {}
    for node in proto.graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in inits:
            w = inits[node.input[1]]
            if len(w.dims) == 2 and w.data_type == onnx.TensorProto.FLOAT:
                found[w.name] = numpy_helper.to_array(w)
    return found


def _weight_count(proto: onnx.ModelProto) -> int:
    return len(_weights(proto))


def uint8_sqnr_db(w: np.ndarray) -> float:
    """Signal-to-noise ratio (dB) of ``w`` after per-tensor asymmetric uint8 min-max quantization (the
    quantizer's; the range includes 0)."""
    w = w.astype(np.float64)
    lo, hi = min(float(w.min()), 0.0), max(float(w.max()), 0.0)
    if hi == lo:
        return float("inf")
    scale = (hi - lo) / 255.0
    err = w - (np.round((w - lo) / scale) * scale + lo)
    noise = float((err**2).mean())
    return float("inf") if noise == 0 else 10.0 * np.log10(float((w**2).mean()) / noise)


def wide_weights(proto: onnx.ModelProto, weights: str) -> list[str]:
    """MatMul/Gemm weights to quantize as int16: all (int16), none (u8), or those 8 bits resolve badly (auto)."""
    if weights == "u8":
        return []
    found = _weights(proto)
    if weights == "int16":
        return sorted(found)
    return sorted(name for name, w in found.items() if uint8_sqnr_db(w) < WIDE_BELOW_DB)


def _precision(q: dict) -> str:
    if "activations" not in q:
        return ""
    return f" ({q['activations']} activations, {q['weights']} weights)"


def _context_at(context: PassContext, inputs: dict[str, int], size: int) -> PassContext:
    """The pass context at one bucket size: sample and calibration feeds padded (mask 0) or cut to ``size``."""
    from precast.runtime.buckets import pad_to

    def at(feeds: dict) -> dict:
        return {k: pad_to(np.asarray(v), inputs[k], size) if k in inputs else v for k, v in feeds.items()}

    calibration = [at(f) for f in context.calibration_feeds] if context.calibration_feeds else None
    return dataclasses.replace(context, sample_feeds=at(context.sample_feeds), calibration_feeds=calibration)


def _fix_shapes(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    from onnxruntime.tools.onnx_model_utils import (
        fix_output_shapes,
        make_input_shape_fixed,
    )

    for name, shape in shapes.items():
        make_input_shape_fixed(proto.graph, name, shape)
    fix_output_shapes(proto)
    return onnx.shape_inference.infer_shapes(proto)
