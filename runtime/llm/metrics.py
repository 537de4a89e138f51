"""Engine counters (monotonic) and gauges, as plain data for the server's Prometheus exporter."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["EngineCounters", "EngineMetrics"]


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
