"""GPTQ (Frantar et al., 2022) for MatMul weights, emitted as ONNX Runtime MatMulNBits.

Why not ONNX Runtime's own port (onnxruntime.quantization.neural_compressor.gptq_quantize): it runs
GPTQ on one quantization grid, then re-quantizes the result with a second, differently scaled grid
(quant_tensor), which re-rounds every weight; measured here, its output error came out *higher* than
plain round-to-nearest. This module quantizes on the grid that MatMulNBits stores, so what GPTQ
optimises is exactly what runs.

For W[K, N] (rows = input channels) and calibration activations X[n, K]:
    H = 2/n X^T X + damp*I;  U = chol(H^-1)^T (upper)
    for each row k (in blocks of 128 rows, groups of ``block`` rows share one scale per column):
        q_k = quant(w_k);  e = (w_k - q_k) / U[k,k];  w_{k+1:} -= U[k, k+1:]^T e
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from precast.runtime.progress import SILENT, ProgressReporter

__all__ = ["collect_hessians", "gptq_weight", "gptq_model"]

_MAXQ = 15  # 4-bit levels 0..15


def collect_hessians(
    proto: onnx.ModelProto, names: Sequence[str], batches: Sequence[dict], progress: ProgressReporter = SILENT
) -> dict[str, np.ndarray]:
    """H = 2/n sum x^T x for each activation ``name`` (the MatMul's first input), over all calibration rows."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    sums: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}
    for b, feeds in enumerate(batches):
        progress.advance(b, len(batches), f"Hessians: calibration batch {b + 1} of {len(batches)}")
        outs = sess.run(list(names), dict(feeds))
        for name, x in zip(names, outs):
            x = np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])
            sums[name] = sums.get(name, 0) + x.T @ x
            rows[name] = rows.get(name, 0) + x.shape[0]
    return {n: 2.0 * sums[n] / max(rows[n], 1) for n in names}


def _params(w: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point per column of a group w[g, N], as MatMulNBits' native RTN picks them."""
    if symmetric:
        # The signed value of largest magnitude maps to level 0 (= -8 after the implicit zero point 8).
        idx = np.abs(w).argmax(axis=0)
        extreme = w[idx, np.arange(w.shape[1])]
        scale = extreme / -8.0
        scale[scale == 0] = 1.0
        return scale, np.full(w.shape[1], 8.0)
    lo = np.minimum(w.min(axis=0), 0.0)
    hi = np.maximum(w.max(axis=0), 0.0)
    scale = (hi - lo) / _MAXQ
    scale[scale == 0] = 1.0
    zero = np.clip(np.round(-lo / scale), 0, _MAXQ)
    return scale, zero


def gptq_weight(
    weight: np.ndarray, hessian: np.ndarray, group: int, symmetric: bool = True, percdamp: float = 0.01
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels q[Kp, N] (uint8 0..15), scales[Kp/group, N], zero points[Kp/group, N]; Kp = K padded to ``group``."""
    k, n = weight.shape
    kp = -(-k // group) * group
    W = np.zeros((kp, n), dtype=np.float64)
    W[:k] = weight
    H = np.zeros((kp, kp), dtype=np.float64)
    H[:k, :k] = hessian
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[dead] = 0.0
    H[np.diag_indices(kp)] += percdamp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    q = np.zeros((kp, n), dtype=np.uint8)
    scales = np.zeros((kp // group, n))
    zeros = np.zeros((kp // group, n))
    step = max(128, group)  # a multiple of every allowed group, so groups never straddle two steps
    for i1 in range(0, kp, step):
        i2 = min(i1 + step, kp)
        W1 = W[i1:i2].copy()
        err = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = i1 + i
            if row % group == 0:
                s, z = _params(W1[i : i + group], symmetric)
                scales[row // group], zeros[row // group] = s, z
            s, z = scales[row // group], zeros[row // group]
            level = np.clip(np.round(W1[i] / s) + z, 0, _MAXQ)
            q[row] = level
            e = (W1[i] - (level - z) * s) / U1[i, i]
            W1[i:] -= np.outer(U1[i, i:], e)
            err[i] = e
        W[i2:] -= U[i1:i2, i2:].T @ err
    return q, scales, zeros


def gptq_model(
    proto: onnx.ModelProto,
    batches: Sequence[dict],
    group: int,
    symmetric: bool,
    accuracy_level: int,
    exclude: Sequence[str] = (),
    percdamp: float = 0.01,
    progress: ProgressReporter = SILENT,
) -> tuple[onnx.ModelProto, int]:
    """Replace each MatMul with a constant 2-D fp32 weight by a GPTQ-quantized MatMulNBits.

    ``progress`` hears each calibration batch of the Hessians, then ``advance(i, n, MatMul)`` per layer."""
    from onnxruntime.quantization.neural_compressor.weight_only import (
        make_matmul_weight_only_node,
    )

    inits = {t.name: t for t in proto.graph.initializer}
    uses: dict[str, int] = {}
    for node in proto.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    targets = [
        (i, node)
        for i, node in enumerate(proto.graph.node)
        if node.op_type == "MatMul"
        and node.domain in ("", "ai.onnx")
        and node.name not in set(exclude)
        and node.input[1] in inits
        and len(inits[node.input[1]].dims) == 2
        and inits[node.input[1]].data_type == onnx.TensorProto.FLOAT
        and node.input[0] not in inits
    ]
    if not targets:
        return proto, 0
    hessians = collect_hessians(proto, sorted({t.input[0] for _, t in targets}), batches, progress)
    replaced: dict[int, onnx.NodeProto] = {}
    new_inits: list[onnx.TensorProto] = []
    for n, (i, node) in enumerate(targets):
        progress.advance(n, len(targets), f"MatMul '{node.name}' ({n + 1} of {len(targets)})")
        weight = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        q, scales, zeros = gptq_weight(weight, hessians[node.input[0]], group, symmetric, percdamp)
        k_blocks = q.shape[0] // group
        new_node, made = make_matmul_weight_only_node(
            node=node,
            weight_shape=weight.shape,
            num_bits=4,
            group_size=group,
            k_blocks=k_blocks,
            q_weight=np.ascontiguousarray(q.T).reshape(-1, group),
            scale=np.ascontiguousarray(scales.T).astype(np.float32).reshape(-1, 1),
            zero_point=None if symmetric else np.ascontiguousarray(zeros.T).astype(np.uint8).reshape(-1, 1),
            accuracy_level=accuracy_level,
        )
        replaced[i] = new_node
        new_inits.extend(made)
        uses[node.input[1]] -= 1
    nodes = [replaced.get(i, n) for i, n in enumerate(proto.graph.node)]
    progress.advance(len(targets), len(targets), "writing MatMulNBits")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    outputs = {o.name for o in out.graph.output}
    keep = [t for t in out.graph.initializer if uses.get(t.name, 0) > 0 or t.name in outputs]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep + new_inits)
    if not any(op.domain == "com.microsoft" for op in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return out, len(targets)
