"""The compile driver: source -> passes -> target files -> verified artifact (or nothing, and an error)."""

from __future__ import annotations

import math
import platform
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx_ir as ir

import precast
from precast.compiler.artifact import (
    check_replaceable,
    clean_stale_siblings,
    finalize_manifest,
    publish,
    save_tensors,
    staging_dir,
    write_index,
)
from precast.compiler.budget import (
    apply_budget,
    budget_bounds,
    budget_message,
    budget_tolerance,
    is_quantized,
)
from precast.compiler.parity import (
    DEFAULT_TOL,
    Tolerance,
    compare_outputs,
    io_signature,
    make_sample_feeds,
    ort_run_model,
)
from precast.compiler.pipeline import (
    PassManager,
    PassRecord,
    PassSpec,
    clone_model,
    format_pipeline,
    parse_pipeline,
)
from precast.compiler.registry import PassContext, get_pass
from precast.compiler.source import Source, load_source
from precast.runtime.backends import explain_ort_error
from precast.runtime.errors import (
    InputError,
    ParityError,
    PartialCompileError,
    PrecastError,
    UnsupportedOpError,
    UsageError,
)
from precast.runtime.feeds import check_feeds
from precast.runtime.manifest import SCHEMA_VERSION, TensorSpec
from precast.runtime.model import preference_order
from precast.runtime.progress import ProgressReporter, reporter
from precast.runtime.verify import mask_dont_cares
from precast.targets.base import Target, get_target

__all__ = ["CompileOptions", "CompileResult", "compile_model", "toolchain_versions", "bisect_parity"]


@dataclass
class CompileOptions:
    targets: Sequence[str] = ("ort-cpu",)
    passes: str | None = None  # None -> the target's default pipeline
    inputs: Sequence[TensorSpec] = ()
    dims: dict[str, int] = field(default_factory=dict)
    sample_inputs: dict[str, np.ndarray] | None = None
    atol: float | None = None
    rtol: float | None = None
    min_cosine: float | None = None
    target_options: dict[str, str] = field(default_factory=dict)
    print_ir_after: frozenset[str] = frozenset()
    task: str | None = None
    kv_layout: str | None = None  # causal-lm: 'mapped' | 'paged' (None: the model's best)
    seed: int = 0
    bisect: bool = True
    calibration_feeds: list[dict[str, np.ndarray]] | None = None
    calibration_text: str | None = None
    accuracy_budget: str | None = (
        None  # 'cosine>=0.99,top1>=0.95'; quantized pipelines default to cosine>=0.99
    )
    cache_dir: str | None = None  # compile cache (compiler/cache.py); the CLI also reads PRECAST_CACHE_DIR
    # Several targets: False writes those that verify (and the index names the failed ones, then
    # PartialCompileError); True writes nothing when any target fails.
    all_or_nothing: bool = False

    def __post_init__(self) -> None:
        # Options also come from precast.toml, so types are checked here, not only by click.
        if isinstance(self.targets, str) or not all(isinstance(t, str) for t in self.targets):
            raise UsageError(f"targets must be a list of target names, got {self.targets!r}")
        if self.passes is not None and not isinstance(self.passes, str):
            raise UsageError(f"passes must be a pipeline string, got {self.passes!r}")
        if not isinstance(self.all_or_nothing, bool):
            raise UsageError(f"all_or_nothing must be true or false, got {self.all_or_nothing!r}")
        for name in ("atol", "rtol", "min_cosine"):
            value = getattr(self, name)
            if value is None:
                continue
            low, high, what = (-1.0, 1.0, "in [-1, 1]") if name == "min_cosine" else (0.0, math.inf, ">= 0")
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                raise UsageError(f"{name} must be a number {what}, got {value!r}")


@dataclass
class CompileResult:
    output: Path
    manifest: dict
    records: dict[str, list[PassRecord]]  # per target
    seconds: dict[str, float]
    cache: str | None = None  # None (no cache), "hit", "miss" or "corrupt: ..." (rebuilt)
    warnings: list[str] = field(default_factory=list)  # not errors, but the user should hear them
    bytes: int = 0  # the artifact on disk: every file under ``output``
    files: int = 0


# What compile_model reports its steps to: a ProgressReporter, or a plain callable(message) (older API)
Progress = ProgressReporter | Callable[[str], None]


def toolchain_versions() -> dict[str, str]:
    out = {"precast": precast.__version__}
    for pkg in ("onnx", "onnx-ir", "onnxscript", "onnxruntime"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def _is_empty(value) -> bool:
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_empty(v) for v in value)
    return np.asarray(value).size == 0


def _reference_outputs(source: Source, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if source.reference is not None:
        return source.reference(feeds)
    try:
        return ort_run_model(source.model, feeds)
    except PrecastError:
        raise
    except Exception as e:
        node, op, first = explain_ort_error(e)
        if op:
            where = f"node '{node}' (op {op})" if node else f"op {op}"
            raise UnsupportedOpError(f"{where} cannot run on onnxruntime: {first}") from e
        raise UnsupportedOpError(f"onnxruntime cannot run the source model: {first}") from e


def _tolerance(target_cls: type[Target], opts: CompileOptions, specs: Sequence[PassSpec] = ()) -> Tolerance:
    base = DEFAULT_TOL.get(target_cls.precision, DEFAULT_TOL["fp32"])
    tol = Tolerance(
        atol=opts.atol if opts.atol is not None else base.atol,
        rtol=opts.rtol if opts.rtol is not None else base.rtol,
        min_cosine=opts.min_cosine if opts.min_cosine is not None else base.min_cosine,
    )
    # Quantized compiles are held to the accuracy budget, not to fp32's elementwise tolerances.
    bounds = budget_bounds(specs, opts.accuracy_budget, target_cls.precision)
    return budget_tolerance(tol, bounds, is_quantized(specs, target_cls.precision), opts.atol is not None)


def _first_failure(report: dict[str, dict]) -> tuple[str, dict] | None:
    return next(((n, r) for n, r in report.items() if not r.get("ok")), None)


def _describe(name: str, r: dict, tol: Tolerance) -> str:
    if "error" in r:
        return f"output '{name}': {r['error']}"
    if "mismatches" in r:
        return f"output '{name}': {r['mismatches']} mismatching elements (exact comparison)"
    if "nonfinite_mismatches" in r:
        return f"output '{name}': {r['nonfinite_mismatches']} NaN/inf values where the reference differs"
    if tol.atol is None:  # cosine-only budget (int8)
        return f"output '{name}' cosine {r['cosine']:.6f} (min {tol.min_cosine:g}), max abs error {r['max_abs']:.3g}"
    return (
        f"output '{name}' max abs error {r['max_abs']:.3g} (atol {tol.atol:g}, rtol {tol.rtol:g}), "
        f"cosine {r['cosine']:.6f} (min {tol.min_cosine:g})"
    )


def bisect_parity(
    source_model: ir.Model,
    specs: Sequence[PassSpec],
    feeds: dict[str, np.ndarray],
    expected: dict[str, np.ndarray],
    tol: Tolerance,
    context: PassContext | None = None,
    progress: Progress | None = None,
    dont_cares: Mapping | None = None,
) -> tuple[int, str] | None:
    """Re-run the pipeline prefix by prefix; (index, message) of the first pass that breaks tolerance.

    ``context`` gives the passes the same calibration data as the compile, so a quantize pass re-runs as it did.
    ``progress`` hears ``advance(i, len(specs), pass)`` as each prefix starts. ``dont_cares``: the source's
    masking rules (``Source.info``: padded positions, a causal LM's unwritten KV rows), as verification uses.
    """
    tell = reporter(progress)
    model = clone_model(source_model)
    context = context or PassContext(sample_feeds=feeds)
    rules = dont_cares or {}
    expected = mask_dont_cares(expected, feeds, rules)
    for i, spec in enumerate(specs):
        tell.advance(i, len(specs), f"prefix {i + 1}: ..,{spec}")
        model = PassManager([spec], context=context).run(model, copy_input=False)
        report = compare_outputs(expected, mask_dont_cares(ort_run_model(model, feeds), feeds, rules), tol)
        bad = _first_failure(report)
        if bad:
            return i, _describe(bad[0], bad[1], tol)
    return None


def sample_feeds(source: Source, inputs: Sequence[TensorSpec], opts: CompileOptions) -> dict:
    """The feeds a compile (and ``precast bisect``) verifies on: the user's, else the source's own (a causal
    LM's step feeds, consistent with its KV layout), else generated from the IO signature."""
    if opts.sample_inputs is not None:
        return check_feeds(opts.sample_inputs, inputs)  # zero-size tensors are valid ONNX feeds
    if source.sample_feeds is not None:
        return source.sample_feeds
    return make_sample_feeds(source.model, inputs, opts.dims, seed=opts.seed)


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
) -> CompileResult:
    progress = reporter(progress)
    output = Path(output)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    target_classes = [get_target(t) for t in opts.targets]  # unknown target fails before any work
    twice = sorted({t for t in opts.targets if opts.targets.count(t) > 1})
    if twice:
        raise UsageError(f"target '{twice[0]}' is named twice")
    for name in sorted(opts.print_ir_after - {"all"}):
        get_pass(name)  # an unknown name would print nothing, silently
    unknown = [k for k in opts.target_options if not any(k in c.option_defaults for c in target_classes)]
    if unknown:
        names = ", ".join(c.name for c in target_classes)
        raise UsageError(f"--target-option '{unknown[0]}' is not an option of target(s) {names}")
    # A key=value option goes to every selected target that declares it.
    targets = [
        cls({k: v for k, v in opts.target_options.items() if k in cls.option_defaults})
        for cls in target_classes
    ]
    for t in targets:
        avail = t.can_build()
        if not avail.ok:
            from precast.runtime.errors import TargetUnavailableError

            raise TargetUnavailableError(f"target '{t.name}' cannot be built on this host: {avail.reason}")
    pipelines = {
        t.name: parse_pipeline(opts.passes or "default", default=t.default_pipeline) for t in targets
    }
    check_replaceable(output)  # a folder that is not provably precast's is refused before any work
    clean_stale_siblings(output)  # staging dirs of compiles that were killed (their pid is gone)

    progress.step(f"loading {model if isinstance(model, str) else model.name}")
    source = source_of(model, opts, progress)
    timings["load"] = time.perf_counter() - t0
    if "llm" in source.info:  # a causal LM's top1/ppl_delta budget needs text: say so before any work
        from precast.compiler.llm_text import check_text_budget

        for t in targets:
            check_text_budget(
                budget_bounds(pipelines[t.name], opts.accuracy_budget, t.precision), opts.calibration_text
            )
    inputs, outputs = io_signature(source.model)
    if opts.calibration_text and not opts.calibration_feeds:
        from precast.compiler.llm_text import is_step_graph

        if not is_step_graph(inputs):  # quantizers would fall back to the random sample feeds, silently
            raise UsageError(
                "--calibration text calibrates causal-lm models (--task causal-lm); give this model an .npz of feeds"
            )
    symbolic = {d for spec in inputs for d in (spec.shape or ()) if isinstance(d, str)}
    unknown_dims = sorted(set(opts.dims) - symbolic)
    if unknown_dims:
        have = ", ".join(sorted(symbolic)) or "none"
        raise UsageError(f"--dim '{unknown_dims[0]}' is not a symbolic input dim of the model (has: {have})")
    feeds = sample_feeds(source, inputs, opts)
    cache_key, cache_status = None, None
    if opts.cache_dir:
        from precast.compiler import cache

        tols = {t.name: _tolerance(type(t), opts, pipelines[t.name]) for t in targets}
        cache_key = cache.cache_key(cache.compile_key_parts(source, targets, pipelines, tols, feeds, opts))
        cached, cache_status = cache.restore(opts.cache_dir, cache_key, output, progress.note)
        if cached is not None:
            timings["total"] = time.perf_counter() - t0
            size, count = artifact_size(output)
            return CompileResult(output, cached, {}, timings, cache=cache_status, bytes=size, files=count)
    t1 = time.perf_counter()
    progress.step(f"running the reference ({source.reference_name})")
    expected = _reference_outputs(source, feeds)
    # Zero-size tensors are valid ONNX; outputs that are all empty still check shapes and dtypes, not values.
    shapes_only = bool(expected) and all(_is_empty(v) for v in expected.values())
    timings["reference"] = time.perf_counter() - t1

    with staging_dir(output) as stage:
        entries = {}
        manifests = {}
        all_records: dict[str, list[PassRecord]] = {}
        failed: dict[str, PrecastError] = {}
        for target in targets:
            sub = stage if len(targets) == 1 else stage / target.name
            sub.mkdir(exist_ok=True)
            all_records[target.name] = []
            try:
                manifests[target.name] = _build_one(
                    source,
                    target,
                    pipelines[target.name],
                    sub,
                    inputs,
                    outputs,
                    feeds,
                    expected,
                    opts,
                    progress,
                    timings,
                    all_records[target.name],
                )
            except PrecastError as e:
                # One target's failure (a vendor crash is one too: it ran in a child) costs that target only
                if len(targets) == 1 or opts.all_or_nothing:
                    raise
                failed[target.name] = e
                shutil.rmtree(sub)
                progress.note(f"[{target.name}] failed (exit {e.exit_code}): {e}")
                continue
            entries[target.name] = {"dir": target.name, "target": target.name, "precision": target.precision}
        if failed and not manifests:
            raise next(iter(failed.values()))
        if len(targets) > 1:
            first = next(iter(manifests.values()))
            index = {
                "schema_version": SCHEMA_VERSION,
                "kind": "multi-target",
                "precast_version": precast.__version__,
                "source": first["source"],
                "targets": entries,
                "fallback_order": preference_order(entries),
                "io": first["io"],
                "target": {"name": "multi"},
                **({"failed": {name: _failure(e) for name, e in failed.items()}} if failed else {}),
            }
            manifest = write_index(stage, index)
        else:
            manifest = manifests[targets[0].name]
        publish(stage, output)
    if cache_key is not None and not failed:  # a partial artifact is not what this key asks for
        cache.store(opts.cache_dir, cache_key, output)
        progress.note(f"cache {'store' if cache_status == 'miss' else 'rebuilt'} {cache_key[:12]}")
    timings["total"] = time.perf_counter() - t0
    warnings = []
    if (opts.calibration_feeds or opts.calibration_text) and not any(
        t.context is not None and t.context.extra.get("calibration_used") for t in targets
    ):
        warnings.append("--calibration was not used: no pass or target of this pipeline calibrates")
    if shapes_only:
        warnings.append("parity checked shapes and dtypes only: every output is empty for these sample feeds")
    size, count = artifact_size(output)
    result = CompileResult(
        output, manifest, all_records, timings, cache=cache_status, warnings=warnings, bytes=size, files=count
    )
    if failed:
        raise _partial(failed, result)
    return result


def _failure(e: PrecastError) -> dict:
    return {"error": str(e), "error_type": type(e).__name__, "exit_code": e.exit_code}


def _partial(failed: dict[str, PrecastError], result: CompileResult) -> PartialCompileError:
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


def artifact_size(root: Path) -> tuple[int, int]:
    """(bytes, files) of every regular file under ``root``."""
    sizes = [p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(sizes), len(sizes)


def _tokenizer_dir(source: Source) -> Path | None:
    """Where the source's tokenizer.json lives (causal-lm sources ship it; passes tokenize calibration text)."""
    tok = source.ship_files.get("tokenizer/tokenizer.json")
    return Path(tok).parent if tok else None


def _build_one(
    source, target, specs, out_dir, inputs, outputs, feeds, expected, opts, progress, timings, records
) -> dict:
    from precast.runtime import load as runtime_load

    def on_pass(rec: PassRecord) -> None:
        records.append(rec)
        stats = ", ".join(f"{k}={v}" for k, v in rec.stats.items())
        progress.note(f"[{target.name}] {rec.spec}: {stats} ({rec.seconds * 1000:.0f} ms)")

    t0 = time.perf_counter()
    context = PassContext(
        sample_feeds=feeds,
        calibration_feeds=opts.calibration_feeds,
        calibration_text=opts.calibration_text,
        source_dir=source.info.get("folder") or _tokenizer_dir(source),
        extra={"task": source.info.get("task")},
        progress=progress,
    )
    pm = PassManager(
        specs,
        print_ir_after=opts.print_ir_after,
        on_pass=on_pass,
        on_start=lambda spec: progress.step(f"[{target.name}] {spec}"),
        context=context,
    )
    optimized = pm.run(source.model)
    timings[f"{target.name}:passes"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    progress.step(f"[{target.name}] building")
    target.context = context  # targets that calibrate (ort-qnn) read the sample/calibration feeds
    target_block = target.build(optimized, out_dir)
    for note in target_block.get("notes", []):  # what the target wants the user to know (e.g. "plan only")
        progress.note(f"[{target.name}] {note}")
    for rel, src in sorted(source.ship_files.items()):
        dst = out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    tol = _tolerance(type(target), opts, specs)
    parity_inputs = save_tensors(feeds, out_dir / "parity" / "inputs", "parity/inputs")
    parity_expected = save_tensors(expected, out_dir / "parity" / "expected", "parity/expected")
    timings[f"{target.name}:build"] = time.perf_counter() - t1

    manifest = {
        "schema_version": SCHEMA_VERSION,
        "precast_version": precast.__version__,
        "toolchain": toolchain_versions(),
        "source": {
            "kind": source.kind,
            "name": source.name,
            "sha256": source.sha256,
            **{k: v for k, v in source.info.items() if k != "llm"},
        },
        **({"llm": source.info["llm"]} if "llm" in source.info else {}),
        "pipeline": format_pipeline(specs),
        "passes": [r.to_json(with_time=False) for r in records],
        "target": target_block,
        "io": {"inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs]},
        "extra_files": sorted(source.ship_files),
    }
    # Verify through the runtime, exactly as a user would load it.
    t2 = time.perf_counter()
    progress.step(f"[{target.name}] verifying against {source.reference_name}")
    staged = finalize_manifest(out_dir, {**manifest, "parity": {"ok": False}})
    stand_in = target.stand_in(out_dir, target_block)  # e.g. a TensorRT build plan's prepared ONNX
    try:
        actual = stand_in(feeds) if stand_in is not None else runtime_load(out_dir).run(feeds)
    except InputError as e:
        raise UsageError(f"compiled model rejects the sample inputs: {e}") from e
    mask_input, kv_rule = source.info.get("padding_mask"), source.info.get("kv_valid")
    expected_cmp = mask_dont_cares(expected, feeds, source.info)  # padded positions, unspecified KV rows
    actual = mask_dont_cares(actual, feeds, source.info)
    report = compare_outputs(expected_cmp, actual, tol)
    bounds = budget_bounds(specs, opts.accuracy_budget, target.precision)
    text_metrics = None
    if bounds is not None and "llm" in source.info:  # causal LMs: top1 / ppl_delta on text vs the fp32 graph
        from precast.compiler.llm_text import llm_text_metrics

        text_metrics = llm_text_metrics(source, out_dir, bounds, opts.calibration_text, progress)
        if opts.calibration_text:
            context.extra["calibration_used"] = True  # the budget's top1 / ppl_delta are measured on it
    budget = apply_budget(bounds, expected_cmp, actual, report, extra=text_metrics)
    timings[f"{target.name}:verify"] = time.perf_counter() - t2
    parity = {
        "ok": all(r["ok"] for r in report.values()),
        "reference": source.reference_name,
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "min_cosine": tol.min_cosine},
        "inputs": parity_inputs,
        "expected": parity_expected,
        "outputs": report,
        **({"padding_mask": mask_input} if mask_input else {}),
        **({"kv_valid": kv_rule} if kv_rule else {}),
        **({"budget": budget} if budget else {}),
    }
    if budget and budget["violations"]:
        raise ParityError(budget_message(target.name, budget["violations"]), parity)
    bad = _first_failure(report)
    if bad:
        msg = f"target '{target.name}': parity failed: {_describe(bad[0], bad[1], tol)}"
        if opts.bisect and specs:
            progress.step(f"[{target.name}] parity failed; bisecting the pipeline")
            # Bisect against ORT on the source graph: that isolates the passes from the exporter.
            base_expected = ort_run_model(source.model, feeds) if source.reference is not None else expected
            culprit = bisect_parity(
                source.model, specs, feeds, base_expected, tol, context, progress, dont_cares=source.info
            )
            if culprit:
                i, why = culprit
                done = [s.name for s in specs[:i]]
                msg += f"; first broken by pass '{specs[i]}' (after [{', '.join(done)}]): {why}"
            else:
                msg += "; every pass keeps parity on its own, so the target build or the export broke it"
        raise ParityError(msg, parity)
    build_info = {
        "host": platform.platform(),
        "python": platform.python_version(),
        "pass_seconds": {r.spec: round(r.seconds, 4) for r in records},
        "seconds": {k: round(v, 3) for k, v in timings.items()},
    }
    # Same files as staged (the runtime load above checked them): only the manifest's parity block changes.
    return finalize_manifest(out_dir, {**manifest, "parity": parity}, build_info, files=staged["files"])
