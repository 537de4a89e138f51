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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import onnx_ir as ir

from precast.compiler.parity import io_signature
from precast.runtime.errors import UsageError
from precast.runtime.manifest import TensorSpec
from precast.runtime.target_blocks import SessionSettings, TritonBlock
from precast.targets.base import Target, register_target
from precast.targets.ort_cpu import OrtCpu, save_model, save_onnx
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
        model_name: str = field(default="model", metadata={"help": "the Triton model's folder name"})
        version: int = field(default=1, metadata={"help": "model version folder (>= 1)"})
        max_batch_size: int = field(
            default=8, metadata={"help": "used when every input and output leads with one symbolic batch dim"}
        )
        preferred_batch_sizes: str = field(default="", metadata={"help": "dynamic batcher sizes, e.g. 4,8"})
        max_queue_delay_us: int = field(default=100, metadata={"help": "dynamic batcher queue delay"})
        instance_count: int = field(default=1, metadata={"help": "instances of the onnxruntime model"})
        instance_kind: Literal["cpu", "gpu"] = field(
            default="cpu", metadata={"help": "the instance group's kind"}
        )
        mode: Literal["auto", "tensor", "llm"] = field(
            default="auto", metadata={"help": "the Python model's interface"}
        )
        llm_num_blocks: int = field(
            default=0, metadata={"help": "KV blocks of the Python model's engine (0: default)"}
        )
        ort_level: Literal["none", "basic", "extended"] = field(
            default="none", metadata={"help": "offline ORT optimization of model.onnx, as ort-cpu"}
        )
        threads: int = field(default=0, metadata={"help": "intra-op threads at load (0: default)"})
        stage_backend: Literal["python", "onnxruntime"] = field(
            default="python",
            metadata={"help": "staged models: what runs each stage model (python: ORT in the Python stub)"},
        )
        stage_instances: str = field(
            default="",
            metadata={"help": "staged models: instances per stage, e.g. 1,2 (default: instance_count)"},
        )

    def check_options(self) -> None:
        self._checked_options()

    def _checked_options(self) -> dict:
        o = dict(self.options)
        if not _NAME_RE.match(o["model_name"]):
            raise UsageError(
                f"target 'triton' option model_name must be a folder-safe name, got '{o['model_name']}'"
            )
        for key in ("version", "instance_count"):
            if o[key] < 1:
                raise UsageError(f"target 'triton' option {key} must be >= 1, got {o[key]}")
        if o["max_batch_size"] < 0 or o["max_queue_delay_us"] < 0:
            raise UsageError("target 'triton' options max_batch_size and max_queue_delay_us must be >= 0")
        if o["instance_kind"] not in ("cpu", "gpu"):
            raise UsageError(
                f"target 'triton' option instance_kind must be cpu|gpu, got '{o['instance_kind']}'"
            )
        if o["mode"] not in ("auto", "tensor", "llm"):
            raise UsageError(f"target 'triton' option mode must be auto|tensor|llm, got '{o['mode']}'")
        if o["ort_level"] not in ("none", "basic", "extended"):
            raise UsageError(
                f"target 'triton' option ort_level must be none|basic|extended, got '{o['ort_level']}'"
            )
        try:
            sizes = tuple(
                int(s) for s in str(o["preferred_batch_sizes"]).replace(";", ",").split(",") if s.strip()
            )
        except ValueError:
            raise UsageError(
                f"target 'triton' option preferred_batch_sizes must be comma-separated integers, "
                f"got '{o['preferred_batch_sizes']}'"
            ) from None
        bad = [s for s in sizes if not 1 <= s <= o["max_batch_size"]]
        if bad:
            raise UsageError(
                f"target 'triton': preferred batch size {bad[0]} is outside [1, max_batch_size={o['max_batch_size']}]"
            )
        o["preferred_batch_sizes"] = sizes
        if o["stage_backend"] not in ("python", "onnxruntime"):
            raise UsageError(
                f"target 'triton' option stage_backend must be python|onnxruntime, got '{o['stage_backend']}'"
            )
        try:
            counts = tuple(int(s) for s in str(o["stage_instances"]).split(",") if s.strip())
        except ValueError:
            counts = (0,)
        if any(c < 1 for c in counts):
            raise UsageError(
                "target 'triton' option stage_instances must be comma-separated counts >= 1, "
                f"got '{o['stage_instances']}'"
            )
        o["stage_instances"] = counts
        return o

    def build(self, model: ir.Model, out_dir: Path) -> TritonBlock:
        from precast.compiler.stages import is_staged

        o = self._checked_options()
        inputs, outputs = io_signature(model)
        mode = o["mode"]
        if mode == "auto":
            from precast.compiler.llm_text import is_step_graph  # a causal-lm step graph is served as an LLM

            mode = "llm" if is_step_graph(inputs) else "tensor"
        if is_staged(model):
            return self._build_staged(model, out_dir, mode, o)
        name, py_name = o["model_name"], o["model_name"] + "_precast"
        repo = out_dir / REPOSITORY_DIR
        version_dir = repo / name / str(o["version"])
        version_dir.mkdir(parents=True)
        files = save_onnx(model, version_dir / "model.onnx")
        if o["ort_level"] != "none" and len(files) == 1:
            OrtCpu._ort_offline_optimize(version_dir / "model.onnx", o["ort_level"])

        # An LLM step graph is not Triton-batchable (its KV views are bound in place by the engine).
        batch = shared_batch_dim(inputs, outputs) if o["max_batch_size"] > 0 and mode != "llm" else None
        max_batch = o["max_batch_size"] if batch else 0
        onnx_cfg = self._onnx_config(name, inputs, outputs, batch, max_batch, o)
        (repo / name / "config.pbtxt").write_text(render_config(onnx_cfg), encoding="utf-8")

        py_cfg = self._python_config(py_name, onnx_cfg, mode, o)
        (repo / py_name / str(o["version"])).mkdir(parents=True)
        shutil.copyfile(_PYTHON_MODEL, repo / py_name / str(o["version"]) / "model.py")
        (repo / py_name / "config.pbtxt").write_text(render_config(py_cfg), encoding="utf-8")

        model_rel = f"{REPOSITORY_DIR}/{name}/{o['version']}/model.onnx"
        return self._block(
            o,
            model_rel,
            triton={
                "repository": REPOSITORY_DIR,
                "onnx_model": name,
                "python_model": py_name,
                "version": o["version"],
                "max_batch_size": max_batch,
                "batch_dim": batch,
                "mode": mode,
                "decoupled": mode == "llm",
                "instance_kind": onnx_cfg.instance_kind,
            },
            notes=[
                (
                    f"Triton model repository: {REPOSITORY_DIR}/ (models '{name}' on the onnxruntime backend, "
                    f"'{py_name}' on the python backend{', decoupled' if mode == 'llm' else ''})"
                )
            ],
        )

    def _build_staged(self, model: ir.Model, out_dir: Path, mode: str, o: dict) -> TritonBlock:
        from precast.targets.triton_ensemble import build_ensemble

        if mode == "llm":
            return self._build_staged_llm(model, out_dir, o)
        name = o["model_name"]
        built = build_ensemble(model, out_dir / REPOSITORY_DIR, REPOSITORY_DIR, o)
        self.stages = built.stages  # the manifest's stages block: the files the stage models serve
        stage_names = [cfg.name for cfg in built.stage_configs]
        backend = "python backend" if o["stage_backend"] == "python" else "onnxruntime backend"
        return self._block(
            o,
            None,  # the stages block names the stage files (as ort-cpu's staged block)
            triton={
                "repository": REPOSITORY_DIR,
                "ensemble": name,
                "stage_models": stage_names,
                "stage_backend": o["stage_backend"],
                "version": o["version"],
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

    def _build_staged_llm(self, model: ir.Model, out_dir: Path, o: dict) -> TritonBlock:
        """A staged causal-LM step graph is no ensemble (the engine binds each stage's KV in place, step by
        step): the decoupled precast model's Engine runs the stages as a pipeline (runtime/llm/staged_runner.py),
        from ``stages/stage_<k>.onnx`` beside the repository, as ort-cpu writes them."""
        from precast.compiler.stages import STAGES_DIR

        level = o["ort_level"]
        offline = None if level == "none" else (lambda path: OrtCpu._ort_offline_optimize(path, level))
        save_model(model, out_dir, self, offline=offline)  # sets self.stages
        py_name = o["model_name"] + "_precast"
        py_cfg = self._python_config(py_name, None, "llm", o)
        version_dir = out_dir / REPOSITORY_DIR / py_name / str(o["version"])
        version_dir.mkdir(parents=True)
        shutil.copyfile(_PYTHON_MODEL, version_dir / "model.py")
        (version_dir.parent / "config.pbtxt").write_text(render_config(py_cfg), encoding="utf-8")
        return self._block(
            o,
            None,  # the stages block names the stage files
            triton={
                "repository": REPOSITORY_DIR,
                "python_model": py_name,
                "version": o["version"],
                "max_batch_size": 0,
                "batch_dim": None,
                "mode": "llm",
                "decoupled": True,
                "instance_kind": "KIND_CPU",
            },
            notes=[
                f"Triton model repository: {REPOSITORY_DIR}/ (model '{py_name}' on the python backend, decoupled: "
                f"its precast Engine runs the {self.stages.n} stages of {STAGES_DIR}/ as a pipeline)"
            ],
        )

    def _block(self, o: dict, model: str | None, *, triton: dict, notes: list[str]) -> TritonBlock:
        """The target block every layout shares (ORT on the CPU, the offline level) with its own model,
        ``triton`` record and notes."""
        return TritonBlock(
            name=self.name,
            model=model,
            providers=["CPUExecutionProvider"],
            device="cpu",
            precision=self.precision,
            session=SessionSettings(graph_optimization_level="all", intra_op_num_threads=int(o["threads"])),
            offline_ort_level=o["ort_level"],
            triton=triton,
            notes=notes,
        )

    @staticmethod
    def _onnx_config(
        name: str,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        batch: str | None,
        max_batch: int,
        o: dict,
    ) -> ModelConfig:
        params = {"intra_op_thread_count": str(o["threads"])} if o["threads"] else {}
        return ModelConfig(
            name=name,
            platform="onnxruntime_onnx",
            inputs=tensor_configs(inputs, drop_batch=batch is not None),
            outputs=tensor_configs(outputs, drop_batch=batch is not None),
            max_batch_size=max_batch,
            preferred_batch_sizes=o["preferred_batch_sizes"] if max_batch else (),
            max_queue_delay_us=o["max_queue_delay_us"] if max_batch else None,
            instance_count=o["instance_count"],
            instance_kind="KIND_GPU" if o["instance_kind"] == "gpu" else "KIND_CPU",
            default_model_filename="model.onnx",
            parameters=params,
        )

    @staticmethod
    def _python_config(py_name: str, onnx_cfg: ModelConfig | None, mode: str, o: dict) -> ModelConfig:
        params = {"precast_artifact": "../..", "precast_mode": mode, "precast_threads": str(o["threads"])}
        if mode == "llm":
            params["precast_num_blocks"] = str(o["llm_num_blocks"])
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
            instance_count=o["instance_count"],
            parameters=params,
        )
