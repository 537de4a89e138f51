"""Engine counters (monotonic) and gauges, as plain data for the server's Prometheus exporter."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["EngineCounters", "EngineMetrics", "SpecStats"]


@dataclass
class EngineCounters:
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_rejected: int = 0
    requests_failed: int = 0  # finished with finish_reason "error" (e.g. the on_token callback raised)
    prompt_tokens: int = 0  # tokens in
    generation_tokens: int = 0  # tokens out
    computed_tokens: int = 0  # tokens run through the model (prefill + decode + recompute)
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_query_tokens: int = 0  # prompt tokens looked up in it (each admission)
    preemptions: int = 0
    cow_copies: int = 0
    steps: int = 0
    ttft_count: int = 0
    ttft_sum_s: float = 0.0
    ttft_last_s: float = 0.0
    # speculative decoding: draft tokens proposed / kept, and how many verified rows kept 0, 1, 2, ... of them
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_row: list = field(default_factory=list)

    def observe_acceptance(self, kept: int) -> None:
        hist = self.spec_accepted_per_row
        if kept >= len(hist):
            hist.extend([0] * (kept + 1 - len(hist)))
        hist[kept] += 1

    @property
    def spec_verify_rows(self) -> int:
        return sum(self.spec_accepted_per_row)

    def observe_ttft(self, handle) -> None:
        import time

        ttft = time.perf_counter() - handle.t_submit
        self.ttft_count += 1
        self.ttft_sum_s += ttft
        self.ttft_last_s = ttft

    def snapshot(self, **gauges) -> EngineMetrics:
        counters = asdict(self)
        counters["spec_accepted_per_row"] = list(self.spec_accepted_per_row)
        return EngineMetrics(**counters, **gauges)


@dataclass
class EngineMetrics(EngineCounters):
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_touched: int = 0  # blocks ever handed out (the pool's high-water mark)
    kv_bytes_reserved: int = 0  # the runner's KV pools as allocated (address space)
    kv_bytes_resident: int = 0  # the part of them holding memory: the touched blocks
    block_size: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_usage": self.kv_usage}


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding's counters over a span (``of(now, since)``: between two snapshots; without
    ``since``: since the engine started), and what follows from them. A verified row is one request's step
    of 1 + k tokens; it yields its kept drafts plus one token of the target's own."""

    proposed: int  # draft tokens proposed
    accepted: int  # ... and kept
    verified_rows: int
    accepted_per_row: tuple[int, ...]  # [j]: verified rows that kept exactly j drafts

    @classmethod
    def of(cls, now: EngineCounters, since: EngineCounters | None = None) -> SpecStats:
        hist = list(now.spec_accepted_per_row)
        if since is not None:
            for j, n in enumerate(since.spec_accepted_per_row):
                hist[j] -= n
        return cls(
            now.spec_proposed_tokens - (since.spec_proposed_tokens if since is not None else 0),
            now.spec_accepted_tokens - (since.spec_accepted_tokens if since is not None else 0),
            sum(hist),
            tuple(hist),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Kept / proposed draft tokens (None: nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens a verified row yielded on average: 1 + kept drafts per row (None: no row was verified)."""
        return 1 + self.accepted / self.verified_rows if self.verified_rows else None

    def as_dict(self) -> dict:
        return {
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "verified_rows": self.verified_rows,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.tokens_per_step,
            "accepted_per_row": list(self.accepted_per_row),
        }
