"""The subcommands. Each parses options, calls one library function, and prints the result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import numpy as np
from rich.markup import escape
from rich.table import Table

from precast.cli.commands_ci import signature_options
from precast.cli.commands_compile import print_parity
from precast.cli.feeds_io import read_feeds
from precast.cli.main import cli
from precast.cli.output import (
    THREADS,
    check_output_path,
    emit_json,
    err_console,
    out_console,
)
from precast.errors import InputError, UsageError


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(artifact, as_json):
    """Show an artifact's manifest: IO signature, pipeline, pass stats, parity, files."""
    from precast.artifact.manifest import read_manifest

    manifest = read_manifest(artifact).to_json()  # shown as the document it is
    if as_json:
        emit_json(manifest)
        return
    if manifest.get("kind") == "multi-target":
        out_console.print(
            f"[bold]{artifact}[/bold]: multi-target artifact, fallback order {manifest.get('fallback_order', '?')}"
        )
        for name, why in (manifest.get("failed") or {}).items():  # targets the compile could not build
            from rich.markup import escape

            reason = why.get("error", why) if isinstance(why, dict) else why
            out_console.print(
                f"[yellow]{escape(str(name))}: not built[/yellow] ({escape(str(reason))})", highlight=False
            )
        _inspect_speeds(Path(artifact), manifest["targets"])
        for name, entry in manifest["targets"].items():
            out_console.print(f"\n[bold]== {name} ==[/bold]")
            _inspect_one(
                Path(artifact) / entry.get("dir", name),
                read_manifest(Path(artifact) / entry.get("dir", name)).to_json(),
            )
        return
    _inspect_one(Path(artifact), manifest)


def _inspect_speeds(root: Path, targets: dict) -> None:
    """A causal LM's measured serving rates per target (the compile's, on its host) and which target each load
    opens: ``precast generate`` 1 request, ``serve`` its --max-num-seqs (runtime/hal.py's rate_at)."""
    from precast.artifact.manifest import read_manifest
    from precast.runtime.hal import SPEED_FIGURES, VERIFY_FIGURE, rate_at, speed_figure

    speeds = {}
    for name, entry in targets.items():
        speed = (read_manifest(root / entry.get("dir", name)).parity or {}).get("speed")
        if rate_at(speed, 1) is None:
            return
        speeds[name] = speed
    out_console.print("measured on the compiling host, tokens/s (requests at once):")
    figures = [(str(n), k) for n, k in SPEED_FIGURES] + [("1 in 8-token verify rows", VERIFY_FIGURE)]
    for name, speed in speeds.items():
        rates = ", ".join(f"{n}: {v:g}" for n, k in figures if (v := speed_figure(speed, k)) is not None)
        out_console.print(f"  {name}: {rates}", markup=False)
    for n, _ in SPEED_FIGURES:
        best = max(speeds, key=lambda t: rate_at(speeds[t], n) or 0.0)
        out_console.print(f"  at {n} request{'s' if n > 1 else ''}: {best}", markup=False)
    if all(speed_figure(s, VERIFY_FIGURE) is not None for s in speeds.values()):
        best = max(speeds, key=lambda t: rate_at(speeds[t], 1, speculative=True) or 0.0)
        out_console.print(f"  at 1 request, speculating (--draft, --speculative): {best}", markup=False)


def _inspect_states(states) -> None:
    """A hybrid or state-space LLM's recurrent states (the llm block, already checked on read)."""
    if not states:
        return
    layers = sorted({st["layer"] for st in states})
    kinds = "/".join(sorted({st["kind"] for st in states}))
    elements = sum(math.prod(st["shape"]) for st in states)
    out_console.print(
        f"recurrent state: {len(layers)} layer(s) ({kinds}), {elements * 4 / 1024:.1f} KiB per request, one slot "
        "each; prefix caching off, no speculative decoding",
        markup=False,
    )


def _inspect_one(path: Path, m: dict) -> None:
    t = m["target"]
    src = m.get("source", {})
    out_console.print(
        f"[bold]{path}[/bold]  schema {m['schema_version']}, precast {m.get('precast_version')}"
    )
    out_console.print(
        f"source: {src.get('kind')} '{src.get('name')}' sha256 {str(src.get('sha256'))[:16]}..."
    )
    out_console.print(
        f"target: {t.get('name')} ("
        + ", ".join(
            str(x)
            for x in (t.get("backend"), *(t.get("providers") or [t.get("device")]), t.get("precision"))
            if x
        )
        + ")"
        + (f", session {t['session']}" if t.get("session") else "")
    )
    out_console.print(escape(f"pipeline: {m.get('pipeline') or '(none)'}"))
    _inspect_states((m.get("llm") or {}).get("states"))
    io = Table(title="IO signature", title_justify="left")
    for col in ("", "name", "dtype", "shape"):
        io.add_column(col)
    for kind in ("inputs", "outputs"):
        for s in m["io"][kind]:
            shape = (
                "?"
                if s["shape"] is None
                else "[" + ", ".join("?" if d is None else str(d) for d in s["shape"]) + "]"
            )
            io.add_row(kind[:-1], escape(s["name"]), s["dtype"], escape(shape))
    out_console.print(io)
    passes = Table(title="passes", title_justify="left")
    for col in ("pass", "stats", "nodes"):
        passes.add_column(col)
    for p in m.get("passes", []):
        passes.add_row(
            escape(p["pass"]),
            ", ".join(f"{k}={v}" for k, v in p["stats"].items()),
            f"{p['nodes_before']} -> {p['nodes_after']}",
        )
    out_console.print(passes)
    if m.get("stages"):
        _print_stages(m["stages"])
    print_parity(m, console=out_console)
    files = Table(title="files", title_justify="left")
    files.add_column("file")
    files.add_column("bytes", justify="right")
    files.add_column("sha256")
    for rel, digest in sorted(m["files"].items()):
        p = path / rel
        files.add_row(rel, str(p.stat().st_size) if p.exists() else "MISSING", digest[:16] + "...")
    out_console.print(files)


def _print_stages(block: dict) -> None:
    """The split-stages block: per stage its file, layers, bytes (and profiled time), inputs and outputs."""
    timed = any("time_ms" in s for s in block["stages"])
    table = Table(title=f"stages ({block['n']}, balanced by {block['by']})", title_justify="left")
    for col in ("stage", "file", "layers", "bytes", *(("time ms",) if timed else ()), "inputs", "outputs"):
        table.add_column(col, justify="right" if col in ("bytes", "time ms") else "left")
    for k, s in enumerate(block["stages"]):
        first, end = s["layers"] if s.get("layers") else (None, None)
        layers = "-" if first is None else str(first) if end - first == 1 else f"{first}-{end - 1}"
        row = [str(k), escape(s["model"]), layers, f"{s['bytes']:,}"]
        if timed:
            row.append(f"{s['time_ms']:.3f}" if "time_ms" in s else "-")
        row += [escape(", ".join(s["inputs"])), escape(", ".join(s["outputs"]))]
        table.add_row(*row)
    out_console.print(table)


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@signature_options("accept")
@click.option(
    "--junit", type=click.Path(), default=None, help="Write a JUnit XML report (one testcase per output)."
)
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success (the exit code says it).")
def verify(artifact, as_json, pubkey, expect_name, min_version, junit, quiet):
    """Check integrity (sha256 of every file) and re-run the stored parity feeds.

    ARTIFACT is a directory or a packed file (precast pack); --pubkey also checks a packed file's signed
    statement (signature, expiry, and --expect-name / --min-version when given).
    """
    from precast.errors import ParityError, PrecastError
    from precast.runtime.verify import verify_artifact

    if junit:
        check_output_path(junit, "--junit")
    try:
        from precast.artifact.signing import signature_policy

        policy = signature_policy(pubkey, expect_name, min_version)
        if Path(artifact).is_file():
            from precast.artifact.archive import unpack_to_temp

            report = verify_artifact(unpack_to_temp(artifact, policy=policy))
        elif pubkey:
            raise UsageError(f"--pubkey checks packed artifacts; {artifact} is a directory")
        else:
            report = verify_artifact(artifact)
    except PrecastError as e:
        if junit:
            from precast.cli.junit import verify_junit

            verify_junit(junit, error=e)
        if as_json:  # CI parses stdout: a failure is a report too
            emit_json(
                {"ok": False, "error": str(e), "error_type": type(e).__name__, "exit_code": e.exit_code}
            )
        raise
    reports = report if "ok" not in report else {report["target"]: report}
    if junit:
        from precast.cli.junit import verify_junit

        verify_junit(junit, reports)
    if as_json:
        emit_json(report)
    elif not quiet:
        for target, r in reports.items():
            if r.get("skipped"):
                out_console.print(
                    escape(f"{target}: files intact; parity not re-run on this host ({r['skipped']})")
                )
            for name, o in r["outputs"].items():
                status = "ok" if o["ok"] else "FAIL"
                out_console.print(
                    f"{target} {name}: max abs {o.get('max_abs', 0):.3g}, cosine {o.get('cosine', 1):.6f} {status}"
                )
    bad = [(t, n) for t, r in reports.items() for n, o in r["outputs"].items() if not o["ok"]]
    if bad:
        raise ParityError(
            f"artifact {artifact}: target '{bad[0][0]}' output '{bad[0][1]}' no longer matches its stored reference"
        )
    if not as_json and not quiet:
        out_console.print(f"[green]verified[/green] {artifact}: all files intact, parity holds")


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("-i", "--input", "input_file", type=click.Path(), help="Feeds: .npz or .json.")
@click.option("--image", "images", multiple=True, type=click.Path(), help="An image file (image tasks).")
@click.option("--audio", "audios", multiple=True, type=click.Path(), help="A WAV file (audio tasks).")
@click.option(
    "--text", "texts", multiple=True, help="A text (text tasks; the question for question-answering)."
)
@click.option("--context", default=None, help="question-answering: the text to find the answer in.")
@click.option(
    "--labels", default=None, help="zero-shot-image-classification: candidate labels, comma-separated."
)
@click.option("--top-k", default=5, show_default=True, type=click.IntRange(1, 1000), help="Labels per input.")
@click.option("-o", "--output", "output_file", type=click.Path(), default=None, help="Save outputs to .npz.")
@click.option("--prefer", default=None, help="Target to prefer in a multi-target artifact.")
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1, 65536),
    default=None,
    help="Generation tasks: tokens to generate at most (default: the model's generation config).",
)
@click.option(
    "--num-beams",
    type=click.IntRange(1, 64),
    default=None,
    help="Generation tasks: beam search width (default: the model's generation config).",
)
@click.option("--language", default=None, help="Whisper: the spoken language (e.g. en); default: detected.")
@click.option("--translate", is_flag=True, help="Whisper: translate to English instead of transcribing.")
@THREADS
@click.option("--json", "as_json", is_flag=True, help="Print outputs as JSON lists.")
def run(
    artifact,
    input_file,
    images,
    audios,
    texts,
    context,
    labels,
    top_k,
    output_file,
    prefer,
    max_new_tokens,
    num_beams,
    language,
    translate,
    threads,
    as_json,
):
    """Run an artifact on feeds from a file (-i), or a task artifact on images, WAV files or text, and print
    (or save) the outputs: labels and scores, decoded text, an answer span, an embedding; an encoder-decoder
    artifact translates / summarizes --text or transcribes --audio (WAV or FLAC, any length)."""
    from precast.runtime import load

    generation = {
        k: v
        for k, v in (("max_new_tokens", max_new_tokens), ("num_beams", num_beams), ("language", language))
        if v is not None
    }
    if translate:
        generation["task"] = "translate"
    if (Path(artifact).parent / "seq2seq.json").is_file() and Path(artifact).name in ("encoder", "decoder"):
        raise UsageError(
            f"{artifact} is a part of the encoder-decoder artifact {Path(artifact).parent}: run that"
        )
    if (Path(artifact) / "seq2seq.json").is_file():
        if input_file or images:
            raise UsageError(f"{artifact} is an encoder-decoder artifact: give --text or --audio")
        unused = [("-o", output_file), ("--context", context), ("--labels", labels), ("--top-k", top_k != 5)]
        for option, value in unused:
            if value:
                raise UsageError(
                    f"{option} does not apply to an encoder-decoder artifact (it prints text; --json)"
                )
        _run_seq2seq(artifact, audios, texts, generation, threads, as_json)
        return
    if generation:
        raise UsageError(f"--{next(iter(generation)).replace('_', '-')} applies to encoder-decoder artifacts")
    given = bool(images or audios or texts)
    if input_file and given:
        raise UsageError("give either -i FEEDS or --image/--audio/--text, not both")
    if not input_file and not given:
        raise UsageError(
            "nothing to run: give -i FEEDS (.npz/.json), or --image / --audio / --text for a task artifact"
        )
    if output_file:
        check_output_path(output_file, "-o")
    model = load(artifact, threads=threads, prefer=prefer)
    for name, why in model.skipped.items():
        err_console.print(escape(f"skipped target {name}: {why}"))
    if model.skipped or prefer:
        err_console.print(escape(f"running target {model.target} on {', '.join(model.providers)}"))
    if given:
        _run_task(model, images, audios, texts, context, labels, top_k, as_json)
        return
    feeds = read_feeds(input_file, model.inputs)
    outputs = model.run(feeds)
    if output_file:
        with open(output_file, "wb") as f:  # a file handle: np.savez would append ".npz" to other names
            np.savez(f, **outputs)
    if as_json:
        emit_json({k: v.tolist() for k, v in outputs.items()})
        return
    for name, arr in outputs.items():
        flat = arr.ravel()
        head = np.array2string(flat[:6], precision=5, separator=", ")
        out_console.print(
            escape(f"{name}: {arr.dtype}{list(arr.shape)} {head}{' ...' if flat.size > 6 else ''}")
        )
    if output_file:
        err_console.print(f"saved outputs to {output_file}")


def _run_task(model, images, audios, texts, context, labels, top_k, as_json) -> None:
    """``precast run --image/--audio/--text``: the artifact's own preprocessing and labels (runtime/tasks.py)."""
    from precast.runtime.processing import load_image, read_wav
    from precast.runtime.tasks import TaskRunner

    runner = TaskRunner.open(model)
    if runner is None:
        raise UsageError(
            f"{model.path} is not a Hugging Face task artifact (no task in its manifest): give -i FEEDS instead"
        )
    names = [*images, *audios, *texts]
    candidates = [x.strip() for x in (labels or "").split(",") if x.strip()]
    runner.check_inputs(images, audios, texts, candidates, context)  # before reading any file
    results = runner.run(
        images=[load_image(p) for p in images],
        audio=[_mono(read_wav(p), p) for p in audios],
        texts=list(texts),
        labels=candidates,
        context=context,
        top_k=top_k,
    )
    if as_json:
        emit_json([{"input": n, "result": r} for n, r in zip(names, results)])
        return
    for name, result in zip(names, results):
        out_console.print(escape(f"{name}: {_describe(result)}"))


def _run_seq2seq(artifact, audios, texts, generation: dict, threads, as_json) -> None:
    """``precast run`` on an encoder-decoder artifact: each --text translated / summarized, each --audio
    transcribed (30 s windows); the texts are served together (one batch)."""
    from precast.runtime.seq2seq.engine import Seq2SeqEngine

    engine = Seq2SeqEngine.load(artifact, threads=threads)
    speech = engine.spec.input == "speech"
    if (texts if speech else audios) or not (audios if speech else texts):
        want = "--audio FILE (WAV or FLAC)" if speech else "--text TEXT"
        raise UsageError(f"{artifact} is an encoder-decoder artifact for {engine.spec.task}: give {want}")
    if not speech and ("language" in generation or "task" in generation):
        raise UsageError("--language and --translate apply to speech recognition (Whisper) artifacts")
    try:
        if speech:
            from precast.runtime.processing.whisper import read_audio

            rate = engine.features.sampling_rate
            waves = [read_audio(_read_bytes(p), p, rate) for p in audios]
            results = [engine.transcribe(w, **generation) for w in waves]
            names = list(audios)
        else:
            results = engine.generate(list(texts), **generation)
            names = list(texts)
    finally:
        engine.close()
    if as_json:
        emit_json(
            [
                {
                    "input": n,
                    "text": r.text,
                    "tokens": r.tokens,
                    **({"language": r.language} if r.language else {}),
                }
                for n, r in zip(names, results)
            ]
        )
        return
    for name, r in zip(names, results):
        out_console.print(escape(f"{name}: {r.text}"))


def _read_bytes(path: str) -> bytes:
    from precast.runtime.processing.audio import MAX_WAV_BYTES

    p = Path(path)
    try:
        if p.stat().st_size > MAX_WAV_BYTES:
            raise InputError(f"{path}: {p.stat().st_size} bytes is over the {MAX_WAV_BYTES}-byte audio limit")
        return p.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from e


def _mono(wav, path):
    samples, rate = wav
    if samples.ndim != 1:
        raise InputError(
            f"{path}: {samples.shape[1]} channels; the model takes mono audio (1 channel) at its sampling rate"
        )
    return samples, rate


def _describe(result) -> str:
    if isinstance(result, dict) and "embedding" in result:
        v = result["embedding"]
        return (
            f"embedding [{len(v)}] " + ", ".join(f"{x:.5f}" for x in v[:6]) + (" ..." if len(v) > 6 else "")
        )
    if isinstance(result, list) and result and isinstance(result[0], dict) and "label" in result[0]:
        return ", ".join(f"{r['label']} ({r['score']:.4f})" for r in result)
    return json.dumps(result)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def passes(as_json):
    """List registered passes with their options."""
    from precast.ir.registry import all_passes, describe_options

    items = all_passes()
    if as_json:
        emit_json(
            {n: {"summary": c.summary(), "options": describe_options(c.Options)} for n, c in items.items()}
        )
        return
    table = Table(title="passes", title_justify="left")
    for col in ("pass", "what it does", "options"):
        table.add_column(col)
    for name, cls in items.items():
        table.add_row(name, escape(cls.summary()), escape(describe_options(cls.Options) or "-"))
    out_console.print(table)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def targets(as_json):
    """List targets and whether this host can build and run them (with the reason)."""
    from precast.targets import all_targets

    rows = {}
    for name, cls in all_targets().items():
        b, r = cls.can_build(), cls.can_run()
        rows[name] = {
            "summary": cls.summary,
            "build": b.ok,
            "build_reason": b.reason,
            "run": r.ok,
            "run_reason": r.reason,
            "default_pipeline": cls.default_pipeline,
            "options": cls.option_defaults,
        }
    if as_json:
        emit_json(rows)
        return
    table = Table(title="targets", title_justify="left")
    for col in ("target", "what", "build here", "run here", "default pipeline"):
        table.add_column(col)
    for name, r in rows.items():
        b = (
            ("yes" + (f" ({r['build_reason']})" if r["build_reason"] else ""))
            if r["build"]
            else f"unavailable: {r['build_reason']}"
        )
        x = "yes" if r["run"] else f"unavailable: {r['run_reason']}"
        table.add_row(name, r["summary"], escape(b), escape(x), escape(r["default_pipeline"]))
    out_console.print(table)
