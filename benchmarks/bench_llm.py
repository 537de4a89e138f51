"""Issue 20's LLM serving table: precast's engine vs OpenVINO GenAI, onnxruntime-genai and llama.cpp.

    python benchmarks/bench_llm.py [--model bench|small256|small384|dsv2|mamba130m] [--rounds 3] [--threads 2] [--load]
        [--engines precast-fp32,ov-fp32,...] [--rows b1,c8,c32] [--new 128] [--b1-reps 3] [--list] [--json FILE]

Every engine runs in its own worker process (bench_llm_worker.py) under the interpreter that has its package
(--precast-python, --genai-python, --ov-python, --llamacpp-python; defaults: this one, and /work/venvs/genai,
/work/venvs/ovgenai, /work/venvs/llamacpp where they exist). An engine whose interpreter or package is
missing is skipped with a note. Models: bench_llm_models.py (the builds are cached under --work).
Rows (greedy, EOS ignored, token ids in and out, fresh random prompts for every measurement; the same ids
for every engine in a round):
  b1     one request, prompt 128 + --new tokens: time to first token, decode tokens/s (first token excluded);
         a measurement is the median of --b1-reps (3) such generations back to back, each a fresh prompt
  c8     8 requests at once, prompts 32-512 tokens (evenly spread, shuffled), --new each: aggregate tokens/s
  c32    the same with 32 requests
Engines (precision class: what its ratio divides by):
  precast-fp32, precast-int4   precast's engine on ort-cpu artifacts (INT4 = RTN block 32, accuracy level 4)
                               (ONNX Runtime's thread spinning "auto", precast's default: it spins while
                               the host is otherwise idle, sleeps while other processes use CPU)
  precast-fp32-spin, -int4-spin  the same with spinning always on; -calm: always off
  precast-fp32-aa              precast-fp32 again, in its own worker (the A/A spread; opt-in)
  precast-ov-fp32, -ov-bf16,   precast's engine on --target openvino artifacts (its scheduler, block pool and
  precast-ov-int4              sampler; the step on OpenVINO's PagedAttention): fp32 = f32 compute + f32 KV;
                               bf16 = OpenVINO GenAI's defaults on optimum's fp32 IR (bf16 compute where the
                               CPU has it, else f32; f16 KV, from the IR's runtime_options); INT4 = NNCF group
                               32 every linear layer, bf16 compute, u8 KV (the INT4 IR's defaults)
  genai-fp32, genai-int4       onnxruntime-genai (b1 only: on CPU it batches statically, without paging)
  ov-fp32                      OpenVINO GenAI, its defaults (bf16 compute where the CPU has it, f16 KV): class
                               bf16, against precast-ov-bf16
  ov-fp32-f32                  the same with f32 inference precision and an f32 KV cache forced
  ov-int4                      optimum-intel's INT4 export (NNCF, group 32, every layer), defaults
  llamacpp-f32, llamacpp-q4_0  llama.cpp through llama-cpp-python (its converter; Q4_0 by its quantizer;
                               f32 with an f32 KV cache, Q4_0 with its default f16 KV)
  (b1: LLMPipeline; c8 / c32: ContinuousBatchingPipeline, prefix caching off, KV grown on demand)
Ratios: engine / the base precast engine of the same precision class in the same round (--base: ort =
precast-fp32 / precast-int4, ov = precast-ov-*, auto = ov when those run; rates: >1 = engine faster; TTFT:
<1 = engine faster), median and range over rounds. Rounds rotate the engines' order. --load measures every
round twice, without and with a competing process that keeps one core busy (a single-threaded numpy matmul
loop, or --load-kind spin: a Python busy loop), and adds each engine's loaded / unloaded rate.
"agree": how many of the first 32 greedy tokens of one warm-up prompt equal precast-fp32's (else precast-ov-fp32's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_llm_models as models  # noqa: E402
from _common import JsonWorker  # noqa: E402
from bench_llm_requests import TOKENS, mixed_prompts, round_ratios, summary  # noqa: E402

# bench_llm_decode.py and bench_llm_overhead.py take these from here (issue 5's table, now bench_llm_vs_genai.py)
from bench_llm_vs_genai import Genai, build  # noqa: E402,F401

PROMPT = 128
SETTLE_S = 0.2  # pause before each measurement (not timed)
ROWS = {"b1": 1, "c8": 8, "c32": 32}
# name: (worker kind, interpreter flag, build precision, precision class, worker flags, rows)
ENGINES = {  # (the -spin / -calm variants are opt-in: --engines names them)
    "precast-fp32": ("precast", "precast", "fp32", "fp32", [], ("b1", "c8", "c32")),
    "precast-int4": ("precast", "precast", "int4", "int4", [], ("b1", "c8", "c32")),
    "precast-fp32-aa": ("precast", "precast", "fp32", "fp32", [], ("b1", "c8", "c32")),  # (A/A: opt-in)
    "precast-fp32-spin": ("precast", "precast", "fp32", "fp32", ["--spinning=on"], ("b1", "c8", "c32")),
    "precast-int4-spin": ("precast", "precast", "int4", "int4", ["--spinning=on"], ("b1", "c8", "c32")),
    "precast-fp32-calm": ("precast", "precast", "fp32", "fp32", ["--spinning=off"], ("b1", "c8", "c32")),
    "precast-int4-calm": ("precast", "precast", "int4", "int4", ["--spinning=off"], ("b1", "c8", "c32")),
    "precast-ov-fp32": ("precast", "precast", "ov-fp32", "fp32", [], ("b1", "c8", "c32")),
    "precast-ov-bf16": ("precast", "precast", "ov-bf16", "bf16", [], ("b1", "c8", "c32")),
    "precast-ov-int4": ("precast", "precast", "ov-int4", "int4", [], ("b1", "c8", "c32")),
    "genai-fp32": ("genai", "genai", "fp32", "fp32", [], ("b1",)),
    "genai-int4": ("genai", "genai", "int4", "int4", [], ("b1",)),
    "ov-fp32": ("ov", "ov", "fp32", "bf16", [], ("b1", "c8", "c32")),
    "ov-fp32-f32": ("ov", "ov", "fp32", "fp32", ["--force-f32"], ("b1", "c8", "c32")),
    "ov-int4": ("ov", "ov", "int4", "int4", [], ("b1", "c8", "c32")),
    "llamacpp-f32": ("llamacpp", "llamacpp", "f32", "fp32", ["--force-f32"], ("b1", "c8", "c32")),
    "llamacpp-q4_0": ("llamacpp", "llamacpp", "q4_0", "int4", [], ("b1", "c8", "c32")),
}
PACKAGES = {
    "precast": "precast.runtime",
    "genai": "onnxruntime_genai",
    "ov": "openvino_genai",
    "llamacpp": "llama_cpp",
}
VENVS = {"genai": "/work/venvs/genai", "ov": "/work/venvs/ovgenai", "llamacpp": "/work/venvs/llamacpp"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(models.MODELS), default="bench")
    ap.add_argument(
        "--engines",
        default=",".join(e for e in ENGINES if not e.endswith(("-spin", "-calm", "-aa"))),
        help="comma-separated (default: all but the -spin / -calm / -aa variants)",
    )
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated of b1,c8,c32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument(
        "--b1-reps", type=int, default=3, help="b1: generations per measurement (fresh prompts), median taken"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load", action="store_true", help="also measure under a competing one-core load")
    ap.add_argument("--load-kind", choices=("matmul", "spin"), default="matmul")
    ap.add_argument(
        "--base", choices=("auto", "ort", "ov"), default="auto", help="the precast engine ratios divide by"
    )
    ap.add_argument("--work", default="/tmp/precast-bench-llm")
    ap.add_argument("--json", type=Path, default=None, help="write the raw measurements here")
    ap.add_argument(
        "--list", action="store_true", help="say which engines would run (and why not), then exit"
    )
    for kind in ("precast", "genai", "ov", "llamacpp"):
        default = sys.executable if kind == "precast" else f"{VENVS[kind]}/bin/python"
        ap.add_argument(f"--{kind}-python", default=default, help=f"interpreter with {PACKAGES[kind]}")
    a = ap.parse_args(argv)
    if a.b1_reps < 1:
        ap.error(f"--b1-reps must be at least 1 (got {a.b1_reps})")
    a.engines = [e for e in a.engines.split(",") if e]
    a.rows = [r for r in a.rows.split(",") if r]
    for name in a.engines:
        if name not in ENGINES:
            ap.error(f"unknown engine '{name}' (known: {', '.join(ENGINES)})")
    for row in a.rows:
        if row not in ROWS:
            ap.error(f"unknown row '{row}' (known: {', '.join(ROWS)})")
    return a


def available(a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(engines to run, {engine: why it is skipped}); one import check per interpreter."""
    ok: dict[str, str | None] = {}
    for kind, pkg in PACKAGES.items():
        py = getattr(a, f"{kind}_python")
        if not Path(py).is_file():
            ok[kind] = f"skipped: {py} not found"
            continue
        p = subprocess.run([py, "-c", f"import {pkg}"], capture_output=True, text=True)
        ok[kind] = None if p.returncode == 0 else f"skipped: {pkg} not installed in {py}"
    run = [e for e in a.engines if ok[ENGINES[e][1]] is None]
    return run, {e: ok[ENGINES[e][1]] for e in a.engines if e not in run}


def build_for(name: str, a: argparse.Namespace) -> Path | str:
    kind, flag, prec = ENGINES[name][:3]
    work, py = Path(a.work), getattr(a, f"{flag}_python")
    if kind == "precast":
        return models.build_precast(work, a.model, prec)
    return {"genai": models.build_genai, "ov": models.build_ov, "llamacpp": models.build_gguf}[kind](
        work, a.model, prec, py
    )


class Worker(JsonWorker):
    """One engine's process (_common.JsonWorker): ask() sends a request line and reads the answer line."""

    def __init__(self, name: str, path: Path, a: argparse.Namespace, log: Path):
        kind, flag, _, _, flags, self.rows = ENGINES[name]
        py = getattr(a, f"{flag}_python")
        cmd = [py, str(HERE / "bench_llm_worker.py"), kind, str(path), "--threads", str(a.threads)]
        cmd += ["--max-requests", str(max(ROWS[r] for r in a.rows)), "--max-len", str(512 + a.new), *flags]
        super().__init__(cmd, log, close_timeout=30)
        self.info = self.first.get("ready")


BURN = {
    "matmul": "import numpy as np\na = np.random.rand(384, 384)\nwhile True:\n    a = (a @ a) * 1e-3",
    "spin": "while True:\n    pass",
}


class Burner:
    """A competing process that keeps one core busy while the block runs (started and ended by this bench)."""

    def __init__(self, kind: str | None):
        self.kind, self.p = kind, None

    def __enter__(self):
        if self.kind:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            self.p = subprocess.Popen([sys.executable, "-c", BURN[self.kind]], env=env)
            time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.kill()
            self.p.wait()


def start_workers(run: list[str], a, notes: dict[str, str]) -> dict[str, Worker]:
    logs = Path(a.work) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    workers = {}
    for name in run:
        path = build_for(name, a)
        if isinstance(path, str):
            notes[name] = f"skipped: {path}"
            continue
        print(f"starting {name}", flush=True)
        w = Worker(name, path, a, logs / f"{a.model}-{name}.log")
        if w.error:
            notes[name] = f"skipped: {w.error}"
            w.close()
            continue
        workers[name] = w
    return workers


def warm_up(workers: dict[str, Worker], a) -> dict[str, str]:
    """One b1 and one small concurrent batch each (compiles, pools, pipelines); the b1 tokens -> "agree"."""
    rng = np.random.default_rng(12345)
    prompt = rng.integers(*TOKENS, size=PROMPT).tolist()
    ids: dict[str, list[int]] = {}
    for name, w in workers.items():
        r = w.ask(op="b1", prompt=prompt, new=32)
        ids[name] = r.get("ids", [])
        if "c8" in w.rows and any(x != "b1" for x in a.rows):
            w.ask(op="batch", prompts=mixed_prompts(rng, 4, 16, 64), new=8)
    ref = ids.get("precast-fp32") or ids.get("precast-ov-fp32")
    agree = {}
    for name, got in ids.items():
        same = next(
            (i for i, (x, y) in enumerate(zip(got, ref or [])) if x != y), min(len(got), len(ref or []))
        )
        agree[name] = f"{same}/{len(ref)}" if ref and got else "-"
    return agree


def ask_row(w: Worker, row: str, prompts: list[list[int]], new: int) -> tuple[object, str | None]:
    """One measurement: b1 -> (TTFT s, decode tok/s), c8/c32 -> aggregate tok/s; or (None, the error).

    b1 runs one generation per prompt in ``prompts`` back to back (--b1-reps; each a fresh prompt) and takes the
    median TTFT and the median decode rate: a small decoder's 128 tokens last 50-100 ms, so one scheduler
    hiccup of the shared host would otherwise decide a round's ratio."""
    if row == "b1":
        ttfts, rates = [], []
        for prompt in prompts:
            r = w.ask(op="b1", prompt=prompt, new=new)
            if "error" in r:
                return None, r["error"]
            ttfts.append(r["ttft"])
            rates.append((r["n"] - 1) / (r["wall"] - r["ttft"]))
        return (statistics.median(ttfts), statistics.median(rates)), None
    else:
        r = w.ask(op="batch", prompts=prompts, new=new)
        val = None if "error" in r else r["n"] / r["wall"]
    return val, r.get("error")


def measure(workers: dict[str, Worker], a) -> dict:
    """res[cond][row][engine]: one value per round (None where it failed); b1 values are (ttft, tok/s)."""
    conds = ["quiet", "load"] if a.load else ["quiet"]
    res: dict = {c: {r: {e: [] for e in workers} for r in a.rows} for c in conds}
    errors: dict[str, str] = {}
    names = list(workers)
    for rnd in range(a.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for cond in conds if rnd % 2 == 0 else conds[::-1]:
            with Burner(a.load_kind if cond == "load" else None):
                for row in a.rows:
                    rng = np.random.default_rng([rnd, conds.index(cond), list(ROWS).index(row)])
                    if row == "b1":
                        prompts = [rng.integers(*TOKENS, size=PROMPT).tolist() for _ in range(a.b1_reps)]
                    else:
                        prompts = mixed_prompts(rng, ROWS[row])
                    for name in (n for n in order if row in workers[n].rows):
                        # The engine before may still spin (ONNX Runtime's pool spins ~40 ms after its
                        # last run): a quiet measurement starts once that has ended.
                        time.sleep(SETTLE_S)
                        val, err = ask_row(workers[name], row, prompts, a.new)
                        res[cond][row][name].append(val)
                        if err:
                            errors[f"{name} {row} ({cond})"] = err
        print(f"round {rnd + 1}/{a.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    return {"res": res, "errors": errors}


def _col(res_row: dict, name: str, part: int | None) -> list:
    vals = res_row.get(name, [])
    return [None if v is None else (v[part] if part is not None else v) for v in vals]


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def base_of(name: str, workers: dict, a, col: dict | None = None, part: int | None = None) -> str:
    """The precast engine an engine's ratios divide by: same precision class; --base's backend, or with
    --base auto the precast backend that did better in this column (``col``: {engine: per-round values};
    TTFT, ``part`` 0, lower is better)."""
    cls = ENGINES[name][3]
    ov, ort = f"precast-ov-{cls}", f"precast-{cls}"
    if cls == "bf16":  # only the OpenVINO backend has bf16 compute
        return ov if ov in workers else base_of("ov-fp32-f32", workers, a, col, part)
    if a.base == "ort" or (a.base == "auto" and ov not in workers):
        return ort
    if a.base == "ov" or ort not in workers or col is None:
        return ov
    m_ov, m_ort = _med(col.get(ov, [])), _med(col.get(ort, []))
    if m_ov is None or m_ort is None:
        return ort if m_ov is None and m_ort is not None else ov
    return ov if (m_ov < m_ort if part == 0 else m_ov > m_ort) else ort


def print_tables(workers: dict, m: dict, agree: dict, notes: dict, a) -> None:
    res = m["res"]
    print(
        f"\n{models.describe(a.model)}; {a.threads} threads; prompt {PROMPT} (b1) / 32-512 (c8, c32) + {a.new} new;"
    )
    print(
        f"{a.rounds} interleaved rounds (b1: median of {a.b1_reps} generations each); load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    cols = [("b1", 0, "TTFT ms"), ("b1", 1, "b1 tok/s"), ("c8", None, "c8 tok/s"), ("c32", None, "c32 tok/s")]
    cols = [c for c in cols if c[0] in a.rows]
    for cond, rows in res.items():
        hdr = (
            f"{'[' + cond + ']':<15}"
            + "".join(f"{c[2]:>11}" for c in cols)
            + "".join(f"{'x ' + c[2].split()[0]:>20}" for c in cols)
            + f"{'agree':>7}"
        )
        print("\n" + hdr + "\n" + "-" * len(hdr))
        if cond == "quiet":
            how = {
                "auto": "the faster precast backend of its class in that column",
                "ort": "precast ORT",
                "ov": "precast OpenVINO",
            }
            print(
                f"(x: engine / {how[a.base]}, same round, median (range); TTFT: < 1 = the engine is faster)"
            )
        values = [{k: _col(rows[row], k, part) for k in workers} for row, part, _ in cols]
        for name in workers:
            line = f"{name:<15}"
            for col, (_row, part, _label) in zip(values, cols):
                v = _med(col[name])
                line += f"{'-' if v is None else f'{v * 1e3:.1f}' if part == 0 else f'{v:.1f}':>11}"
            for col, (_row, part, _label) in zip(values, cols):
                base = base_of(name, workers, a, col, part)
                r = round_ratios({k: col[k] for k in (name, base)}, base, name)
                line += f"{'' if name == base else summary(r):>20}"
            print(line + f"{agree.get(name, '-'):>7}")
    if a.load:
        print("\nloaded / unloaded rate, same round (1.00 = no loss; TTFT: unloaded / loaded)")
        for name in workers:
            parts = []
            for row, part, label in cols:
                q, ld = _col(res["quiet"][row], name, part), _col(res["load"][row], name, part)
                r = [(x / y if part == 0 else y / x) for x, y in zip(q, ld) if x and y]
                parts.append(f"{label.split()[0]} {summary(r)}")
            print(f"  {name:<15} " + "; ".join(parts))
    rss = ", ".join(f"{n} {v:.0f}" for n, v in m["rss_mb"].items() if v)
    print(f"\npeak RSS MB per worker (weights + KV + runtime): {rss}")
    for name, why in notes.items():
        print(f"{name}: {why}")
    for what, err in m["errors"].items():
        print(f"{what}: failed ({err})")


def main(argv=None) -> None:
    a = parse_args(argv)
    run, notes = available(a)
    if a.list:
        print(f"{models.describe(a.model)}\nwould run: {', '.join(run) or 'nothing'}")
        for name, why in notes.items():
            print(f"{name}: {why}")
        return
    if not [e for e in run if e.startswith("precast-")]:
        sys.exit("bench_llm: no precast engine to compare with (need one of the precast-* engines)")
    workers = start_workers(run, a, notes)
    try:
        agree = warm_up(workers, a)
        m = measure(workers, a)
        m["rss_mb"] = {n: w.ask(op="rss").get("rss_mb") for n, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    print_tables(workers, m, agree, notes, a)
    if a.json:
        info = {n: w.info for n, w in workers.items()}
        a.json.write_text(
            json.dumps(
                {"args": {**vars(a), "json": str(a.json)}, "info": info, "agree": agree, "notes": notes, **m},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
