"""LLM engine throughput: continuous batching vs one request at a time, and the paged-gather question.

    python benchmarks/bench_llm_engine.py                       # builds a small Llama-style model (random weights)
    python benchmarks/bench_llm_engine.py --artifact out/llm    # an existing causal-lm artifact
    python benchmarks/bench_llm_engine.py --requests 8 --new 32 --threads 2

Rows:
  sequential      the N requests one after another (each alone in the engine)
  continuous      the N requests submitted together (continuous batching, chunked prefill)
Then, for the concurrent decode batch: the time to copy every request's cache out of the pool into a
contiguous [B, KV, past, D] tensor per layer (what a model without in-graph block-table gather would need
each step) against the measured decode step, and KV memory held vs contiguous max-length caches.
Prompts are mixed lengths of real text; greedy; each request's tokens are checked equal in both modes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


def build_artifact(work: Path) -> Path:
    from precast.compiler.driver import CompileOptions, compile_model
    from tests.llm.fixtures import build_llama

    out = work / "artifact"
    if not (out / "manifest.json").is_file():
        folder = build_llama(work / "hf", **SMALL)
        compile_model(str(folder), out, CompileOptions(targets=("ort-cpu",), task="causal-lm"))
    return out


def prompts_for(engine, n: int, seed: int = 0) -> list[list[int]]:
    import sysconfig

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = engine.tokenizer.encode(text) if engine.tokenizer else list(range(1, 2000))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length, start = int(rng.integers(16, 129)), int(rng.integers(0, len(ids) - 130))
        out.append(ids[start : start + length])
    return out


def run(engine, prompts, params, together: bool) -> tuple[float, list, list[float]]:
    t0 = time.perf_counter()
    if together:
        handles = [engine.submit(p, params) for p in prompts]
        engine.run_until_done()
    else:
        handles = []
        for p in prompts:
            handles.append(engine.submit(p, params))
            engine.run_until_done()
    wall = time.perf_counter() - t0
    return wall, [h.result().token_ids for h in handles], [h.ttft_s for h in handles]


def copy_vs_step(engine, prompts, params) -> tuple[float, float, int]:
    """Median ms of a decode step with all requests running, and of copying their caches contiguous."""
    handles = [engine.submit(p, params) for p in prompts]
    while any(h.request.num_pending > 1 or not h.token_ids for h in handles):
        engine.step()
    step_ms, copy_ms = [], []
    runner = engine.runner
    for _ in range(10):
        tables = [engine.kv.block_table(h.request_id) for h in handles]
        past = max(h.request.num_computed for h in handles)
        t0 = time.perf_counter()
        for pool in (*runner.key_cache, *runner.value_cache):
            nb = -(-past // engine.block_size)
            idx = np.array([t[:nb] + [0] * (nb - len(t[:nb])) for t in tables])
            # [B, nb, KV, bs, D] -> [B, KV, nb*bs, D]
            g = pool[idx].transpose(0, 2, 1, 3, 4).reshape(len(tables), pool.shape[1], -1, pool.shape[3])
            g = np.ascontiguousarray(g)
        copy_ms.append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        engine.step()
        step_ms.append(1000 * (time.perf_counter() - t0))
    peak_blocks = engine.pool.num_used
    for h in handles:
        engine.cancel(h.request_id)
    return statistics.median(step_ms), statistics.median(copy_ms), peak_blocks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=256, help="token budget per step")
    args = ap.parse_args(argv)

    from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

    with tempfile.TemporaryDirectory() as tmp:
        art = args.artifact or build_artifact(Path(tmp))
        cfg = SchedulerConfig(max_num_batched_tokens=args.budget)
        engine = Engine.load(
            art, num_blocks=512, config=cfg, enable_prefix_caching=False, threads=args.threads
        )
        spec = engine.runner.spec
        prompts = prompts_for(engine, args.requests)
        params = SamplingParams(max_tokens=args.new, ignore_eos=True)
        run(engine, prompts[:1], SamplingParams(max_tokens=4), together=True)  # warm-up
        seq_wall, seq_tokens, seq_ttft = run(engine, prompts, params, together=False)
        cb_wall, cb_tokens, cb_ttft = run(engine, prompts, params, together=True)
        same = seq_tokens == cb_tokens
        step_ms, copy_ms, blocks = copy_vs_step(
            engine, prompts, SamplingParams(max_tokens=10_000, ignore_eos=True)
        )

    n_out = args.requests * args.new
    per_token = spec.layers * spec.kv_heads * (spec.head_size + spec.value_head_size) * 4
    held = blocks * spec.block_size * per_token
    contiguous = args.requests * spec.max_context * per_token
    print(
        f"model: {spec.architecture} layers {spec.layers} kv_heads {spec.kv_heads} head {spec.head_size} "
        f"vocab {spec.vocab}; {args.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens, {args.new} new each, {args.threads} threads"
    )
    print(f"{'mode':<12} {'wall s':>8} {'tokens/s':>9} {'TTFT median ms':>15}")
    for name, wall, ttft in [("sequential", seq_wall, seq_ttft), ("continuous", cb_wall, cb_ttft)]:
        print(f"{name:<12} {wall:8.2f} {n_out / wall:9.1f} {1000 * statistics.median(ttft):15.1f}")
    print(f"speedup continuous / sequential: {seq_wall / cb_wall:.2f}x; tokens identical: {same}")
    print(
        f"decode step, batch {args.requests}: {step_ms:.2f} ms; copying all caches contiguous each step would add "
        f"{copy_ms:.2f} ms ({100 * copy_ms / step_ms:.0f}% of the step)"
    )
    print(
        f"KV memory held: {held / 2**20:.2f} MiB ({blocks} blocks) vs contiguous max-length caches "
        f"{contiguous / 2**20:.2f} MiB ({100 * held / contiguous:.0f}%)"
    )


if __name__ == "__main__":
    main()
