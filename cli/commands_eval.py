"""`precast eval`: perplexity of a causal-lm artifact on a raw text file."""

from __future__ import annotations

import json
from pathlib import Path

import click

from precast.cli.main import cli
from precast.cli.output import (
    THREADS,
    Progress,
    check_output_path,
    emit_json,
    err_console,
)


@cli.command("eval")
@click.argument("artifact", type=click.Path())
@click.option(
    "--perplexity",
    "text_file",
    type=click.Path(),
    required=True,
    help="Raw text file (WikiText style) to measure perplexity on.",
)
@click.option(
    "--window", type=int, default=None, help="Tokens per window (default: max context, at most 1024)."
)
@click.option("--stride", type=int, default=None, help="Tokens between window starts (default: the window).")
@click.option("--max-tokens", type=int, default=None, help="Score only the first N tokens of the text.")
@click.option("--batch", default=16, show_default=True, type=int, help="Windows scored together per step.")
@THREADS
@click.option("--report", type=click.Path(), default=None, help="Write the result as JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def eval_cmd(artifact, text_file, window, stride, max_tokens, batch, threads, report, as_json, quiet):
    """Measure the perplexity of the language model in ARTIFACT on a text file."""
    from precast.errors import InputError, UsageError
    from precast.runtime.llm.perplexity import perplexity_of_text

    if report:
        check_output_path(report, "--report")  # before minutes of scoring
    path = Path(text_file)
    if not path.is_file():
        raise UsageError(f"--perplexity: text file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--perplexity: {path} is not UTF-8 text (bad byte at offset {e.start})") from e
    if not text.strip():
        raise InputError(f"--perplexity: {path} is empty")
    with Progress(quiet or as_json) as progress:
        result = perplexity_of_text(artifact, text, window, stride, max_tokens, batch, threads, progress)
    payload = {"artifact": str(artifact), "text": str(path), **result.as_dict()}
    if report:
        Path(report).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    if as_json:
        emit_json(payload)
    else:
        click.echo(f"perplexity {result.perplexity:.4f}")
        err_console.print(
            f"[dim]{result.tokens} tokens scored in {result.windows} windows (window {result.window}, stride "
            f"{result.stride}), {result.seconds:.1f} s[/dim]"
        )
