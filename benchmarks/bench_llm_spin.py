"""LLM decode with ONNX Runtime's thread spinning on vs off, with and without a competing busy process.

    python benchmarks/bench_llm_spin.py ARTIFACT [ARTIFACT ...] [--rounds 6] [--threads 2] [--busy 0,1]

Per artifact (a causal-lm ort-cpu artifact, e.g. bench_llm_small.py's /tmp/precast-bench-small/h256-precast-int4):
two engines, ``Engine.load(..., spinning=True)`` and ``spinning=False``, alternate within every round (order
flipping each round): batch 1 (prompt 128 + 128 new, decode tok/s, time to first token excluded) then 8 such
requests at once (aggregate tok/s, whole generation). ``--busy 1`` runs the rounds with one extra process
spinning in a Python loop (it takes one core of the host's). Ratios off/on are paired within rounds; medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPT, NEW, BATCH = 128, 128, 8


def engine(art: Path, spinning: bool, threads: int):
    from precast.runtime.llm import Engine, SchedulerConfig

    return Engine.load(
        art,
        num_blocks=2 * BATCH * (PROMPT + NEW) // 16 + 16,
        threads=threads,
        spinning=spinning,
        config=SchedulerConfig(max_num_batched_tokens=512),
        enable_prefix_caching=False,
    )


def rounds(engines: dict, prompts, params, n: int) -> dict:
    res = {k: {"b1": [], "b8": []} for k in engines}
    for r in range(n):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for k in order:
            e = engines[k]
            h = e.submit(prompts[0], params)
            t0 = time.perf_counter()
            e.run_until_done()
            res[k]["b1"].append((NEW - 1) / (time.perf_counter() - t0 - h.ttft_s))
        for k in order:
            t0 = time.perf_counter()
            engines[k].generate(prompts, params)
            res[k]["b8"].append(BATCH * NEW / (time.perf_counter() - t0))
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", default="0,1", help="competing busy processes per pass, comma-separated")
    args = ap.parse_args(argv)
    from precast.runtime.llm import SamplingParams

    params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 500, PROMPT).tolist() for _ in range(BATCH)]
    for art in args.artifacts:
        engines = {"spin": engine(art, True, args.threads), "no-spin": engine(art, False, args.threads)}
        for e in engines.values():  # warm-up, and the two must agree
            e.generate(prompts, params)
        a, b = (e.generate(prompts[:1], params)[0].token_ids for e in engines.values())
        assert a == b, "spinning changed the greedy tokens"
        for busy in (int(x) for x in args.busy.split(",")):
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                res = rounds(engines, prompts, params, args.rounds)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            line = f"{art.name:<22} busy={busy}"
            for k, v in res.items():
                line += f"  {k} b1 {statistics.median(v['b1']):7.1f} b8 {statistics.median(v['b8']):7.1f}"
            off, on = res["no-spin"], res["spin"]
            r1 = statistics.median(x / y for x, y in zip(off["b1"], on["b1"]))
            r8 = statistics.median(x / y for x, y in zip(off["b8"], on["b8"]))
            print(f"{line}  tok/s; off/on b1 {r1:.2f}x b8 {r8:.2f}x", flush=True)
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
