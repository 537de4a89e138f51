"""Target ``ort-cpu``: an ONNX model for ONNX Runtime's CPU execution provider.

The artifact stores the graph after precast's passes and, optionally, after ONNX Runtime's own
*portable* graph optimizations (level ``extended``) applied offline. Layout-specific rewrites (NCHWc
and friends, level ``all``) depend on the host CPU, so they are left to session creation on the host.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnx_ir as ir

from precast.artifact.stages_spec import StagesSpec
from precast.artifact.target_blocks import OrtBlock, SessionSettings
from precast.options import opt
from precast.runtime.backends import ort_session_options
from precast.targets.base import BuildContext, BuildResult, Target, register_target

__all__ = ["OrtCpu", "save_onnx", "save_model", "ort_offline_optimize", "cpu_block_fields"]

_EXTERNAL_THRESHOLD = 1 << 30  # bytes of initializers above which weights go to model.onnx.data


def _initializer_bytes(model: ir.Model) -> int:
    total = 0
    for v in model.graph.initializers.values():
        if v.const_value is not None:
            total += v.const_value.nbytes
    return total


def save_onnx(model: ir.Model, path: Path) -> list[str]:
    """Save deterministically; big models get one external data file. Returns the file names written."""
    if _initializer_bytes(model) > _EXTERNAL_THRESHOLD:
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
        return [path.name, path.name + ".data"]
    ir.save(model, path)
    return [path.name]


def ort_offline_optimize(path: Path, level: str) -> None:
    """Rewrite the single-file model at ``path`` with ONNX Runtime's own graph optimizations at ``level``
    (a portable one: none|basic|extended), as a CPU session would apply them at load."""
    import onnxruntime as ort

    so = ort_session_options(SessionSettings(graph_optimization_level=level))
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        optimized = Path(tmp) / "opt.onnx"
        so.optimized_model_filepath = str(optimized)
        ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        os.replace(optimized, path)


def save_model(model: ir.Model, out_dir: Path, level: str = "none") -> tuple[str | None, StagesSpec | None]:
    """The shared save path: ``model.onnx``, or for a split-stages model ``stages/stage_<k>.onnx`` (each
    with external data past the threshold, as model.onnx). ``level``: ONNX Runtime's offline optimization,
    applied to each single-file model written. Returns the block's ``model`` (None for stages: the stages
    block names the files) and the manifest's stages block (None for one model)."""
    from precast.ir.stages import is_staged, write_stages

    def save(m: ir.Model, path: Path) -> list[str]:
        files = save_onnx(m, path)
        if level != "none" and len(files) == 1:
            ort_offline_optimize(path, level)
        return files

    if is_staged(model):
        return None, write_stages(model, out_dir, save)
    save(model, out_dir / "model.onnx")
    return "model.onnx", None


def cpu_block_fields(
    target: Target, model: str | None, *, graph_level: str, threads: int, offline_level: str
) -> dict[str, Any]:
    """The fields of every block that runs a saved model on ONNX Runtime's CPU provider (ort-cpu's, and
    triton's, whose manifest runs the very file Triton serves)."""
    return {
        "name": target.name,
        "model": model,
        "providers": ["CPUExecutionProvider"],
        "device": "cpu",
        "precision": target.precision,
        "session": SessionSettings(graph_optimization_level=graph_level, intra_op_num_threads=threads),
        "offline_ort_level": offline_level,
    }


@register_target("ort-cpu")
class OrtCpu(Target):
    summary = "ONNX Runtime, CPU execution provider (portable across x86/ARM hosts)"
    # Loops first (their bodies then fold and fuse like the rest); attention before the MatMul/bias
    # rewrites that would consume its projections; skip-LN and bias-GeLU before Gemm takes their bias Adds.
    # fuse-embed-layernorm is opt-in: on a quiet machine MiniLM ran 1-10% slower with it (2 threads, interleaved,
    # 3 runs), and it does nothing that ONNX Runtime's own embedding kernels need.
    runs_stages = True
    default_pipeline = (
        "infer-shapes,fold-constants,unroll-loops,fold-constants,eliminate-dead-code,"
        "fuse-layernorm,fuse-rmsnorm,fuse-gelu,fuse-attention,fuse-skip-layernorm,"
        "fuse-matmul-add,pack-matmuls,"
        "eliminate-dead-code"
    )

    @dataclass(frozen=True)
    class Options:
        ort_level: Literal["none", "basic", "extended"] = opt(
            "none", "ONNX Runtime's graph optimizations applied offline (portable levels)"
        )
        threads: int = opt(0, "intra-op threads at load (0: ONNX Runtime's default)")
        runtime_level: Literal["disable", "basic", "extended", "all"] = opt(
            "all", "graph_optimization_level of the session at load"
        )

    def build(self, model: ir.Model, out_dir: Path, ctx: BuildContext) -> BuildResult:
        o = self.options
        if o.ort_level not in ("none", "basic", "extended"):
            from precast.errors import UsageError

            raise UsageError(
                f"target 'ort-cpu' option ort_level must be none|basic|extended, got '{o.ort_level}'"
            )
        rel, stages = save_model(model, out_dir, o.ort_level)
        fields = cpu_block_fields(
            self, rel, graph_level=o.runtime_level, threads=int(o.threads), offline_level=o.ort_level
        )
        return BuildResult(OrtBlock(**fields), self.precision, stages=stages)
