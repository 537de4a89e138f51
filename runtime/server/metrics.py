"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

__all__ = ["METRIC_NAMES", "ServerMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
_TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Every metric this server exports (a test checks it against the registry below). deploy/monitoring's dashboard
# shows each of them and names no other, and each of its queries returns data from a live server
# (tests/deploy/test_monitoring.py).
METRIC_NAMES = [
    "precast_requests_total",
    "precast_request_latency_seconds",
    "precast_queue_wait_seconds",
    "precast_queue_depth",
    "precast_queue_capacity",
    "precast_inflight_requests",
    "precast_batch_size",
    "precast_batch_run_seconds",
    "precast_reloads_total",
    "precast_model_version",
    "precast_llm_time_to_first_token_seconds",
    "precast_llm_time_per_output_token_seconds",
    "precast_llm_tokens_total",
    "precast_llm_requests_running",
    "precast_llm_requests_waiting",
    "precast_llm_kv_blocks_used",
    "precast_llm_kv_blocks_free",
    "precast_llm_kv_bytes_resident",
    "precast_llm_kv_bytes_reserved",
    "precast_llm_preemptions_total",
    "precast_llm_prefix_cache_queries_total",
    "precast_llm_prefix_cache_hits_total",
    "precast_llm_e2e_request_latency_seconds",
    "precast_llm_request_queue_time_seconds",
    "precast_llm_request_prompt_tokens",
    "precast_llm_request_generation_tokens",
]


class ServerMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series: smaller scrapes

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "precast_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "precast_request_latency_seconds",
            "End-to-end request latency",
            ["endpoint"],
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_wait = Histogram(
            "precast_queue_wait_seconds",
            "Time from submit to the start of its batch",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_depth = Gauge("precast_queue_depth", "Requests queued, not yet running", registry=r)
        self.queue_capacity = Gauge(
            "precast_queue_capacity", "Requests the server holds before it answers 429", registry=r
        )
        self.inflight = Gauge("precast_inflight_requests", "HTTP requests being handled", registry=r)
        self.batch_size = Histogram(
            "precast_batch_size", "Rows per model call (dynamic batching)", buckets=_BATCH, registry=r
        )
        self.batch_run = Histogram(
            "precast_batch_run_seconds", "Model call time per batch", buckets=_LATENCY, registry=r
        )
        self.reloads = Counter("precast_reloads", "Hot reloads by result", ["result"], registry=r)
        self.model_version = Gauge(
            "precast_model_version", "Version number of the model being served", registry=r
        )
        self.ttft = Histogram(
            "precast_llm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "precast_llm_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Counter("precast_llm_tokens", "Tokens processed", ["kind"], registry=r)
        self.llm_running = Gauge(
            "precast_llm_requests_running", "LLM requests in the running batch", registry=r
        )
        self.llm_waiting = Gauge("precast_llm_requests_waiting", "LLM requests waiting", registry=r)
        self.kv_used = Gauge("precast_llm_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge("precast_llm_kv_blocks_free", "KV cache blocks free", registry=r)
        self.kv_resident = Gauge(
            "precast_llm_kv_bytes_resident",
            "KV cache bytes holding memory (blocks ever handed out; the pool grows on demand)",
            registry=r,
        )
        self.kv_reserved = Gauge(
            "precast_llm_kv_bytes_reserved",
            "KV cache bytes reserved (address space of the whole pool)",
            registry=r,
        )
        self.preemptions = Counter(
            "precast_llm_preemptions", "Requests preempted because the KV cache ran out of blocks", registry=r
        )
        self.prefix_queries = Counter(
            "precast_llm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "precast_llm_prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.llm_e2e = Histogram(
            "precast_llm_e2e_request_latency_seconds",
            "LLM request latency, arrival to last token",
            buckets=_E2E,
            registry=r,
        )
        self.llm_queue_time = Histogram(
            "precast_llm_request_queue_time_seconds",
            "LLM request time from arrival to its first scheduling",
            buckets=_LATENCY,
            registry=r,
        )
        self.llm_prompt_tokens = Histogram(
            "precast_llm_request_prompt_tokens", "Prompt tokens per LLM request", buckets=_TOKENS, registry=r
        )
        self.llm_generation_tokens = Histogram(
            "precast_llm_request_generation_tokens",
            "Generated tokens per LLM request",
            buckets=_TOKENS,
            registry=r,
        )

    def on_batch(self, rows: int, waits: list[float], seconds: float) -> None:
        self.batch_size.observe(rows)
        for w in waits:
            self.queue_wait.observe(w)
        self.batch_run.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
