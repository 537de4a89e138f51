"""`precast generate`: text generation from a causal-lm artifact with the LLM engine."""

from __future__ import annotations

import sys
import time

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
@click.option("--threads", default=None, type=THREADS, help="Intra-op threads of the session.")
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
    from precast.runtime.llm import Engine, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=tuple(stop),
    )
    params.validate()  # bad options fail before the model loads
    runner_kwargs = {"threads": threads} if threads is not None else {}
    engine = Engine.load(artifact, num_blocks=num_blocks, **runner_kwargs)
    handle = engine.submit(prompt, params)
    req, cap = handle.request, handle.request.max_total_tokens
    if req.num_prompt + max_tokens > cap:  # the engine stops there (finish "length"), for the server too
        limit = "the context length" if cap == engine.max_context else "the KV pool (--num-blocks)"
        err_console.print(
            f"note: --max-tokens {max_tokens} capped at {cap - req.num_prompt}: {limit} is {cap} tokens "
            f"and the prompt has {req.num_prompt}",
            markup=False,
        )
    if stream and not as_json:
        for ev in handle:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        out = handle.result()
    else:
        out = handle.result()
        if not as_json:
            click.echo(out.text)
    if as_json:
        emit_json(
            {
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "ttft_s": out.ttft_s,
                "metrics": engine.metrics().as_dict(),
            }
        )
    else:
        total = time.perf_counter() - handle.t_submit
        decode = (
            (len(out.token_ids) - 1) / (total - out.ttft_s) if len(out.token_ids) > 1 and out.ttft_s else 0.0
        )
        err_console.print(
            f"[dim]{len(out.token_ids)} tokens, finish: {out.finish_reason}, time to first token "
            f"{1000 * (out.ttft_s or 0):.1f} ms, decode {decode:.1f} tokens/s[/dim]"
        )
