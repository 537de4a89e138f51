"""The ``triton`` target for a staged model (pipeline ending in ``split-stages``): one Triton model per stage
and an ensemble that chains them under the unsplit model's name.

    model_repository/
      <name>/config.pbtxt                platform "ensemble": the unsplit model's inputs/outputs; one step per
      <name>/1/ENSEMBLE.txt              stage, wiring the boundary tensors (the version folder must exist)
      <name>_stage_<k>/config.pbtxt      backend python (or platform onnxruntime_onnx): the stage's own IO,
      <name>_stage_<k>/1/model.onnx      instance group, dynamic batcher where the stage has the batch dim
      <name>_stage_<k>/1/model.py        runs model.onnx on ONNX Runtime inside Triton's Python stub

Clients call ``<name>`` as they would the unsplit model; Triton's ensemble scheduler moves each request
from stage to stage, so different requests run in different stages at once, and each stage model gets its
own instances (``stage_instances``), which Triton may place on different devices. The manifest's ``stages``
block lists the stage files Triton serves, so ``precast.runtime.load`` and the compile's verification run
the same files in order.

Ensemble tensor names are the ONNX tensor names (unique in the source graph), so a boundary tensor has the
same name in the stage that writes it, the stages that read it and the ensemble. A tensor that a stage only
passes through (``ir/stages.py``: an input and an output of it, for a stage after the next one) is
not one of its Triton outputs: an ensemble tensor is written once, and every later step reads it as the
stage that computed it wrote it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx_ir as ir

from precast.artifact.stages_spec import StagesSpec
from precast.errors import UsageError
from precast.ir.parity import io_signature
from precast.ir.stages import Stage, stage_models, stage_plan
from precast.targets.ort_cpu import ort_offline_optimize, save_onnx
from precast.targets.triton_config import (
    EnsembleStep,
    ModelConfig,
    render_config,
    shared_batch_dim,
    tensor_configs,
)

if TYPE_CHECKING:
    from precast.targets.triton import Triton

__all__ = ["EnsembleBuild", "build_ensemble", "stage_model_name"]

_STAGE_MODEL = Path(__file__).with_name("_triton_stage_model.py")
_PLACEHOLDER = (
    "Triton ensemble: the ensemble scheduler runs the steps in ../config.pbtxt; this version folder only\n"
    "has to exist (a packed artifact keeps files, not empty folders).\n"
)


def stage_model_name(name: str, k: int) -> str:
    return f"{name}_stage_{k}"


@dataclass(frozen=True)
class EnsembleBuild:
    """What ``build_ensemble`` wrote: the manifest's stages block, the ensemble's and the stages' configs."""

    stages: StagesSpec
    ensemble: ModelConfig
    stage_configs: list[ModelConfig]
    batch_dim: str | None


def build_ensemble(model: ir.Model, repo: Path, repo_rel: str, o: Triton.Options) -> EnsembleBuild:
    """Write the stage models and the ensemble under ``repo`` (``repo_rel``: its path in the artifact).
    ``o``: the target's options (checked)."""
    name, version = o.model_name, str(o.version)
    plan, stages = stage_plan(model), stage_models(model)
    counts = _instance_counts(o, len(stages))
    inputs, outputs = io_signature(model)
    batch = shared_batch_dim(inputs, outputs) if o.max_batch_size > 0 else None
    entries, configs = [], []
    for stage, count in zip(stages, counts):
        folder = repo / stage_model_name(name, stage.index) / version
        folder.mkdir(parents=True)
        files = save_onnx(stage.model, folder / "model.onnx")
        if o.ort_level != "none" and len(files) == 1:
            ort_offline_optimize(folder / "model.onnx", o.ort_level)
        cfg = _stage_config(stage, batch, count, o)
        (folder.parent / "config.pbtxt").write_text(render_config(cfg), encoding="utf-8")
        if cfg.backend == "python":
            shutil.copyfile(_STAGE_MODEL, folder / "model.py")
        entries.append(stage.entry(f"{repo_rel}/{cfg.name}/{version}/model.onnx"))
        configs.append(cfg)
    ensemble = ModelConfig(
        name=name,
        platform="ensemble",
        inputs=tensor_configs(inputs, drop_batch=batch is not None),
        outputs=tensor_configs(outputs, drop_batch=batch is not None),
        max_batch_size=o.max_batch_size if batch else 0,
        ensemble_steps=[
            EnsembleStep(
                cfg.name, {t.name: t.name for t in cfg.inputs}, {t.name: t.name for t in cfg.outputs}
            )
            for cfg in configs
        ],
    )
    check_wiring(ensemble, configs)
    (repo / name / version).mkdir(parents=True)
    (repo / name / version / "ENSEMBLE.txt").write_text(_PLACEHOLDER, encoding="utf-8")
    (repo / name / "config.pbtxt").write_text(render_config(ensemble), encoding="utf-8")
    spec = StagesSpec(n=int(plan["n"]), by=str(plan["by"]), stages=entries)
    return EnsembleBuild(spec, ensemble, configs, batch)


def _instance_counts(o: Triton.Options, n: int) -> list[int]:
    counts = o.stage_counts()
    if not counts:
        return [o.instance_count] * n
    if len(counts) != n:
        raise UsageError(
            f"target 'triton' option stage_instances lists {len(counts)} counts for a model of {n} stages"
        )
    return list(counts)


def _stage_config(stage: Stage, batch: str | None, count: int, o: Triton.Options) -> ModelConfig:
    """A stage is Triton-batched when all its inputs and outputs lead with the model's batch dim; a stage that
    is not (a boundary tensor without it) takes the ensemble's batch whole, with full dims."""
    ins, outs = io_signature(stage.model)
    outs = [t for t in outs if t.name not in stage.inputs]  # passed through: the ensemble has it already
    if not outs:
        raise UsageError(
            f"target 'triton': stage {stage.index} only passes tensors through; use fewer stages"
        )
    batched = batch is not None and shared_batch_dim(ins, outs) == batch
    max_batch = o.max_batch_size if batched else 0
    common = dict(
        name=stage_model_name(o.model_name, stage.index),
        inputs=tensor_configs(ins, drop_batch=batched),
        outputs=tensor_configs(outs, drop_batch=batched),
        max_batch_size=max_batch,
        preferred_batch_sizes=o.batch_sizes() if max_batch else (),
        max_queue_delay_us=o.max_queue_delay_us if max_batch else None,
        instance_count=count,
    )
    if o.stage_backend == "onnxruntime":  # a Triton with the onnxruntime backend runs the file itself
        params = {"intra_op_thread_count": str(o.threads)} if o.threads else {}
        kind = "KIND_GPU" if o.instance_kind == "gpu" else "KIND_CPU"
        return ModelConfig(
            platform="onnxruntime_onnx",
            instance_kind=kind,
            default_model_filename="model.onnx",
            parameters=params,
            **common,
        )
    params = {
        "precast_artifact": "../..",
        "precast_stage": str(stage.index),
        "precast_threads": str(o.threads),
    }
    # The stub runs the stage on ORT's CPU provider, so its instances are CPU ones (as the precast model's).
    return ModelConfig(backend="python", parameters=params, **common)


def check_wiring(ensemble: ModelConfig, stages: list[ModelConfig]) -> None:
    """Every step input is an ensemble input or an earlier step's output, each ensemble tensor is written
    once, every ensemble output is written, and each step maps exactly its model's inputs and outputs.
    (Triton checks the same when it loads the ensemble; failing here names the tensor at compile time.)"""
    by_name = {cfg.name: cfg for cfg in stages}
    available = {t.name for t in ensemble.inputs}
    written: set[str] = set()
    for step in ensemble.ensemble_steps:
        cfg = by_name[step.model_name]
        if set(step.input_map) != {t.name for t in cfg.inputs} or set(step.output_map) != {
            t.name for t in cfg.outputs
        }:
            raise UsageError(
                f"target 'triton': ensemble step '{step.model_name}' does not map its model's IO"
            )
        for tensor in step.input_map.values():
            if tensor not in available:
                raise UsageError(
                    f"target 'triton': ensemble step '{step.model_name}' reads '{tensor}', "
                    "which no earlier step or ensemble input provides"
                )
        for tensor in step.output_map.values():
            if tensor in written or tensor in {t.name for t in ensemble.inputs}:
                raise UsageError(f"target 'triton': ensemble tensor '{tensor}' is written twice")
            written.add(tensor)
        available |= set(step.output_map.values())
    for t in ensemble.outputs:
        if t.name not in written:
            raise UsageError(f"target 'triton': ensemble output '{t.name}' is written by no stage")
