"""How fast a compiled causal-lm target serves on the compiling host: what a multi-target compile orders by.

A causal LM compiled for several CPU backends (ort-cpu and openvino: the same engine above two step graphs)
is measured per target right after it verifies, through the runtime's own Engine: one request's decode rate
and the aggregate rates of 8 and of 32 requests, fresh prompts, the prefix cache off. The backends lead at
different loads (issue 43: ONNX Runtime at batch 1, OpenVINO at 32 requests), so the loaders rank by the rate
nearest the load they will run (runtime/hal.py's ``rate_at``): ``precast generate`` by the batch-1 rate,
``precast serve`` and ``Engine.load(config=...)`` by ``--max-num-seqs``. The index's ``fallback_order`` (the
geometric mean of the b1 and 8-request rates) is the order for a caller that says no load; ``--prefer``
overrides both. A fourth figure, one request's prompt read in steps of 8 tokens (the rows of a speculative
verify step), ranks them for a speculating engine at batch 1: ONNX Runtime's INT4 MatMul costs more with
every row, OpenVINO's reads its weights once for all 8 (issue 43). Each target's parity block keeps its
numbers (``speed``). It is this host's measurement: a deployment host unlike it may rank them otherwise
(``precast bench`` says).
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import numpy as np

__all__ = ["llm_speed", "speed_score"]

NEW_TOKENS = 16
REPS = 3  # each rate: the median of this many runs
BATCH = 8
BATCH_LARGE = 32
VERIFY_ROWS = 8  # a verify step's rows: 7 drafts and the token before them


def llm_speed(path: Path, threads: int | None = None, reps: int = REPS) -> dict[str, float]:
    """{'decode_b1_tok_s', 'batch8_tok_s', 'batch32_tok_s', 'verify8_b1_tok_s'} of the causal-lm artifact at
    ``path`` on this host: each the median of ``reps`` runs. The batch-1 rate is timed between one request's
    own tokens (first to last), not by subtracting a separately measured time to first token: on a tiny model
    that difference was noise, once negative (a rate of 1.6e10 tok/s)."""
    rates = _decode_rates(path, threads, reps)
    verify = _verify_rate(path, threads, reps)
    if verify is not None:
        rates["verify8_b1_tok_s"] = verify
    return rates


def _verify_rate(path: Path, threads: int | None, reps: int) -> float | None:
    """One request's prompt tokens per second, read VERIFY_ROWS tokens a step (the scheduler's token budget):
    a speculative verify step's rows through the layers (its lm head reads them all, a prefill chunk's one),
    at contexts up to the prompt's length. None for a context too short to hold two such steps."""
    from precast.runtime.llm import Engine, SchedulerConfig
    from precast.runtime.llm.sampler import SamplingParams

    config = SchedulerConfig(max_num_batched_tokens=VERIFY_ROWS)
    engine = Engine.load(path, threads=threads, enable_prefix_caching=False, verify=False, config=config)
    try:
        n = min(128, engine.max_context // 2) // VERIFY_ROWS * VERIFY_ROWS
        if n < 2 * VERIFY_ROWS:
            return None
        rng = np.random.default_rng(1)
        one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
        engine.generate([rng.integers(0, engine.vocab, VERIFY_ROWS).tolist()], one)  # warm-up
        rates = []
        for _ in range(reps):
            prompt = rng.integers(0, engine.vocab, n).tolist()
            t0 = time.perf_counter()
            engine.generate([prompt], one)
            rates.append(n / (time.perf_counter() - t0))
    finally:
        engine.close()
    return round(statistics.median(rates), 2)


def _decode_rates(path: Path, threads: int | None, reps: int) -> dict[str, float]:
    from precast.runtime.llm import Engine
    from precast.runtime.llm.sampler import SamplingParams

    engine = Engine.load(path, threads=threads, enable_prefix_caching=False, verify=False)
    try:
        vocab, ctx = engine.vocab, engine.max_context
        prompt_len = max(2, min(64, ctx // 4))
        rng = np.random.default_rng(0)

        def prompts(n: int) -> list[list[int]]:
            return [rng.integers(0, vocab, prompt_len).tolist() for _ in range(n)]

        def params(n: int):
            return SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)

        def decode_rate() -> float | None:
            times: list[float] = []
            handle = engine.submit(
                prompts(1)[0], params(NEW_TOKENS + 1), on_token=lambda _ev: times.append(time.perf_counter())
            )
            handle.result()
            span = times[-1] - times[0] if len(times) > 1 else 0.0
            return (len(times) - 1) / span if span > 0 else None

        def batch_rate(n: int) -> float:
            t0 = time.perf_counter()
            done = engine.generate(prompts(n), params(NEW_TOKENS))
            return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)

        engine.generate(prompts(1), params(2))  # warm-up: first shapes, first allocations
        b1 = [r for r in (decode_rate() for _ in range(reps)) if r is not None]
        rates = {n: statistics.median(batch_rate(n) for _ in range(reps)) for n in (BATCH, BATCH_LARGE)}
    finally:
        engine.close()
    return {
        "decode_b1_tok_s": round(statistics.median(b1), 2) if b1 else 0.0,
        "batch8_tok_s": round(rates[BATCH], 2),
        "batch32_tok_s": round(rates[BATCH_LARGE], 2),
    }


def speed_score(speed: dict[str, float] | None) -> float:
    """One number to rank targets by (higher is faster): the geometric mean of the two rates."""
    if not speed:
        return 0.0
    return math.sqrt(max(speed["decode_b1_tok_s"], 0.0) * max(speed["batch8_tok_s"], 0.0))
