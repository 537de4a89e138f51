"""Structured outputs: decode speed and time to first token under a JSON schema vs free generation (issue 42).

    python benchmarks/bench_structured.py [--rounds 5] [--threads 2] [--work /tmp/precast-bench-structured]

Model: the benchmark Llama (bench_llm_models.py's ``bench``: hidden 512, 8 layers, 8 / 4 heads, vocab 32000,
fp32, ort-cpu) with a 32000-token byte-level BPE trained on the stdlib's modules, so that the grammar engine
masks a real 32k vocabulary (the bench tokenizer has 512 pieces). Random weights: what is measured is the
cost per token, not what the model says.

Rows (each round runs its engines in a rotated order; ratios are taken within a round, then the median and
the spread over rounds):
- ``b1``: one request (prompt 128 tokens). The schema run first; its output length L is then the
  ``max_tokens`` of two free runs (``ignore_eos``): free A and free B, the A/A pair that shows the noise.
  Decode tok/s = (tokens - 1) / (last token - first token).
- ``c8``: 8 requests at once (prompts 32..256), the same way (each free request gets its constrained twin's
  length): aggregate tok/s = tokens / wall time.
- ``ttft``: time to first token with a 50-property schema: the first request (compiles the grammar: a new
  schema each round) and a second one with the same schema (cached), beside a free request.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 100000},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.(com|org|net)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "churned", "trial"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": ["id", "name", "email", "age", "tags", "address", "active", "notes"],
    "additionalProperties": False,
}


def large_schema(tag: str, n: int = 50) -> dict:
    """A flat object of ``n`` typed properties (names carry ``tag``: a new schema, a new compile)."""
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "string", "maxLength": 8},
        {"type": "boolean"},
        {"enum": ["a", "b", "c"]},
        {"type": "number", "minimum": 0, "maximum": 1},
    ]
    props = {f"field_{tag}_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def build(work: Path) -> Path:
    """The bench Llama folder with a 32k tokenizer, compiled fp32 for ort-cpu (cached under ``work``)."""
    import bench_llm_models as models

    art = work / "precast-fp32-tok32k"
    if (art / "manifest.json").is_file():
        return art
    folder = work / "llama-512-tok32k"
    if not (folder / "config.json").is_file():
        src = models.build_folder(work, "bench")
        shutil.copytree(src, folder, dirs_exist_ok=True)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
        from train_tiny_lm import SPECIALS, bpe_tokenizer

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [p.read_text(encoding="utf-8", errors="ignore") for p in sorted(stdlib.glob("*.py"))]
        print("training a 32000-token BPE on the stdlib", flush=True)
        tok = bpe_tokenizer(texts, 32000, SPECIALS)
        tok.save(str(folder / "tokenizer.json"))
        cfg = json.loads((folder / "config.json").read_text())
        cfg["bos_token_id"], cfg["eos_token_id"] = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    from precast.compiler.driver import CompileOptions, compile_model

    print(f"compiling {folder} -> {art}", flush=True)
    compile_model(str(folder), art, CompileOptions(targets=("ort-cpu",), task="causal-lm"))
    return art


class Timed:
    """Submit requests, run them to the end, and keep each one's token times."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, prompts: list[list[int]], params: list) -> tuple[float, list[list[float]], list[int]]:
        times: list[list[float]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        handles = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            handles.append(
                self.engine.submit(p, sp, on_token=lambda ev, i=i: times[i].append(time.perf_counter()))
            )
        self.engine.run_until_done()
        wall = time.perf_counter() - t0
        lengths = [len(h.result().token_ids) for h in handles]
        return wall, [[t - t0 for t in ts] for ts in times], lengths


def decode_rate(ts: list[float]) -> float:
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/precast-bench-structured"))
    ap.add_argument("--json", type=Path, default=None, help="write the raw measurements here")
    ap.add_argument(
        "--grammar-thread",
        choices=("auto", "on", "off"),
        default="auto",
        help="masks beside the backend's step (on) or after it (off); auto: the engine's choice",
    )
    a = ap.parse_args(argv)
    import numpy as np

    from precast.runtime.llm import Engine, SamplingParams
    from precast.runtime.llm.structured import Constraint

    a.work.mkdir(parents=True, exist_ok=True)
    art = build(a.work)
    # (no prefix caching: the free twins reuse the schema run's prompts, which would skip their prefill)
    eng = Engine.load(art, threads=a.threads, enable_prefix_caching=False)
    if a.grammar_thread != "auto":
        eng.grammar_thread = a.grammar_thread == "on"
    timed = Timed(eng)
    rng = np.random.default_rng(0)
    schema = Constraint.json_schema(SCHEMA)
    rows: dict[str, list[dict]] = {"b1": [], "c8": [], "ttft": []}

    def prompt(n: int) -> list[int]:
        return rng.integers(3, 32000, n).tolist()

    def greedy(max_tokens=4096, constraint=None):
        return SamplingParams(max_tokens=max_tokens, constraint=constraint, ignore_eos=constraint is None)

    timed.run([prompt(128)], [greedy(constraint=schema)])  # warm-up (and the schema compiled once)
    for r in range(a.rounds):
        # b1
        p = prompt(128)
        _, ts, lengths = timed.run([p], [greedy(constraint=schema)])
        n_out = len(ts[0])
        res = {"tokens": n_out, "schema": decode_rate(ts[0])}
        for name in ["free_a", "free_b"] if r % 2 == 0 else ["free_b", "free_a"]:
            _, fts, _ = timed.run([p], [greedy(max_tokens=n_out)])
            res[name] = decode_rate(fts[0])
        rows["b1"].append(res)
        # c8
        ps = [prompt(int(n)) for n in np.linspace(32, 256, 8).astype(int)]
        wall, ts, _ = timed.run(ps, [greedy(constraint=schema)] * 8)
        outs = [len(t) for t in ts]
        res = {"tokens": sum(outs), "schema": sum(outs) / wall}
        for name in ["free_a", "free_b"] if r % 2 == 0 else ["free_b", "free_a"]:
            wall, fts, _ = timed.run(ps, [greedy(max_tokens=n) for n in outs])
            res[name] = sum(map(len, fts)) / wall
        rows["c8"].append(res)
        # ttft: a 50-property schema, new each round (compiled), then again (cached); a free request
        big = Constraint.json_schema(large_schema(f"r{r}"))
        p = prompt(128)
        t_c0 = time.perf_counter()
        eng.grammars.matcher(Constraint.json_schema(large_schema(f"probe{r}")))
        compile_s = time.perf_counter() - t_c0
        res = {"compile_only": compile_s}
        for name, sp in (
            ("schema_new", greedy(max_tokens=1, constraint=big)),
            ("schema_cached", greedy(max_tokens=1, constraint=big)),
            ("free", greedy(max_tokens=1)),
        ):
            t0 = time.perf_counter()
            h = eng.submit(p, sp)
            eng.run_until_done()
            h.result()
            res[name] = time.perf_counter() - t0
        rows["ttft"].append(res)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    eng.close()
    report(rows, a)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


def _ratio(rows: list[dict], num: str, den: str) -> str:
    rs = [r[num] / r[den] for r in rows]
    return f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})"


def report(rows: dict, a) -> None:
    print(
        f"\nstructured outputs, {a.rounds} rounds, {a.threads} threads, grammar thread {a.grammar_thread}; "
        "median (min-max over rounds)\n"
    )
    print(
        "| row | tokens | free A tok/s | free B tok/s | schema tok/s | schema / free A | free B / free A (A/A) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in ("b1", "c8"):
        rs = rows[row]
        med = {k: statistics.median(r[k] for r in rs) for k in ("tokens", "free_a", "free_b", "schema")}
        print(
            f"| {row} | {med['tokens']:.0f} | {med['free_a']:.1f} | {med['free_b']:.1f} | {med['schema']:.1f} | "
            f"{_ratio(rs, 'schema', 'free_a')} | {_ratio(rs, 'free_b', 'free_a')} |"
        )
    t = rows["ttft"]
    ms = {
        k: 1000 * statistics.median(r[k] for r in t)
        for k in ("compile_only", "schema_new", "schema_cached", "free")
    }
    print("\n| time to first token, prompt 128 | ms (median) |\n|---|---|")
    print(f"| free | {ms['free']:.1f} |")
    print(f"| 50-property schema, first request (grammar compiled) | {ms['schema_new']:.1f} |")
    print(f"| same schema again (compiled grammar cached) | {ms['schema_cached']:.1f} |")
    print(f"| compiling that grammar alone | {ms['compile_only']:.1f} |")


if __name__ == "__main__":
    main()
