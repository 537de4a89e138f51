"""Target ``tensorrt``: a serialized TensorRT engine for NVIDIA GPUs, or a build plan where none can be built.

    ONNX graph --onnx-graphsurgeon (fold constants, cleanup, toposort)--> model.onnx
      --profiles from the symbolic dims (min/opt/max), precision flags, timing cache-->
      GPU + tensorrt here:  model.engine   (locked to TensorRT version + compute capability, in the manifest)
      otherwise:            build plan     (model.onnx + plan.json + build_engine.py for the deployment host)

Engines are only valid for the TensorRT version and GPU that built them, and TensorRT cannot be installed
on every build host, so the plan path is a first-class output: it says plainly that no engine was built,
and why. Compiles verify the plan's prepared ONNX on ONNX Runtime's CPU EP; the engine itself is verified
where it is built (``precast verify`` re-runs the stored parity feeds with the engine's tolerance).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir

from precast.artifact.target_blocks import TensorRTBlock
from precast.errors import UsageError
from precast.options import opt
from precast.runtime.backends.tensorrt import tensorrt_available
from precast.targets import trt_engine_builder
from precast.targets.base import (
    Availability,
    BuildContext,
    BuildResult,
    Target,
    register_target,
)

__all__ = ["TensorRT", "parse_profile"]

_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
# What the engine is held to when built (fp32 reference); int8/fp8 get the cosine-only budget.
_ENGINE_TOL = {
    "fp32": {"atol": 1e-3, "rtol": 1e-3, "min_cosine": 0.9999},
    "fp16": {"atol": 1e-2, "rtol": 1e-2, "min_cosine": 0.999},
    "bf16": {"atol": 5e-2, "rtol": 5e-2, "min_cosine": 0.995},
    "int8": {"atol": None, "rtol": None, "min_cosine": 0.99},
    "fp8": {"atol": None, "rtol": None, "min_cosine": 0.98},
}


def parse_profile(text: str) -> dict[str, tuple[int, int | None, int]]:
    """'batch=1:8:32;seq=16::512' -> {'batch': (1, 8, 32), 'seq': (16, None, 512)} (opt None = sample size)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, rng = part.partition("=")
        bits = rng.split(":")
        try:
            if not sep or len(bits) != 3:
                raise ValueError
            lo, opt, hi = (int(b) if b.strip() else None for b in bits)
            if lo is None or hi is None:
                raise ValueError
        except ValueError:
            raise UsageError(
                f"target 'tensorrt' option profile: expected DIM=MIN:OPT:MAX[;...], got '{part}'"
            ) from None
        out[name.strip()] = (lo, opt, hi)
    return out


def prepare_onnx(model: ir.Model, path: Path) -> str:
    """Save the graph TensorRT parses, cleaned with onnx-graphsurgeon when it is installed; return the tool used."""
    proto = ir.serde.serialize_model(model)
    try:
        import onnx_graphsurgeon as gs
    except ImportError:
        onnx.save(proto, path)
        return "onnx_ir (onnx-graphsurgeon not installed)"
    graph = gs.import_onnx(proto)
    graph.fold_constants().cleanup().toposort()
    onnx.save(gs.export_onnx(graph), path)
    return f"onnx-graphsurgeon {gs.__version__}"


@register_target("tensorrt")
class TensorRT(Target):
    summary = "NVIDIA GPU engine via TensorRT (engine on a GPU host; a build plan + build script elsewhere)"
    default_pipeline = "infer-shapes,fold-constants,eliminate-dead-code"
    precision = "fp16"

    @dataclass(frozen=True)
    class Options:
        precision: Literal["fp32", "fp16", "bf16", "int8", "fp8"] = opt("fp16", "engine precision")
        profile: str = opt("", "optimization profile, NAME=MIN:OPT:MAX;... (default: from the sample feeds)")
        workspace_mb: int = opt(4096, "builder workspace in MB")
        timing_cache: str = opt("", "timing cache file to read and update")

    @classmethod
    def can_build(cls) -> Availability:
        # A build plan can always be written; say whether an engine can be built here too.
        ok, why = tensorrt_available()
        return Availability(True, "" if ok else f"build plan only: {why}")

    @classmethod
    def can_run(cls) -> Availability:
        ok, why = tensorrt_available()
        return Availability(ok, why)

    def build(self, model: ir.Model, out_dir: Path, ctx: BuildContext) -> BuildResult:
        return BuildResult(self._build(model, out_dir, ctx.sample_feeds), self.precision)

    def _build(self, model: ir.Model, out_dir: Path, sample: dict) -> TensorRTBlock:
        o = self.options
        precision = o.precision
        if precision not in _PRECISIONS:
            raise UsageError(f"target 'tensorrt' option precision must be one of {', '.join(_PRECISIONS)}")
        prepared_with = prepare_onnx(model, out_dir / "model.onnx")
        plan = {
            "precision": precision,
            "workspace_mb": int(o.workspace_mb),
            "profiles": self._profiles(out_dir / "model.onnx", sample),
            "prepared_with": prepared_with,
            "engine_tolerance": _ENGINE_TOL[precision],
        }
        block = {
            "name": self.name,
            "device": "cuda",
            "precision": precision,
            "profiles": plan["profiles"],
            "prepared_with": prepared_with,
        }
        ok, why = tensorrt_available()
        if ok:
            cache = Path(o.timing_cache) if o.timing_cache else None
            lock = trt_engine_builder.build_engine(
                out_dir / "model.onnx", plan, out_dir / "model.engine", cache
            )
            # engine_block also runs without precast (build_engine.py on the GPU host): plain JSON both ways
            engine = trt_engine_builder.engine_block({**block, "backend": "tensorrt-plan"}, lock)
            return TensorRTBlock.from_json(engine, f"target '{self.name}'")
        (out_dir / "plan.json").write_text(
            json.dumps(plan, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        shutil.copyfile(trt_engine_builder.__file__, out_dir / "build_engine.py")
        return TensorRTBlock(
            **block,
            backend="tensorrt-plan",
            model="model.onnx",
            plan="plan.json",
            engine_built=False,
            why_plan=f"no engine built on this host: {why}; run build_engine.py on the deployment GPU host",
            verified_as="prepared ONNX on onnxruntime CPU (the engine is verified where it is built)",
            notes=[
                f"TensorRT build plan only, no engine: {why}; build it with build_engine.py on the GPU host"
            ],
        )

    def stand_in(self, out_dir: Path, built: BuildResult):
        """A build plan cannot run here: the driver verifies its prepared ONNX on ONNX Runtime's CPU EP."""
        block = built.block
        if not isinstance(block, TensorRTBlock) or not block.is_plan:
            return None
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out_dir / block.model_file), providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        return lambda feeds: dict(zip(names, sess.run(names, dict(feeds))))

    def _profiles(self, onnx_path: Path, sample: dict) -> dict[str, dict[str, list[int]]]:
        """One optimization profile: per input, min/opt/max shapes; symbolic dims from the profile option
        and the ``sample`` feeds' sizes."""
        given = parse_profile(self.options.profile)
        proto = onnx.load(str(onnx_path), load_external_data=False)
        inits = {i.name for i in proto.graph.initializer}
        profiles, used = {}, set()
        for inp in proto.graph.input:
            if inp.name in inits:
                continue
            dims = inp.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                continue  # static input: no profile entry needed
            lo, opt, hi = [], [], []
            for axis, d in enumerate(dims):
                if d.HasField("dim_value"):
                    lo.append(d.dim_value), opt.append(d.dim_value), hi.append(d.dim_value)
                    continue
                seen = int(np.shape(sample[inp.name])[axis]) if inp.name in sample else None
                key = d.dim_param
                if key in given:
                    used.add(key)
                    a, b, c = given[key]
                    b = b if b is not None else (seen if seen is not None else a)
                elif seen is not None:
                    a, b, c = 1, seen, 4 * seen  # default: 1 .. sample .. 4x sample
                else:
                    raise UsageError(
                        f"target 'tensorrt': dim '{key or axis}' of input '{inp.name}' needs --target-option profile={key}=MIN:OPT:MAX"
                    )
                if not a <= b <= c:
                    raise UsageError(
                        f"target 'tensorrt' profile for '{key}': need MIN <= OPT <= MAX, got {a}:{b}:{c}"
                    )
                lo.append(a), opt.append(b), hi.append(c)
            profiles[inp.name] = {"min": lo, "opt": opt, "max": hi}
        unknown = sorted(set(given) - used)
        if unknown:
            raise UsageError(f"target 'tensorrt' option profile names dim '{unknown[0]}', which no input has")
        return profiles
