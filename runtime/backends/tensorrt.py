"""TensorRT backend: runs a serialized engine. Engines are locked to a TensorRT version and a GPU
compute capability, so both are checked against the manifest before the engine is touched.

The GPU check goes through the CUDA driver library (``libcuda.so.1``) with ctypes *before* importing
``tensorrt``: importing or initializing TensorRT on a host without a GPU can crash the process.
Device memory is managed through the same driver API, so the runtime needs no cuda-python/pycuda.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from precast.artifact.manifest import model_path
from precast.artifact.target_blocks import TensorRTBlock
from precast.errors import ArtifactError, TargetUnavailableError
from precast.runtime.backends import register_backend

__all__ = ["TensorRTSession", "create_tensorrt_session", "gpu_info", "tensorrt_available"]

_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}


@lru_cache(maxsize=1)
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@lru_cache(maxsize=1)
def gpu_info() -> tuple[bool, str, str | None]:
    """(ok, reason, compute capability "major.minor" of device 0) from the CUDA driver, without TensorRT."""
    cuda = _libcuda()
    if cuda is None:
        return False, "no NVIDIA driver (libcuda.so.1 not found)", None
    if cuda.cuInit(0) != 0:
        return False, "the NVIDIA driver found no usable GPU (cuInit failed)", None
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return False, "no NVIDIA GPU visible (cuDeviceGetCount = 0)", None
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, 0)
    return True, "", f"{major.value}.{minor.value}"


def tensorrt_available() -> tuple[bool, str]:
    ok, why, _ = gpu_info()
    if not ok:
        return False, why
    try:
        import tensorrt  # noqa: F401  (safe now: a GPU is present)
    except ImportError:
        return False, "python package 'tensorrt' is not installed"
    return True, ""


class _DeviceBuffer:
    def __init__(self, nbytes: int):
        self.ptr = ctypes.c_uint64(0)
        self.nbytes = max(int(nbytes), 1)
        _check(_libcuda().cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(self.nbytes)), "cuMemAlloc")

    def __del__(self):
        cuda = _libcuda()
        if cuda is not None and self.ptr.value:
            cuda.cuMemFree_v2(self.ptr)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise ArtifactError(f"CUDA driver call {what} failed with error {code}")


class TensorRTSession:
    """``run(names, feeds)`` over a deserialized engine (dynamic shapes set per call)."""

    def __init__(self, engine, trt):
        self._trt = trt
        self._engine = engine
        self._context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in self._inputs]

    @property
    def native(self):  # -> tensorrt.ICudaEngine
        """The deserialized engine this session runs (Session.native)."""
        return self._engine

    def get_providers(self) -> list[str]:
        return ["TensorRT"]

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        cuda, trt, ctx = _libcuda(), self._trt, self._context
        keep = []
        for name in self._inputs:
            arr = np.ascontiguousarray(feeds[name], dtype=trt.nptype(self._engine.get_tensor_dtype(name)))
            ctx.set_input_shape(name, arr.shape)
            buf = _DeviceBuffer(arr.nbytes)
            _check(
                cuda.cuMemcpyHtoD_v2(
                    buf.ptr, arr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(arr.nbytes)
                ),
                "HtoD",
            )
            ctx.set_tensor_address(name, buf.ptr.value)
            keep.append(buf)
        results = {}
        for name in self._outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            out = np.empty(shape, dtype=trt.nptype(self._engine.get_tensor_dtype(name)))
            buf = _DeviceBuffer(out.nbytes)
            ctx.set_tensor_address(name, buf.ptr.value)
            results[name] = (out, buf)
        if not ctx.execute_async_v3(0):
            raise ArtifactError("TensorRT engine execution failed")
        _check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
        for out, buf in results.values():
            _check(
                cuda.cuMemcpyDtoH_v2(
                    out.ctypes.data_as(ctypes.c_void_p), buf.ptr, ctypes.c_size_t(out.nbytes)
                ),
                "DtoH",
            )
        return [results[n][0] for n in names]


def _bind_primary_context() -> None:
    cuda = _libcuda()
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@register_backend("tensorrt", "tensorrt-plan")
def create_tensorrt_session(root: Path, target: TensorRTBlock, threads: int | None = None) -> TensorRTSession:
    if target.is_plan:
        raise TargetUnavailableError(
            f"artifact {root} is a TensorRT build plan, not an engine: run "
            f"'python {root / 'build_engine.py'} {root} OUT' on the deployment GPU host"
        )
    ok, why, cc = gpu_info()
    if not ok:
        raise TargetUnavailableError(f"artifact {root}: TensorRT needs an NVIDIA GPU: {why}")
    want_cc = target.compute_capability
    if want_cc and want_cc != cc:
        raise TargetUnavailableError(
            f"artifact {root}: engine was built for GPU compute capability {want_cc}, this GPU is {cc}; "
            "rebuild the engine on this GPU model"
        )
    try:
        import tensorrt as trt
    except ImportError:
        raise TargetUnavailableError(f"artifact {root}: python package 'tensorrt' is not installed") from None
    want_v = target.tensorrt_version
    if want_v and want_v != trt.__version__:
        raise TargetUnavailableError(
            f"artifact {root}: engine was built with TensorRT {want_v}, this host has {trt.__version__}; "
            "engines only load on the exact TensorRT version that built them"
        )
    engine_file = model_path(root, target)
    if not engine_file.is_file():
        raise ArtifactError(f"artifact {root}: engine file '{engine_file.name}' is missing")
    _bind_primary_context()
    logger = trt.Logger(trt.Logger.ERROR)
    engine = trt.Runtime(logger).deserialize_cuda_engine(engine_file.read_bytes())
    if engine is None:
        raise ArtifactError(f"artifact {root}: TensorRT could not deserialize {engine_file.name}")
    return TensorRTSession(engine, trt)
