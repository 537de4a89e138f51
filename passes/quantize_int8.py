"""INT8 quantization with ONNX Runtime's quantizers: dynamic (weights only, activations at run time)
or static (activation ranges calibrated on sample data, QDQ graphs for NPU execution providers).

    dynamic:   x -> MatMul(W)                 ==>  DynamicQuantizeLinear(x) -> MatMulInteger(Wq) -> scale
               packed Attention(x, Wqkv)      ==>  3 x MatMulInteger + MultiHeadAttention (unpack_attention)
    static:    x -> MatMul(W)                 ==>  Q(x) -> DQ -> MatMul(DQ(Wq))        (format=qdq)
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnx
import onnx_ir as ir

from precast.ir.calibration import used_user_data
from precast.ir.registry import Pass, PassFacts, PassResult, option, register
from precast.passes._quantize_common import (
    count_ops,
    from_proto,
    quiet,
    resolve_exclude,
    to_proto,
)
from precast.passes._unpack_attention import unpack_attention

__all__ = ["QuantizeInt8"]

_LARGE = 1_800_000_000  # protobuf's 2 GiB limit: bigger models go through external data files


def _int8_initializers(model: ir.Model) -> int:
    return sum(
        1
        for v in model.graph.initializers.values()
        if v.const_value is not None
        and v.const_value.dtype in (ir.DataType.INT8, ir.DataType.UINT8)
        and len(v.const_value.shape) >= 2  # weights, not per-channel zero points
    )


def _host_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI or AVX-VNNI (Linux /proc/cpuinfo; elsewhere assumed yes)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return "avx512_vnni" in flags or "avx_vnni" in flags
    except OSError:
        pass
    return True


@register("quantize-int8")
class QuantizeInt8(Pass):
    """INT8 weights (and, in static mode, calibrated activations) via onnxruntime.quantization.

    Options: mode=dynamic|static; per_channel; static: method=minmax|entropy|percentile, format=qdq|qoperator,
    activation/weight types; ops (op types to quantize, empty = ONNX Runtime's default set);
    exclude=[node name or op type,...] keeps those layers fp32 (mixed precision).
    unpack_attention (default on): packed Attention nodes, which ONNX Runtime's quantizer leaves fp32,
    become Q/K/V MatMuls + MultiHeadAttention first so their projections quantize too (MiniLM batch 8:
    ~1.5x over the fp32 artifact instead of ~1.3x; benchmarks/bench_quant.py).
    """

    @dataclass(frozen=True)
    class Options:
        mode: Literal["dynamic", "static"] = option(
            "dynamic",
            "dynamic: weights only, activations quantized at run time; static: calibrated activations",
        )
        per_channel: bool = option(True, "one scale per output channel instead of per tensor")
        method: Literal["minmax", "entropy", "percentile"] = option(
            "minmax", "static: calibration method for activation ranges"
        )
        format: Literal["qdq", "qoperator"] = option(
            "qdq", "static: QDQ pairs around float ops, or QOperator (QLinear*) nodes"
        )
        activation: Literal["uint8", "int8"] = option("uint8", "static: activation type")
        weight: Literal["int8", "uint8"] = option("int8", "weight type")
        reduce_range: bool = option(
            False,
            "7-bit weights: ONNX Runtime's u8 x s8 kernels on CPUs without VNNI saturate 16-bit sums of 8-bit "
            "products (dynamic mode turns it on by itself where the compiling CPU has no VNNI)",
        )
        ops: tuple[str, ...] = option((), "op types to quantize (empty: ONNX Runtime's default set)")
        exclude: tuple[str, ...] = option((), "node names or op types to keep fp32 (mixed precision)")
        unpack_attention: bool = option(
            True,
            "packed Attention -> Q/K/V MatMuls + MultiHeadAttention first, so the projections quantize too",
        )

    def call(self, model: ir.Model) -> PassResult:
        from onnxruntime.quantization import QuantType

        o = self.options
        unpacked = 0
        if o.unpack_attention and (not o.ops or "MatMul" in o.ops):
            # An excluded Attention (by name or op type) stays packed and fp32.
            skip = {n.name for n in model.graph if n.name in o.exclude or n.op_type in o.exclude}
            unpacked = unpack_attention(model, skip=skip)
        excluded = resolve_exclude(
            model, o.exclude, self.name
        )  # after unpacking: exclude=[MatMul] covers Q/K/V
        proto = to_proto(model)
        qtype = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
        # Fused contrib ops (SkipLayerNormalization, ...) defeat the quantizer's type inference; their
        # outputs are float, which DefaultTensorType tells it.
        extra = {"DefaultTensorType": onnx.TensorProto.FLOAT}
        common = dict(
            op_types_to_quantize=list(o.ops) or None,
            per_channel=o.per_channel,
            reduce_range=o.reduce_range or (o.mode == "dynamic" and not _host_has_vnni()),
            weight_type=qtype[o.weight],
            nodes_to_exclude=excluded,
            use_external_data_format=proto.ByteSize() > _LARGE,
        )
        stats: dict = {"mode": o.mode}
        with tempfile.TemporaryDirectory(prefix="precast-q8-") as tmp, quiet():
            out = Path(tmp) / "quantized.onnx"
            if o.mode == "dynamic":
                from onnxruntime.quantization import quantize_dynamic

                quantize_dynamic(proto, out, extra_options=extra, **common)
            else:
                stats.update(self._static(model, proto, out, extra, common, qtype))
            qproto = onnx.load(str(out), load_external_data=True)
        result = from_proto(qproto)
        ops = count_ops(result)
        stats.update(
            {
                "int8_weights": _int8_initializers(result),
                "quantize_nodes": ops.get("QuantizeLinear", 0) + ops.get("DynamicQuantizeLinear", 0),
                "excluded": len(excluded),
                **({"attention_unpacked": unpacked} if unpacked else {}),
            }
        )
        if stats["int8_weights"] == 0:
            stats["note"] = "nothing was quantized (no supported op with constant weights)"
        changed = stats["int8_weights"] > 0 or stats["quantize_nodes"] > 0
        return PassResult(
            result, changed, stats, PassFacts(calibration_used=used_user_data(stats.get("calibration")))
        )

    def _static(
        self, model: ir.Model, proto: onnx.ModelProto, out: Path, extra: dict, common: dict, qtype: dict
    ) -> dict:
        from onnxruntime.quantization import (
            CalibrationMethod,
            QuantFormat,
            quantize_static,
        )

        from precast.ir.calibration import FeedsReader, calibration_batches
        from precast.ir.parity import io_signature

        o = self.options
        inputs, _ = io_signature(model)
        batches, source = calibration_batches(self.context, inputs)
        method = {
            "minmax": CalibrationMethod.MinMax,
            "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile,
        }[o.method]
        quantize_static(
            proto,
            out,
            FeedsReader(batches, self.context.progress),
            quant_format=QuantFormat.QDQ if o.format == "qdq" else QuantFormat.QOperator,
            activation_type=qtype[o.activation],
            calibrate_method=method,
            extra_options=extra,
            **common,
        )
        stats = {
            "method": o.method,
            "format": o.format,
            "calibration": source,
            "calibration_batches": len(batches),
        }
        if source == "sample-feeds":
            stats["note"] = (
                "no --calibration data: calibrated on the random sample feeds; ranges may not match real data"
            )
        return stats
