"""Helpers shared by the benchmarks: engines with one call signature, interleaved timing, op histograms."""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

Engine = Callable[[dict[str, np.ndarray]], np.ndarray]  # feeds -> the output being compared

__all__ = [
    "Engine",
    "JsonWorker",
    "fmt_ops",
    "interleave",
    "load_line",
    "ms_ops",
    "ort_engine",
    "precast_engine",
]


def ort_engine(path: Path, threads: int, output: str | None = None) -> Engine:
    """ONNX Runtime CPU session at ORT_ENABLE_ALL (its default), thread count pinned."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    names = [output] if output else None

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return sess.run(names, {k: feeds[k] for k in inputs})[0]

    return run


def precast_engine(artifact: Path, threads: int, output: str | None = None) -> Engine:
    """A precast artifact through the thin runtime (precast.runtime.load)."""
    from precast.runtime import load

    model = load(artifact, threads=threads)
    inputs = [s.name for s in model.inputs]
    key = output or model.outputs[0].name

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return model.run({k: feeds[k] for k in inputs}, [key])[key]

    return run


def interleave(
    engines: dict[str, Engine], feeds: dict[str, np.ndarray], rounds: int, warmup: int = 2
) -> dict[str, float]:
    """Median milliseconds per engine; one call each per round, order reversed every other round."""
    names = list(engines)
    for _ in range(warmup):
        for n in names:
            engines[n](feeds)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        for n in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            engines[n](feeds)
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def ms_ops(path: Path) -> collections.Counter:
    """Histogram of com.microsoft ops in an ONNX file or a precast artifact folder (its model.onnx)."""
    import onnx

    path = path / "model.onnx" if path.is_dir() else path
    graph = onnx.load(str(path), load_external_data=False).graph
    return collections.Counter(n.op_type for n in graph.node if n.domain == "com.microsoft")


def fmt_ops(ops: collections.Counter) -> str:
    short = {
        "SkipSimplifiedLayerNormalization": "SkipSimpLN",
        "SimplifiedLayerNormalization": "SimpLN",
        "SkipLayerNormalization": "SkipLN",
        "EmbedLayerNormalization": "EmbedLN",
        "GroupQueryAttention": "GQA",
        "MultiHeadAttention": "MHA",
        "RotaryEmbedding": "Rotary",
    }
    return ", ".join(f"{short.get(k, k)} {v}" for k, v in sorted(ops.items())) or "-"


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def serve_timed(run: Callable[[int], int], warm_up: int) -> None:
    """A benchmark worker's loop: warm up, say "ready", then for each line N on stdin run(N) and print
    {"s": seconds, "tokens": what run returned} as one JSON line (the driver interleaves the workers)."""
    import json
    import sys

    run(warm_up)
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        tokens = run(int(line))
        print(json.dumps({"s": time.perf_counter() - t0, "tokens": tokens}), flush=True)


class JsonWorker:
    """A benchmark worker process speaking JSON lines (stdin in, stdout out; its stderr into ``log``): its first
    line ({"ready": ...} or {"error": ...}) is ``first``; ``ask`` sends one request and reads its answer, an
    {"error": ...} once the process has died (the caller's rows then fail, the others go on)."""

    def __init__(self, cmd: list[str], log: Path, close_timeout: float = 60):
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.close_timeout = close_timeout
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.first = self._read()
        self.error = self.first.get("error")

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        return (
            json.loads(line)
            if line
            else {"error": f"worker exited (rc {self.p.poll()}; see {self.log.name})"}
        )

    def ask(self, **req) -> dict:
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return {"error": f"worker exited (rc {self.p.poll()}; see {self.log.name})"}
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            self.ask(op="quit")
            self.p.wait(timeout=self.close_timeout)
        self.log.close()
