"""Language-model text for the compiler: calibration feeds for the paged step graph, and the accuracy of a
compiled causal-lm artifact against the fp32 step graph on text (top-1 agreement, perplexity delta).

Calibration: ``--calibration text.txt`` is tokenized with the model's own tokenizer and cut into
prefill steps (past_lens 0, S tokens per request, an empty one-block pool). Prefill runs every MatMul
on the same per-token activations as the full-sequence model, which is what GPTQ's Hessians need.

Accuracy: the same sliding-window scorer as ``precast eval --perplexity`` runs the fp32 source graph
and the artifact on the last ``tokens`` tokens of the text; the budget's ``top1`` is the fraction of
scored positions where both predict the same next token, ``ppl_delta`` = ppl(artifact) - ppl(fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import TensorSpec
from precast.errors import InputError, UsageError
from precast.runtime.llm.runners.mapped import MAPPED_STEP_INPUTS, gqa_lengths
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "STEP_INPUTS",
    "TEXT_METRICS_KEY",
    "check_text_budget",
    "is_step_graph",
    "llm_text_metrics",
    "step_calibration_feeds",
    "text_accuracy",
]

STEP_INPUTS = ("input_ids", "positions")
TEXT_METRICS_KEY = "logits@text"  # the budget's name for metrics measured on text (not on the sample step)


def is_step_graph(inputs: Sequence[TensorSpec]) -> bool:
    names = {s.name for s in inputs}
    paged = {"past_lens", "new_lens", "key_cache.0"} <= names  # kv_layout "paged" (in-graph gather)
    mapped = {*MAPPED_STEP_INPUTS, "past_key.0"} <= names  # kv_layout "mapped" (views bound in place)
    return all(n in names for n in STEP_INPUTS) and (paged or mapped)


def _tokenizer(folder) -> object:
    from precast.runtime.llm.tokenizer import TextTokenizer

    path = Path(folder) / "tokenizer.json" if folder is not None else None
    if path is None or not path.is_file():
        raise UsageError("calibration text needs the model's tokenizer.json (compile a Hugging Face folder)")
    return TextTokenizer.from_file(path)


def step_calibration_feeds(
    text: str,
    tokenizer_dir,
    inputs: Sequence[TensorSpec],
    seq: int = 128,
    batch: int = 1,
    max_batches: int = 16,
) -> list[dict[str, np.ndarray]]:
    """Prefill feeds of ``batch`` x ``seq`` tokens from ``text`` (up to ``max_batches`` of them).

    One request per feed by default: graphs with fused attention take S > 1 for one request at a time.
    """
    by_name = {s.name: s for s in inputs}
    ids = np.asarray(_tokenizer(tokenizer_dir).encode(text), dtype=np.int64)
    seq = max(2, min(seq, len(ids)))
    rows = len(ids) // seq
    if rows < 1:
        raise InputError(f"calibration text is too short: {len(ids)} tokens")
    rows = min(rows, batch * max_batches)
    chunks = ids[: rows * seq].reshape(rows, seq)
    mapped = "past_key.0" in by_name  # kv_layout "mapped": per-request views [B, KV, C, D]
    prefixes = ("past_key.", "past_value.") if mapped else ("key_cache.", "value_cache.")
    kv_names = sorted((n for n in by_name if n.startswith(prefixes)), key=str)
    for name in kv_names:
        shape = by_name[name].shape or ()
        fixed = (shape[1], shape[3]) if mapped and len(shape) == 4 else tuple(shape[1:])
        if len(shape) != 4 or not all(isinstance(d, int) for d in fixed):
            raise InputError(
                f"step graph input '{name}' has shape {shape}; expected "
                + ("[B, KV, C, D]" if mapped else "[num_blocks, KV, block, D]")
            )
    # Each request's table covers its tokens, as the engine's would (fused attention checks it).
    maxb = 0 if mapped else -(-seq // int(by_name[kv_names[0]].shape[2]))
    feeds = []
    for g in range(0, rows, batch):
        x = chunks[g : g + batch]
        b = x.shape[0]
        f = {"input_ids": x, "positions": np.broadcast_to(np.arange(seq, dtype=np.int64), x.shape).copy()}
        past, new = np.zeros(b, np.int64), np.full(b, seq, np.int64)
        if mapped:
            f.update(gqa_lengths(past, new, seq))
        else:
            f.update(
                past_lens=past,
                new_lens=new,
                block_tables=np.arange(b * maxb, dtype=np.int64).reshape(b, maxb),
            )
        for name in kv_names:
            shape = by_name[name].shape
            kv_shape = (b, shape[1], seq, shape[3]) if mapped else (b * maxb, *shape[1:])
            f[name] = np.zeros(kv_shape, np.float32)
        feeds.append(f)
    return feeds


def text_accuracy(
    source,
    artifact_dir: Path,
    text: str,
    tokens: int = 1024,
    window: int = 128,
    batch: int = 8,
    progress: ProgressReporter = SILENT,
) -> dict[str, float]:
    """top1 agreement and perplexity delta of the artifact vs the fp32 source graph on the end of ``text``."""
    import onnx_ir as ir
    import onnxruntime as ort

    from precast.artifact.manifest import read_manifest
    from precast.runtime.backends.ort_session import OrtSession
    from precast.runtime.llm.perplexity import make_windows, score_windows
    from precast.runtime.llm.runners.factory import (
        RunnerOptions,
        open_runner,
        runner_on,
    )

    spec = LLMSpec.from_json(source.info["llm"], source.name)
    tok_file = source.ship_files.get("tokenizer/tokenizer.json")
    ids = _tokenizer(Path(tok_file).parent if tok_file else None).encode(text)[-tokens:]
    window = min(window, spec.max_context, len(ids))
    windows = make_windows(len(ids), window, window)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref_session = OrtSession(
        ir.serde.serialize_model(source.model).SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    progress.step(f"scoring the fp32 graph on {len(ids)} tokens of the calibration text")
    ref_runner = runner_on(ref_session, spec, min(batch, len(windows)) * spec.blocks_for(window))
    ref = score_windows(ref_runner, ids, windows, batch, progress=progress)
    progress.step(f"scoring the artifact on {len(ids)} tokens of the calibration text")
    manifest = read_manifest(artifact_dir)  # (checked as the compile wrote it: no second sha256 pass)
    own = manifest.llm or spec  # (an OpenVINO step graph has its own contract: its block size, its pool)
    nb = min(batch, len(windows)) * own.blocks_for(window)
    # (spinning: ONNX Runtime's default, as a loaded Model runs; one session, no spin switch)
    runner = open_runner(artifact_dir, manifest, nb, RunnerOptions(spinning=True))
    try:
        got = score_windows(runner, ids, windows, batch, progress=progress)
    finally:
        runner.close()
        ref_runner.close()
    ppl_ref, ppl = float(np.exp(-ref.logprobs.mean())), float(np.exp(-got.logprobs.mean()))
    return {
        "top1": round(float(np.mean(ref.argmax == got.argmax)), 6),
        "ppl_delta": round(ppl - ppl_ref, 6),
        "ppl": round(ppl, 6),
        "ppl_reference": round(ppl_ref, 6),
        "tokens": int(ref.logprobs.size),
    }


def check_text_budget(bounds, text: str | None) -> None:
    """A causal-lm budget naming top1 or ppl_delta without text to measure them on: UsageError."""
    wanted = sorted({b.metric for b in bounds or ()} & {"top1", "ppl_delta"})
    if wanted and not text:
        raise UsageError(
            f"accuracy budget {', '.join(wanted)} of a causal-lm compile is measured on text: pass --calibration FILE.txt"
        )


def llm_text_metrics(
    source, artifact_dir: Path, bounds, text: str | None, progress: ProgressReporter = SILENT
) -> dict | None:
    """The compile driver's hook: {TEXT_METRICS_KEY: metrics} when there is text, else None.

    A budget that names top1 or ppl_delta on a causal-lm compile without text is a usage error: the
    bound could not be checked, and an unchecked bound must not pass silently.
    """
    check_text_budget(bounds, text)
    if not text:
        return None
    progress.note("measuring top-1 agreement and perplexity delta against the fp32 graph on calibration text")
    return {TEXT_METRICS_KEY: text_accuracy(source, Path(artifact_dir), text, progress=progress)}
