"""Target ``triton``: a Triton Inference Server model repository inside the artifact.

    <artifact>/
      manifest.json                      precast's manifest (its target block runs model.onnx on ORT CPU)
      model_repository/                  tritonserver --model-repository <artifact>/model_repository
        <name>/config.pbtxt              platform onnxruntime_onnx: dynamic batcher, instance group
        <name>/1/model.onnx
        <name>_precast/config.pbtxt      backend python: serves the whole precast artifact
        <name>_precast/1/model.py        (LLM artifacts: decoupled, the precast Engine streams tokens)

The repository sits in its own folder so that Triton sees only model folders (not parity/ or the
tokenizer). The precast manifest's block points at ``<name>/1/model.onnx`` with the CPU execution
provider, so ``precast.runtime.load`` (and the compile's verification) run the very file Triton serves.

A staged model (the pipeline ends in ``split-stages``) is written as one model per stage and an ensemble
named ``<name>`` that chains them: see targets/triton_ensemble.py. A staged causal-LM step graph is served
by the decoupled ``<name>_precast`` model alone, its Engine running ``stages/stage_<k>.onnx`` as a pipeline.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnx_ir as ir

from precast.artifact.manifest import TensorSpec
from precast.artifact.target_blocks import TritonBlock
from precast.errors import UsageError
from precast.ir.parity import io_signature
from precast.options import opt
from precast.targets.base import BuildContext, BuildResult, Target, register_target
from precast.targets.ort_cpu import (
    OrtCpu,
    cpu_block_fields,
    ort_offline_optimize,
    save_model,
    save_onnx,
)
from precast.targets.triton_config import (
    ModelConfig,
    TensorConfig,
    render_config,
    shared_batch_dim,
    tensor_configs,
)

__all__ = ["REPOSITORY_DIR", "Triton"]

REPOSITORY_DIR = "model_repository"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_PYTHON_MODEL = Path(__file__).with_name("_triton_python_model.py")

# Text in / text out of the decoupled LLM model (Triton's generate extension maps JSON fields by name).
_LLM_INPUTS = [
    TensorConfig("text_input", "TYPE_STRING", (1,)),
    TensorConfig("max_tokens", "TYPE_INT32", (1,), optional=True),
    TensorConfig("temperature", "TYPE_FP32", (1,), optional=True),
    TensorConfig("top_k", "TYPE_INT32", (1,), optional=True),
    TensorConfig("top_p", "TYPE_FP32", (1,), optional=True),
    TensorConfig("seed", "TYPE_INT64", (1,), optional=True),
]
_LLM_OUTPUTS = [
    TensorConfig("text_output", "TYPE_STRING", (1,)),
    TensorConfig("token_id", "TYPE_INT64", (1,)),
    TensorConfig("finish_reason", "TYPE_STRING", (1,)),
]


@register_target("triton")
class Triton(Target):
    summary = (
        "Triton Inference Server model repository (onnxruntime backend + a Python-backend precast model)"
    )
    default_pipeline = OrtCpu.default_pipeline
    runs_stages = True  # a split-stages model becomes a Triton ensemble of its stages

    @dataclass(frozen=True)
    class Options:
        model_name: str = opt("model", "the Triton model's folder name")
        version: int = opt(1, "model version folder (>= 1)")
        max_batch_size: int = opt(8, "used when every input and output leads with one symbolic batch dim")
        preferred_batch_sizes: str = opt("", "dynamic batcher sizes, e.g. 4,8")
        max_queue_delay_us: int = opt(100, "dynamic batcher queue delay")
        instance_count: int = opt(1, "instances of the onnxruntime model")
        instance_kind: Literal["cpu", "gpu"] = opt("cpu", "the instance group's kind")
        mode: Literal["auto", "tensor", "llm"] = opt("auto", "the Python model's interface")
        llm_num_blocks: int = opt(0, "KV blocks of the Python model's engine (0: default)")
        ort_level: Literal["none", "basic", "extended"] = opt(
            "none", "offline ORT optimization of model.onnx, as ort-cpu"
        )
        threads: int = opt(0, "intra-op threads at load (0: default)")
        stage_backend: Literal["python", "onnxruntime"] = opt(
            "python", "staged models: what runs each stage model (python: ORT in the Python stub)"
        )
        stage_instances: str = opt(
            "", "staged models: instances per stage, e.g. 1,2 (default: instance_count)"
        )

        def batch_sizes(self) -> tuple[int, ...]:
            """``preferred_batch_sizes`` as numbers, each in [1, max_batch_size] (else a UsageError)."""
            text = self.preferred_batch_sizes
            try:
                sizes = tuple(int(s) for s in text.replace(";", ",").split(",") if s.strip())
            except ValueError:
                raise UsageError(
                    f"target 'triton' option preferred_batch_sizes must be comma-separated integers, got '{text}'"
                ) from None
            bad = [s for s in sizes if not 1 <= s <= self.max_batch_size]
            if bad:
                raise UsageError(
                    f"target 'triton': preferred batch size {bad[0]} is outside [1, max_batch_size={self.max_batch_size}]"
                )
            return sizes

        def stage_counts(self) -> tuple[int, ...]:
            """``stage_instances`` as counts >= 1 (() when not given: every stage gets instance_count)."""
            try:
                counts = tuple(int(s) for s in self.stage_instances.split(",") if s.strip())
            except ValueError:
                counts = (0,)
            if any(c < 1 for c in counts):
                raise UsageError(
                    "target 'triton' option stage_instances must be comma-separated counts >= 1, "
                    f"got '{self.stage_instances}'"
                )
            return counts

    def check_options(self) -> None:
        o = self.options
        if not _NAME_RE.match(o.model_name):
            raise UsageError(
                f"target 'triton' option model_name must be a folder-safe name, got '{o.model_name}'"
            )
        for key in ("version", "instance_count"):
            if getattr(o, key) < 1:
                raise UsageError(f"target 'triton' option {key} must be >= 1, got {getattr(o, key)}")
        if o.max_batch_size < 0 or o.max_queue_delay_us < 0:
            raise UsageError("target 'triton' options max_batch_size and max_queue_delay_us must be >= 0")
        _check_choice("instance_kind", o.instance_kind, ("cpu", "gpu"))
        _check_choice("mode", o.mode, ("auto", "tensor", "llm"))
        _check_choice("ort_level", o.ort_level, ("none", "basic", "extended"))
        o.batch_sizes()
        _check_choice("stage_backend", o.stage_backend, ("python", "onnxruntime"))
        o.stage_counts()

    def build(self, model: ir.Model, out_dir: Path, ctx: BuildContext) -> BuildResult:
        from precast.ir.stages import is_staged

        self.check_options()
        o = self.options
        inputs, outputs = io_signature(model)
        mode = o.mode
        if mode == "auto":
            from precast.ir.llm_text import (
                is_step_graph,  # a causal-lm step graph is served as an LLM
            )

            mode = "llm" if is_step_graph(inputs) else "tensor"
        if is_staged(model):
            if mode == "llm":
                return self._build_staged_llm(model, out_dir)
            return self._build_staged(model, out_dir, mode)
        name, py_name = o.model_name, o.model_name + "_precast"
        repo = out_dir / REPOSITORY_DIR
        version_dir = repo / name / str(o.version)
        version_dir.mkdir(parents=True)
        files = save_onnx(model, version_dir / "model.onnx")
        if o.ort_level != "none" and len(files) == 1:
            ort_offline_optimize(version_dir / "model.onnx", o.ort_level)

        # An LLM step graph is not Triton-batchable (its KV views are bound in place by the engine).
        batch = shared_batch_dim(inputs, outputs) if o.max_batch_size > 0 and mode != "llm" else None
        max_batch = o.max_batch_size if batch else 0
        onnx_cfg = self._onnx_config(name, inputs, outputs, batch, max_batch)
        (repo / name / "config.pbtxt").write_text(render_config(onnx_cfg), encoding="utf-8")
        self._write_python_model(repo / py_name, self._python_config(py_name, onnx_cfg, mode))
        triton = {
            "repository": REPOSITORY_DIR,
            "onnx_model": name,
            "python_model": py_name,
            "version": o.version,
            "max_batch_size": max_batch,
            "batch_dim": batch,
            "mode": mode,
            "decoupled": mode == "llm",
            "instance_kind": onnx_cfg.instance_kind,
        }
        note = (
            f"Triton model repository: {REPOSITORY_DIR}/ (models '{name}' on the onnxruntime backend, "
            f"'{py_name}' on the python backend{', decoupled' if mode == 'llm' else ''})"
        )
        model_rel = f"{REPOSITORY_DIR}/{name}/{o.version}/model.onnx"
        return BuildResult(self._block(model_rel, triton=triton, notes=[note]), self.precision)

    def _build_staged(self, model: ir.Model, out_dir: Path, mode: str) -> BuildResult:
        from precast.targets.triton_ensemble import build_ensemble

        o = self.options
        name = o.model_name
        built = build_ensemble(model, out_dir / REPOSITORY_DIR, REPOSITORY_DIR, o)
        stage_names = [cfg.name for cfg in built.stage_configs]
        backend = "python backend" if o.stage_backend == "python" else "onnxruntime backend"
        block = self._block(
            None,  # the stages block names the stage files (as ort-cpu's staged block)
            triton={
                "repository": REPOSITORY_DIR,
                "ensemble": name,
                "stage_models": stage_names,
                "stage_backend": o.stage_backend,
                "version": o.version,
                "max_batch_size": built.ensemble.max_batch_size,
                "batch_dim": built.batch_dim,
                "stage_batching": [cfg.max_batch_size > 0 for cfg in built.stage_configs],
                "mode": mode,
                "decoupled": False,
                "instance_kind": built.stage_configs[0].instance_kind,
            },
            notes=[
                f"Triton model repository: {REPOSITORY_DIR}/ (ensemble '{name}' of {len(stage_names)} stage "
                f"models on the {backend}: {', '.join(stage_names)})"
            ],
        )
        # the manifest's stages block: the files the stage models serve
        return BuildResult(block, self.precision, stages=built.stages)

    def _build_staged_llm(self, model: ir.Model, out_dir: Path) -> BuildResult:
        """A staged causal-LM step graph is no ensemble (the engine binds each stage's KV in place, step by
        step): the decoupled precast model's Engine runs the stages as a pipeline (runtime/llm/runners/staged.py),
        from ``stages/stage_<k>.onnx`` beside the repository, as ort-cpu writes them."""
        from precast.ir.stages import STAGES_DIR

        o = self.options
        _, stages = save_model(model, out_dir, o.ort_level)
        py_name = o.model_name + "_precast"
        self._write_python_model(
            out_dir / REPOSITORY_DIR / py_name, self._python_config(py_name, None, "llm")
        )
        block = self._block(
            None,  # the stages block names the stage files
            triton={
                "repository": REPOSITORY_DIR,
                "python_model": py_name,
                "version": o.version,
                "max_batch_size": 0,
                "batch_dim": None,
                "mode": "llm",
                "decoupled": True,
                "instance_kind": "KIND_CPU",
            },
            notes=[
                f"Triton model repository: {REPOSITORY_DIR}/ (model '{py_name}' on the python backend, decoupled: "
                f"its precast Engine runs the {stages.n} stages of {STAGES_DIR}/ as a pipeline)"
            ],
        )
        return BuildResult(block, self.precision, stages=stages)

    def _write_python_model(self, folder: Path, cfg: ModelConfig) -> None:
        """The precast python-backend model: its config and ``<version>/model.py``."""
        (folder / str(self.options.version)).mkdir(parents=True)
        shutil.copyfile(_PYTHON_MODEL, folder / str(self.options.version) / "model.py")
        (folder / "config.pbtxt").write_text(render_config(cfg), encoding="utf-8")

    def _block(self, model: str | None, *, triton: dict, notes: list[str]) -> TritonBlock:
        """The target block every layout shares (ORT on the CPU, the offline level) with its own model,
        ``triton`` record and notes."""
        o = self.options
        fields = cpu_block_fields(
            self, model, graph_level="all", threads=int(o.threads), offline_level=o.ort_level
        )
        return TritonBlock(**fields, triton=triton, notes=notes)

    def _onnx_config(
        self,
        name: str,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        batch: str | None,
        max_batch: int,
    ) -> ModelConfig:
        o = self.options
        params = {"intra_op_thread_count": str(o.threads)} if o.threads else {}
        return ModelConfig(
            name=name,
            platform="onnxruntime_onnx",
            inputs=tensor_configs(inputs, drop_batch=batch is not None),
            outputs=tensor_configs(outputs, drop_batch=batch is not None),
            max_batch_size=max_batch,
            preferred_batch_sizes=o.batch_sizes() if max_batch else (),
            max_queue_delay_us=o.max_queue_delay_us if max_batch else None,
            instance_count=o.instance_count,
            instance_kind="KIND_GPU" if o.instance_kind == "gpu" else "KIND_CPU",
            default_model_filename="model.onnx",
            parameters=params,
        )

    def _python_config(self, py_name: str, onnx_cfg: ModelConfig | None, mode: str) -> ModelConfig:
        o = self.options
        params = {"precast_artifact": "../..", "precast_mode": mode, "precast_threads": str(o.threads)}
        if mode == "llm":
            params["precast_num_blocks"] = str(o.llm_num_blocks)
            # One engine per instance owns the KV pool and batches continuously: Triton must not batch.
            return ModelConfig(
                name=py_name,
                backend="python",
                inputs=list(_LLM_INPUTS),
                outputs=list(_LLM_OUTPUTS),
                instance_count=1,
                decoupled=True,
                parameters=params,
            )
        # The precast artifact runs on ORT's CPU provider inside the stub, so its instances are CPU ones.
        return ModelConfig(
            name=py_name,
            backend="python",
            inputs=onnx_cfg.inputs,
            outputs=onnx_cfg.outputs,
            max_batch_size=onnx_cfg.max_batch_size,
            preferred_batch_sizes=onnx_cfg.preferred_batch_sizes,
            max_queue_delay_us=onnx_cfg.max_queue_delay_us,
            instance_count=o.instance_count,
            parameters=params,
        )


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    """A Literal option's value (an Options built in code bypasses the parser's check)."""
    if value not in choices:
        raise UsageError(f"target 'triton' option {key} must be {'|'.join(choices)}, got '{value}'")
