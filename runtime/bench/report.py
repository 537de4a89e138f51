"""The typed result of ``precast bench``: one Level per concurrency, plain dataclasses that dump to JSON."""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from precast.runtime.bench.inputs import InputInfo

if TYPE_CHECKING:
    from pathlib import Path

    from precast.runtime.bench import BenchOptions

__all__ = ["BenchReport", "Host", "LLMSettings", "Latency", "Level", "Sample", "level_from_samples"]


@dataclass(frozen=True, slots=True)  # (a short request rate can make millions of them)
class Sample:
    """One finished request: wall-clock start and end (time.perf_counter seconds), and for LLM requests the
    time each output token arrived."""

    start: float
    end: float
    token_times: Sequence[float] | None = None


@dataclass(frozen=True)
class Latency:
    """Percentiles of a set of durations, in milliseconds (numpy's linear interpolation, as benchmarks/)."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency | None:
        if not len(seconds):
            return None
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(
            float(p50), float(p90), float(p99), float(ms.mean()), float(ms.min()), float(ms.max()), len(ms)
        )


@dataclass(frozen=True)
class Level:
    """What ``concurrency`` clients issuing requests back to back measured."""

    concurrency: int
    requests: int  # finished without error, in the measured window
    errors: int
    wall_s: float  # first request sent -> last one finished
    requests_per_s: float
    items_per_s: float  # requests/s x items per request (the batch dim)
    latency: Latency | None  # whole request, send -> last byte (LLM: last token)
    first_error: str | None = None
    # LLM artifacts only
    output_tokens: int | None = None
    tokens_per_s: float | None = None  # every output token of the window / wall (prefill included)
    request_tokens_per_s: float | None = None  # median per request: (tokens - 1) / (last token - first token)
    ttft: Latency | None = None  # time to first token
    itl: Latency | None = None  # inter-token latency: gaps between a request's consecutive tokens
    # speculative decoding (in-process LLM bench with --draft / --speculative), over the measured window
    spec_proposed_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_acceptance_rate: float | None = None  # accepted / proposed (None: nothing proposed)
    spec_tokens_per_step: float | None = None  # 1 + accepted drafts per verified row (None: none verified)


@dataclass(frozen=True)
class Host:
    cpus: int
    machine: str
    system: str
    load_start: float  # 1-minute load average before the first level
    load_end: float

    @classmethod
    def now(cls) -> Host:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        return cls(os.cpu_count() or 1, platform.machine(), platform.system(), load, load)


@dataclass(frozen=True)
class LLMSettings:
    prompt_len: int
    output_len: int
    shared_prefix: bool
    vocab: int
    max_context: int
    num_blocks: int | None = None  # in-process: the KV pool the engine was given
    block_size: int | None = None
    prefix_hit_tokens: int | None = None  # prompt tokens the prefix cache served (in-process)
    preemptions: int | None = None
    speculative: str | None = None  # speculative decoding's method ("draft" | "ngram"), None: off
    num_speculative_tokens: int | None = None
    draft: str | None = None


@dataclass(frozen=True)
class BenchReport:
    artifact: str
    kind: str  # "model" | "llm"
    mode: str  # "in-process" | "http"
    target: str
    threads: str  # intra-op threads, in words ("2", "artifact setting: 0 = ORT default, 2 CPUs", "server's")
    host: Host
    duration_s: float | None
    requests: int | None  # per level, when given instead of a duration
    warmup_s: float
    levels: list[Level] = field(default_factory=list)
    url: str | None = None
    endpoint: str | None = None  # "v2" | "embeddings" | "completions" (http mode)
    model_name: str | None = None
    dims: dict[str, int] = field(default_factory=dict)
    defaulted_dims: list[str] = field(default_factory=list)
    inputs: list[InputInfo] = field(default_factory=list)
    items_per_request: int = 1
    llm: LLMSettings | None = None

    @classmethod
    def of_run(
        cls, options: BenchOptions, root: Path, url: str | None, host: Host, levels: list[Level], **fields
    ) -> BenchReport:
        """A report with the fields every kind of bench fills the same way: the artifact, the run's window
        (duration, requests, warm-up) from its options, and its mode from ``url``."""
        return cls(
            artifact=str(root),
            mode="http" if url else "in-process",
            host=host,
            duration_s=options.duration_s,
            requests=options.requests,
            warmup_s=options.warmup_s,
            levels=levels,
            url=url,
            **fields,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def level_from_samples(
    concurrency: int,
    samples: Sequence[Sample],
    errors: int,
    first_error: str | None,
    t0: float,
    items_per_request: int = 1,
) -> Level:
    """Aggregate one level's samples; ``t0`` is when its first request was sent."""
    wall = max((s.end for s in samples), default=t0) - t0
    n = len(samples)
    rps = n / wall if wall > 0 else 0.0
    latency = Latency.of([s.end - s.start for s in samples])
    # (positional: the order of Level's fields)
    level = Level(concurrency, n, errors, wall, rps, rps * items_per_request, latency, first_error)
    if not samples or samples[0].token_times is None:
        return level
    ttft, itl, rates, out = [], [], [], 0
    for s in samples:
        times = s.token_times or ()
        out += len(times)
        if times:
            ttft.append(times[0] - s.start)
            itl.extend(np.diff(times).tolist())
        if len(times) > 1 and times[-1] > times[0]:
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return replace(
        level,
        output_tokens=out,
        tokens_per_s=out / wall if wall > 0 else 0.0,
        request_tokens_per_s=float(np.median(rates)) if rates else None,
        ttft=Latency.of(ttft),
        itl=Latency.of(itl),
    )
