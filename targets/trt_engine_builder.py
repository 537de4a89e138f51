"""Build a TensorRT engine from a precast TensorRT build plan.

This file is self-contained on purpose (standard library + ``tensorrt`` only): the ``tensorrt`` target
imports it to build engines in-process on a GPU host, and copies it verbatim into build-plan artifacts as
``build_engine.py`` so the deployment host can build the engine without the compiler installed:

    python build_engine.py PLAN_DIR OUT_DIR [--timing-cache FILE]
    precast verify OUT_DIR        # re-runs the stored parity feeds on the engine

Engines are locked to the TensorRT version and the GPU's compute capability; both go into the manifest
and the runtime refuses a mismatch.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import shutil
import sys
from pathlib import Path

__all__ = ["build_engine", "gpu_compute_capability", "main"]

_SKIP = {"manifest.json", "build-info.json"}


def gpu_compute_capability() -> str | None:
    """'major.minor' of GPU 0 from the CUDA driver, or None without a driver/GPU (never touches TensorRT)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return None
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0)
    return f"{major.value}.{minor.value}"


def build_engine(onnx_path: Path, plan: dict, engine_path: Path, timing_cache: Path | None = None) -> dict:
    """Parse the prepared ONNX, apply precision flags and profiles, serialize the engine; return its lock info."""
    cc = gpu_compute_capability()
    if cc is None:
        raise RuntimeError(
            "no NVIDIA GPU visible (libcuda.so.1 missing or no device): build engines on the GPU host"
        )
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if (
        hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH")
        and int(trt.__version__.split(".")[0]) < 10
    ):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(plan.get("workspace_mb", 4096)) << 20)
    precision = plan.get("precision", "fp16")
    flag = {"fp16": "FP16", "bf16": "BF16", "int8": "INT8", "fp8": "FP8"}.get(precision)
    if flag is not None:
        # int8/fp8 use explicit quantization: the plan's ONNX carries the Q/DQ scales (no calibrator here).
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if plan.get("profiles"):
        profile = builder.create_optimization_profile()
        for name, p in plan["profiles"].items():
            profile.set_shape(name, p["min"], p["opt"], p["max"])
        config.add_optimization_profile(profile)
    cache_bytes = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine (see the TensorRT log above)")
    engine_path.write_bytes(bytes(serialized))
    if timing_cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {"tensorrt_version": trt.__version__, "compute_capability": cc}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def engine_block(plan_block: dict, lock: dict) -> dict:
    """The manifest target block of a built engine, from the plan's block and the engine's lock info."""
    block = {
        k: v
        for k, v in plan_block.items()
        if k not in ("plan", "verified_as", "engine_built", "why_plan", "notes")
    }
    block.update(backend="tensorrt", model="model.engine", onnx="model.onnx", **lock)
    return block


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build a TensorRT engine from a precast build plan.")
    ap.add_argument("plan_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--timing-cache", type=Path, default=None)
    args = ap.parse_args(argv)
    manifest = json.loads((args.plan_dir / "manifest.json").read_text())
    block = manifest["target"]
    if block.get("backend") != "tensorrt-plan":
        print(f"error: {args.plan_dir} is not a TensorRT build plan", file=sys.stderr)
        return 2
    if args.out_dir.exists():
        print(f"error: {args.out_dir} exists; choose a new directory", file=sys.stderr)
        return 2
    plan = json.loads((args.plan_dir / block["plan"]).read_text())
    shutil.copytree(args.plan_dir, args.out_dir, ignore=shutil.ignore_patterns(*_SKIP))
    try:
        lock = build_engine(
            args.out_dir / "model.onnx", plan, args.out_dir / "model.engine", args.timing_cache
        )
    except Exception as e:
        shutil.rmtree(args.out_dir, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 1
    manifest["target"] = engine_block(block, lock)
    if "parity" in manifest and plan.get("engine_tolerance"):
        manifest["parity"]["tolerance"] = plan["engine_tolerance"]
    manifest["files"] = {
        p.relative_to(args.out_dir).as_posix(): _sha256(p)
        for p in sorted(args.out_dir.rglob("*"))
        if p.is_file() and p.name not in _SKIP
    }
    with open(args.out_dir / "manifest.json", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    print(
        f"engine built: TensorRT {lock['tensorrt_version']}, GPU sm {lock['compute_capability']} -> {args.out_dir}"
    )
    print(f"check it: precast verify {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
