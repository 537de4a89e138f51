"""Decode step at batch 1: precast ModelRunner.step vs onnxruntime-genai generate_next_token, interleaved.

    python benchmarks/bench_llm_decode.py [--threads 1] [--steps 60] [--work /tmp/precast-bench-llm]
                                          [--extra NAME=ARTIFACT ...] [--profile]

Uses the artifacts and genai folders bench_llm.py builds under --work (precast-fp32, precast-int4, genai-fp32,
genai-int4). One process, every engine stepping in turn (past 128..), so load on the shared cores hits all
alike; reports median and min ms per step and each precast engine over its genai counterpart. --profile adds
ONNX Runtime's per-op totals of the raw step graphs (precast's step graph vs genai's model.onnx, past 128).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
PAST = 128


class PrecastStep:
    def __init__(self, art: Path, threads: int):
        from precast.runtime.llm import ModelRunner

        self.runner = ModelRunner.from_artifact(art, num_blocks=272, threads=threads)
        self.past = PAST

    def step(self) -> None:
        if self.past >= PAST + 64:
            self.past = PAST
        blocks = self.runner.spec.blocks_for(self.past + 1)
        self.runner.step([[17]], [[self.past]], [self.past], [1], [list(range(blocks))])
        self.past += 1


class GenaiStep:
    def __init__(self, path: Path, threads: int):
        from bench_llm import Genai

        self.g = Genai(path, threads)

    def step(self) -> None:
        self.g.step()


def profile_graphs(paths: dict[str, Path], threads: int, runs: int = 30) -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    for name, path in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads, so.enable_profiling = threads, 1, True
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(path / "model.onnx"), so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        if "seqlens_k" in names:  # precast's mapped step graph: past = present views, bound in place
            from precast.runtime.llm.runners.mapped import gqa_lengths

            feeds = {"input_ids": np.array([[17]]), "positions": np.array([[PAST]])}
            feeds.update(gqa_lengths([PAST], [1], 1))
            view = (1, *sess.get_inputs()[5].shape[1:2], 2048, sess.get_inputs()[5].shape[3])
            kv = {n: rng.standard_normal(view).astype(np.float32) for n in names[5:]}
            io = sess.io_binding()
            for n, a in {**feeds, **kv}.items():
                io.bind_cpu_input(n, a)
            for o in sess.get_outputs():
                src = o.name.replace("present_", "past_")
                if src in kv:
                    io.bind_output(o.name, "cpu", 0, np.float32, list(view), kv[src].ctypes.data)
                else:
                    io.bind_output(o.name, "cpu")
            for _ in range(runs):
                sess.run_with_iobinding(io)
            events = json.loads(Path(sess.end_profiling()).read_text())
            _report(name, events, runs)
            continue
        if "block_tables" in names:
            feeds = {
                "input_ids": np.array([[17]]),
                "positions": np.array([[PAST]]),
                "past_lens": np.array([PAST]),
                "new_lens": np.array([1]),
                "block_tables": np.arange(-(-(PAST + 1) // 16))[None],
            }
            pool = (272, *sess.get_inputs()[5].shape[1:])
            feeds.update({n: rng.standard_normal(pool).astype(np.float32) for n in names[5:]})
        else:
            feeds = {"input_ids": np.array([[17]]), "attention_mask": np.ones((1, PAST + 1), np.int64)}
            shape = (1, sess.get_inputs()[2].shape[1], PAST, 64)
            feeds.update({n: rng.standard_normal(shape).astype(np.float32) for n in names[2:]})
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
        _report(name, events, runs)


def _report(name: str, events: list, runs: int) -> None:
    total: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            total[e["args"]["op_name"]] += e["dur"]
    print(
        f"{name}: {sum(total.values()) / runs / 1e3:.2f} ms of kernels per step; "
        + ", ".join(f"{op} {us / runs / 1e3:.2f}" for op, us in total.most_common(6))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--work", default="/tmp/precast-bench-llm")
    ap.add_argument(
        "--extra", action="append", default=[], help="NAME=ARTIFACT: another precast artifact to step"
    )
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    paths = {
        n: work / n
        for n in ("precast-fp32", "genai-fp32", "precast-int4", "genai-int4")
        if (work / n).is_dir()
    }
    paths.update({kv.split("=", 1)[0]: Path(kv.split("=", 1)[1]) for kv in args.extra})
    engines = {
        n: (GenaiStep if n.startswith("genai") else PrecastStep)(p, args.threads) for n, p in paths.items()
    }
    for e in engines.values():
        e.step()
    times: dict[str, list[float]] = {n: [] for n in engines}
    names = list(engines)
    for r in range(args.steps):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            engines[n].step()
            times[n].append(time.perf_counter() - t0)
    print(
        f"decode step b1, past {PAST}+, {args.threads} thread(s), {args.steps} interleaved steps, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    for n in names:
        med, low = statistics.median(times[n]) * 1e3, min(times[n]) * 1e3
        prec = n.rsplit("-", 1)[-1]
        rel = ""
        if not n.startswith("genai") and f"genai-{prec}" in times:
            g = times[f"genai-{prec}"]
            rel = f"  vs genai-{prec}: median x{med / (statistics.median(g) * 1e3):.2f}, min x{low / (min(g) * 1e3):.2f}"
        print(f"  {n:<18} median {med:7.2f} ms  min {low:7.2f} ms{rel}")
    if args.profile:
        profile_graphs(paths, args.threads)


if __name__ == "__main__":
    main()
