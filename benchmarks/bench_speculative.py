"""Issue 43's table: speculative decoding on a trained target / draft pair, side by side in one run.

    python benchmarks/bench_speculative.py [--work .cache/bench-spec] [--rounds 3] [--threads 2] [--k 4]
        [--new 128] [--prompts 8] [--engines ...] [--skip-check] [--json FILE]

Models: benchmarks/spec_pair.py trains a target (Llama, hidden 512, 8 layers) and a draft (hidden 128-192,
2 layers) with one tokenizer on tests/data's text, and cuts prompts from the held-out part (never trained on);
cached under --work with every build below (precast artifacts: ort-cpu fp32, the target INT4 too; optimum's
OpenVINO exports for OpenVINO GenAI; GGUF files for llama.cpp where its build is found).

The draft is distilled towards the target (spec_distill.py: its next-token distribution trained to the
target's on the same training text, from the text-trained draft's weights; --no-distil: the text-trained draft).

1. Exactness (in this process): the greedy tokens of --check-prompts held-out prompts, --new each, with draft
   speculation at K = 2, 4, 6, 8 and prompt lookup at K = 4, alone and 8 batched, against the engine without
   speculation ("identical" or the first prompt that differs).
2. Speed (each engine its own worker process, bench_llm_worker.py; rounds rotate their order; the same prompts
   for every engine in a round):
     b1       one request at a time over --prompts held-out prompts: decode tok/s after the first token
              (tokens / time, summed over the prompts), TTFT median; acceptance (kept / proposed drafts) and
              tokens per verify step from precast's counters
     quote    prompt lookup's workload: a passage (two held-out prompts), then its first 24 tokens again
              (the continuation repeats the passage)
     sampled  b1's prompts sampled at temperature 0.8 (seeded): an output that does not repeat itself, where
              prompt lookup finds little and must cost nothing (the small greedy model loops, so b1 repeats)
     c8, c32  8 / 32 held-out prompts at once, --new each: aggregate tok/s (precast's off-switches: no
              speculation past its max batch, nor where its measured tokens/s fall below plain steps')
   Engines: precast-fp32 (and precast-fp32-aa, the same engine twice: the A/A spread), precast-fp32-draft,
   precast-ov-fp32 / -ov-fp32-draft (precast's engine on its OpenVINO backend, which a multi-target artifact
   runs at 8+ requests; the same draft artifact), precast-int4, precast-int4-draft (the trained target in
   INT4: 14 MB, decoded from the CPU's cache), precast-int4w / -int4w-aa / -int4w-draft and precast-ov-int4w /
   -ov-int4w-aa / -ov-int4w-draft (spec_widen.py's function-preserving widening of the trained target, 243M
   parameters, 150 MB in INT4: a target whose weight read dominates its step, as a served LLM's does; ort-cpu
   MatMulNBits and OpenVINO NNCF INT4, group 32), precast-fp32-ngram, ov-fp32 / ov-fp32-draft / ov-fp32-ngram (OpenVINO
   GenAI's LLMPipeline, f32 forced, with the same draft and K; ContinuousBatchingPipeline for c8/c32),
   llamacpp-draft (llama.cpp's llama-speculative-simple on GGUFs of the same pair, f32; --llamacpp-bin).
   Ratios: engine / its base in the same round, median (min-max): precast-fp32 (INT4 rows: precast-int4,
   precast-int4w, precast-ov-int4w; precast's OpenVINO rows: precast-ov-fp32).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from _common import JsonWorker  # noqa: E402
from bench_llm_requests import summary  # noqa: E402

OV_PY = "/work/venvs/ovgenai/bin/python"
GGUF_PY = "/work/venvs/gguf/bin/python"
LLAMACPP = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
# name: (worker kind, target build, draft build, worker flags, rows, ratio base)
ENGINES = {
    "precast-fp32": ("precast", "fp32", None, [], ("b1", "quote", "sampled", "c8", "c32"), "precast-fp32"),
    "precast-fp32-aa": ("precast", "fp32", None, [], ("b1", "quote", "sampled", "c8", "c32"), "precast-fp32"),
    "precast-fp32-draft": (
        "precast",
        "fp32",
        "fp32",
        ["--spec", "draft"],
        ("b1", "c8", "c32"),
        "precast-fp32",
    ),
    "precast-fp32-ngram": (
        "precast",
        "fp32",
        None,
        ["--spec", "ngram"],
        ("b1", "quote", "sampled"),
        "precast-fp32",
    ),
    "precast-ov-fp32": ("precast", "ov-fp32", None, [], ("b1", "c8", "c32"), "precast-ov-fp32"),
    "precast-ov-fp32-draft": (
        "precast",
        "ov-fp32",
        "fp32",
        ["--spec", "draft"],
        ("b1", "c8", "c32"),
        "precast-ov-fp32",
    ),
    "precast-int4": ("precast", "int4", None, [], ("b1",), "precast-int4"),
    "precast-int4-draft": ("precast", "int4", "fp32", ["--spec", "draft"], ("b1",), "precast-int4"),
    "precast-int4w": ("precast", "int4w", None, [], ("b1",), "precast-int4w"),
    "precast-int4w-aa": ("precast", "int4w", None, [], ("b1",), "precast-int4w"),
    "precast-int4w-draft": ("precast", "int4w", "fp32", ["--spec", "draft"], ("b1",), "precast-int4w"),
    "precast-ov-int4w": ("precast", "ov-int4w", None, [], ("b1",), "precast-ov-int4w"),
    "precast-ov-int4w-aa": ("precast", "ov-int4w", None, [], ("b1",), "precast-ov-int4w"),
    "precast-ov-int4w-draft": (
        "precast",
        "ov-int4w",
        "fp32",
        ["--spec", "draft"],
        ("b1",),
        "precast-ov-int4w",
    ),
    "ov-fp32": ("ov", "ov", None, ["--force-f32"], ("b1", "quote", "c8", "c32"), "precast-fp32"),
    "ov-fp32-draft": ("ov", "ov", "ov", ["--force-f32", "--spec", "draft"], ("b1",), "precast-fp32"),
    "ov-fp32-ngram": ("ov", "ov", None, ["--force-f32", "--spec", "ngram"], ("b1", "quote"), "precast-fp32"),
    "llamacpp-draft": ("llamacpp", "gguf", "gguf", [], ("b1",), "precast-fp32"),
}
ROWS = {"b1": 1, "quote": 1, "sampled": 1, "c8": 8, "c32": 32}


# -- builds ----------------------------------------------------------------------------------------------
# precast builds: (target, passes, accuracy budget, target options). OpenVINO: its PagedAttention step, f32
# compute and KV; INT4 = NNCF group 32 there, MatMulNBits RTN block 32 (accuracy level 4) on ort-cpu, both held
# to bench_llm.py's INT4 budget.
PRECAST_BUILDS = {
    "fp32": ("ort-cpu", None, None, {}),
    "int4": ("ort-cpu", "default,quantize-int4{accuracy_level=4}", "cosine>=0.95", {}),
    "ov-fp32": ("openvino", None, None, {}),
    "ov-int4": ("openvino", None, "cosine>=0.95", {"weights": "int4", "group_size": "32"}),
}


def build_precast(folder: Path, out: Path, prec: str) -> Path:
    from precast.compiler.driver import CompileOptions, compile_model

    if not (out / "manifest.json").is_file():
        print(f"compiling {out.name}", flush=True)
        target, passes, budget, options = PRECAST_BUILDS[prec]
        opts = CompileOptions(
            targets=(target,), task="causal-lm", passes=passes, accuracy_budget=budget, target_options=options
        )
        compile_model(str(folder), out, opts)
    return out


def build_ov(folder: Path, out: Path) -> Path | str:
    if not (out / "openvino_model.xml").is_file():
        cli = str(Path(OV_PY).parent / "optimum-cli")
        if not Path(cli).is_file():
            return f"no {cli}"
        print(f"exporting {out.name} with optimum-intel", flush=True)
        cmd = [cli, "export", "openvino", "--model", str(folder), "--task", "text-generation-with-past"]
        p = subprocess.run([*cmd, "--weight-format", "fp32", str(out)], capture_output=True, text=True)
        if p.returncode:
            return f"optimum export failed: {(p.stderr or p.stdout).strip().splitlines()[-1][:200]}"
    return out


def build_gguf(folder: Path, out: Path) -> Path | str:
    if not out.is_file():
        if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
            return f"no llama.cpp sources at {LLAMACPP}"
        print(f"converting {out.name} with llama.cpp's converter", flush=True)
        # (llama.cpp's converter imports sentencepiece: an interpreter with it, e.g. a venv over this one's
        # site-packages plus `pip install sentencepiece`)
        py = GGUF_PY if Path(GGUF_PY).is_file() else sys.executable
        cmd = [py, str(HERE / "bench_llm_llamacpp.py"), "convert", str(folder), str(out), "f32"]
        p = subprocess.run(
            cmd, capture_output=True, text=True, env={**_env(), "LLAMACPP_CONVERT_DIR": str(LLAMACPP)}
        )
        if p.returncode:
            return f"GGUF conversion failed: {(p.stderr or p.stdout).strip().splitlines()[-1][:200]}"
    return out


def _env() -> dict:
    import os

    return dict(os.environ)


# -- workers ---------------------------------------------------------------------------------------------
class Worker(JsonWorker):
    """One engine's bench_llm_worker.py process (_common.JsonWorker): ask() sends a request, reads the answer."""

    def __init__(self, name: str, cmd: list[str], log: Path):
        super().__init__(cmd, log)
        self.name, self.info = name, self.first.get("ready")


class LlamaCppSpec:
    """llama.cpp's own speculative example (llama-speculative-simple): one process per request, greedy,
    --spec-draft-n-max K, f32 weights; its printed decode speed and acceptance are the measurement."""

    def __init__(self, name: str, target: Path, draft: Path, a, tok):
        self.name, self.target, self.draft, self.a, self.tok = name, target, draft, a, tok
        self.bin = Path(a.llamacpp_bin)
        self.error = None if self.bin.is_file() else f"no {self.bin} (build llama.cpp's examples)"
        self.info = str(self.bin)

    def ask(self, op: str, prompt: list[int], new: int, **_) -> dict:
        text = self.tok.decode(prompt)
        cmd = [str(self.bin), "-m", str(self.target), "-md", str(self.draft), "-p", text, "-n", str(new)]
        cmd += [
            "--spec-draft-n-max",
            str(self.a.k),
            "--spec-draft-n-min",
            "0",
            "--spec-draft-p-min",
            "0",
            "-t",
            str(self.a.threads),
        ]
        cmd += ["-td", str(self.a.threads), "--temp", "0", "-c", "512", "--ignore-eos"]
        cmd += ["--spec-type", "draft-simple"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        out = p.stdout + p.stderr
        import re

        m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds", out)
        acc = re.search(r"n_drafted\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", out, re.S)
        if p.returncode or not m:
            return {"error": f"llama-speculative-simple failed (rc {p.returncode}): {out.strip()[-200:]}"}
        n, s = int(m.group(1)), float(m.group(2))
        res = {"n": n + 1, "wall": s, "ttft": 0.0}  # (its "decoded" excludes the prompt: decode time only)
        if acc:
            res.update(proposed=int(acc.group(1)), accepted=int(acc.group(2)))
        return res

    def close(self) -> None:
        pass


def worker_cmd(kind: str, path: Path, draft: Path | None, flags: list[str], a) -> list[str]:
    py = sys.executable if kind == "precast" else OV_PY
    cmd = [py, str(HERE / "bench_llm_worker.py"), kind, str(path), "--threads", str(a.threads)]
    k = a.ngram_k if "ngram" in flags else a.k
    cmd += ["--max-requests", "32", "--max-len", str(2 * a.prompt + a.new + 64), "--spec-k", str(k), *flags]
    return cmd + (["--draft", str(draft)] if draft is not None else [])


# -- prompts ---------------------------------------------------------------------------------------------
def quote_prompts(held: list[list[int]], n: int) -> list[list[int]]:
    """A passage (two consecutive held-out prompts), then its first 24 tokens again: the likely continuation
    repeats the passage (as a summary or an edit quotes its source)."""
    return [p + q + p[:24] for p, q in zip(held[: 2 * n : 2], held[1 : 2 * n : 2])]


# -- exactness -------------------------------------------------------------------------------------------
def check_exact(target: Path, draft: Path, prompts: list[list[int]], new: int, threads: int) -> list[str]:
    from precast.runtime.llm import Engine, SamplingParams
    from precast.runtime.llm.speculative import SpeculativeConfig

    params = SamplingParams(max_tokens=new, ignore_eos=True, detokenize=False)
    plain = Engine.load(target, threads=threads, enable_prefix_caching=False)
    want = [plain.generate([p], params)[0].token_ids for p in prompts]
    plain.close()
    lines = []
    cases = [("draft", k) for k in (2, 4, 6, 8)] + [("ngram", 4)]
    for method, k in cases:
        cfg = SpeculativeConfig(
            method=method, num_tokens=k, draft=str(draft) if method == "draft" else None, max_batch=8
        )
        eng = Engine.load(target, threads=threads, speculative=cfg, enable_prefix_caching=False)
        alone = [eng.generate([p], params)[0].token_ids for p in prompts]
        batched = []
        for i in range(0, len(prompts), 8):
            batched += [c.token_ids for c in eng.generate(prompts[i : i + 8], params)]
        m = eng.metrics()
        eng.close()
        bad = [i for i, (a, b, w) in enumerate(zip(alone, batched, want)) if a != w or b != w]
        rate = m.spec_accepted_tokens / max(1, m.spec_proposed_tokens)
        verdict = "identical" if not bad else f"DIFFERS (prompts {bad[:5]})"
        lines.append(
            f"{method:5s} K={k}: {verdict} over {len(prompts)} prompts x {new} tokens, alone and 8 batched; acceptance {rate:.2f}"
        )
        print(lines[-1], flush=True)
    return lines


# -- timing ----------------------------------------------------------------------------------------------
def b1_row(w, prompts: list[list[int]], new: int, temperature: float = 0.0) -> dict:
    """Decode tok/s (first token excluded) summed over the prompts, TTFT median, speculation counters."""
    toks = secs = 0.0
    ttft, prop, acc, rows = [], 0, 0, 0
    for i, p in enumerate(prompts):
        extra = {"temperature": temperature, "seed": i} if temperature else {}
        r = w.ask(op="b1", prompt=p, new=new, **extra)
        if "error" in r:
            return {"error": r["error"]}
        toks += r["n"] - 1
        secs += r["wall"] - r["ttft"]
        ttft.append(r["ttft"])
        prop += r.get("proposed", 0)
        acc += r.get("accepted", 0)
        rows += r.get("rows", 0)
    return {
        "rate": toks / secs,
        "ttft": statistics.median(ttft),
        "proposed": prop,
        "accepted": acc,
        "rows": rows,
    }


def batch_row(w, prompts: list[list[int]], new: int) -> dict:
    r = w.ask(op="batch", prompts=prompts, new=new)
    if "error" in r:
        return {"error": r["error"]}
    return {"rate": r["n"] / r["wall"], "proposed": r.get("proposed", 0), "accepted": r.get("accepted", 0)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-spec")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=6, help="draft tokens per step (draft-model engines)")
    ap.add_argument(
        "--ngram-k", type=int, default=8, help="tokens per step of prompt lookup (cheap proposals)"
    )
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64, help="tokens per held-out prompt")
    ap.add_argument("--prompts", type=int, default=8, help="b1 prompts per round (each round its own)")
    ap.add_argument("--check-prompts", type=int, default=16)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument(
        "--no-distil", action="store_true", help="the draft as trained on the text, not distilled"
    )
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--llamacpp-bin", default=str(LLAMACPP / "build" / "bin" / "llama-speculative-simple"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    engines = [e for e in a.engines.split(",") if e]
    rows = [r for r in a.rows.split(",") if r]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} (known: {', '.join(ENGINES)})")
    a.work.mkdir(parents=True, exist_ok=True)

    from spec_distill import distilled
    from spec_pair import heldout_prompts, spec_pair
    from spec_widen import widened
    from tokenizers import Tokenizer

    from precast.runtime.llm.tokenizer import TextTokenizer

    target_dir, trained_draft = spec_pair(a.work)
    draft_dir = trained_draft if a.no_distil else distilled(a.work, target_dir, trained_draft)
    tok = TextTokenizer.from_file(target_dir / "tokenizer.json")
    need = a.check_prompts + a.rounds * a.prompts + 32 + 8
    held = heldout_prompts(need, a.prompt, Tokenizer.from_file(str(target_dir / "tokenizer.json")))
    wide = functools.cache(lambda: widened(a.work, target_dir))  # (hashes the target's weights: once)
    builds = {
        ("precast", "fp32", "t"): lambda: build_precast(target_dir, a.work / "precast-target-fp32", "fp32"),
        ("precast", "int4", "t"): lambda: build_precast(target_dir, a.work / "precast-target-int4", "int4"),
        ("precast", "int4w", "t"): lambda: build_precast(
            wide(), a.work / f"precast-{wide().name}-int4", "int4"
        ),
        ("precast", "ov-int4w", "t"): lambda: build_precast(
            wide(), a.work / f"precast-{wide().name}-ov-int4", "ov-int4"
        ),
        ("precast", "ov-fp32", "t"): lambda: build_precast(
            target_dir, a.work / "precast-target-ov", "ov-fp32"
        ),
        ("precast", "fp32", "d"): lambda: build_precast(
            draft_dir, a.work / f"precast-{draft_dir.name}", "fp32"
        ),
        ("ov", "ov", "t"): lambda: build_ov(target_dir, a.work / "ov-target-fp32"),
        ("ov", "ov", "d"): lambda: build_ov(draft_dir, a.work / f"ov-{draft_dir.name}"),
        ("llamacpp", "gguf", "t"): lambda: build_gguf(target_dir, a.work / "target-f32.gguf"),
        ("llamacpp", "gguf", "d"): lambda: build_gguf(draft_dir, a.work / f"{draft_dir.name}-f32.gguf"),
    }
    report: dict = {"host": _host(), "k": a.k, "new": a.new, "threads": a.threads}
    if not a.skip_check:
        print("\n== exactness (greedy, precast)", flush=True)
        report["exact"] = check_exact(
            builds[("precast", "fp32", "t")](),
            builds[("precast", "fp32", "d")](),
            held[: a.check_prompts],
            a.new,
            a.threads,
        )
    held = held[a.check_prompts :]
    notes: dict[str, str] = {}
    workers: dict = {}
    logs = a.work / "logs"
    logs.mkdir(exist_ok=True)
    for name in engines:
        kind, tb, db, flags, _, _ = ENGINES[name]
        path = builds[(kind, tb, "t")]()
        draft = builds[(kind, db, "d")]() if db else None
        bad = next((x for x in (path, draft) if isinstance(x, str)), None)
        if bad:
            notes[name] = f"skipped: {bad}"
            continue
        print(f"starting {name}", flush=True)
        if kind == "llamacpp":
            w = LlamaCppSpec(name, path, draft, a, tok)
        else:
            w = Worker(name, worker_cmd(kind, path, draft, flags, a), logs / f"{name}.log")
        if w.error:
            notes[name] = f"skipped: {w.error}"
            w.close()
            continue
        w.ask(op="b1", prompt=held[0], new=16)  # warm-up
        workers[name] = w
    res: dict = {n: {r: [] for r in rows} for n in workers}
    order = list(workers)
    for rnd in range(a.rounds):
        b1p = held[8 + rnd * a.prompts : 8 + (rnd + 1) * a.prompts]
        quote = quote_prompts(held[8 + rnd * a.prompts :], a.prompts)
        rng = np.random.default_rng(rnd)
        conc = {n: [held[int(i)] for i in rng.choice(len(held), n, replace=False)] for n in (8, 32)}
        order = order[1:] + order[:1]
        for name in order:
            w, want = workers[name], ENGINES[name][4]
            for row in rows:
                if row not in want:
                    continue
                time.sleep(0.2)
                if row == "b1":
                    r = b1_row(w, b1p, a.new)
                elif row == "quote":
                    r = b1_row(w, quote, a.new)
                elif row == "sampled":  # temperature 0.8: an output that does not repeat itself
                    r = b1_row(w, b1p, a.new, temperature=0.8)
                else:
                    r = batch_row(w, conc[ROWS[row]], a.new)
                if "error" in r:
                    notes.setdefault(name, f"{row}: {r['error']}")
                res[name][row].append(r)
                rate = r.get("rate")
                print(
                    f"round {rnd + 1} {name:20s} {row:5s} "
                    + (f"{rate:7.1f} tok/s" if rate else r.get("error", "")),
                    flush=True,
                )
    for w in workers.values():
        w.close()
    report["results"], report["notes"] = res, notes
    table(res, rows, notes, a)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


def table(res: dict, rows: list[str], notes: dict, a) -> None:
    print(
        f"\n== speed (tok/s, median over {a.rounds} rounds; ratio = engine / base in the same round, median (min-max))"
    )
    print("| engine | row | tok/s | vs base | TTFT ms | acceptance | tokens/step |")
    print("|---|---|---|---|---|---|---|")
    for name, by in res.items():
        base = ENGINES[name][5]
        for row in rows:
            ms = [m for m in by.get(row, []) if "rate" in m]
            if not ms:
                continue
            rate = statistics.median(m["rate"] for m in ms)
            bs = [m for m in res.get(base, {}).get(row, [])]
            ratios = [m["rate"] / b["rate"] for m, b in zip(by[row], bs) if "rate" in m and "rate" in b]
            ttft = [m["ttft"] for m in ms if m.get("ttft")]
            prop = sum(m.get("proposed", 0) for m in ms)
            acc = sum(m.get("accepted", 0) for m in ms)
            steps = sum(m.get("rows", 0) for m in ms)
            accept = f"{acc / prop:.2f}" if prop else "-"
            per_step = f"{1 + acc / steps:.2f}" if steps else "-"
            t = f"{statistics.median(ttft) * 1000:.1f}" if ttft else "-"
            print(
                f"| {name} | {row} | {rate:.1f} | {summary(ratios) if name != base else '1'} | {t} | {accept} | {per_step} |"
            )
    for name, why in notes.items():
        print(f"note: {name}: {why}")


def _host() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = "?"
    return model


if __name__ == "__main__":
    main()
