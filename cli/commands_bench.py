"""`precast bench`: latency and throughput per concurrency level, in process or against `precast serve`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from precast.cli.main import cli
from precast.cli.output import (
    THREADS,
    Progress,
    check_output_path,
    emit_json,
    err_console,
    out_console,
)
from precast.errors import UsageError
from precast.options import click_options
from precast.runtime.llm.speculative_options import SpeculativeOptions

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _dims(values: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit() or int(value) < 1:
            raise UsageError(
                f"bad --dim '{item}': expected NAME=SIZE with a positive integer size, e.g. batch=8"
            )
        out[key.strip()] = int(value)
    return out


@cli.command("bench")
@click.argument("artifact", type=click.Path())
@click.option("--dim", "dims", multiple=True, help="Size of a symbolic dim, NAME=SIZE (repeatable).")
@click.option("--concurrency", default="1", show_default=True, help="Concurrency levels, e.g. 1,4,16.")
@click.option("--duration", default=None, help="Measured time per level, e.g. 30s, 2m, 500ms. [default: 10s]")
@click.option("--requests", type=int, default=None, help="Requests per level, instead of a duration.")
@click.option("--warmup", default="1s", show_default=True, help="Unmeasured time per level (0 = none).")
@THREADS
@click.option("--prefer", default=None, help="Target to bench in a multi-target artifact.")
@click.option(
    "-i", "--input", "input_file", type=click.Path(), default=None, help="Feeds .npz/.json to send."
)
@click.option("--prompt-len", type=int, default=128, show_default=True, help="LLM: prompt tokens.")
@click.option("--output-len", type=int, default=128, show_default=True, help="LLM: tokens generated.")
@click.option("--shared-prefix", is_flag=True, help="LLM: one prompt for all requests (prefix cache on).")
@click.option(
    "--num-blocks", type=int, default=None, help="LLM: KV blocks (default: room for every request)."
)
@click_options(SpeculativeOptions, prefix="LLM: ")
@click.option(
    "--url", default=None, help="Drive a running `precast serve` on this host, e.g. http://127.0.0.1:8000."
)
@click.option("--model-name", default=None, help="With --url: the served model (default: the one it lists).")
@click.option(
    "--endpoint",
    type=click.Choice(["auto", "v2", "embeddings", "completions"]),
    default="auto",
    show_default=True,
    help="With --url: v2 infer or /v1/embeddings (completions for LLMs).",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the generated inputs / prompts."
)
@click.option(
    "--plot", type=click.Path(), default=None, help="Write latency vs throughput here (.png/.svg/.pdf)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def bench_cmd(
    artifact,
    dims,
    concurrency,
    duration,
    requests,
    warmup,
    threads,
    prefer,
    input_file,
    prompt_len,
    output_len,
    shared_prefix,
    num_blocks,
    draft,
    speculative,
    num_speculative_tokens,
    url,
    model_name,
    endpoint,
    seed,
    plot,
    as_json,
    quiet,
):
    """Latency (p50/p90/p99) and throughput of ARTIFACT at each concurrency level.

    \b
    N clients send requests back to back for --duration (or --requests) after --warmup, with inputs
    generated from the IO signature. Causal-lm artifacts: time to first token, inter-token latency and
    tokens/s (with --draft or --speculative ngram: the draft acceptance rate and tokens per verified
    step too). --url sends the same requests to `precast serve` (loopback only).
    """
    from precast.runtime.bench import (
        BenchOptions,
        bench,
        parse_concurrency,
        parse_duration,
    )

    if requests is not None and duration is not None:
        raise UsageError("give --duration or --requests, not both")
    if num_blocks is not None and num_blocks < 1:
        raise UsageError(f"--num-blocks must be a positive integer, got {num_blocks}")
    feeds = None
    if input_file:
        from precast.cli.feeds_io import read_feeds

        feeds = read_feeds(input_file)
    if plot:
        check_output_path(plot, "--plot")
        if Path(plot).suffix.lower() not in PLOT_SUFFIXES:
            raise UsageError(f"--plot {plot}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
        from precast.cli.bench_plot import require_matplotlib

        require_matplotlib()  # before minutes of measuring
    options = BenchOptions(
        concurrency=parse_concurrency(concurrency),
        duration_s=None if requests is not None else parse_duration(duration or "10s"),
        requests=requests,
        warmup_s=parse_duration(warmup, "--warmup", allow_zero=True),
        dims=_dims(dims),
        feeds=feeds,
        threads=threads,
        prefer=prefer,
        seed=seed,
        prompt_len=prompt_len,
        output_len=output_len,
        shared_prefix=shared_prefix,
        num_blocks=num_blocks,
        speculative=SpeculativeOptions(draft, speculative, num_speculative_tokens).config(),
        url=url,
        model_name=model_name,
        endpoint=endpoint,
    )
    report = bench(artifact, options, progress=Progress(quiet or as_json))
    if plot:
        from precast.cli.bench_plot import plot_report

        plot_report(report, plot)
    if as_json:
        emit_json(report.to_json())
    else:
        print_report(report)
    if plot and not quiet:
        err_console.print(f"wrote the plot to {escape(str(plot))}")


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def title(report) -> str:
    """One line: what ran where (also the plot's title)."""
    where = f"via {report.url} ({report.endpoint})" if report.url else "in-process"
    window = f"{report.duration_s:g} s" if report.duration_s is not None else f"{report.requests} requests"
    return (
        f"{Path(report.artifact).name} ({report.target}), {where}, intra-op threads: {report.threads}, "
        f"{report.host.cpus} CPUs, {window} per level"
    )


_LLM_COLUMNS = [
    "concurrency",
    "requests",
    "errors",
    "tokens/s",
    "tokens/s per request",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "request p50 ms",
]


def print_report(report) -> None:
    table = Table(title=f"precast bench: {escape(title(report))}", title_justify="left")
    for c in _columns(report):
        table.add_column(c, justify="right")
    for lv in report.levels:
        table.add_row(*(str(x) for x in _row(report, lv)))
    out_console.print(table)
    for n in _notes(report):
        out_console.print(escape(n), style="dim", soft_wrap=True)


_SPEC_COLUMNS = ["accepted %", "tokens/step"]


def _speculating(report) -> bool:
    return report.llm is not None and report.llm.speculative is not None


def _columns(report) -> list[str]:
    """An LLM's columns are token rates and TTFT / ITL (and speculative decoding's acceptance); a model's
    request rates (and items/s when a request carries a batch) and latency percentiles."""
    if report.kind == "llm":
        return _LLM_COLUMNS + (_SPEC_COLUMNS if _speculating(report) else [])
    cols = ["concurrency", "requests", "errors", "req/s"]
    cols += ["items/s"] if report.items_per_request > 1 else []
    return cols + ["p50 ms", "p90 ms", "p99 ms", "mean ms"]


def _row(report, lv) -> list:
    """One level's cells, in the order of _columns."""
    lat, head = lv.latency, [lv.concurrency, lv.requests, lv.errors]
    if report.kind == "llm":
        ttft, itl = lv.ttft, lv.itl
        rates = [_rate(lv.tokens_per_s), _rate(lv.request_tokens_per_s)]
        times = [ttft and ttft.p50_ms, ttft and ttft.p99_ms, itl and itl.p50_ms, itl and itl.p99_ms]
        cells = head + rates + [_ms(t) for t in times] + [_ms(lat and lat.p50_ms)]
        if _speculating(report):
            rate, per_step = lv.spec_acceptance_rate, lv.spec_tokens_per_step
            cells += [
                "-" if rate is None else f"{100 * rate:.1f}",
                "-" if per_step is None else f"{per_step:.2f}",
            ]
        return cells
    rates = [_rate(lv.requests_per_s)] + ([_rate(lv.items_per_s)] if report.items_per_request > 1 else [])
    times = [lat and lat.p50_ms, lat and lat.p90_ms, lat and lat.p99_ms, lat and lat.mean_ms]
    return head + rates + [_ms(t) for t in times]


def _notes(report) -> list[str]:
    """The lines under the table: what was sent, the failures, and how busy the machine was."""
    notes = []
    if report.kind == "llm":
        s = report.llm
        notes.append(
            f"prompt {s.prompt_len} tokens ({'one shared prompt' if s.shared_prefix else 'fresh random ids each'}) "
            f"+ {s.output_len} generated (EOS ignored); tokens/s = all output tokens / wall, prefill included"
        )
        if s.speculative is not None:
            how = f"draft {s.draft}" if s.speculative == "draft" else "ngram (prompt lookup)"
            notes.append(
                f"speculative decoding: {how}, up to {s.num_speculative_tokens} tokens per step; accepted % = "
                "draft tokens kept / proposed, tokens/step = 1 + kept drafts per verified row ('-': no request "
                "speculated at that level: the engine stops speculating while many requests decode at once)"
            )
    else:
        sig = "; ".join(f"{i.name} {i.dtype}{i.shape}: {i.values}" for i in report.inputs)
        notes.append(f"inputs: {sig}")
        if report.defaulted_dims:
            given = ", ".join(f"{n}={report.dims[n]}" for n in report.defaulted_dims)
            notes.append(f"dims not given, defaulted: {given} (set them with --dim NAME=SIZE)")
    for lv in report.levels:
        if lv.errors:
            notes.append(
                f"concurrency {lv.concurrency}: {lv.errors} failed requests, first: {lv.first_error}"
            )
    h = report.host
    # At the start only: by the end the bench's own threads are in the load average.
    busy = " - other work was running, re-run when the machine is idle" if h.load_start > h.cpus / 2 else ""
    notes.append(
        f"1-min load average {h.load_start:.1f} at start, {h.load_end:.1f} at end, {h.cpus} CPUs{busy}"
    )
    return notes
