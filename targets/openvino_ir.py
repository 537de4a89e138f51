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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import onnx_ir as ir

from precast.runtime.errors import PassFailedError, UsageError, first_line
from precast.runtime.openvino_backend import openvino_available
from precast.runtime.target_blocks import OpenVINOBlock
from precast.targets.base import Availability, Target, register_target

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
        device: str = field(
            default="CPU", metadata={"help": "OpenVINO device recorded for the runtime (CPU, GPU, NPU)"}
        )
        inference_precision: Literal["f32", "f16", "bf16"] = field(
            default="f32", metadata={"help": "OpenVINO's inference precision hint"}
        )
        performance_hint: Literal["LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"] = field(
            default="LATENCY", metadata={"help": "OpenVINO's performance hint"}
        )
        weights: Literal["f32", "int8", "int4"] = field(
            default="f32", metadata={"help": "weight compression through NNCF (int4: symmetric, per group)"}
        )
        group_size: int = field(
            default=128, metadata={"help": "int4 weights: columns per scale (e.g. 128, 32)"}
        )
        kv_cache_precision: Literal["f32", "f16", "u8"] = field(
            default="f32",
            metadata={"help": "causal-lm: the paged KV cache's precision (u8: per-block scales)"},
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
        if self.options["group_size"] < 1:
            raise UsageError(
                f"target 'openvino' option group_size must be >= 1, got {self.options['group_size']}"
            )

    def build(self, model: ir.Model, out_dir: Path) -> OpenVINOBlock:
        import openvino as ov

        prec, hint = self.options["inference_precision"], self.options["performance_hint"].upper()
        if prec not in _PRECISIONS:
            raise UsageError(
                f"target 'openvino' option inference_precision must be one of {', '.join(_PRECISIONS)}"
            )
        if hint not in _HINTS:
            raise UsageError(f"target 'openvino' option performance_hint must be one of {', '.join(_HINTS)}")
        lowering = (getattr(self.context, "extra", None) or {}).get("lowerings", {}).get("openvino")
        if lowering is not None:  # a causal LM: its own step graph over OpenVINO's PagedAttention
            from precast.targets.openvino_llm import build_causal_lm

            return build_causal_lm(self, lowering, out_dir)
        if self.options["kv_cache_precision"] != "f32":
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

            ov_model = compress_weights(ov_model, self.options["weights"], self.options["group_size"])
            ov.save_model(ov_model, str(out_dir / "model.xml"), compress_to_fp16=False)
        if self.options["weights"] != "f32":
            self.precision = self.options["weights"]  # held to the accuracy budget
        return OpenVINOBlock(
            name=self.name,
            backend="openvino",
            model="model.xml",
            weights="model.bin",
            device=self.options["device"],
            precision=_PRECISIONS[prec] if self.options["weights"] == "f32" else self.options["weights"],
            config={"INFERENCE_PRECISION_HINT": prec, "PERFORMANCE_HINT": hint},
            requires={"openvino": ov.get_version().split("-")[0]},
        )

    def stand_in(self, out_dir: Path, block: OpenVINOBlock):
        """A causal-lm step IR is verified on the compile's sample step (the ort-cpu contract) through the
        runtime's OVStepRunner (runtime/llm/ov_contract.py); other IR loads as a user would."""
        if self.llm is None:
            return None
        from precast.runtime.llm.ov_contract import ContractStep
        from precast.runtime.llm_spec import LLMSpec

        return ContractStep(out_dir, block, LLMSpec.from_json(self.llm, f"target {self.name}"))
