"""`precast serve ARTIFACT`: the HTTP server (KServe v2, OpenAI-compatible, Prometheus metrics)."""

from __future__ import annotations

import click

from precast.cli.commands_ci import signature_options
from precast.cli.main import cli
from precast.cli.output import THREADS
from precast.runtime.llm.scheduler import SchedulerConfig
from precast.runtime.server.config import API_KEY_ENV, ServerConfig


class _MemorySize(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):
        from precast.runtime.errors import UsageError
        from precast.runtime.server.kv_memory import parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except UsageError as e:
            self.fail(str(e), param, ctx)


MEMORY_SIZE = _MemorySize()


class _Seconds(click.FloatRange):
    """A FloatRange that also refuses nan and inf (nan passes every range comparison)."""

    def convert(self, value, param, ctx):
        import math

        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return out


def _name(ctx, param, value):
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty.", ctx, param)
    return value


@cli.command("serve")
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to bind.")
@click.option(
    "--model-name",
    default=None,
    callback=_name,
    help="Name in the API (default: the artifact folder's name).",
)
@click.option(
    "--max-batch-size",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Dynamic batching: most rows per model call (1 turns batching off).",
)
@click.option(
    "--max-queue-delay-ms",
    default=2.0,
    show_default=True,
    type=_Seconds(0),
    help="Dynamic batching: how long the oldest request waits for others.",
)
@click.option(
    "--max-queue",
    default=256,
    show_default=True,
    type=click.IntRange(1),
    help="Queued requests before answering 429.",
)
@click.option(
    "--timeout",
    "request_timeout",
    default=60.0,
    show_default=True,
    type=_Seconds(0.001),
    help="Per-request timeout in seconds (504 after it).",
)
@click.option(
    "--admin-token",
    default=None,
    envvar="PRECAST_ADMIN_TOKEN",
    help="Token for /admin/* (required beyond loopback, and for requests through a proxy; not empty).",
)
@click.option("--threads", default=None, type=THREADS, help="ONNX Runtime intra-op threads.")
@click.option(
    "--instances",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Model calls that may run at once.",
)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=_Seconds(0),
    help="On SIGTERM/SIGINT: seconds to finish in-flight requests.",
)
@click.option(
    "--max-request-bytes",
    default=ServerConfig.max_request_bytes,
    show_default=True,
    type=click.IntRange(1),
    help="Largest request body accepted (413 beyond it, before the body is read).",
)
@click.option(
    "--max-embedding-inputs",
    default=ServerConfig.max_embedding_inputs,
    show_default=True,
    type=click.IntRange(1),
    help="Most texts in one /v1/embeddings request.",
)
@click.option(
    "--max-embedding-tokens",
    default=ServerConfig.max_embedding_tokens,
    show_default=True,
    type=click.IntRange(1),
    help="Most tokens one /v1/embeddings request runs (texts x longest text).",
)
@click.option(
    "--max-text-chars",
    default=ServerConfig.max_text_chars,
    show_default=True,
    type=click.IntRange(1),
    help="Most characters one request hands the tokenizer (embeddings inputs, or a prompt).",
)
@click.option(
    "--text-timeout",
    default=ServerConfig.text_timeout,
    show_default=True,
    type=_Seconds(0.001),
    help="Seconds the artifact's chat template and tokenizer may run on one request (504 past it).",
)
@click.option(
    "--text-memory",
    default=ServerConfig.text_memory,
    show_default=True,
    type=MEMORY_SIZE,
    help="Memory the chat template and tokenizer may use on one request, e.g. 128MiB (400 past it).",
)
@click.option(
    "--text-workers",
    default=ServerConfig.text_workers,
    show_default=True,
    type=click.IntRange(1),
    help="Requests whose text is rendered and tokenized at once (each in its own process).",
)
@click.option(
    "--max-connections",
    default=ServerConfig.max_connections,
    show_default=True,
    type=click.IntRange(1),
    help="Open connections and requests at once (503 beyond them).",
)
@click.option("--no-verify", is_flag=True, help="Skip re-running the stored parity feeds on load/reload.")
@signature_options("serve (at start and on every reload)")
@click.option("--num-blocks", default=None, type=click.IntRange(1), help="LLM: KV cache blocks in the pool.")
@click.option(
    "--kv-cache-memory",
    default=None,
    type=MEMORY_SIZE,
    help="LLM: KV cache size instead of --num-blocks, e.g. 512MiB, 2GiB, 1.5GB (converted to whole blocks).",
)
@click.option(
    "--max-num-seqs",
    default=None,
    type=click.IntRange(1),
    help=f"LLM: requests in the running batch at once (default {SchedulerConfig.max_num_seqs}).",
)
@click.option(
    "--max-num-batched-tokens",
    default=None,
    type=click.IntRange(1),
    help=f"LLM: token budget of one engine step (default {SchedulerConfig.max_num_batched_tokens}).",
)
@click.option(
    "--api-key",
    default=None,
    envvar=API_KEY_ENV,
    help="Key the inference endpoints (/v1/*, /v2/models/*/infer) require as 'Authorization: Bearer <key>' "
    "(not empty; /health, /ready, /metrics stay open).",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def serve_cmd(artifact, no_verify, **options):
    """Serve ARTIFACT over HTTP until SIGINT/SIGTERM; SIGHUP or POST /admin/reload hot-reloads it."""
    from precast.runtime.server import serve

    serve(ServerConfig.from_options(artifact, verify=not no_verify, **options))
