"""One engine of bench_llm.py, loaded once, timed on request: JSON lines in on stdin, JSON lines out.

    python bench_llm_worker.py ENGINE PATH [--threads 2] [--max-requests 32] [--max-len 640] [--force-f32]

ENGINE: precast (an artifact; this interpreter needs precast), genai (a builder folder; onnxruntime-genai),
ov (an optimum-intel export; openvino-genai), llamacpp (a GGUF file; llama-cpp-python). Each runs in the
interpreter that has its package, so no engine's libraries (thread pools, allocators) share a process.
Requests (token ids; greedy; EOS ignored; every engine returns ids, none detokenizes):
    {"op": "b1", "prompt": [ids], "new": N}        -> {"ttft": s, "wall": s, "n": N, "ids": first 32}
    {"op": "batch", "prompts": [[ids]...], "new": N} -> {"wall": s, "n": total new tokens}   (all at once)
    {"op": "rss"}                                   -> {"rss_mb": peak resident MB of the worker}
    {"op": "quit"}
The first line out is {"ready": info} or {"error": one line}; a failed request answers {"error": ...}.
Native libraries' own prints go to stderr (the driver keeps it in a log file), never into the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np


class Precast:
    """precast's LLM engine: continuous batching over its paged KV pool (prefix caching off: fresh prompts)."""

    def __init__(self, path: str, a: argparse.Namespace):
        from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig
        from precast.runtime.llm.speculative import SpeculativeConfig

        block = json.loads((Path(path) / "manifest.json").read_text())["llm"]["block_size"]
        blocks = a.max_requests * -(-a.max_len // block) + 16
        spec = None
        if a.spec:  # speculative decoding (bench_speculative.py): a draft artifact or prompt lookup
            spec = SpeculativeConfig(
                method=a.spec, num_tokens=a.spec_k, draft=a.draft, max_batch=a.spec_max_batch
            )
        self.engine = Engine.load(
            path,
            num_blocks=blocks,
            threads=a.threads,
            config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max(64, a.max_requests)),
            enable_prefix_caching=False,
            spinning={"auto": "auto", "on": True, "off": False}[a.spinning],
            speculative=spec,
        )
        self.params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)
        self.info = f"{blocks} KV blocks of {block}" + (
            f", speculative {a.spec} k={a.spec_k}" if spec else ""
        )

    def _spec(self, before) -> dict:
        """The speculation counters of the last request(s): drafts proposed / kept, verified rows."""
        m = self.engine.metrics()
        rows = sum(m.spec_accepted_per_row) - before[2]
        return {
            "proposed": m.spec_proposed_tokens - before[0],
            "accepted": m.spec_accepted_tokens - before[1],
            "rows": rows,
            "steps": m.steps - before[3],
        }

    def _counters(self) -> tuple:
        m = self.engine.metrics()
        return (m.spec_proposed_tokens, m.spec_accepted_tokens, sum(m.spec_accepted_per_row), m.steps)

    def b1(
        self, prompt: list[int], new: int, all_ids: bool = False, temperature: float = 0.0, seed=None
    ) -> dict:
        before = self._counters()
        params = self.params(new)
        if temperature:  # (a sampled request: bench_speculative.py's non-repeating workload)
            import dataclasses

            params = dataclasses.replace(params, temperature=temperature, seed=seed)
        t0 = time.perf_counter()
        h = self.engine.submit(prompt, params)
        self.engine.run_until_done()
        wall = time.perf_counter() - t0
        ids = list(h.result().token_ids)
        self._log_spin("b1")
        return {
            "ttft": h.ttft_s,
            "wall": wall,
            "n": len(ids),
            "ids": ids if all_ids else ids[:32],
            **self._spec(before),
        }

    def _log_spin(self, what: str) -> None:
        sw = getattr(self.engine.runner, "spin_switch", None)
        if sw is None:
            return
        if not hasattr(self, "_readings"):  # (into the worker's log: the switch's readings of each request)
            self._readings, decide = [], sw._decide
            sw._decide = lambda w, *now: (decide(w, *now), self._readings.append((w, sw.spinning_now)))
        shown = ", ".join(
            f"{'-' if w is None else f'{w:.3f}'}{'s' if on else 'c'}" for w, on in self._readings
        )
        print(
            f"{what}: spinning {sw.spinning_now}, switches {sw.switches}, readings {shown}",
            file=sys.stderr,
            flush=True,
        )
        self._readings.clear()

    def batch(self, prompts: list[list[int]], new: int, all_ids: bool = False) -> dict:
        before = self._counters()
        t0 = time.perf_counter()
        handles = [self.engine.submit(p, self.params(new)) for p in prompts]
        self.engine.run_until_done()
        wall = time.perf_counter() - t0
        out = {"wall": wall, "n": sum(len(h.result().token_ids) for h in handles), **self._spec(before)}
        if all_ids:
            out["ids"] = [list(h.result().token_ids) for h in handles]
        return out


class Genai:
    """onnxruntime-genai: batch 1 only (on CPU its batching is static batches of equal length, no paging)."""

    def __init__(self, path: str, a: argparse.Namespace):
        import onnxruntime_genai as og

        cfg_file = Path(path) / "genai_config.json"
        cfg = json.loads(cfg_file.read_text())
        opts = cfg["model"]["decoder"]["session_options"]
        if opts.get("intra_op_num_threads") != a.threads or opts.get("inter_op_num_threads") != 1:
            opts.update(intra_op_num_threads=a.threads, inter_op_num_threads=1)
            cfg_file.write_text(json.dumps(cfg, indent=4))
        self.og, self.model = og, og.Model(path)
        self.info = f"onnxruntime-genai {og.__version__}"

    def b1(self, prompt: list[int], new: int) -> dict:
        og = self.og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + new, do_sample=False, batch_size=1)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.array([prompt], dtype=np.int32))
        ttft = time.perf_counter() - t0  # append_tokens runs the prompt; its logits give the first token
        n = 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
        wall = time.perf_counter() - t0
        ids = [int(t) for t in gen.get_sequence(0)[len(prompt) :]]
        return {"ttft": ttft, "wall": wall, "n": n, "ids": ids[:32]}


class OpenVINO:
    """OpenVINO GenAI: LLMPipeline for batch 1, ContinuousBatchingPipeline (paged, its own scheduler) for
    concurrent requests. --force-f32 forces f32 inference precision and an f32 KV cache; else its defaults (bf16
    compute where the CPU has it; the KV precision optimum wrote into the IR's runtime_options: f16 for its
    fp32 export, none (the CPU's u8) for INT4). Prefix caching off on both (the bench sends fresh prompts anyway)."""

    def __init__(self, path: str, a: argparse.Namespace):
        import openvino as ov
        import openvino_genai as ovg

        self.ov, self.ovg, self.path = ov, ovg, path
        self.props: dict = {"INFERENCE_NUM_THREADS": a.threads}
        if a.force_f32:
            self.props.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
        sc = ovg.SchedulerConfig()
        sc.enable_prefix_caching = False
        extra: dict = {}
        self.spec_k = 0
        if a.spec == "draft":  # speculative decoding with a draft model (its own optimum export)
            extra["draft_model"] = ovg.draft_model(a.draft, "CPU", **self.props)
            self.spec_k = a.spec_k
        elif a.spec == "ngram":
            extra["prompt_lookup"] = True
            self.spec_k = a.spec_k
        self._ngram = a.spec == "ngram"
        self.pipe = ovg.LLMPipeline(path, "CPU", scheduler_config=sc, **extra, **self.props)
        self._cb = None
        spec = f", speculative {a.spec} k={a.spec_k}" if a.spec else ""
        self.info = f"openvino-genai {ovg.__version__}, properties {self.props}{spec}"

    def _config(self, new: int):
        cfg = self.ovg.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = new
        cfg.ignore_eos, cfg.do_sample = True, False
        if self.spec_k:
            cfg.num_assistant_tokens = self.spec_k
            if self._ngram:
                cfg.max_ngram_size = 3
        return cfg

    def _ids(self, prompt: list[int]):
        return self.ov.Tensor(np.array([prompt], dtype=np.int64))

    def b1(self, prompt: list[int], new: int, all_ids: bool = False) -> dict:
        t0 = time.perf_counter()
        res = self.pipe.generate(self._ids(prompt), self._config(new))
        wall = time.perf_counter() - t0
        ttft = res.perf_metrics.get_ttft().mean / 1e3
        ids = [int(t) for t in res.tokens[0]]
        return {"ttft": ttft, "wall": wall, "n": len(ids), "ids": ids if all_ids else ids[:32]}

    def batch(self, prompts: list[list[int]], new: int) -> dict:
        if self._cb is None:
            sc = self.ovg.SchedulerConfig()  # cache_size 0: KV blocks allocated on demand
            sc.enable_prefix_caching, sc.max_num_batched_tokens = False, 512
            sc.max_num_seqs, sc.dynamic_split_fuse = 256, True
            self._cb = self.ovg.ContinuousBatchingPipeline(self.path, sc, "CPU", self.props)
        cfg = self._config(new)
        t0 = time.perf_counter()
        res = self._cb.generate([self._ids(p) for p in prompts], [cfg] * len(prompts))
        wall = time.perf_counter() - t0
        return {"wall": wall, "n": sum(len(r.m_generation_ids[0]) for r in res)}


def make(engine: str, path: str, a: argparse.Namespace):
    if engine == "llamacpp":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_llm_llamacpp import LlamaCpp

        return LlamaCpp(path, a)
    return {"precast": Precast, "genai": Genai, "ov": OpenVINO}[engine](path, a)


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux carries that across exec,
    so every worker would report the driver's peak (it compiled the models with torch) instead of its own."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def serve(engine, out) -> None:
    def say(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"ready": engine.info})
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        if op == "quit":
            return
        if op == "rss":  # peak resident memory of this process: weights, KV cache, compiled kernels
            say({"rss_mb": peak_rss_mb()})
            continue
        fn = getattr(engine, op, None)
        if fn is None:
            say({"error": f"{type(engine).__name__} has no '{op}' row"})
            continue
        try:
            say(fn(**req))
        except Exception as e:  # noqa: BLE001 - one failed request is a row's note, not the bench's end
            say({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=("precast", "genai", "ov", "llamacpp"))
    ap.add_argument("path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-requests", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=640, help="longest prompt + new tokens of one request")
    ap.add_argument(
        "--force-f32", action="store_true", help="f32 compute and KV cache (OpenVINO, llama.cpp: f32 KV)"
    )
    ap.add_argument("--spec", choices=("draft", "ngram"), help="speculative decoding (precast, ov)")
    ap.add_argument("--draft", help="the draft model (a precast artifact, or an optimum export for ov)")
    ap.add_argument("--spec-k", type=int, default=4, help="draft tokens per step (K)")
    ap.add_argument(
        "--spec-max-batch", type=int, default=None, help="precast: no speculation above this batch"
    )
    ap.add_argument(
        "--spinning",
        choices=("auto", "on", "off"),
        default="auto",
        help="precast: ONNX Runtime's thread spinning (auto: follows the host's load, precast's default)",
    )
    a = ap.parse_args()
    out = os.fdopen(os.dup(1), "w")  # the protocol's stdout; fd 1 itself now goes to stderr
    os.dup2(2, 1)
    try:
        engine = make(a.engine, a.path, a)
    except Exception as e:  # noqa: BLE001 - the driver prints it as the column's skip note
        out.write(
            json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
            + "\n"
        )
        out.flush()
        return
    serve(engine, out)


if __name__ == "__main__":
    main()
