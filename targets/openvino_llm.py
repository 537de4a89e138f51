"""Target ``openvino`` for ``--task causal-lm``: the PagedAttention step graph (compiler/decoder/ov_decoder.py) as IR.

    source.lowerings["openvino"]() -> ov.Model (+ its llm block, kv_layout "ov-paged", block 32)
      -> weights: f32 | int8 | int4 (NNCF compress_weights, group_size; what optimum-intel runs)
      -> model.xml/.bin, config: INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION (f32 | f16 | u8 per-block scales)

Verification runs the IR on the compile's sample step, which is the ort-cpu step contract: the runtime's
ContractStep (runtime/llm/runners/ov_contract.py: past K/V copied into an OVStepRunner pool, new K/V read back out)
gives logits and every new K/V row for the torch reference; ``precast verify`` re-runs it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import TensorSpec
from precast.artifact.schema import IOSignature
from precast.artifact.target_blocks import OpenVINOBlock
from precast.errors import PassFailedError, UsageError, first_line
from precast.runtime.progress import ProgressReporter
from precast.targets.base import BuildResult, Target

__all__ = ["build_causal_lm", "compress_weights", "ir_block", "step_io"]

KV_PRECISIONS = {"f32": "float32", "f16": "float16", "u8": "uint8"}


def compress_weights(model, weights: str, group_size: int):
    """NNCF weight compression (int8: per channel; int4: symmetric, ``group_size`` columns per scale)."""
    if weights == "f32":
        return model
    try:
        import nncf
    except ImportError:
        raise UsageError(
            "target 'openvino' weights=int4|int8 needs nncf: pip install 'precast[openvino-weights]'"
        ) from None
    try:
        if weights == "int8":
            return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        return nncf.compress_weights(
            model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group_size, ratio=1.0
        )
    except Exception as e:
        raise PassFailedError(
            f"target 'openvino': NNCF weight compression ({weights}) failed: {first_line(e)}"
        ) from e


def step_io(llm: dict, kv: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The IR's inputs and outputs as the manifest records them (the pool's dims as the f32 layout names them)."""
    ints = [
        TensorSpec("input_ids", "int64", (1, "tokens")),
        TensorSpec("positions", "int64", (1, "tokens")),
        TensorSpec("past_lens", "int32", ("batch",)),
        TensorSpec("subsequence_begins", "int32", ("batch_plus_1",)),
        TensorSpec("block_indices", "int32", ("blocks",)),
        TensorSpec("block_indices_begins", "int32", ("batch_plus_1",)),
        TensorSpec("max_context_len", "int32", ()),
        TensorSpec("logits_indices", "int64", ("batch",)),
    ]
    pool = ("num_blocks", llm["kv_heads"], "block_rows", "head_bytes")
    kinds = [[TensorSpec(n, KV_PRECISIONS[kv], pool) for n in pair] for pair in llm["kv_inputs"]]
    pools = [p[0] for p in kinds] + [p[1] for p in kinds]
    return ints + pools, [TensorSpec("logits", "float32", ("batch", llm["vocab"]))]


def ir_block(name: str, opts: Any, precision: str, config: dict[str, str]) -> OpenVINOBlock:
    """The block of an IR at model.xml/.bin: ``opts`` (the target's Options) give the device and the
    inference precision hint, ``config`` the rest of OpenVINO's compile config."""
    import openvino as ov

    return OpenVINOBlock(
        name=name,
        backend="openvino",
        model="model.xml",
        weights="model.bin",
        device=opts.device,
        precision=precision,
        config={"INFERENCE_PRECISION_HINT": opts.inference_precision, **config},
        requires={"openvino": ov.get_version().split("-")[0]},
    )


def build_causal_lm(
    target: Target, lowering: Callable, out_dir: Path, progress: ProgressReporter | None = None
) -> BuildResult:
    """The step IR from the source's OpenVINO lowering, with its own llm block and io for the manifest."""
    import openvino as ov

    opts = target.options
    kv, weights, prec = opts.kv_cache_precision, opts.weights, opts.inference_precision
    if prec == "bf16" and kv == "f32":  # (before minutes of export)
        raise UsageError(
            "target 'openvino': inference_precision=bf16 needs kv_cache_precision=u8 or f16 (OpenVINO's "
            "PagedAttention computing in bf16 refuses an f32 cache on a CPU with bf16)"
        )
    model, llm = lowering(progress)
    model = compress_weights(model, weights, int(opts.group_size))
    open_cache_inputs(model)
    ov.save_model(model, str(out_dir / "model.xml"), compress_to_fp16=False)
    precision = target.precision
    if weights != "f32":
        precision = weights  # held to the accuracy budget, not to fp32 tolerances
    elif prec != "f32":  # bf16 / f16 compute: also budget-held (bf16 keeps 8 mantissa bits)
        precision = {"bf16": "bf16", "f16": "fp16"}[prec]
    config = {
        "KV_CACHE_PRECISION": kv,
        "PERFORMANCE_HINT": opts.performance_hint.upper(),
        # Pinned workers on a shared host wait for cores others hold: measured on a loaded 2-core host,
        # pinned 47 ms vs unpinned 5.6 ms per b1 decode step, 1.3 s vs 74 ms for a 128-token prefill.
        "ENABLE_CPU_PINNING": "NO",
    }
    inputs, outputs = step_io(llm, kv)
    return BuildResult(
        ir_block(target.name, opts, precision, config),
        precision,
        llm=LLMSpec.from_json(llm, f"target {target.name}"),
        io=IOSignature(tuple(inputs), tuple(outputs)),
    )

def open_cache_inputs(model) -> None:
    """Leave the cache inputs' type and shape to the device plugin (its block size, layout and
    KV_CACHE_PRECISION). Last, after weight compression: NNCF refuses a graph with dynamic types."""
    import openvino as ov

    for port in model.inputs:
        if port.get_any_name().startswith(("key_cache.", "value_cache.")):
            port.get_node().set_element_type(ov.Type.dynamic)
            port.get_node().set_partial_shape(ov.PartialShape.dynamic(4))
    model.validate_nodes_and_infer_types()
