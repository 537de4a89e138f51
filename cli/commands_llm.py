"""`precast generate`: text generation from a causal-lm artifact with the LLM engine."""

from __future__ import annotations

import sys

import click

from precast.cli.main import cli
from precast.cli.output import THREADS, emit_json, err_console


@cli.command("generate")
@click.argument("artifact", type=click.Path())
@click.argument("prompt")
@click.option("--max-tokens", default=64, show_default=True, type=int, help="New tokens at most.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option(
    "--top-k", default=0, show_default=True, type=int, help="Keep the k most likely tokens (0 = off)."
)
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass.")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float)
@click.option("--seed", default=None, type=int, help="Seed of this request's sampler.")
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stream", is_flag=True, help="Print tokens as they come.")
@click.option("--num-blocks", default=None, type=int, help="KV blocks in the pool (default: runner's).")
@THREADS
@click.option("--json", "as_json", is_flag=True, help="Print the completion and metrics as JSON.")
def generate_cmd(
    artifact,
    prompt,
    max_tokens,
    temperature,
    top_k,
    top_p,
    repetition_penalty,
    seed,
    stop,
    stream,
    num_blocks,
    threads,
    as_json,
):
    """Generate a continuation of PROMPT with the compiled model in ARTIFACT."""
    from precast.runtime.llm import SamplingParams
    from precast.runtime.llm.generate import generate

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=tuple(stop),
    )
    streaming = stream and not as_json
    out = generate(
        artifact,
        prompt,
        params,
        num_blocks=num_blocks,
        threads=threads,
        on_text=_write if streaming else None,
        on_note=lambda note: err_console.print(f"note: {note}", markup=False),
    )
    if as_json:
        emit_json(out.as_dict())
        return
    click.echo("" if streaming else out.text)  # a stream ends its line here
    err_console.print(
        f"[dim]{len(out.token_ids)} tokens, finish: {out.finish_reason}, time to first token "
        f"{1000 * (out.ttft_s or 0):.1f} ms, decode {out.decode_tokens_per_s:.1f} tokens/s[/dim]"
    )


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
