"""CI commands: bisect, pack, unpack, keygen, profile. Each parses options and calls one library function."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from precast.cli.feeds_io import read_feeds
from precast.cli.main import cli
from precast.cli.output import (
    THREADS,
    Progress,
    check_output_path,
    emit_json,
    err_console,
    out_console,
)
from precast.errors import ParityError, UsageError

__all__ = ["signature_options"]


def signature_options(what: str):
    """--pubkey, --expect-name, --min-version: what `unpack`, `verify` and `serve` require of a signed pack."""

    def decorate(f):
        f = click.option(
            "--min-version",
            default=None,
            help="With --pubkey: refuse a signed version older than this (e.g. 4, 1.2.3).",
        )(f)
        f = click.option("--expect-name", default=None, help="With --pubkey: the signed name must be this.")(
            f
        )
        return click.option(
            "--pubkey",
            type=click.Path(),
            default=None,
            help=f"Ed25519 public key (PEM): {what} only a pack whose signed statement it verifies (unexpired).",
        )(f)

    return decorate


@cli.command()
@click.argument("model")
@click.option(
    "-p", "--passes", default=None, help="Pipeline to bisect. Default: the target's default pipeline."
)
@click.option(
    "-t",
    "--target",
    default="ort-cpu",
    show_default=True,
    help="Target whose default pipeline/tolerance to use.",
)
@click.option(
    "-i", "--input", "inputs", multiple=True, help="Input spec for PyTorch callables: name:dtype[dims]."
)
@click.option("--task", default=None, help="Task for Hugging Face folders.")
@click.option("--sample-inputs", type=click.Path(), default=None, help=".npz/.json of feeds to compare on.")
@click.option("--atol", type=float, default=None)
@click.option("--rtol", type=float, default=None)
@click.option("--min-cosine", type=float, default=None)
@click.option("--report", type=click.Path(), default=None, help="Write the result as JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def bisect(
    model, passes, target, inputs, task, sample_inputs, atol, rtol, min_cosine, report, as_json, quiet
):
    """Run the pipeline prefix by prefix against the reference; name the first pass that breaks tolerance.

    Exit 0 when every pass keeps parity, 2 when one breaks it.
    """
    from precast.compiler.driver import CompileOptions
    from precast.compiler.frontends.source import parse_input_spec
    from precast.compiler.verification.bisect import bisect_model

    opts = CompileOptions(
        targets=(target,),
        passes=passes,
        inputs=[parse_input_spec(s) for s in inputs],
        task=task,
        sample_inputs=read_feeds(sample_inputs) if sample_inputs else None,
        atol=atol,
        rtol=rtol,
        min_cosine=min_cosine,
    )
    if report:
        check_output_path(report, "--report")
    with Progress(quiet or as_json) as progress:
        result = bisect_model(model, opts, target=target, progress=progress)
    payload = result.to_json()
    if report:
        Path(report).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    if as_json:
        emit_json(payload)
    if result.index is not None:
        after = ", ".join(result.after)
        raise ParityError(
            f"first broken by pass '{result.culprit}' (#{result.index + 1}, after [{after}]): {result.error}"
        )
    if not as_json and not quiet:
        out_console.print(
            f"[green]ok[/green]: all {len(result.passes)} passes keep parity ({','.join(result.passes) or 'empty pipeline'})"
        )


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option(
    "-o", "--output", required=True, type=click.Path(), help="Packed file to write, e.g. model.precast."
)
@click.option(
    "--sign-key",
    type=click.Path(),
    default=None,
    help="Ed25519 private key (PEM): sign a statement of the name, version, manifest sha256 and expiry.",
)
@click.option("--name", default=None, help="Signed name (default: the artifact folder's name).")
@click.option(
    "--version",
    "version",
    default=None,
    help="Signed version, dotted integers (4, 1.2.3); required with --sign-key.",
)
@click.option(
    "--expires",
    default=None,
    help="Signed expiry: a date (2026-01-31, UTC), a time with a zone, or a span (36h, 90d, 2w).",
)
@click.option(
    "--with-build-info", is_flag=True, help="Also ship build-info.json (wall times; breaks byte-identity)."
)
@click.option("--json", "as_json", is_flag=True)
@click.option("-q", "--quiet", is_flag=True)
def pack(artifact, output, sign_key, name, version, expires, with_build_info, as_json, quiet):
    """Pack an artifact directory into one deterministic tar file (checked first; optionally signed)."""
    import tarfile

    from precast.artifact.signing import check_name, parse_expiry, version_key
    from precast.compiler.pack import pack_artifact

    if sign_key is None:
        given = [o for o, v in (("--name", name), ("--version", version), ("--expires", expires)) if v]
        if given:
            raise UsageError(f"{', '.join(given)}: parts of the signed statement; give --sign-key too")
    elif version is None:
        raise UsageError(
            "--sign-key needs --version V: a verifier's --min-version refuses older signed packs"
        )
    else:
        version_key(version, "--version")
        if name is not None:
            check_name(name, "--name")
    expiry = parse_expiry(expires) if expires else None
    check_output_path(output, "-o")
    if Path(output).is_file() and not tarfile.is_tarfile(output):
        raise UsageError(f"-o {output}: exists and is not a packed artifact; refusing to overwrite it")
    info = pack_artifact(
        artifact,
        output,
        sign_key=sign_key,
        name=name,
        version=version or "0",
        expires=expiry,
        build_info=with_build_info,
    )
    if as_json:
        emit_json(info)
    elif not quiet:
        st = info["statement"]
        signed = ""
        if st is not None:
            until = f", expires {st['not_after']}" if "not_after" in st else ""
            signed = f", signed as '{escape(st['name'])}' version {st['version']}{until}"
        err_console.print(
            f"[green]packed[/green] {escape(str(output))}: {info['files']} files, {info['bytes']} bytes{signed}, "
            f"sha256 {info['sha256']}"
        )


@cli.command()
@click.argument("packed", type=click.Path())
@click.option(
    "-o", "--output", required=True, type=click.Path(), help="Directory to unpack into (new or empty)."
)
@signature_options("unpack")
@click.option("-q", "--quiet", is_flag=True)
def unpack(packed, output, pubkey, expect_name, min_version, quiet):
    """Unpack a packed artifact safely: no links/devices/unlisted files/size bombs; every sha256 checked."""
    from precast.artifact.archive import unpack_checked
    from precast.artifact.signing import signature_policy

    policy = signature_policy(pubkey, expect_name, min_version)
    check_output_path(output, "-o", directory=True)
    done = unpack_checked(packed, output, policy=policy)
    if not quiet:
        st = done.statement
        sig = f", signed '{escape(st.name)}' version {st.version} ok" if st is not None else ""
        err_console.print(
            f"[green]unpacked[/green] {escape(str(packed))} -> {escape(str(output))}: "
            f"{len(done.manifest.files)} files verified{sig}"
        )


@cli.command()
@click.option("-o", "--output", "private", required=True, type=click.Path(), help="Private key PEM to write.")
@click.option(
    "--pub", "public", default=None, type=click.Path(), help="Public key PEM (default: <output>.pub)."
)
def keygen(private, public):
    """Generate an Ed25519 key pair for `pack --sign-key` / `verify --pubkey`."""
    from precast.artifact.signing import generate_keypair

    public = public or f"{private}.pub"
    check_output_path(private, "-o")
    check_output_path(public, "--pub")
    generate_keypair(private, public)
    err_console.print(f"wrote private key {escape(private)} (keep it secret) and public key {escape(public)}")


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option(
    "-i",
    "--input",
    "input_file",
    type=click.Path(),
    default=None,
    help="Feeds .npz/.json (default: stored parity inputs).",
)
@click.option("--runs", type=int, default=10, show_default=True, help="Profiled runs.")
@click.option("--top", type=int, default=15, show_default=True, help="How many operator types to show.")
@click.option(
    "--trace", type=click.Path(), default=None, help="Chrome trace to save (chrome://tracing, Perfetto)."
)
@THREADS
@click.option("--prefer", default=None, help="Target to profile in a multi-target artifact.")
@click.option("--json", "as_json", is_flag=True)
def profile(artifact, input_file, runs, top, trace, threads, prefer, as_json):
    """Profile an artifact with ONNX Runtime's profiler; print the top operator types by total time."""
    from precast.runtime.bench.profiling import profile_artifact

    if top < 1:
        raise UsageError(f"--top must be at least 1, got {top}")
    if trace:
        check_output_path(trace, "--trace")
    feeds = read_feeds(input_file) if input_file else None
    result = profile_artifact(artifact, feeds, runs=runs, trace=trace, threads=threads, prefer=prefer)
    if as_json:
        emit_json(result)
        return
    table = Table(
        title=f"top operators ({result['target']}, {result['runs']} runs + {result['warmup']} warmup)",
        title_justify="left",
    )
    for col, justify in (
        ("op", "left"),
        ("nodes", "right"),
        ("us/run", "right"),
        ("share", "right"),
        ("provider", "left"),
    ):
        table.add_column(col, justify=justify)
    for r in result["ops"][:top]:
        table.add_row(
            escape(r["op"]),
            str(r["nodes"]),
            f"{r['us_per_run']:.1f}",
            f"{r['share'] * 100:.1f}%",
            r["provider"],
        )
    out_console.print(table)
    if trace:
        err_console.print(f"saved the Chrome trace to {escape(str(trace))}")
