"""Issue 5's LLM table: precast engine vs onnxruntime-genai vs Hugging Face generate(), in one process.

    python benchmarks/bench_llm_vs_genai.py [--rounds 3] [--threads 2] [--work /tmp/precast-bench-llm] [--no-int4]

Model: the Llama-style decoder of bench_llm_step.py (hidden 512, 8 layers, 8 heads / 4 KV heads,
vocab 32000, tied embeddings, ~160 MB fp32, seeded random weights), built once into --work.
Rows (2 threads each; medians of interleaved rounds; greedy, EOS ignored):
  step b1      one decode step, batch 1, 128 tokens cached (precast: ModelRunner.step incl. the KV scatter;
               genai: Generator.generate_next_token after a 128-token prompt; HF: forward with a DynamicCache)
  gen b1       prompt 128 + 128 new tokens: time to first token, decode tokens/s. Steady state: per round each
               engine runs 1 unmeasured + 3 measured generations (median of the 3); precast asks for token ids
               only, as genai's loop returns ids. The paired lines under the table: precast / genai within
               each round, median and range over rounds; then --pairs back-to-back generation pairs of the
               two (order alternating: the finest pairing on a shared, drifting machine), median ratio with
               a bootstrap 95% interval.
  gen b8       8 such requests at once: aggregate tokens/s (precast: continuous batching over the paged
               cache; genai: a static batch of 8; HF: generate() on a batch of 8)
"of limit": decode tokens/s / (measured copy bandwidth / weight bytes read per token).
onnxruntime-genai is optional (`pip install onnxruntime-genai`); its rows are skipped with a note when missing.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT, NEW, BATCH = 128, 128, 8


def copy_bandwidth(mb: int = 256, reps: int = 7) -> float:
    """Bytes per second of a numpy copy of a large array (the memory-read yardstick)."""
    src = np.ones(mb * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(ts)


def weight_bytes_read(onnx_path: Path) -> int:
    """Initializer bytes a decode step reads: all but tables only indexed by Gather (the embedding rows)."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    users: dict[str, set[str]] = {}
    for n in m.graph.node:
        for i in n.input:
            users.setdefault(i, set()).add(n.op_type)
    total = 0
    for t in m.graph.initializer:
        size = int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if t.data_type in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4):
            size //= 2
        if users.get(t.name, set()) - {"Gather"}:
            total += size
    return total


def build(work: Path, int4: bool) -> dict[str, Path]:
    from bench_llm_step import CONFIG

    from precast.compiler.driver import CompileOptions, compile_model
    from tests.llm.fixtures import build_llama

    folder = work / "llama-512"
    if not (folder / "config.json").is_file():
        print("building the model folder", flush=True)
        build_llama(folder, **CONFIG)
    # INT4 as genai builds it (RTN, block 32, accuracy level 4 = int8 compute). Random weights make INT4 error
    # large (logits cosine ~0.98 vs fp32), so its compile uses a cosine>=0.95 budget instead of 0.99.
    arts = {"fp32": (work / "precast-fp32", "default", None)}
    if int4:
        arts["int4"] = (work / "precast-int4", "default,quantize-int4{accuracy_level=4}", "cosine>=0.95")
    out = {"folder": folder}
    for prec, (path, passes, budget) in arts.items():
        if not (path / "manifest.json").is_file():
            print(f"compiling precast {prec} ({passes})", flush=True)
            try:
                compile_model(
                    str(folder),
                    path,
                    CompileOptions(
                        targets=("ort-cpu",), task="causal-lm", passes=passes, accuracy_budget=budget
                    ),
                )
            except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                print(f"precast {prec}: compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                continue
        out[f"precast-{prec}"] = path
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        print("onnxruntime-genai not installed: its rows are skipped (pip install onnxruntime-genai)")
        return out
    for prec in ("fp32", "int4") if int4 else ("fp32",):
        path = work / f"genai-{prec}"
        if not (path / "genai_config.json").is_file():
            print(f"building genai {prec}", flush=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "onnxruntime_genai.models.builder",
                    "-i",
                    str(folder),
                    "-o",
                    str(path),
                    "-p",
                    prec,
                    "-e",
                    "cpu",
                ],
                check=True,
                capture_output=True,
            )
        out[f"genai-{prec}"] = path
    return out


class Precast:
    def __init__(self, art: Path, threads: int):
        from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

        self.engine = Engine.load(
            art,
            num_blocks=2 * BATCH * (PROMPT + NEW) // 16 + 16,
            threads=threads,
            config=SchedulerConfig(max_num_batched_tokens=512),
            enable_prefix_caching=False,
        )
        # Token ids only, as genai's loop below (it returns ids; neither side decodes text per token).
        self.params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)
        self.weights = weight_bytes_read(art / "model.onnx")
        runner = self.engine.runner
        blocks = runner.spec.blocks_for(PROMPT + 1)
        self._step = {
            "input_ids": [[17]],
            "positions": [[PROMPT]],
            "past_lens": [PROMPT],
            "new_lens": [1],
            "block_tables": [list(range(blocks))],
        }

    def step(self) -> None:
        self.engine.runner.step(**self._step)

    def generate(self, prompts: list[list[int]]) -> tuple[float, float]:
        """(wall seconds, median time to first token)"""
        t0 = time.perf_counter()
        handles = [self.engine.submit(p, self.params) for p in prompts]
        self.engine.run_until_done()
        wall = time.perf_counter() - t0
        assert all(len(h.result().token_ids) == NEW for h in handles)
        return wall, statistics.median(h.ttft_s for h in handles)


def open_genai(path: Path, threads: int):
    """(onnxruntime_genai, its Model of the builder folder ``path``) with ``threads`` intra-op threads and one
    inter-op thread (written into the folder's genai_config.json, genai's only way to set them)."""
    import onnxruntime_genai as og

    cfg = json.loads((path / "genai_config.json").read_text())
    cfg["model"]["decoder"]["session_options"].update(intra_op_num_threads=threads, inter_op_num_threads=1)
    (path / "genai_config.json").write_text(json.dumps(cfg, indent=4))
    return og, og.Model(str(path))


class Genai:
    def __init__(self, path: Path, threads: int):
        self.og, self.model = open_genai(path, threads)
        self.weights = weight_bytes_read(path / "model.onnx")
        self._gen = None

    def _generator(self, prompts: list[list[int]], max_length: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(prompts))
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(np.array(prompts, dtype=np.int32))
        return gen

    def step(self) -> None:
        # Successive tokens of one generator: past 128, 129, ... (restarted every 64 tokens).
        if self._gen is None or self._left == 0:
            self._gen, self._left = self._generator([list(range(5, 5 + PROMPT))], PROMPT + 80), 64
            self._gen.generate_next_token()
        self._gen.generate_next_token()
        self._left -= 1

    def generate(self, prompts: list[list[int]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        gen = self._generator(prompts, PROMPT + NEW)
        ttft = time.perf_counter() - t0  # append_tokens runs the prompt and leaves its logits
        n = 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
        assert n == NEW, n
        return time.perf_counter() - t0, ttft


class HF:
    def __init__(self, folder: Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True
        ).eval()
        self.weights = sum(p.numel() * 4 for p in self.model.parameters())
        cfg = self.model.config
        kv = [
            torch.randn(1, cfg.num_key_value_heads, PROMPT, cfg.hidden_size // cfg.num_attention_heads)
            for _ in range(2 * cfg.num_hidden_layers)
        ]
        self._kv = kv

    def step(self) -> None:
        from transformers import DynamicCache

        cfg, torch = self.model.config, self.torch
        cache = DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            cache.update(self._kv[2 * i], self._kv[2 * i + 1], i)
        with torch.no_grad():
            self.model(
                input_ids=torch.tensor([[17]]),
                attention_mask=torch.ones(1, PROMPT + 1, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
            )

    def _gen(self, prompts, new):
        torch = self.torch
        ids = torch.tensor(prompts)
        with torch.no_grad():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )

    def generate(self, prompts: list[list[int]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        self._gen(prompts, 1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._gen(prompts, NEW)
        return time.perf_counter() - t0, ttft


def interleave(variants: dict, fn, rounds: int) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(fn(variants[name]))
    return out


def paired_decode(a, b, prompt: list[int], n: int, label: str) -> str:
    """Decode b1 speed of a over b from n back-to-back pairs of generations (order alternating), the finest
    pairing a drifting shared host allows: median ratio, bootstrap 95% interval, how often a was faster."""
    for _ in range(2):
        a.generate([prompt]), b.generate([prompt])
    ratios = []
    for i in range(n):
        first, second = (a, b) if i % 2 else (b, a)
        r = {id(first): first.generate([prompt]), id(second): second.generate([prompt])}
        (wa, ta), (wb, tb) = r[id(a)], r[id(b)]
        ratios.append((wb - tb) / (wa - ta))
    rng = np.random.default_rng(0)
    boot = sorted(float(np.median(rng.choice(ratios, len(ratios)))) for _ in range(2000))
    return (
        f"decode b1 {label}, {n} alternating pairs: median {statistics.median(ratios):.3f}x "
        f"(95% CI {boot[50]:.3f}-{boot[1949]:.3f}; faster in {sum(x > 1 for x in ratios)}/{n})"
    )


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each generation row")
    ap.add_argument("--steps", type=int, default=30, help="interleaved decode steps per engine")
    ap.add_argument(
        "--pairs", type=int, default=30, help="alternating precast/genai b1 generations per precision"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/precast-bench-llm")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    return ap.parse_args()


def make_engines(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    paths = build(work, not args.no_int4)
    engines: dict = {}
    for name, path in paths.items():
        if name.startswith("precast"):
            engines[name] = Precast(path, args.threads)
        elif name.startswith("genai"):
            engines[name] = Genai(path, args.threads)
    if not args.no_hf:
        engines["hf-fp32"] = HF(paths["folder"], args.threads)
    return engines


def measure(engines: dict, args: argparse.Namespace) -> dict:
    """Every row's raw measurements, interleaved across engines, plus the host's state around them."""
    from precast.runtime.hugepages import huge_page_bytes

    m = {"huge": huge_page_bytes()}  # precast's engines load first: their weights (runtime/hugepages.py)
    m["bw"], m["load0"] = copy_bandwidth(), os.getloadavg()
    for e in engines.values():  # warm-up
        e.step()
        e.generate([list(range(5, 5 + PROMPT))][:1]) if not isinstance(e, HF) else None
    m["steps"] = interleave(engines, lambda e: timed(e.step), args.steps)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 500, PROMPT).tolist() for _ in range(BATCH)]

    # Steady state: in each round an engine runs one unmeasured generation (caches warm for it, whichever
    # engine ran before) then three measured ones; the round's value is their median decode rate.
    def steady(e):
        e.generate(prompts[:1])
        runs = sorted((e.generate(prompts[:1]) for _ in range(3)), key=lambda wt: wt[0] - wt[1])
        return runs[1]

    m["gen1"] = interleave(engines, steady, args.rounds)
    m["pairs"] = {}
    for prec in ("fp32", "int4"):
        a, b = engines.get(f"precast-{prec}"), engines.get(f"genai-{prec}")
        if a and b and args.pairs:
            m["pairs"][prec] = paired_decode(a, b, prompts[0], args.pairs, f"precast-{prec} / genai-{prec}")
    m["gen8"] = interleave(engines, lambda e: e.generate(prompts), args.rounds)
    m["copy"] = None
    if "precast-fp32" in engines:
        from bench_llm_engine import copy_vs_step

        from precast.runtime.llm import SamplingParams

        m["copy"] = copy_vs_step(
            engines["precast-fp32"].engine, prompts, SamplingParams(max_tokens=10_000, ignore_eos=True)
        )
    m["load1"] = os.getloadavg()
    return m


def print_table(engines: dict, m: dict, args: argparse.Namespace) -> None:
    steps, gen1, gen8, bw = m["steps"], m["gen1"], m["gen8"], m["bw"]
    base = "genai-fp32" if "genai-fp32" in engines else "precast-fp32"
    base_step = statistics.median(steps[base])
    print(
        f"\nLlama-style decoder: hidden 512, 8 layers, 8/4 heads, vocab 32000; {args.threads} threads; "
        f"prompt {PROMPT} + {NEW} new; {args.steps} steps / {args.rounds} rounds interleaved"
    )
    print(
        f"load average {m['load0'][0]:.1f} at start, {m['load1'][0]:.1f} at end (2 cores); "
        f"copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    print(
        f"precast weights on transparent huge pages: {m['huge'] / 2**20:.0f} MB (genai and HF load theirs as usual)"
    )
    hdr = (
        f"{'engine':<14} {'weights MB':>10} {'step b1 ms':>10} {'vs ' + base:>16} {'TTFT b1 ms':>10} "
        f"{'decode b1 tok/s':>15} {'of limit':>8} {'b8 tok/s':>9} {'b8 / b1':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, e in engines.items():
        step = statistics.median(steps[name])
        wall1 = statistics.median(w for w, _ in gen1[name])
        ttft1 = statistics.median(t for _, t in gen1[name])
        dec1 = (NEW - 1) / (wall1 - ttft1)
        wall8 = statistics.median(w for w, _ in gen8[name])
        agg8 = BATCH * NEW / wall8
        limit = bw / e.weights
        print(
            f"{name:<14} {e.weights / 1e6:>10.0f} {step * 1e3:>10.2f} {base_step / step:>15.2f}x {ttft1 * 1e3:>10.1f} "
            f"{dec1:>15.1f} {dec1 / limit:>8.2f} {agg8:>9.1f} {agg8 / (NEW / wall1):>6.2f}x"
        )


def print_ratios(m: dict) -> None:
    # Paired ratios: precast over genai within each round (runs minutes apart drift on a shared machine;
    # runs of one round are adjacent in time), median and range over rounds.
    gen1 = m["gen1"]
    for prec in ("fp32", "int4"):
        a, b = gen1.get(f"precast-{prec}"), gen1.get(f"genai-{prec}")
        if a and b:
            ratios = sorted(
                (NEW - 1) / (wa - ta) / ((NEW - 1) / (wb - tb)) for (wa, ta), (wb, tb) in zip(a, b)
            )
            print(
                f"decode b1 precast-{prec} / genai-{prec}, paired by round: median {statistics.median(ratios):.3f}x "
                f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}, {len(ratios)} rounds)"
            )
    for line in m["pairs"].values():
        print(line)
    if m["copy"] is not None:
        step_ms, copy_ms, blocks = m["copy"]
        print(
            f"\npaged gather vs copy-whole-cache: precast-fp32 decode step at batch {BATCH} (past ~{PROMPT}) "
            f"{step_ms:.2f} ms; copying every request's cache contiguous would add {copy_ms:.2f} ms "
            f"({100 * copy_ms / step_ms:.0f}% of the step); KV held {blocks} blocks"
        )
    print(
        "b8 / b1: aggregate tokens/s with 8 requests over batch-1 tokens/s of the same engine (whole generation)"
    )


def main() -> None:
    args = parse_args()
    engines = make_engines(args)
    m = measure(engines, args)
    print_table(engines, m, args)
    print_ratios(m)


if __name__ == "__main__":
    main()
