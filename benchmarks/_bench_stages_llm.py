"""LLM decode through pipeline stages: a Llama step graph unsplit (2 threads) vs split in 2 stages (1 thread each).

    python benchmarks/_bench_stages_llm.py                  # 8 and 16 concurrent requests, 3 rounds
    python benchmarks/_bench_stages_llm.py --concurrency 8 --rounds 5 --new-tokens 96 --work /tmp/llm-stages
    python benchmarks/bench_stages.py --llm                 # the same rows in bench_stages' table (run(args))

Model: bench_llm_step's Llama (hidden 512, 8 layers, 8 heads / 4 KV heads, intermediate 1408, vocab 32000)
with untied embeddings (~225 MB fp32; see CONFIG for why), seeded random weights with norms perturbed around 1
(distinct norm weights, as a trained model has: split-stages finds its layers by their weight names).
Compiled twice into ``--work``: the ort-cpu default pipeline (kv_layout mapped), and the same ending in
``split-stages{n=2,by=time}`` (stages balanced by the profiled time of the compile's sample decode step).

Each engine serves the same ``--concurrency`` requests, all submitted at once to its running engine (fresh
prompts of 24-40 tokens, greedy, ``--new-tokens`` each, no EOS): continuous batching decodes them together.

    unsplit, 2 threads              Engine.load(unsplit, threads=2): one session, 2 intra-op threads
    unsplit, 1 thread               the same with 1 thread (what a stage's session is: no spinning pool)
    2 stages x 1 thread, mb 2       Engine.load(staged): a worker + 1-thread session per stage; each step's
                                    rows in 2 micro-batches, stage 1 runs one while stage 0 runs the other
    2 stages x 1 thread, mb 4       4 micro-batches: a smaller pipeline bubble, each stage's weights read 4x
    2 stages x 1 thread, mb 1       the same without micro-batches (the stages take turns: the control)

Columns: aggregate generated tokens/s (all requests, first submit to last token), its ratio to the first row,
per-token latency p50 / p90 (the gaps between a request's consecutive tokens, all requests), the p50 ratio
(first row's / this one's: > 1 is faster), each stage's busy share (time in its session / wall), and whether
every request's tokens equal the unsplit engine's. Rounds are interleaved (each round runs every engine once,
rotating who goes first); medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llm_step import CONFIG as STEP_CONFIG  # noqa: E402

# Untied embeddings: with bench_llm_step's tied table, stage 0's embedding reads Transpose(lm_head_t), which
# split-stages' by=time profile (optimizations off) times at ~25 ms a run although a session folds it at load,
# and which by=bytes charges 65 MB to stage 0 although the Gather reads a few rows: either way one stage got
# 7 of the 8 layers. Separate tables leave the profile honest (embedding Gather cheap, lm_head MatMul not).
CONFIG = {**STEP_CONFIG, "tie_word_embeddings": False}

STAGED = "default,split-stages{n=2,by=time}"
ENGINES = {  # name -> (artifact, Engine.load options)
    "unsplit, 2 threads": ("unsplit", {"threads": 2}),
    "unsplit, 1 thread": ("unsplit", {"threads": 1}),
    "2 stages x 1 thread, mb 2": ("staged", {"threads": 1, "micro_batches": 2}),
    "2 stages x 1 thread, mb 4": ("staged", {"threads": 1, "micro_batches": 4}),
    "2 stages x 1 thread, mb 1": ("staged", {"threads": 1, "micro_batches": 1}),
}


def build(work: Path) -> dict[str, Path]:
    """The model folder and both artifacts under ``work`` (built once, then reused)."""
    from tests.llm.fixtures import build_causal_lm

    folder, arts = work / "llama-512", {"unsplit": work / "llm-unsplit", "staged": work / "llm-2stages"}
    if not (folder / "config.json").is_file():
        print("building the model folder", file=sys.stderr, flush=True)
        build_causal_lm(folder, "llama", seed=0, **CONFIG)
    from precast.compiler.driver import CompileOptions, compile_model

    for name, passes in (("unsplit", None), ("staged", STAGED)):
        if not (arts[name] / "manifest.json").is_file():
            print(f"compiling the {name} artifact (ort-cpu, task causal-lm)", file=sys.stderr, flush=True)
            compile_model(str(folder), arts[name], CompileOptions(task="causal-lm", passes=passes))
    return arts


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Fresh prompts (no shared prefix: no prefix-cache hits), 24-40 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, size=int(rng.integers(24, 41))).tolist() for _ in range(n)]


def serve(engine, batch: list[list[int]], new_tokens: int) -> dict:
    """All prompts submitted at once to the running engine; token times per request."""
    from precast.runtime.llm.sampler import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    stamps: list[list[float]] = [[] for _ in batch]
    lock = threading.Lock()

    def on_token(i: int):
        def record(ev) -> None:
            with lock:
                stamps[i].append(time.perf_counter())

        return record

    busy0 = [s.busy_seconds for s in getattr(engine.runner, "stages", ())]
    t0 = time.perf_counter()
    handles = [engine.submit(p, params, on_token=on_token(i)) for i, p in enumerate(batch)]
    tokens = [h.result().token_ids for h in handles]
    wall = time.perf_counter() - t0
    gaps = np.concatenate([np.diff(s) for s in stamps if len(s) > 1]) * 1e3
    busy = [(s.busy_seconds - b) / wall for s, b in zip(getattr(engine.runner, "stages", ()), busy0)]
    return {
        "tok_s": sum(map(len, tokens)) / wall,
        "p50": float(np.percentile(gaps, 50)),
        "p90": float(np.percentile(gaps, 90)),
        "busy": busy,
        "tokens": tokens,
    }


def measure(arts: dict[str, Path], concurrency: int, rounds: int, new_tokens: int) -> dict[str, dict]:
    from precast.runtime.llm import Engine

    names = list(ENGINES)
    engines = {}
    try:
        for name, (art, options) in ENGINES.items():
            engines[name] = Engine.load(arts[art], num_blocks=concurrency * 8, **options)
            engines[name].start()
        out = {n: {"tok_s": [], "p50": [], "p90": [], "busy": [], "same": True} for n in names}
        warm = prompts(CONFIG["vocab_size"], concurrency, seed=999)
        for name in names:
            serve(engines[name], warm, 8)
        for r in range(rounds):
            batch = prompts(CONFIG["vocab_size"], concurrency, seed=r)  # every engine gets the same prompts
            reference = None
            for name in names[r % len(names) :] + names[: r % len(names)]:
                got = serve(engines[name], batch, new_tokens)
                for key in ("tok_s", "p50", "p90"):
                    out[name][key].append(got[key])
                if got["busy"]:
                    out[name]["busy"].append(got["busy"])
                out[name]["last_tokens"] = got["tokens"]
            reference = out[names[0]]["last_tokens"]
            for name in names:
                out[name]["same"] &= out[name]["last_tokens"] == reference
    finally:
        for engine in engines.values():
            engine.close()
    return out


def table_rows(concurrency: int, new_tokens: int, results: dict) -> list[list[str]]:
    """Rows in bench_stages.py's columns (load, engine, rate, ratio, p50, p90, p50 ratio, busy, diff)."""
    first = next(iter(results))
    base, base_p50 = statistics.median(results[first]["tok_s"]), statistics.median(results[first]["p50"])
    rows = []
    for name, rec in results.items():
        rate, p50, p90 = (statistics.median(rec[k]) for k in ("tok_s", "p50", "p90"))
        busy = "-"
        if rec["busy"]:
            busy = " / ".join(
                f"{statistics.median(b[k] for b in rec['busy']):.0%}" for k in range(len(rec["busy"][0]))
            )
        rows.append(
            [
                f"LLM decode, {concurrency} req x {new_tokens} tok",
                name,
                f"{rate:.1f} tok/s",
                f"{rate / base:.2f}x",
                f"{p50:.1f}",
                f"{p90:.1f}",
                f"{base_p50 / p50:.2f}x",
                busy,
                "tokens ==" if rec["same"] else "TOKENS DIFFER",
            ]
        )
    return rows


def run(args) -> list[list[str]]:
    """bench_stages.py's hook: the LLM rows for its table (``args``: its namespace; missing keys default)."""
    concurrency = getattr(args, "concurrency", None) or [8, 16]
    rounds = getattr(args, "rounds", 3)
    new_tokens = getattr(args, "new_tokens", 64)
    with tempfile.TemporaryDirectory(prefix="precast-stages-llm-") as tmp:
        work = getattr(args, "work", None)
        arts = build(Path(work) if work else Path(tmp))
        rows = []
        for n in concurrency:
            print(
                f"timing LLM decode: {n} concurrent requests x {rounds} rounds ...",
                file=sys.stderr,
                flush=True,
            )
            rows += table_rows(n, new_tokens, measure(arts, n, rounds, new_tokens))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="LLM decode: unsplit (2 threads) vs 2 pipeline stages (1 thread each)"
    )
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[8, 16], help="concurrent requests (default 8 16)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--work", type=Path, default=None, help="cache the model folder and artifacts here")
    args = ap.parse_args(argv)
    if min(args.rounds, args.new_tokens, *args.concurrency) < 1:
        ap.error("--concurrency, --rounds and --new-tokens must be >= 1")
    from _common import load_line

    start = load_line()
    rows = run(args)
    header = (
        "load",
        "engine",
        "rate",
        "vs first",
        "p50 ms",
        "p90 ms",
        "p50 vs first",
        "stage busy",
        "tokens",
    )
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    for line in (header, *rows):
        print(
            "  ".join(
                cell.ljust(w) if k < 2 else cell.rjust(w) for k, (cell, w) in enumerate(zip(line, widths))
            )
        )
    print(f"{start} at start, {load_line()} at the end (other work shares these cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
