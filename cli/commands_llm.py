"""`precast generate`: text generation from a causal-lm artifact with the LLM engine."""

from __future__ import annotations

import sys

import click

from precast.cli.main import cli
from precast.cli.output import THREADS, emit_json, err_console
from precast.options import click_options
from precast.runtime.llm.speculative_options import SpeculativeOptions


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
@click.option(
    "--min-p",
    default=0.0,
    show_default=True,
    type=float,
    help="Drop tokens below min_p x the top one's probability.",
)
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--json-schema",
    "json_schema",
    type=click.Path(dir_okay=False),
    default=None,
    help="Constrain the output to JSON valid under this schema file (needs precast[structured]).",
)
@click.option("--regex", default=None, help="Constrain the output to match this regular expression.")
@click.option(
    "--choice", "choices", multiple=True, help="Constrain the output to one of these strings (repeatable)."
)
@click.option(
    "--grammar",
    type=click.Path(dir_okay=False),
    default=None,
    help="Constrain the output to this Lark grammar file.",
)
@click.option("--stream", is_flag=True, help="Print tokens as they come.")
@click.option("--num-blocks", default=None, type=int, help="KV blocks in the pool (default: runner's).")
@THREADS
@click_options(SpeculativeOptions)
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
    min_p,
    stop,
    json_schema,
    regex,
    choices,
    grammar,
    stream,
    num_blocks,
    threads,
    draft,
    speculative,
    num_speculative_tokens,
    as_json,
):
    """Generate a continuation of PROMPT with the compiled model in ARTIFACT.

    \b
    --draft DIR (or --speculative ngram) decodes speculatively: the output is the same for greedy
    requests, and follows the same distribution when sampling; --json adds its counters."""
    from precast.errors import LLMRequestError
    from precast.runtime.llm import SamplingParams
    from precast.runtime.llm.generate import generate
    from precast.runtime.llm.structured import FAILED as GRAMMAR_FAILED

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        min_p=min_p,
        stop=tuple(stop),
        constraint=_constraint(json_schema, regex, choices, grammar),
    )
    spec = SpeculativeOptions(draft, speculative, num_speculative_tokens).config()
    streaming = stream and not as_json
    try:
        out = generate(
            artifact,
            prompt,
            params,
            num_blocks=num_blocks,
            threads=threads,
            on_text=_write if streaming else None,
            on_note=lambda note: err_console.print(f"note: {note}", markup=False),
            speculative=spec,
        )
    except LLMRequestError as e:  # a constraint the engine refused (or failed on): name the flag it came from
        source = next((shown for _, shown in _constraint_flags(json_schema, regex, choices, grammar)), None)
        if source and (" matches no output" in str(e) or str(e).startswith(("invalid ", GRAMMAR_FAILED))):
            raise LLMRequestError(f"{source}: {e}") from None
        raise
    if as_json:
        emit_json(out.as_dict())
        return
    click.echo("" if streaming else out.text)  # a stream ends its line here
    err_console.print(
        f"[dim]{len(out.token_ids)} tokens, finish: {out.finish_reason}, target {out.target}, time to first token "
        f"{1000 * (out.ttft_s or 0):.1f} ms, decode {out.decode_tokens_per_s:.1f} tokens/s{_spec_words(out)}[/dim]"
    )


def _spec_words(out) -> str:
    """The summary's speculation part: ', speculative ngram: 5 of 12 drafts accepted (42%), 1.8 tokens/step'."""
    s = out.speculative
    if s is None:
        return ""
    head = f", speculative {s['method']}"
    if not s["proposed_tokens"]:
        return f"{head}: nothing proposed"
    return (
        f"{head}: {s['accepted_tokens']} of {s['proposed_tokens']} drafts accepted "
        f"({100 * s['acceptance_rate']:.0f}%), {s['tokens_per_step']:.2f} tokens per verified step"
    )


def _constraint_flags(json_schema, regex, choices, grammar) -> list[tuple[str, str]]:
    """(flag, how an error names it: the file flags with their file) of each constraint flag given."""
    given = (
        ("--json-schema", json_schema),
        ("--regex", regex),
        ("--choice", choices),
        ("--grammar", grammar),
    )
    return [
        (flag, f"{flag} {v}" if flag in ("--json-schema", "--grammar") else flag) for flag, v in given if v
    ]


def _constraint(json_schema, regex, choices, grammar):
    """The --json-schema / --regex / --choice / --grammar constraint (at most one), or None."""
    from precast.errors import LLMRequestError, UsageError
    from precast.runtime.llm.structured import MAX_SPEC_CHARS, Constraint

    given = [flag for flag, _ in _constraint_flags(json_schema, regex, choices, grammar)]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)}: give at most one output constraint")
    if choices:
        return Constraint.choice(list(choices))
    if regex is not None:
        return Constraint.regex(regex)
    for flag, path in (("--json-schema", json_schema), ("--grammar", grammar)):
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(16 * MAX_SPEC_CHARS + 1)  # (a schema's limit is on its compact JSON)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{flag} {path}: cannot read it ({type(e).__name__}: {e})") from None
        try:
            return Constraint.json_schema(text) if flag == "--json-schema" else Constraint.grammar(text)
        except LLMRequestError as e:
            raise LLMRequestError(f"{flag} {path}: {e}") from None
    return None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
