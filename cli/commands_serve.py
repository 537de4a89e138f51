"""`precast serve ARTIFACT`: the HTTP server (KServe v2, OpenAI-compatible, Prometheus metrics).

Its flags are generated from the dataclasses that take them (precast/options.py's click_options): the
server's from ServerConfig, the LLM engine's from KVPoolOptions and SchedulerConfig. A flag's default, bound
and help are the field's, written once; `precast.toml` [serve] keys follow from the flags (cli/config_file).
"""

from __future__ import annotations

import click

from precast.cli.commands_ci import signature_options
from precast.cli.config_file import config_option
from precast.cli.main import cli
from precast.cli.output import THREADS
from precast.options import click_options
from precast.runtime.llm.scheduler import SchedulerConfig
from precast.runtime.llm.speculative_options import SpeculativeOptions
from precast.runtime.server.config import SCHEDULER_OPTIONS, KVPoolOptions, ServerConfig

# The ServerConfig fields that are flags, in --help's order (--threads and --no-verify are declared apart).
_HEAD = ("host", "port", "model_name", "max_batch_size", "max_queue_delay_ms", "max_queue", "request_timeout")
_LIMITS = (
    "instances",
    "drain_timeout",
    "max_request_bytes",
    "max_audio_bytes",
    "max_embedding_inputs",
    "max_embedding_tokens",
    "max_text_chars",
    "text_timeout",
    "text_memory",
    "text_workers",
    "max_connections",
)


def _name(ctx, param, value):
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty.", ctx, param)
    return value


@cli.command("serve")
@click.argument("artifact", type=click.Path())
@click_options(ServerConfig, _HEAD, rename={"request_timeout": "timeout"}, callbacks={"model_name": _name})
@click_options(ServerConfig, ("admin_token",))
@THREADS
@click_options(ServerConfig, _LIMITS)
@click.option("--no-verify", is_flag=True, help="Skip re-running the stored parity feeds on load/reload.")
@signature_options("serve (at start and on every reload)")
@click_options(KVPoolOptions, prefix="LLM: ")
@click_options(SchedulerConfig, SCHEDULER_OPTIONS, unset=True, prefix="LLM: ")
@click_options(SpeculativeOptions, prefix="LLM: ")
@click_options(ServerConfig, ("api_key", "log_level"))
@config_option()
def serve_cmd(artifact, no_verify, config, **options):
    """Serve ARTIFACT over HTTP until SIGINT/SIGTERM; SIGHUP or POST /admin/reload hot-reloads it."""
    from precast.runtime.server import serve

    serve(ServerConfig.from_options(artifact, verify=not no_verify, **options))
