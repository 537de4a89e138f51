"""``precast compile``: parse the options into CompileOptions, call compile_model, print its CompileReport."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from precast.cli.config_file import config_option
from precast.cli.feeds_io import read_feeds
from precast.cli.main import cli
from precast.cli.output import (
    Progress,
    check_output_path,
    emit_json,
    err_console,
    format_bytes,
)
from precast.compiler.frontends.hf_tasks import TASKS
from precast.errors import UsageError

__all__ = ["compile_cmd", "print_parity"]

_KV = "KEY=VALUE"


def _kv_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"bad {what} '{item}': expected {_KV}")
        out[key.strip()] = value.strip()
    return out


@cli.command("compile")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(), help="Artifact directory to write.")
@click.option("-t", "--target", "targets", multiple=True, help="Target (repeatable; default ort-cpu).")
@click.option(
    "-p", "--passes", default=None, help="Pipeline, e.g. 'default,fold-constants'. Default: the target's."
)
@click.option(
    "-i", "--input", "inputs", multiple=True, help="Input spec for PyTorch callables: name:dtype[dims]."
)
@click.option(
    "--dim", "dims", multiple=True, help="Sample size of a symbolic dim for export/verification, NAME=INT."
)
@click.option(
    "--task",
    default=None,
    help=f"Task for Hugging Face folders: {', '.join([*TASKS, 'causal-lm'])} "
    "(default: inferred from config.architectures).",
)
@click.option(
    "--kv-layout",
    type=click.Choice(["auto", "mapped", "paged"]),
    default="auto",
    show_default=True,
    help="causal-lm KV cache: mapped (views of the paged pool, read in place; Linux runtime) or paged "
    "(in-graph gather, any model/host); auto picks mapped when the model allows it.",
)
@click.option("--sample-inputs", type=click.Path(), default=None, help=".npz/.json of feeds to verify with.")
@click.option("--atol", type=float, default=None, help="Absolute tolerance for parity.")
@click.option("--rtol", type=float, default=None, help="Relative tolerance for parity.")
@click.option("--min-cosine", type=float, default=None, help="Minimum cosine similarity per output.")
@click.option(
    "--target-option", "target_options", multiple=True, help="Target option KEY=VALUE (repeatable)."
)
@click.option(
    "--print-ir-after", "print_ir_after", multiple=True, help="Print the IR after this pass ('all')."
)
@config_option()
@click.option("--report", type=click.Path(), default=None, help="Write a JSON report here (also on failure).")
@click.option(
    "--junit", type=click.Path(), default=None, help="Write a JUnit XML report (one testcase per output)."
)
@click.option(
    "--cache-dir",
    envvar="PRECAST_CACHE_DIR",
    type=click.Path(),
    default=None,
    help="Compile cache directory (env PRECAST_CACHE_DIR); a hit copies the cached artifact.",
)
@click.option(
    "--calibration",
    type=click.Path(),
    default=None,
    help="Calibration data for quantize passes: .npz of feeds ('N/name' keys for several batches) or .txt.",
)
@click.option(
    "--accuracy-budget",
    "accuracy_budget",
    default=None,
    help="e.g. 'cosine>=0.99,top1>=0.95,max_abs<=0.1'; quantized pipelines default to cosine>=0.99.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the manifest as JSON on stdout, plus 'artifact': its path, bytes and files.",
)
@click.option(
    "--all-or-nothing/--keep-going",
    "all_or_nothing",
    default=None,
    help="Several targets: write nothing if one fails (default --keep-going: write the others, exit non-zero).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def compile_cmd(
    model,
    output,
    targets,
    passes,
    inputs,
    dims,
    task,
    kv_layout,
    sample_inputs,
    atol,
    rtol,
    min_cosine,
    target_options,
    print_ir_after,
    config,
    report,
    junit,
    cache_dir,
    calibration,
    accuracy_budget,
    as_json,
    all_or_nothing,
    quiet,
):
    """Compile MODEL (.onnx file, Hugging Face folder, or module:callable) into a verified artifact."""
    from precast.compiler.driver import CompileOptions, compile_model
    from precast.compiler.frontends.source import parse_input_spec
    from precast.compiler.report import CompileReport
    from precast.errors import PrecastError

    _check_output_paths(output, report, junit, cache_dir)
    opts = CompileOptions(
        targets=tuple(targets) or ("ort-cpu",),
        passes=passes,
        inputs=[parse_input_spec(s) for s in inputs],
        dims=_dim_sizes(dims),
        sample_inputs=read_feeds(sample_inputs) if sample_inputs else None,
        atol=atol,
        rtol=rtol,
        min_cosine=min_cosine,
        target_options=_kv_pairs(target_options, "--target-option"),
        print_ir_after=frozenset(print_ir_after),
        task=task,
        kv_layout=None if kv_layout == "auto" else kv_layout,
        cache_dir=cache_dir or None,
        accuracy_budget=accuracy_budget,
        all_or_nothing=bool(all_or_nothing),
        report_path=report,
        junit_path=junit,
    )
    if calibration:
        from precast.ir.calibration import load_calibration

        opts.calibration_feeds, opts.calibration_text = load_calibration(calibration)
    try:
        with Progress(quiet or as_json) as progress:  # an error stops the live line before it is printed
            result = compile_model(model, output, opts, progress=progress)
    except PrecastError as e:
        if junit and Path(junit).absolute().parent.is_dir():  # (a missing folder is the error itself)
            from precast.cli.junit import compile_junit

            compile_junit(junit, error=e)
        if report and Path(report).absolute().parent.is_dir():
            _write_json(report, CompileReport.failure_json(e))
        raise
    for warning in result.warnings:  # also with --quiet or --json: stderr, and not progress
        err_console.print(escape(f"warning: {warning}"))
    if junit:
        from precast.cli.junit import compile_junit

        compile_junit(junit, manifest=result.manifest, output=result.output, seconds=result.seconds["total"])
    if report:
        _write_json(report, result.to_json())
    if as_json:
        emit_json({**result.manifest, "artifact": result.artifact})
        return
    if not quiet:
        print_parity(result.manifest)
        size = f"{format_bytes(result.bytes)}, {result.files} file{'s' if result.files != 1 else ''}"
        err_console.print(
            f"[green]wrote[/green] {escape(str(result.output))} ({size}) in {result.seconds['total']:.1f}s"
        )


def _check_output_paths(output: str, report: str | None, junit: str | None, cache_dir: str | None) -> None:
    """Every path the compile writes is writable, before any work (a typo fails in a second, not after export)."""
    check_output_path(output, "-o", directory=True)
    for option, path in (("--report", report), ("--junit", junit)):
        if path:
            check_output_path(path, option)
    if cache_dir:
        check_output_path(cache_dir, "--cache-dir", directory=True)


def _dim_sizes(dims: tuple[str, ...]) -> dict[str, int]:
    sizes = {}
    for k, v in _kv_pairs(dims, "--dim").items():
        if not v.isdigit() or int(v) < 1:
            raise UsageError(f"bad --dim '{k}={v}': the size must be a positive integer")
        sizes[k] = int(v)
    return sizes


def _write_json(path: str, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _parity_rows(manifest: dict):
    if manifest.get("kind") == "multi-target":
        return []
    return list((manifest.get("parity") or {}).get("outputs", {}).items())


def print_parity(manifest: dict, title: str = "parity", console=err_console) -> None:
    rows = _parity_rows(manifest)
    if not rows:
        return
    table = Table(title=f"{title} vs {manifest['parity'].get('reference', '?')}", title_justify="left")
    for col in ("output", "max abs", "max rel", "cosine", "ok"):
        table.add_column(col)
    for name, r in rows:
        table.add_row(
            name,
            f"{r.get('max_abs', '-'):.3g}" if "max_abs" in r else "-",
            f"{r['max_rel']:.3g}" if "max_rel" in r else "-",
            f"{r['cosine']:.6f}" if "cosine" in r else "-",
            "yes" if r["ok"] else "[red]NO[/red]",
        )
    console.print(table)
    budget = manifest["parity"].get("budget")
    if budget:
        state = "[green]ok[/green]" if budget["ok"] else "[red]EXCEEDED[/red]"
        unmeasured = budget.get("not_measured")
        if unmeasured:
            state += escape(f" (not measured here: {', '.join(unmeasured)})")
        console.print(f"accuracy budget {escape(budget['budget'])}: {state}")
        text = budget.get("metrics", {}).get("logits@text")  # causal LMs: measured on the calibration text
        if text:
            console.print(
                f"on {text['tokens']} tokens of text vs fp32: top-1 agreement {text['top1']:.4f}, perplexity "
                f"{text['ppl_reference']:.3f} -> {text['ppl']:.3f} ({text['ppl_delta']:+.3f})"
            )
