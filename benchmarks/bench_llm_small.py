"""Batch-1 decode of small decoders: precast vs onnxruntime-genai, fp32 and INT4, plus precast's step profile.

    /work/venvs/genai/bin/python benchmarks/bench_llm_small.py [--models h256,h384] [--rounds 5] [--threads 2]
        [--work /tmp/precast-bench-small] [--no-int4] [--json]

Models (Llama-style, GQA, vocab 32000, tied embeddings, seeded random weights N(0, 0.02), the local BPE
tokenizer of tests/llm/fixtures.py), built once into --work with their genai folders (genai's builder):
  h256   hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 704   (~36 MB fp32, mostly the embedding)
  h384   hidden 384, 6 layers, 6 heads / 2 KV heads, intermediate 1024  (~62 MB fp32)
  llama512  bench_llm_step.py's model: hidden 512, 8 layers, 8 / 4 KV heads, intermediate 1408 (~160 MB fp32)
Per round, interleaved (order rotating): each engine runs one unmeasured then three measured generations of
prompt 128 + 128 new tokens (greedy, EOS ignored, token ids only); the round's value is the median decode
rate (time to first token excluded). Ratios precast / genai are taken within each round (median, range).
precast runs with its default (ONNX Runtime's thread spinning off; --spinning turns it on, as genai has it).
Profile (precast, decode steps of one generation): wall time of Engine.step, the part inside the ONNX Runtime
call (run_with_iobinding / run), and the rest ("host us": scheduler + runner + sampler + engine).
onnxruntime-genai is optional: without it only precast's rows are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llm_overhead import _TimedSession  # noqa: E402
from bench_llm_vs_genai import open_genai  # noqa: E402

PROMPT, NEW = 128, 128
MODELS = {
    "h256": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 704},
    "h384": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1024},
    # bench_llm_step.py's Llama (the model the engine was tuned on), for the "without losing there" check
    "llama512": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
    },
}
COMMON = {
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}


def build(work: Path, name: str, int4: bool, genai: bool) -> dict[str, Path]:
    from precast.compiler.driver import CompileOptions, compile_model
    from tests.llm.fixtures import build_llama

    folder = work / name
    if not (folder / "config.json").is_file():
        print(f"building the {name} model folder", flush=True)
        build_llama(folder, **{**COMMON, **MODELS[name]})
    precs = ("fp32", "int4") if int4 else ("fp32",)
    passes = {"fp32": ("default", None), "int4": ("default,quantize-int4{accuracy_level=4}", "cosine>=0.95")}
    out: dict[str, Path] = {}
    for prec in precs:
        art = work / f"{name}-precast-{prec}"
        if not (art / "manifest.json").is_file():
            print(f"compiling precast {name} {prec}", flush=True)
            p, budget = passes[prec]
            compile_model(
                str(folder),
                art,
                CompileOptions(targets=("ort-cpu",), task="causal-lm", passes=p, accuracy_budget=budget),
            )
        out[f"precast-{prec}"] = art
        if not genai:
            continue
        gdir = work / f"{name}-genai-{prec}"
        if not (gdir / "genai_config.json").is_file():
            print(f"building genai {name} {prec}", flush=True)
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder)]
            subprocess.run([*cmd, "-o", str(gdir), "-p", prec, "-e", "cpu"], check=True, capture_output=True)
        out[f"genai-{prec}"] = gdir
    return out


class Precast:
    def __init__(self, art: Path, threads: int, spinning: bool = False):
        from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

        self.engine = Engine.load(
            art,
            num_blocks=4 * (PROMPT + NEW) // 16 + 16,
            threads=threads,
            spinning=spinning,
            config=SchedulerConfig(max_num_batched_tokens=512),
            enable_prefix_caching=False,
        )
        self.params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)

    def generate(self, prompt: list[int]) -> tuple[float, float]:
        t0 = time.perf_counter()
        h = self.engine.submit(prompt, self.params)
        self.engine.run_until_done()
        wall = time.perf_counter() - t0
        assert len(h.result().token_ids) == NEW
        return wall, h.ttft_s

    def profile(self, prompt: list[int]) -> tuple[float, float]:
        """(median step us, median host us) over the decode steps of one generation (the session timed
        only here: its wrapper is not in the rates)."""
        runner = self.engine.runner
        inner, runner._session = runner._session, _TimedSession(runner._session)
        session = runner._session
        try:
            h = self.engine.submit(prompt, self.params)
            steps, host = [], []
            while self.engine.has_unfinished():
                decoding = bool(h.token_ids)
                ort0, t0 = session.seconds, time.perf_counter()
                self.engine.step()
                wall = time.perf_counter() - t0
                if decoding:
                    steps.append(wall)
                    host.append(wall - (session.seconds - ort0))
        finally:
            runner._session = inner
        return 1e6 * statistics.median(steps), 1e6 * statistics.median(host)

    def tokens(self, prompt: list[int]) -> list[int]:
        h = self.engine.submit(prompt, self.params)
        self.engine.run_until_done()
        return list(h.result().token_ids)


class Genai:
    def __init__(self, path: Path, threads: int):
        self.og, self.model = open_genai(path, threads)

    def _run(self, prompt: list[int]):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=PROMPT + NEW, do_sample=False, batch_size=1)
        gen = self.og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array([prompt], dtype=np.int32))
        ttft = time.perf_counter() - t0
        while not gen.is_done():
            gen.generate_next_token()
        return gen, t0, ttft

    def generate(self, prompt: list[int]) -> tuple[float, float]:
        gen, t0, ttft = self._run(prompt)
        return time.perf_counter() - t0, ttft

    def tokens(self, prompt: list[int]) -> list[int]:
        gen, _, _ = self._run(prompt)
        return [int(t) for t in gen.get_sequence(0)][PROMPT:]


def steady(engine, prompt) -> float:
    """Decode tok/s: one unmeasured generation, then the median of three."""
    engine.generate(prompt)
    rates = sorted((NEW - 1) / (w - t) for w, t in (engine.generate(prompt) for _ in range(3)))
    return rates[1]


def measure(name: str, paths: dict[str, Path], args) -> dict:
    engines = {
        k: Precast(p, args.threads, args.spinning) if k.startswith("precast") else Genai(p, args.threads)
        for k, p in paths.items()
    }
    prompt = np.random.default_rng(0).integers(5, 500, PROMPT).tolist()
    rates: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    for r in range(args.rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            rates[k].append(steady(engines[k], prompt))
    row: dict = {"model": name}
    for k, v in rates.items():
        row[f"{k}_tok_s"] = statistics.median(v)
    for prec in ("fp32", "int4"):
        a, b = rates.get(f"precast-{prec}"), rates.get(f"genai-{prec}")
        if a and b:
            ratios = sorted(x / y for x, y in zip(a, b))
            row[f"ratio_{prec}"] = statistics.median(ratios)
            row[f"ratio_{prec}_range"] = (ratios[0], ratios[-1])
            if prec == "fp32":
                row["greedy_same_fp32"] = engines[f"precast-{prec}"].tokens(prompt) == engines[
                    f"genai-{prec}"
                ].tokens(prompt)
        e = engines.get(f"precast-{prec}")
        if e is not None:
            prof = [e.profile(prompt) for _ in range(3)]
            row[f"precast-{prec}_step_us"] = statistics.median(p[0] for p in prof)
            row[f"precast-{prec}_host_us"] = statistics.median(p[1] for p in prof)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="h256,h384")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/precast-bench-small")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--spinning", action="store_true", help="precast with ONNX Runtime's thread spinning on")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        import onnxruntime_genai  # noqa: F401

        genai = not args.no_genai
    except ImportError:
        print("onnxruntime-genai not installed: its rows are skipped (pip install onnxruntime-genai)")
        genai = False
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        paths = build(work, name, not args.no_int4, genai)
        if args.build_only:
            continue
        row = measure(name, paths, args)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(
            f"\n{name}: {json.dumps(MODELS[name])}; {args.threads} threads; {args.rounds} rounds interleaved"
        )
        for k, v in row.items():
            if k != "model":
                print(f"  {k:<26} {v if not isinstance(v, float) else round(v, 3)}")


if __name__ == "__main__":
    main()
