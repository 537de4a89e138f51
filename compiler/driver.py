"""The compile driver: it only orchestrates.

    plan -> (cache hit? return) -> load/export -> passes -> build per target -> verify -> publish

``compiler/plan.py`` validates what the user gave, ``compiler/verification/verify.py`` holds the Verifier (feeds, masks,
tolerances, budget, bisection), ``compiler/artifact.py`` assembles and writes manifests.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

import precast
from precast.artifact.manifest import TensorSpec
from precast.compiler.artifact import (
    build_index,
    build_manifest,
    clean_stale_siblings,
    finalize_manifest,
    publish,
    save_tensors,
    staging_dir,
    write_index,
)
from precast.compiler.frontends.source import Source, load_source
from precast.compiler.plan import (
    CompileOptions,
    CompilePlan,
    TargetPlan,
    check_loaded,
    plan_compile,
)
from precast.compiler.report import CompileReport, CompileResult, artifact_size
from precast.compiler.verification.verify import Verifier, bisect_parity, sample_feeds
from precast.errors import InputError, PartialCompileError, PrecastError
from precast.ir.parity import io_signature
from precast.ir.pipeline import PassManager, PassRecord, format_pipeline
from precast.ir.registry import PassContext, PassFacts
from precast.runtime.progress import ProgressReporter, reporter
from precast.targets.base import BuildContext, BuildResult, Target

if TYPE_CHECKING:
    from precast.compiler.cache import EntryKey

__all__ = [
    "CompileOptions",
    "CompileReport",
    "CompileResult",
    "compile_model",
    "toolchain_versions",
    "bisect_parity",
    "sample_feeds",
    "source_of",
]

# What compile_model reports its steps to: a ProgressReporter, or a plain callable(message) (older API)
Progress = ProgressReporter | Callable[[str], None]


def toolchain_versions(with_exporter: bool = False) -> dict[str, str]:
    """Versions that shape an artifact; ``with_exporter``: also torch and transformers (torch/HF sources)."""
    pkgs = (
        "onnx",
        "onnx-ir",
        "onnxscript",
        "onnxruntime",
        *(("torch", "transformers") if with_exporter else ()),
    )
    out = {"precast": precast.__version__}
    for pkg in pkgs:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def source_of(model: str | Source, opts: CompileOptions, progress: Progress | None = None) -> Source:
    """``model`` as given (a Source) or loaded with ``opts``'s inputs, task, dims and KV layout."""
    if isinstance(model, Source):
        return model
    return load_source(
        model,
        inputs=list(opts.inputs),
        task=opts.task,
        dims=opts.dims,
        kv_layout=opts.kv_layout,
        progress=progress,
    )


def compile_model(
    model: str | Source, output: str | Path, opts: CompileOptions, progress: Progress | None = None
) -> CompileReport:
    """Compile ``model`` into a verified artifact at ``output``; every user mistake fails before any work."""
    seq2seq = _seq2seq_task(model, opts)
    if seq2seq is not None:  # encoder-decoder generation: two part artifacts + the engine's contract
        from precast.compiler.seq2seq.compile import compile_seq2seq

        return compile_seq2seq(Path(model), seq2seq, output, opts, progress)
    run = _Run(plan_compile(model, output, opts), reporter(progress))
    clean_stale_siblings(run.plan.output)  # staging dirs of compiles that were killed (their pid is gone)
    cached = run.restore(run.plan.source_sha_before_loading(), run.plan.source.name)
    if cached is not None:  # an HF folder's key needs no export
        return cached
    run.progress.step(f"loading {model if isinstance(model, str) else model.name}")
    source = source_of(model, opts, run.progress)
    run.lap("load")
    inputs, outputs = io_signature(source.model)
    check_loaded(source, inputs, run.plan)
    if run.key is None:  # ONNX files and torch callables: keyed by the loaded graph's hash
        cached = run.restore(source.sha256, source.name)
        if cached is not None:
            return cached
    verifier = Verifier(source, sample_feeds(source, inputs, opts), opts, run.progress)
    run.progress.step(f"running the reference ({source.reference_name})")
    expected = verifier.reference()
    run.lap("reference")
    with staging_dir(run.plan.output) as stage:
        build = _Build(run, source, verifier, inputs, outputs)
        manifest = build.all_targets(stage)
        publish(stage, run.plan.output)
    run.store(failed=bool(build.failed))
    result = run.report(manifest, build.records, _warnings(opts, build.calibration_used, expected))
    if build.failed:
        raise _partial(build.failed, result)
    return result


@dataclass
class _Run:
    """One compile's plan, progress, wall times, cache key and the secret that signs cache entries."""

    plan: CompilePlan
    progress: ProgressReporter
    timings: dict[str, float] = field(default_factory=dict)
    key: EntryKey | None = None
    cache_status: str | None = None
    # None: no --cache-dir, or no usable secret (noted): the cache is then neither read nor written
    secret: bytes | None = None

    def __post_init__(self) -> None:
        self.t0 = self.mark = time.perf_counter()
        if self.plan.opts.cache_dir:  # before any work: an empty $PRECAST_CACHE_SECRET is a usage error
            from precast.compiler import cache

            self.secret = cache.cache_secret(self.progress.note)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = now - self.mark
        self.mark = now

    def restore(self, source_sha: str | None, name: str) -> CompileReport | None:
        """With --cache-dir and a known source hash: the cached artifact at the output, or None (build it)."""
        cache_dir = self.plan.opts.cache_dir
        if not cache_dir or source_sha is None or self.secret is None:
            return None
        from precast.compiler import cache

        pipelines = {t.name: format_pipeline(t.pipeline) for t in self.plan.targets}
        self.key = cache.EntryKey.of(self.plan.cache_key_parts(source_sha, name), source_sha, pipelines)
        manifest, self.cache_status = cache.restore(
            cache_dir, self.key, self.plan.output, self.secret, self.progress.note
        )
        return None if manifest is None else self.report(manifest, {}, [])

    def store(self, failed: bool) -> None:
        if self.key is None or self.secret is None or failed:
            return  # no cache, or a partial artifact: not what this key asks for
        from precast.compiler import cache

        cache.store(self.plan.opts.cache_dir, self.key, self.plan.output, self.secret)
        self.progress.note(
            f"cache {'store' if self.cache_status == 'miss' else 'rebuilt'} {self.key.digest[:12]}"
        )

    def report(self, manifest: dict, records: dict, warnings: list[str]) -> CompileReport:
        self.timings["total"] = time.perf_counter() - self.t0
        size, count = artifact_size(self.plan.output)
        return CompileReport(
            self.plan.output, manifest, records, self.timings, self.cache_status, warnings, size, count
        )


def _seq2seq_task(model, opts: CompileOptions) -> str | None:
    """The seq2seq task of a local Hugging Face folder (None for anything else)."""
    if not isinstance(model, (str, os.PathLike)) or not (Path(model) / "config.json").is_file():
        return None
    from precast.compiler.frontends.hf_source import read_config
    from precast.compiler.seq2seq.export import seq2seq_task

    return seq2seq_task(read_config(Path(model)), opts.task)


@dataclass
class _Build:
    """Builds and verifies every target of the plan into a staging directory."""

    run: _Run
    source: Source
    verifier: Verifier
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    records: dict[str, list[PassRecord]] = field(default_factory=dict)
    failed: dict[str, PrecastError] = field(default_factory=dict)
    # a pass, a target or the text metrics used --calibration (else the report warns it was not used)
    calibration_used: bool = False

    def all_targets(self, stage: Path) -> dict:
        """Each target into ``stage`` (several: one sub-folder each, plus the index); the top manifest."""
        plans = self.run.plan.targets
        many = len(plans) > 1
        manifests: dict[str, dict] = {}
        for tp in plans:
            sub = stage / tp.name if many else stage
            sub.mkdir(exist_ok=True)
            try:
                manifests[tp.name] = self.one_target(tp, sub)
            except PrecastError as e:
                # One target's failure (a vendor crash is one too: it ran in a child) costs that target only
                if not many or self.run.plan.opts.all_or_nothing:
                    raise
                self.failed[tp.name] = e
                shutil.rmtree(sub)
                self.run.progress.note(f"[{tp.name}] failed (exit {e.exit_code}): {e}")
        if not manifests:
            raise next(iter(self.failed.values()))
        if not many:
            return manifests[plans[0].name]
        precisions = {tp.name: tp.target.precision for tp in plans}
        failed = {name: _failure(e) for name, e in self.failed.items()}
        index = build_index(manifests, precisions, failed)
        speeds = {n: (m.get("parity") or {}).get("speed") for n, m in manifests.items()}
        if len(manifests) > 1 and all(speeds.values()):  # causal LMs: the faster on this host first
            from precast.compiler.decoder.llm_speed import speed_score

            order = sorted(index.fallback_order or list(manifests), key=lambda n: -speed_score(speeds[n]))
            index = dataclasses.replace(index, fallback_order=order)
            self.run.progress.note("fastest causal-lm target here: " + " > ".join(order))
        return write_index(stage, index)

    def one_target(self, tp: TargetPlan, out_dir: Path) -> dict:
        """passes -> target files -> staged manifest -> verify through the runtime -> final manifest."""
        target, progress, timings = tp.make(), self.run.progress, self.run.timings
        context = self.verifier.pass_context()
        t0 = time.perf_counter()
        optimized, facts = self.passes(tp, context)
        self.calibration_used |= facts.calibration_used
        timings[f"{tp.name}:passes"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        progress.step(f"[{tp.name}] building")
        built = target.build(optimized, out_dir, self.build_context(tp, context, facts))
        self.calibration_used |= built.calibration_used
        for note in built.block.notes or ():  # what the target wants the user to know (e.g. "plan only")
            progress.note(f"[{tp.name}] {note}")
        self.ship_files(out_dir)
        tensors = {
            "inputs": save_tensors(self.verifier.feeds, out_dir / "parity" / "inputs", "parity/inputs"),
            "expected": save_tensors(
                self.verifier.reference(), out_dir / "parity" / "expected", "parity/expected"
            ),
        }
        timings[f"{tp.name}:build"] = time.perf_counter() - t1
        manifest = build_manifest(
            source=self.source,
            pipeline=format_pipeline(tp.pipeline),
            passes=[r.to_json(with_time=False) for r in self.records[tp.name]],
            target_block=built.block,
            inputs=self.inputs,
            outputs=self.outputs,
            toolchain=toolchain_versions(),
            parity={"ok": False},
            stages=built.stages,
        )
        if built.llm is not None:  # the target shipped its own lowering: its step contract, not the ONNX's
            manifest = dataclasses.replace(manifest, llm=built.llm, io=built.io)
        t2 = time.perf_counter()
        progress.step(f"[{tp.name}] verifying against {self.source.reference_name}")
        staged = finalize_manifest(out_dir, manifest)
        parity = self.verify(tp, target, built, out_dir, context)
        timings[f"{tp.name}:verify"] = time.perf_counter() - t2
        if "llm" in self.source.info and len(self.run.plan.targets) > 1:  # ranks the index's targets
            from precast.compiler.decoder.llm_speed import llm_speed

            progress.step(f"[{tp.name}] measuring its serving speed on this host")
            parity = {**parity, "speed": llm_speed(out_dir)}
        # Same files as staged (the runtime load checked them): only the manifest's parity block changes.
        final = dataclasses.replace(manifest, parity={**parity, **tensors})
        return finalize_manifest(out_dir, final, self.build_info(tp.name), files=staged["files"])

    def passes(self, tp: TargetPlan, context: PassContext) -> tuple[ir.Model, PassFacts]:
        """The target's pipeline on the source: the optimized model and what its passes learned."""
        records = self.records.setdefault(tp.name, [])
        progress = self.run.progress

        def on_pass(rec: PassRecord) -> None:
            records.append(rec)
            stats = ", ".join(f"{k}={v}" for k, v in rec.stats.items())
            progress.note(f"[{tp.name}] {rec.spec}: {stats} ({rec.seconds * 1000:.0f} ms)")

        pm = PassManager(
            list(tp.pipeline),
            print_ir_after=self.run.plan.opts.print_ir_after,
            on_pass=on_pass,
            on_start=lambda spec: progress.step(f"[{tp.name}] {spec}"),
            context=context,
        )
        return pm.run(self.source.model), pm.facts

    def build_context(self, tp: TargetPlan, context: PassContext, facts: PassFacts) -> BuildContext:
        """What the target's build gets besides the model: the passes' feeds and facts, the source's own
        lowerings (openvino's causal-lm step graph), and the pipeline to re-run per static shape (ort-qnn
        sequence buckets)."""

        def rerun(feeds: dict[str, np.ndarray]) -> ir.Model:
            pm = PassManager(list(tp.pipeline), context=dataclasses.replace(context, sample_feeds=feeds))
            return pm.run(self.source.model)

        return BuildContext(context, facts, self.source.lowerings, rerun)

    def ship_files(self, out_dir: Path) -> None:
        for rel, src in sorted(self.source.ship_files.items()):
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)

    def verify(
        self, tp: TargetPlan, target: Target, built: BuildResult, out_dir: Path, context: PassContext
    ) -> dict:
        """Run the staged artifact exactly as a user would load it (or the target's stand-in); check it."""
        from precast.runtime import load as runtime_load

        feeds = self.verifier.feeds
        stand_in = target.stand_in(out_dir, built)  # e.g. a TensorRT build plan's prepared ONNX
        try:
            actual = stand_in(feeds) if stand_in is not None else runtime_load(out_dir).run(feeds)
        except InputError as e:  # the source ran these feeds: the compile broke the graph (named by bisection)
            raise self.verifier.rejected(tp.name, built.precision, tp.pipeline, e, context) from e
        text_metrics = None
        if "llm" in self.source.info:  # causal LMs: top1 / ppl_delta on text vs the fp32 graph
            text_metrics = lambda bounds: self.text_metrics(bounds, out_dir, context)  # noqa: E731
        # (the build's precision: a target that compressed weights in build() says so there)
        return self.verifier.check(tp.name, built.precision, tp.pipeline, actual, text_metrics, context)

    def text_metrics(self, bounds, out_dir: Path, context: PassContext) -> dict | None:
        from precast.ir.llm_text import llm_text_metrics

        text = self.run.plan.opts.calibration_text
        metrics = llm_text_metrics(self.source, out_dir, bounds, text, self.run.progress)
        if text:
            self.calibration_used = True  # the budget's top1 / ppl_delta are measured on it
        return metrics

    def build_info(self, name: str) -> dict:
        return {
            "host": platform.platform(),
            "python": platform.python_version(),
            "pass_seconds": {r.spec: round(r.seconds, 4) for r in self.records[name]},
            "seconds": {k: round(v, 3) for k, v in self.run.timings.items()},
        }


def _is_empty(value) -> bool:
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_empty(v) for v in value)
    return np.asarray(value).size == 0


def _warnings(opts: CompileOptions, calibration_used: bool, expected: dict) -> list[str]:
    warnings = []
    if (opts.calibration_feeds or opts.calibration_text) and not calibration_used:
        warnings.append("--calibration was not used: no pass or target of this pipeline calibrates")
    # Zero-size tensors are valid ONNX; outputs that are all empty still check shapes and dtypes, not values.
    if expected and all(_is_empty(v) for v in expected.values()):
        warnings.append("parity checked shapes and dtypes only: every output is empty for these sample feeds")
    return warnings


def _failure(e: PrecastError) -> dict:
    return {"error": str(e), "error_type": type(e).__name__, "exit_code": e.exit_code}


def _partial(failed: dict[str, PrecastError], result: CompileReport) -> PartialCompileError:
    """The one-line error: the first failure's message, then 'wrote the other target(s) ... to OUT'."""
    name, e = next(iter(failed.items()))
    reason = str(e) if f"'{name}'" in str(e) else f"target '{name}': {e}"
    others = f" (also failed: {', '.join(list(failed)[1:])})" if len(failed) > 1 else ""
    wrote = ", ".join(result.manifest["targets"])
    return PartialCompileError(
        f"{reason}{others}; wrote the other target(s) {wrote} to {result.output} "
        "(the index lists the failure; --all-or-nothing writes nothing instead)",
        exit_code=e.exit_code,
        failed={n: _failure(x) for n, x in failed.items()},
        result=result,
    )
