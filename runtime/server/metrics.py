"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

__all__ = ["METRIC_NAMES", "SEQ2SEQ_METRIC_NAMES", "ServerMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
_TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_KEPT = tuple(range(17))  # draft tokens one verified row keeps: 0 .. runtime.llm.speculative.MAX_SPEC_TOKENS

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
    "precast_llm_spec_proposed_tokens_total",
    "precast_llm_spec_accepted_tokens_total",
    "precast_llm_spec_accepted_tokens_per_step",
]

# Registered only by a server of a seq2seq (encoder-decoder) artifact (``ServerMetrics.seq2seq_gauges``), so not
# in METRIC_NAMES: the dashboard does not show them yet. Its decoder KV blocks are precast_llm_kv_blocks_*, its
# requests precast_requests_total and precast_llm_{tokens,request_*,e2e_*}.
SEQ2SEQ_METRIC_NAMES = ["precast_seq2seq_cross_attention_bytes"]


class _Maker:
    """Metric constructors bound to one registry, so that each metric below is declared on one line."""

    def __init__(self, registry) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry
        self.types = Counter, Gauge, Histogram

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return self.types[0](name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str):
        return self.types[1](name, doc, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple, labels: tuple[str, ...] = ()):
        return self.types[2](name, doc, labels, buckets=buckets, registry=self.registry)


class ServerMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, disable_created_metrics

        disable_created_metrics()  # no *_created series: smaller scrapes

        self.registry = CollectorRegistry()
        m = _Maker(self.registry)
        self._maker = m
        self._cross_bytes = None
        self._request_metrics(m)
        self._llm_metrics(m)

    def _request_metrics(self, m: _Maker) -> None:
        """HTTP requests, the queue, dynamic batching, reloads: every server has these."""
        self.requests = m.counter(
            "precast_requests", "HTTP requests by endpoint and status code", ("endpoint", "status")
        )
        self.latency = m.histogram(
            "precast_request_latency_seconds", "End-to-end request latency", _LATENCY, ("endpoint",)
        )
        self.queue_wait = m.histogram(
            "precast_queue_wait_seconds", "Time from submit to the start of its batch", _LATENCY
        )
        self.queue_depth = m.gauge("precast_queue_depth", "Requests queued, not yet running")
        self.queue_capacity = m.gauge(
            "precast_queue_capacity", "Requests the server holds before it answers 429"
        )
        self.inflight = m.gauge("precast_inflight_requests", "HTTP requests being handled")
        self.batch_size = m.histogram("precast_batch_size", "Rows per model call (dynamic batching)", _BATCH)
        self.batch_run = m.histogram("precast_batch_run_seconds", "Model call time per batch", _LATENCY)
        self.reloads = m.counter("precast_reloads", "Hot reloads by result", ("result",))
        self.model_version = m.gauge("precast_model_version", "Version number of the model being served")

    def _llm_metrics(self, m: _Maker) -> None:
        """The LLM engine's: token timing, scheduling, the KV cache, the prefix cache, per-request sizes."""
        self.ttft = m.histogram("precast_llm_time_to_first_token_seconds", "Time to first token", _LATENCY)
        self.tpot = m.histogram(
            "precast_llm_time_per_output_token_seconds", "Time per output token after the first", _LATENCY
        )
        self.tokens = m.counter("precast_llm_tokens", "Tokens processed", ("kind",))
        self.llm_running = m.gauge("precast_llm_requests_running", "LLM requests in the running batch")
        self.llm_waiting = m.gauge("precast_llm_requests_waiting", "LLM requests waiting")
        self.kv_used = m.gauge("precast_llm_kv_blocks_used", "KV cache blocks in use")
        self.kv_free = m.gauge("precast_llm_kv_blocks_free", "KV cache blocks free")
        self.kv_resident = m.gauge(
            "precast_llm_kv_bytes_resident",
            "KV cache bytes holding memory (blocks ever handed out; the pool grows on demand)",
        )
        self.kv_reserved = m.gauge(
            "precast_llm_kv_bytes_reserved", "KV cache bytes reserved (address space of the whole pool)"
        )
        self.preemptions = m.counter(
            "precast_llm_preemptions", "Requests preempted because the KV cache ran out of blocks"
        )
        self.prefix_queries = m.counter(
            "precast_llm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = m.counter(
            "precast_llm_prefix_cache_hits", "Prompt tokens served from the prefix cache"
        )
        self.llm_e2e = m.histogram(
            "precast_llm_e2e_request_latency_seconds", "LLM request latency, arrival to last token", _E2E
        )
        self.llm_queue_time = m.histogram(
            "precast_llm_request_queue_time_seconds",
            "LLM request time from arrival to its first scheduling",
            _LATENCY,
        )
        self.llm_prompt_tokens = m.histogram(
            "precast_llm_request_prompt_tokens", "Prompt tokens per LLM request", _TOKENS
        )
        self.llm_generation_tokens = m.histogram(
            "precast_llm_request_generation_tokens", "Generated tokens per LLM request", _TOKENS
        )
        # speculative decoding (serve --draft / --speculative): nothing moves without it
        self.spec_proposed = m.counter(
            "precast_llm_spec_proposed_tokens",
            "Draft tokens proposed for verification (speculative decoding)",
        )
        self.spec_accepted = m.counter(
            "precast_llm_spec_accepted_tokens", "Draft tokens the target kept (speculative decoding)"
        )
        self.spec_kept_per_step = m.histogram(
            "precast_llm_spec_accepted_tokens_per_step",
            "Draft tokens each verified step of a request kept (it also yields one token of the target's own)",
            _KEPT,
        )

    def seq2seq_gauges(self):
        """The seq2seq engine's cross-attention cache gauge, registered on first use (SEQ2SEQ_METRIC_NAMES)."""
        if self._cross_bytes is None:
            self._cross_bytes = self._maker.gauge(
                "precast_seq2seq_cross_attention_bytes",
                "Cross-attention K/V bytes held by running seq2seq requests (the encoder's output, per request)",
            )
        return self._cross_bytes

    def on_batch(self, rows: int, waits: list[float], seconds: float) -> None:
        self.batch_size.observe(rows)
        for w in waits:
            self.queue_wait.observe(w)
        self.batch_run.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
