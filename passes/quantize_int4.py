"""Weight-only 4-bit quantization of MatMul weights into ONNX Runtime's MatMulNBits (com.microsoft).

    x -> MatMul(W[K,N] fp32)   ==>   MatMulNBits(x, Wq[N, K/block, block/2] uint8, scales, zero_points?)

algo=rtn rounds each block of ``block`` weights to the nearest of 16 levels (ONNX Runtime's native
quantizer). algo=gptq (Frantar et al. 2022, passes/_gptq.py; see there why not ONNX Runtime's port) quantizes the
columns of W one by one and spreads each rounding error over the not-yet-quantized columns, weighted
by the inverse Hessian H = 2 X^T X of the calibration activations X that reach that MatMul, so the
error of X @ W (not of W) is minimised.

embeddings=true (default) also stores large embedding tables in 4 bits (passes/_embed_int4.py):

    Gather(table[V,E] fp32, ids)   ==>   GatherBlockQuantized(table_q4, ids, scales)

and a tied table (Gather(Transpose(lm head weight))) shares the lm head's MatMulNBits bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import onnx_ir as ir

from precast.errors import PassOptionError
from precast.ir.calibration import used_user_data
from precast.ir.registry import Pass, PassFacts, PassResult, option, register
from precast.passes._quantize_common import (
    count_ops,
    from_proto,
    import_quietly,
    quiet,
    resolve_exclude,
    to_proto,
)

__all__ = ["QuantizeInt4"]

_BLOCKS = (16, 32, 64, 128, 256)
_EMBED_MIN_ELEMENTS = 1 << 16  # a table below 256 KiB fp32 is not worth a GatherBlockQuantized


@register("quantize-int4")
class QuantizeInt4(Pass):
    """Weight-only INT4 MatMul -> MatMulNBits, round-to-nearest or GPTQ (calibrated), per block of weights.

    Options: algo=rtn|gptq; block=16|32|64|128|256; symmetric; accuracy_level=0..4 (MatMulNBits compute
    type: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8; default: 4 for causal LMs, whose decode steps it speeds up
    ~1.3-1.7x, else 0, since it slows prefill-like batches on CPUs without VNNI); exclude=[node name or op type,...] keeps layers fp32
    (e.g. the lm head); embeddings=true|false: 4-bit embedding tables (Gathers on 2-D float tables of at least
    64Ki elements; a tied one shares the lm head's bytes); gptq: percdamp (Hessian dampening).
    """

    @dataclass(frozen=True)
    class Options:
        algo: Literal["rtn", "gptq"] = option(
            "rtn", "rtn: round to nearest; gptq: calibrated, error-compensating (needs --calibration)"
        )
        block: int = option(32, "weights per quantization block (16, 32, 64, 128 or 256)")
        symmetric: bool = option(True, "symmetric blocks (no zero point)")
        accuracy_level: int | None = option(
            None,
            "MatMulNBits compute type: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 (none: 4 for causal LMs, else 0)",
        )
        exclude: tuple[str, ...] = option((), "node names or op types to keep fp32 (e.g. the lm head)")
        percdamp: float = option(0.01, "gptq: Hessian dampening, a fraction of its mean diagonal, in (0, 1)")
        embeddings: bool = option(
            True, "also 4-bit embedding tables (2-D float Gathers of at least 64Ki elements)"
        )

        def __post_init__(self) -> None:
            if self.block not in _BLOCKS:
                raise PassOptionError(
                    f"pass 'quantize-int4' option 'block' must be one of {_BLOCKS}, got {self.block}"
                )
            if self.accuracy_level is not None and not 0 <= self.accuracy_level <= 4:
                raise PassOptionError(
                    f"pass 'quantize-int4' option 'accuracy_level' must be 0..4, got {self.accuracy_level}"
                )
            if not 0 < self.percdamp < 1:
                raise PassOptionError(
                    f"pass 'quantize-int4' option 'percdamp' must be in (0, 1), got {self.percdamp}"
                )

    def call(self, model: ir.Model) -> PassResult:
        MatMulNBitsQuantizer = import_quietly("onnxruntime.quantization.matmul_nbits_quantizer").MatMulNBitsQuantizer

        o = self.options
        level = o.accuracy_level
        if level is None:
            level = 4 if self.context.task == "causal-lm" else 0
        unfused = _plain_matmuls(model)
        before = count_ops(model).get("MatMul", 0)
        proto = to_proto(model)
        excluded = resolve_exclude(model, o.exclude, self.name)
        stats: dict = {"algo": o.algo, "block": o.block, "accuracy_level": level}
        if o.embeddings:
            from precast.passes._embed_int4 import find_tables, quantize_tables

            untied, tied = find_tables(proto, _EMBED_MIN_ELEMENTS, excluded)
        if o.algo == "gptq":
            from precast.ir.calibration import calibration_batches
            from precast.ir.parity import io_signature
            from precast.passes._gptq import gptq_model

            batches, source = calibration_batches(self.context, io_signature(model)[0])
            stats.update({"calibration": source, "calibration_batches": len(batches)})
            if source == "sample-feeds":
                stats["note"] = "no --calibration data: GPTQ's Hessians come from the random sample feeds"
            qproto, _ = gptq_model(
                proto, batches, o.block, o.symmetric, level, excluded, o.percdamp, self.context.progress
            )
        else:
            quantizer = MatMulNBitsQuantizer(
                proto,
                bits=4,
                block_size=o.block,
                is_symmetric=o.symmetric,
                accuracy_level=level or None,
                nodes_to_exclude=excluded,
            )
            with quiet():
                quantizer.process()
            qproto = quantizer.model.model
        if o.embeddings:
            qproto, embed_stats = quantize_tables(qproto, list(untied), tied, o.block, o.symmetric)
            stats.update(embed_stats)
        result = from_proto(qproto)
        ops = count_ops(result)
        stats.update(
            {
                "quantized": ops.get("MatMulNBits", 0),
                "kept_fp32": ops.get("MatMul", 0),
                "excluded": len(excluded),
            }
        )
        if unfused:
            stats["unfused_transposed"] = unfused
        if before and not stats["quantized"]:
            stats["note"] = "no MatMul had a constant 2-D weight to quantize"
        facts = PassFacts(calibration_used=used_user_data(stats.get("calibration")))
        return PassResult(result, True, stats, facts)  # True: rebuilt through the quantizer's proto


def _plain_matmuls(model: ir.Model) -> int:
    """FusedMatMul(x, W, transB=1) over a constant 2-D W (a tied lm head, which fuse-matmul-add leaves reading the
    embedding table [V, E] in place) -> MatMul(x, W^T): the quantizer only takes MatMul. W^T is a new constant
    (the embedding Gather keeps W, and quantizes it as a table of its own)."""
    import numpy as np

    count = 0
    for node in list(model.graph):
        if node.op_type != "FusedMatMul" or node.domain != "com.microsoft" or len(node.inputs) != 2:
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        plain = {"alpha": 1.0, "transA": 0, "transB": 1, "transBatchA": 0, "transBatchB": 0}
        if any(attrs.get(k, {"alpha": 1.0}.get(k, 0)) != v for k, v in plain.items()):
            continue
        w = node.inputs[1]
        if w is None or w.const_value is None or len(w.const_value.shape) != 2 or w.producer() is not None:
            continue
        wt = ir.Value(name=f"{w.name}_T", const_value=ir.tensor(np.ascontiguousarray(w.const_value.numpy().T)))
        model.graph.register_initializer(wt)
        matmul = ir.Node("", "MatMul", [node.inputs[0], wt], name=f"{node.name}_matmul")
        model.graph.insert_before(node, matmul)
        node.outputs[0].replace_all_uses_with(matmul.outputs[0])
        if node.outputs[0].is_graph_output():
            idx = model.graph.outputs.index(node.outputs[0])
            name = node.outputs[0].name
            model.graph.outputs[idx] = matmul.outputs[0]
            matmul.outputs[0].name = name
        matmul.outputs[0].shape, matmul.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
        model.graph.remove(node, safe=True)
        count += 1
    return count
