"""``precast bench`` for causal-lm artifacts: TTFT, inter-token latency and tokens/s per concurrency.

In process, one thread drives the engine (as ``run_until_done`` does, and as benchmarks/bench_llm.py times
it): N requests are kept in flight, a finished one replaced by a fresh one in the same step loop, so the N
clients are closed loops without any thread of their own in the way. Each request is ``prompt_len`` random
token ids (a new draw per request: no prefix-cache hits, unless ``shared_prefix``) and asks for exactly
``output_len`` tokens (``ignore_eos``, token ids only: no detokenization, as bench_llm.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from precast.artifact.manifest import Manifest
from precast.errors import UsageError
from precast.runtime.bench.report import (
    BenchReport,
    Host,
    Level,
    LLMSettings,
    Sample,
    level_from_samples,
)
from precast.runtime.llm.metrics import SpecStats

__all__ = ["PromptSource", "bench_llm", "drive_engine"]


class PromptSource:
    """Prompts of ``length`` token ids in [0, vocab): each call a new draw (numbered, so warm-up and measured
    requests never repeat one another), or always the same one with ``shared``. Thread-safe."""

    def __init__(self, vocab: int, length: int, shared: bool, seed: int = 0):
        self.vocab, self.length, self.shared, self.seed = vocab, length, shared, seed
        self._next = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> list[int]:
        if self.shared:
            index = 0
        else:
            with self._lock:
                index = next(self._next)
        return np.random.default_rng((self.seed, index)).integers(0, self.vocab, self.length).tolist()


def drive_engine(
    engine,
    clients: int,
    prompts: Callable[[], list[int]],
    params,
    *,
    duration_s: float | None,
    requests: int | None,
) -> tuple[list[Sample], int, str | None, float]:
    """Keep ``clients`` requests in flight until ``duration_s`` passed (no new request after it; the ones in
    flight finish) or ``requests`` were sent. Returns (samples, errors, first error, start time)."""
    samples: list[Sample] = []
    errors, first = 0, None
    sent = 0
    t0 = time.perf_counter()
    deadline = t0 + (duration_s or 0.0)

    def more() -> bool:
        return sent < requests if requests is not None else time.perf_counter() < deadline

    def submit():
        nonlocal sent
        times: list[float] = []
        handle = engine.submit(prompts(), params, on_token=lambda _ev: times.append(time.perf_counter()))
        sent += 1
        return handle, times

    live = [submit() for _ in range(clients if requests is None else min(clients, requests))]
    while live:
        engine.step()
        still = []
        for handle, times in live:
            if not handle.finished:
                still.append((handle, times))
                continue
            if handle.error is not None or handle.finish_reason in ("error", "cancelled"):
                errors += 1
                first = first or f"request failed: {handle.error or handle.finish_reason}"
            else:
                samples.append(Sample(handle.t_submit, times[-1] if times else time.perf_counter(), times))
            if more():
                still.append(submit())
        live = still
    return samples, errors, first, t0


def bench_llm(root: Path, manifest: Manifest, options, url: str | None, say) -> BenchReport:
    from precast.runtime.llm.runners.gather import LLMSpec

    spec = LLMSpec.from_manifest(manifest, str(root))
    _check_options(spec, options)
    host = Host.now()
    prompts = PromptSource(spec.vocab, options.prompt_len, options.shared_prefix, options.seed)
    target = manifest.target.name
    settings = LLMSettings(
        prompt_len=options.prompt_len,
        output_len=options.output_len,
        shared_prefix=options.shared_prefix,
        vocab=spec.vocab,
        max_context=spec.max_context,
    )
    if url is not None:
        levels, model_name = _http_levels(url, prompts, options, say)
        threads = "the server's"
    else:
        levels, threads, settings = _engine_levels(root, manifest, spec, prompts, options, settings, say)
        model_name = None
    return BenchReport.of_run(
        options,
        root,
        url,
        host,
        levels,
        kind="llm",
        target=target,
        threads=threads,
        endpoint="completions" if url else None,
        model_name=model_name,
        llm=settings,
    )


def _check_options(spec, options) -> None:
    """UsageError for the options a causal-lm artifact cannot take, before anything is loaded."""
    p, o = options.prompt_len, options.output_len
    if p + o > spec.max_context:
        raise UsageError(
            f"--prompt-len {p} + --output-len {o} = {p + o} tokens; the model's context is {spec.max_context}"
        )
    if options.prefer is not None:
        raise UsageError("--prefer picks a target of a multi-target artifact; a causal-lm artifact has one")
    if options.endpoint not in ("auto", "completions"):
        raise UsageError(f"a causal-lm artifact is served on /v1/completions, not '{options.endpoint}'")


def _window(options) -> str:
    return f"{options.duration_s:g} s" if options.requests is None else f"{options.requests} requests"


def _http_levels(url: str, prompts: PromptSource, options, say) -> tuple[list[Level], str]:
    """Each level against a running server's streamed /v1/completions; the levels and the model's name."""
    from precast.runtime.bench import _checked_level, closed_loop
    from precast.runtime.bench.http import HttpClients, completion_clients

    levels: list[Level] = []
    with HttpClients(url, options.timeout_s) as http:
        model_name, make_client = completion_clients(http, prompts, options)
        say(f"{url} serving '{model_name}', streamed /v1/completions")
        for c in options.concurrency:
            if options.warmup_s > 0:
                closed_loop([make_client(i) for i in range(c)], duration_s=options.warmup_s, requests=None)
            say(f"concurrency {c}: {_window(options)}")
            samples, errors, first, t0 = closed_loop(
                [make_client(i) for i in range(c)], duration_s=options.duration_s, requests=options.requests
            )
            levels.append(_checked_level(level_from_samples(c, samples, errors, first, t0)))
    return levels, model_name


def _engine_levels(
    root: Path, manifest: Manifest, spec, prompts: PromptSource, options, settings: LLMSettings, say
) -> tuple[list[Level], str, LLMSettings]:
    """Each level on an in-process engine with a KV pool for the largest one; the levels, the threads in
    words, and ``settings`` completed with the pool and what the engine counted."""
    from precast.runtime.bench import _checked_level, _threads_words
    from precast.runtime.llm import Engine, SamplingParams

    p, o = options.prompt_len, options.output_len
    num_blocks = options.num_blocks or max(options.concurrency) * spec.blocks_for(p + o) + 1
    engine = Engine.load(
        root,
        num_blocks=num_blocks,
        threads=options.threads,
        enable_prefix_caching=options.shared_prefix,
        speculative=options.speculative,
    )
    params = SamplingParams(max_tokens=o, ignore_eos=True, detokenize=False)
    threads = _threads_words(manifest, options.threads)
    say(
        f"in-process LLM engine, target {manifest.target.name}, {threads} intra-op threads, {num_blocks} KV blocks"
    )
    levels: list[Level] = []
    try:
        for c in options.concurrency:
            if options.warmup_s > 0:
                drive_engine(engine, c, prompts, params, duration_s=options.warmup_s, requests=None)
            say(f"concurrency {c}: {_window(options)}")
            before = engine.metrics()
            samples, errors, first, t0 = drive_engine(
                engine, c, prompts, params, duration_s=options.duration_s, requests=options.requests
            )
            level = _checked_level(level_from_samples(c, samples, errors, first, t0))
            if options.speculative is not None:
                level = _with_speculation(level, SpecStats.of(engine.metrics(), since=before))
            levels.append(level)
        m = engine.metrics()
    finally:
        engine.close()
    settings = replace(
        settings,
        num_blocks=num_blocks,
        block_size=spec.block_size,
        prefix_hit_tokens=m.prefix_hit_tokens,
        preemptions=m.preemptions,
    )
    if options.speculative is not None:
        s = options.speculative
        settings = replace(settings, speculative=s.method, num_speculative_tokens=s.num_tokens, draft=s.draft)
    return levels, threads, settings


def _with_speculation(level: Level, stats: SpecStats) -> Level:
    """``level`` with what speculative decoding did in its measured window (warm-up excluded)."""
    return replace(
        level,
        spec_proposed_tokens=stats.proposed,
        spec_accepted_tokens=stats.accepted,
        spec_acceptance_rate=stats.acceptance_rate,
        spec_tokens_per_step=stats.tokens_per_step,
    )
