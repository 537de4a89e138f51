"""precast's LLM engine on its two CPU backends: the OpenVINO PagedAttention step vs the ONNX Runtime step.

    python benchmarks/bench_llm_ov.py [--rounds 3] [--threads 2] [--int4] [--work /tmp/precast-bench-ov]

Model: bench_llm_step.py's Llama (hidden 512, 8 layers, 8/4 heads, vocab 32000, ~160 MB fp32), compiled
once into --work for ort-cpu (mapped layout) and openvino (fp32: f32 compute + f32 KV; with --int4 also
openvino weights=int4 group 128 and ort-cpu quantize-int4 RTN block 32). Same engine code above the runner
(scheduler, block pool, prefix cache off: fresh prompts), same threads, interleaved rounds; per round:
  b1       one request, prompt 128, 128 new tokens: decode tok/s after the first token, TTFT
  c8, c32  8 / 32 requests at once, prompt lengths 32..512 (bench_llm_requests.mixed_prompts), 64 new
           tokens each: aggregate generated tok/s over the wall time
Ratios are openvino / ort-cpu of the same precision in the same round, median (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_llm_requests import mixed_prompts, summary  # noqa: E402
from benchmarks.bench_llm_step import CONFIG  # noqa: E402

NEW_CONCURRENT = 64
B1_PROMPT, B1_NEW = 128, 128


def build(work: Path, int4: bool) -> dict[str, Path]:
    from precast.compiler.driver import CompileOptions, compile_model
    from tests.llm.fixtures import build_llama

    folder = work / "llama-512"
    if not (folder / "config.json").is_file():
        print("building the model folder", flush=True)
        build_llama(folder, **CONFIG)
    plans = {
        "ort-cpu fp32": ("ort-cpu", {}, None),
        "openvino fp32": ("openvino", {}, None),
    }
    if int4:
        plans["ort-cpu int4"] = ("ort-cpu", {}, "default,quantize-int4{algo=rtn,block=32}")
        plans["openvino int4"] = ("openvino", {"weights": "int4", "group_size": "128"}, None)
    out = {}
    for name, (target, options, passes) in plans.items():
        art = work / name.replace(" ", "-")
        if not (art / "manifest.json").is_file():
            print(f"compiling {name}", flush=True)
            opts = CompileOptions(
                targets=(target,),
                task="causal-lm",
                target_options=options,
                passes=passes,
                # random weights: INT4 logits reach cosine ~0.97 (bench_llm.py's budget)
                accuracy_budget="cosine>=0.95" if "int4" in name else None,
            )
            compile_model(str(folder), art, opts)
        out[name] = art
    return out


def _params(n: int):
    from precast.runtime.llm.sampler import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)


def b1(engine, rng) -> tuple[float, float]:
    """(decode tok/s after the first token, TTFT s) of one fresh 128-token prompt."""
    prompt = rng.integers(5, 500, B1_PROMPT).tolist()
    t0 = time.perf_counter()
    engine.generate([prompt], _params(1))
    ttft = time.perf_counter() - t0
    prompt = rng.integers(5, 500, B1_PROMPT).tolist()
    t0 = time.perf_counter()
    engine.generate([prompt], _params(B1_NEW + 1))
    return B1_NEW / (time.perf_counter() - t0 - ttft), ttft


def concurrent(engine, rng, n: int) -> float:
    """Aggregate generated tok/s of n mixed-length requests submitted together."""
    prompts = mixed_prompts(rng, n)
    t0 = time.perf_counter()
    done = engine.generate(prompts, _params(NEW_CONCURRENT))
    wall = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in done) / wall


def measure(arts: dict[str, Path], rounds: int, threads: int) -> dict[str, dict[str, list[float]]]:
    from precast.runtime.llm import Engine

    engines = {}
    for name, art in arts.items():
        blocks = 34 * (512 + NEW_CONCURRENT) // (32 if name.startswith("openvino") else 16)
        engines[name] = Engine.load(art, num_blocks=blocks, threads=threads, enable_prefix_caching=False)
        engines[name].generate([[5] * 64], _params(4))  # warm-up (compiled shapes, first allocations)
    results = {name: {"b1": [], "ttft": [], "c8": [], "c32": []} for name in arts}
    for r in range(rounds):
        for name, eng in engines.items():
            rng = np.random.default_rng((r, 1))  # the same requests for every engine in a round
            res = results[name]
            rate, ttft = b1(eng, rng)
            res["b1"].append(rate)
            res["ttft"].append(ttft)
            res["c8"].append(concurrent(eng, rng, 8))
            res["c32"].append(concurrent(eng, rng, 32))
            print(
                f"round {r + 1} {name:14s} b1 {rate:6.1f} tok/s  ttft {ttft * 1000:5.0f} ms  "
                f"c8 {res['c8'][-1]:6.1f}  c32 {res['c32'][-1]:6.1f} tok/s",
                flush=True,
            )
    for eng in engines.values():
        eng.close()
    return results


def report(results: dict[str, dict[str, list[float]]]) -> None:
    print("\nmedians (tok/s; ttft ms)            b1      ttft     c8      c32")
    for name, res in results.items():
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"  {name:30s} {med['b1']:7.1f} {med['ttft'] * 1000:7.0f} {med['c8']:7.1f} {med['c32']:7.1f}")
    print("\nopenvino / ort-cpu, same round        b1             c8             c32            ttft")
    for prec in ("fp32", "int4"):
        ov, ort = results.get(f"openvino {prec}"), results.get(f"ort-cpu {prec}")
        if ov is None or ort is None:
            continue
        cells = [summary([a / b for a, b in zip(ov[k], ort[k])]) for k in ("b1", "c8", "c32", "ttft")]
        print(f"  {prec:6s} " + "  ".join(f"{c:14s}" for c in cells))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int4", action="store_true", help="also INT4 weights on both backends")
    ap.add_argument("--work", type=Path, default=Path("/tmp/precast-bench-ov"))
    args = ap.parse_args(argv)
    arts = build(args.work, args.int4)
    results = {}
    for prec in ("fp32", "int4") if args.int4 else ("fp32",):  # two engines loaded at a time
        results.update(
            measure({n: a for n, a in arts.items() if n.endswith(prec)}, args.rounds, args.threads)
        )
    report(results)


if __name__ == "__main__":
    main()
