"""Target ``openvino``: OpenVINO IR (model.xml + model.bin) for Intel CPUs, GPUs and NPUs.

    ONNX graph --openvino.Core.read_model--> ov.Model --save_model--> model.xml/.bin
      (host) --compile_model(device, precision hint)--> compiled blob, cached per host by the runtime

Why the ``openvino`` package and not ONNX Runtime's OpenVINO EP: ``onnxruntime-openvino`` replaces the
``onnxruntime`` module (it cannot sit beside the CPU or QNN builds), and its EP-context models failed to
reload here. The ``openvino`` package reads ONNX directly, saves a portable IR, and caches compiled blobs.
Symbolic dims stay dynamic (OpenVINO supports them). Weights are kept in fp32 in the IR; the precision
hint decides what the device computes in (f32 by default so parity holds to fp32 tolerances).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnx_ir as ir

from precast.errors import PassFailedError, UsageError, first_line
from precast.options import opt
from precast.runtime.backends.openvino import openvino_available
from precast.targets.base import (
    Availability,
    BuildContext,
    BuildResult,
    Target,
    register_target,
)
from precast.targets.openvino_llm import ir_block

__all__ = ["OpenVINO"]

_PRECISIONS = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}
_HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")


@register_target("openvino")
class OpenVINO(Target):
    summary = "OpenVINO IR (xml/bin) via the openvino package; CPU here, GPU/NPU on hosts that have them"
    default_pipeline = "infer-shapes,fold-constants,eliminate-dead-code"
    precision = "fp32"

    @dataclass(frozen=True)
    class Options:
        device: str = opt("CPU", "OpenVINO device recorded for the runtime (CPU, GPU, NPU)")
        inference_precision: Literal["f32", "f16", "bf16"] = opt("f32", "OpenVINO's inference precision hint")
        performance_hint: Literal["LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"] = opt(
            "LATENCY", "OpenVINO's performance hint"
        )
        weights: Literal["f32", "int8", "int4"] = opt(
            "f32", "weight compression through NNCF (int4: symmetric, per group)"
        )
        group_size: int = opt(128, "int4 weights: columns per scale (e.g. 128, 32)")
        kv_cache_precision: Literal["f32", "f16", "u8"] = opt(
            "f32", "causal-lm: the paged KV cache's precision (u8: per-block scales)"
        )

    @classmethod
    def can_build(cls) -> Availability:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return Availability(False, "python package 'openvino' is not installed (pip install openvino)")
        return Availability(True)

    @classmethod
    def can_run(cls) -> Availability:
        ok, why = openvino_available("CPU")
        return Availability(ok, why)

    def check_options(self) -> None:
        if self.options.group_size < 1:
            raise UsageError(
                f"target 'openvino' option group_size must be >= 1, got {self.options.group_size}"
            )

    def build(self, model: ir.Model, out_dir: Path, ctx: BuildContext) -> BuildResult:
        import openvino as ov

        o = self.options
        prec, hint = o.inference_precision, o.performance_hint.upper()
        if prec not in _PRECISIONS:
            raise UsageError(
                f"target 'openvino' option inference_precision must be one of {', '.join(_PRECISIONS)}"
            )
        if hint not in _HINTS:
            raise UsageError(f"target 'openvino' option performance_hint must be one of {', '.join(_HINTS)}")
        lowering = ctx.lowerings.get("openvino")
        if lowering is not None:  # a causal LM: its own step graph over OpenVINO's PagedAttention
            from precast.targets.openvino_llm import build_causal_lm

            return build_causal_lm(self, lowering, out_dir, ctx.progress)
        if o.kv_cache_precision != "f32":
            raise UsageError("target 'openvino' option kv_cache_precision applies to --task causal-lm only")
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / "model.onnx"
            ir.save(model, src)
            try:
                ov_model = ov.Core().read_model(str(src))
            except Exception as e:
                raise PassFailedError(
                    f"target 'openvino': OpenVINO cannot read the ONNX graph: {first_line(e)}"
                ) from e
            from precast.targets.openvino_llm import compress_weights

            ov_model = compress_weights(ov_model, o.weights, o.group_size)
            ov.save_model(ov_model, str(out_dir / "model.xml"), compress_to_fp16=False)
        block = ir_block(
            self.name, o, _PRECISIONS[prec] if o.weights == "f32" else o.weights, {"PERFORMANCE_HINT": hint}
        )
        # compressed weights are held to the accuracy budget, not to fp32 tolerances
        return BuildResult(block, o.weights if o.weights != "f32" else self.precision)

    def stand_in(self, out_dir: Path, built: BuildResult):
        """A causal-lm step IR is verified on the compile's sample step (the ort-cpu contract) through the
        runtime's OVStepRunner (runtime/llm/runners/ov_contract.py); other IR loads as a user would."""
        if built.llm is None:
            return None
        from precast.runtime.llm.runners.ov_contract import ContractStep

        return ContractStep(out_dir, built.block, built.llm)
