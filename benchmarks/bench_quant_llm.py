"""Quantized causal LMs: fp32 vs INT8 dynamic vs INT4 RTN vs INT4 GPTQ (blocks 32 and 128), one table.

    python benchmarks/bench_quant_llm.py [--runs 40] [--threads 2] [--past 128] [--work /tmp/precast-bench-llm]
                                         [--models tiny,llama512] [--eval-tokens N]

Models:
  tiny      the tiny Llama trained on tests/data/web_genesis_exodus.txt (tests/llm/trained_lm.py, cached)
  llama512  hidden 512, 8 layers, 8/4 heads, vocab 32000, seeded random weights (bench_llm_step.py's model,
            folder cached under --work)
Every variant is compiled by precast from the same export, calibrated (GPTQ) on the training split of the
shipped text, and gated by a budget that records top-1 agreement / perplexity delta vs the fp32 graph on
that text (`logits@text`). Columns:
  step ms     decode step, batch 1, one token after --past cached ones (ModelRunner.step, median of
              interleaved rounds) and the ratio to fp32
  size        artifact model files (MB) and the ratio to fp32
  ppl         perplexity on the held-out split (tiny only; random weights have no meaningful perplexity)
  top1/dppl   the compile's budget metrics on the calibration text's last 1024 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {
    "fp32": None,
    "int8-dynamic": "default,quantize-int8",
    "int4-rtn-b32": "default,quantize-int4{algo=rtn,block=32}",
    "int4-gptq-b32": "default,quantize-int4{algo=gptq,block=32}",
    "int4-rtn-b128": "default,quantize-int4{algo=rtn,block=128}",
    "int4-gptq-b128": "default,quantize-int4{algo=gptq,block=128}",
}


def _model_folder(name: str, work: Path) -> Path:
    if name == "tiny":
        from tests.llm.trained_lm import trained_lm_dir

        return trained_lm_dir()
    from benchmarks.bench_llm_step import CONFIG
    from tests.llm.fixtures import build_llama

    folder = work / "llama-512"
    if not (folder / "config.json").is_file():
        print("building the llama-512 folder", flush=True)
        build_llama(folder, **CONFIG)
    return folder


def compile_variants(name: str, folder: Path, work: Path, calib: str) -> dict[str, Path]:
    from precast.compiler.driver import CompileOptions, compile_model
    from precast.compiler.frontends.source import load_source

    out, source = {}, None
    for variant, passes in VARIANTS.items():
        art = work / f"quant-{name}-{folder.name}" / variant  # a retrained fixture gets new artifacts
        if not (art / "manifest.json").is_file():
            if source is None:
                print(f"[{name}] exporting {folder}", flush=True)
                source = load_source(str(folder), task="causal-lm")
            print(f"[{name}] compiling {variant}", flush=True)
            t0 = time.perf_counter()
            opts = CompileOptions(
                passes=passes,
                task="causal-lm",
                calibration_text=calib,
                accuracy_budget="cosine>=0.5,top1>=0.1" if passes else None,
            )
            compile_model(source, art, opts)
            print(f"[{name}] {variant}: {time.perf_counter() - t0:.0f} s", flush=True)
        out[variant] = art
    return out


def _size(art: Path) -> int:
    """Bytes of the model files (not the manifest, parity samples or tokenizer)."""
    files = [p for p in art.rglob("*") if p.is_file() and p.suffix != ".json"]
    return sum(p.stat().st_size for p in files if not {"parity", "tokenizer"} & set(p.relative_to(art).parts))


def step_latency(arts: dict[str, Path], past: int, runs: int, warmup: int, threads: int) -> dict[str, float]:
    from precast.runtime.llm import ModelRunner

    steps = {}
    for variant, art in arts.items():
        runner = ModelRunner.from_artifact(art, num_blocks=2 * (past // 16 + 2), threads=threads)
        spec, rng = runner.spec, np.random.default_rng(0)
        nblk = spec.blocks_for(past + 1)
        for pool in (*runner.key_cache, *runner.value_cache):
            pool[...] = rng.standard_normal(pool.shape, dtype=np.float32)
        args = {
            "input_ids": np.array([[17]]),
            "positions": np.array([[past]]),
            "past_lens": np.array([past]),
            "new_lens": np.array([1]),
            "block_tables": np.arange(nblk, dtype=np.int64)[None],
        }
        steps[variant] = lambda r=runner, a=args: r.step(**a)
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(warmup + runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument(
        "--eval-tokens", type=int, default=None, help="Held-out tokens to score (default: all, ~12.9k)."
    )
    ap.add_argument("--models", default="tiny,llama512")
    ap.add_argument("--work", default="/tmp/precast-bench-llm")
    ap.add_argument("--json", default=None, help="Also write the rows as JSON here.")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    from precast.runtime.llm.perplexity import perplexity_of_text
    from tests.llm.trained_lm import texts

    train, held = texts()
    calib = train[:40_000]
    rows = []
    for name in args.models.split(","):
        folder = _model_folder(name, work)
        arts = compile_variants(name, folder, work, calib)
        lat = step_latency(arts, args.past, args.runs, args.warmup, args.threads)
        for variant, art in arts.items():
            manifest = json.loads((art / "manifest.json").read_text())
            text = manifest["parity"].get("budget", {}).get("metrics", {}).get("logits@text", {})
            ppl = None
            if name == "tiny":
                ppl = perplexity_of_text(
                    art, held, window=64, max_tokens=args.eval_tokens, batch=64, threads=args.threads
                ).perplexity
            rows.append(
                {
                    "model": name,
                    "variant": variant,
                    "step_ms": lat[variant] * 1e3,
                    "size_mb": _size(art) / 1e6,
                    "ppl": ppl,
                    "top1": text.get("top1"),
                    "ppl_delta": text.get("ppl_delta"),
                }
            )
    print(
        f"\ndecode step b1 past {args.past}, {args.threads} threads, median of {args.runs}; "
        f"held-out perplexity over {args.eval_tokens or 'all'} tokens (window 64); top1/dppl vs fp32 on calibration text"
    )
    head = f"{'model':<9} {'variant':<15} {'step ms':>8} {'vs fp32':>8} {'size MB':>8} {'vs fp32':>8} {'ppl':>8} {'top1':>6} {'dppl':>8}"
    print(head)
    base: dict[str, dict] = {}
    for r in rows:
        b = base.setdefault(r["model"], r)
        ppl = f"{r['ppl']:.3f}" if r["ppl"] is not None else "-"
        top1 = f"{r['top1']:.3f}" if r["top1"] is not None else "-"
        dppl = f"{r['ppl_delta']:+.3f}" if r["ppl_delta"] is not None else "-"
        print(
            f"{r['model']:<9} {r['variant']:<15} {r['step_ms']:>8.2f} {b['step_ms'] / r['step_ms']:>7.2f}x "
            f"{r['size_mb']:>8.2f} {r['size_mb'] / b['size_mb']:>7.0%} {ppl:>8} {top1:>6} {dppl:>8}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
