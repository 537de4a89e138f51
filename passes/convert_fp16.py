"""fp32 -> fp16 weights and compute for accelerator targets, via onnxruntime.transformers.float16.

    x(fp32) -> MatMul(W fp32) -> ...     ==>   x(fp32) -> Cast(fp16) -> MatMul(W fp16) -> ... -> Cast(fp32)

Graph inputs/outputs stay fp32 (keep_io), and numerically sensitive ops (reductions, Exp/Log/Pow,
layer norms, plus ONNX Runtime's default block list) run in fp32 behind Casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from precast.ir.registry import Pass, PassResult, option, register
from precast.passes._quantize_common import (
    count_ops,
    from_proto,
    quiet,
    resolve_exclude,
    to_proto,
)

__all__ = ["ConvertFp16", "SENSITIVE_OPS"]

# fp16's 10-bit mantissa and 65504 range break sums of many terms and exponentials first.
SENSITIVE_OPS = (
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "Pow", "Exp", "Log",
    "Softmax", "LogSoftmax", "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "RMSNormalization", "CumSum", "Range",
)  # fmt: skip


@register("convert-fp16")
class ConvertFp16(Pass):
    """Convert float tensors to fp16; IO and sensitive ops stay fp32; exclude=[node or op type,...] keeps more."""

    @dataclass(frozen=True)
    class Options:
        keep_io: bool = option(True, "keep the graph inputs and outputs fp32 (Casts at the edges)")
        keep_sensitive: bool = option(
            True, "keep precision-sensitive ops (normalizations, softmax, exp/log, ...) fp32"
        )
        exclude: tuple[str, ...] = option((), "node names or op types to keep fp32")

    def call(self, model: ir.Model) -> PassResult:
        from onnxruntime.transformers.float16 import (
            DEFAULT_OP_BLOCK_LIST,
            convert_float_to_float16,
        )

        o = self.options
        excluded = resolve_exclude(model, o.exclude, self.name)
        proto = to_proto(model)
        op_block = list(DEFAULT_OP_BLOCK_LIST) + (list(SENSITIVE_OPS) if o.keep_sensitive else [])
        with quiet():
            converted = convert_float_to_float16(
                proto, keep_io_types=o.keep_io, op_block_list=op_block, node_block_list=excluded or None
            )
        result = from_proto(converted)
        fp16 = sum(
            1
            for v in result.graph.initializers.values()
            if v.const_value is not None and v.const_value.dtype == ir.DataType.FLOAT16
        )
        kept = sum(1 for n in result.graph.all_nodes() if n.op_type in op_block or n.name in excluded)
        return PassResult(
            result,
            True,  # the graph is re-typed to float16 (its Casts keep the fp32 interface)
            {"fp16_initializers": fp16, "casts": count_ops(result).get("Cast", 0), "kept_fp32": kept},
        )
