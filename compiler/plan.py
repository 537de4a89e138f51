"""The compile plan: everything the user gave, validated before any work (no export, no reference run).

plan_compile(model, output, CompileOptions) -> CompilePlan
    targets        known, named once, buildable here; options typed (each target's ``Options`` dataclass)
    pipelines      parsed per target; --print-ir-after names registered passes
    tolerances     per target (precision defaults, the user's, the accuracy budget's)
    output paths   -o replaceable; --report / --junit in an existing, writable folder
    source         what the model names (ONNX file, HF folder, module:callable) and the symbolic input
                   dims its export will have, read from the graph / config / --input specs, so a --dim
                   the model lacks and text calibration of a model that is not a causal LM fail here
    cache key      for ONNX files and HF folders, from the source files' hashes + the plan, so a cache hit
                   returns before the torch export
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.compiler.frontends.source import Source, locate_source
from precast.compiler.verification.budget import budget_bounds
from precast.compiler.verification.verify import tolerance_for
from precast.errors import TargetUnavailableError, UsageError
from precast.ir.parity import Tolerance
from precast.ir.pipeline import PassSpec, format_pipeline, parse_pipeline
from precast.ir.registry import get_pass
from precast.targets.base import Target, all_targets, get_target

__all__ = ["CompileOptions", "CompilePlan", "SourcePlan", "TargetPlan", "plan_compile", "plan_source"]


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
    # Where the caller will write the JSON / JUnit report (the CLI does, from the CompileReport): checked by
    # the plan before any work, so a report that cannot be written does not cost a whole compile.
    report_path: str | None = None
    junit_path: str | None = None

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


@dataclass(frozen=True)
class SourcePlan:
    """What the model names, known without loading or exporting it."""

    kind: str  # "onnx" | "hf" | "torch" | "given" (a Source object)
    path: Path | None
    name: str  # the Source's name (HF: the folder's; known here, it goes into the cache key)
    dims: frozenset[str] | None  # symbolic input dims of the source's graph; None: the loader will tell
    step_graph: bool | None  # a causal-lm step graph (text calibration applies); None: unknown


@dataclass(frozen=True)
class TargetPlan:
    target: type[Target]
    options: Any  # the target's Options instance
    pipeline: tuple[PassSpec, ...]
    tolerance: Tolerance

    @property
    def name(self) -> str:
        return self.target.name

    def make(self) -> Target:
        return self.target(self.options)

    def option_values(self) -> dict[str, Any]:
        """The options as plain JSON-able data: the one place they are a dict (the compile cache key)."""
        return asdict(self.options)


@dataclass(frozen=True)
class CompilePlan:
    output: Path
    source: SourcePlan
    targets: tuple[TargetPlan, ...]
    opts: CompileOptions

    def pipeline(self, name: str) -> tuple[PassSpec, ...]:
        return next(t.pipeline for t in self.targets if t.name == name)

    def cache_key_parts(self, source_sha: str, name: str) -> dict[str, Any]:
        """Everything that decides the artifact's bytes, as plain JSON-able data: the source files' hash, the
        plan, the user's feeds and the toolchain. Sample feeds are not hashed: they are a function of these
        (the source's files or graph, --dim, the seed, and precast's code, whose hash is in the key)."""
        from precast.compiler.cache import code_hash, hash_feeds
        from precast.compiler.driver import toolchain_versions

        opts = self.opts
        versions = toolchain_versions(
            with_exporter=self.source.kind != "onnx"
        )  # the exporter shapes the graph
        text = opts.calibration_text
        return {
            "recipe": "plan",  # what the key is made of (an older key hashed the exported graph and feeds)
            "source": {"kind": self.source.kind, "name": name, "sha256": source_sha},
            "targets": [
                {
                    "name": t.name,
                    "options": t.option_values(),
                    "pipeline": format_pipeline(t.pipeline),
                    "tolerance": vars(t.tolerance),
                }
                for t in self.targets
            ],
            "sample_inputs": hash_feeds(opts.sample_inputs),
            "seed": opts.seed,
            "calibration": None
            if opts.calibration_feeds is None
            else [hash_feeds(f) for f in opts.calibration_feeds],
            "calibration_text": None if text is None else hashlib.sha256(text.encode()).hexdigest(),
            "accuracy_budget": opts.accuracy_budget,
            "task": opts.task,
            "kv_layout": opts.kv_layout,
            "inputs": [s.to_json() for s in opts.inputs],
            "dims": dict(sorted(opts.dims.items())),
            "toolchain": versions,
            "code": code_hash(),
        }

    def source_sha_before_loading(self) -> str | None:
        """The source's hash without loading it: an HF folder's files (what its Source.sha256 will be).
        None for ONNX files (cheap to load), torch callables (their hash is the exported graph's) and Sources."""
        if self.source.kind != "hf":
            return None
        from precast.compiler.frontends.hf_source import folder_hash_and_ship

        return folder_hash_and_ship(self.source.path, ())[0]


def plan_compile(model: str | Source, output: str | os.PathLike, opts: CompileOptions) -> CompilePlan:
    """Validate everything the user gave; a mistake raises its one-line error here, before any work."""
    from precast.compiler.artifact import check_replaceable

    targets = _plan_targets(opts)
    for name in sorted(opts.print_ir_after - {"all"}):
        get_pass(name)  # an unknown name would print nothing, silently
    for option, path in (("--report", opts.report_path), ("--junit", opts.junit_path)):
        if path:
            _check_writable_file(path, option)
    check_replaceable(output)  # a folder that is not provably precast's is refused before any work
    source = plan_source(model, opts)
    check_source(source, targets, opts)
    return CompilePlan(Path(output), source, targets, opts)


def _plan_targets(opts: CompileOptions) -> tuple[TargetPlan, ...]:
    classes = [get_target(t) for t in opts.targets]  # unknown target: exit 4 with the closest name
    twice = sorted({t for t in opts.targets if opts.targets.count(t) > 1})
    if twice:
        raise UsageError(f"target '{twice[0]}' is named twice")
    unknown = [k for k in opts.target_options if not any(k in c.option_defaults for c in classes)]
    if unknown and len(classes) > 1:
        names = ", ".join(c.name for c in classes)
        raise UsageError(f"--target-option '{unknown[0]}' is not an option of target(s) {names}")
    plans = []
    for cls in classes:
        # A key=value option goes to every selected target that declares it (one target: all of them, so an
        # unknown key is named with the closest option).
        mine = {k: v for k, v in opts.target_options.items() if k in cls.option_defaults or len(classes) == 1}
        options = cls.parse_typed(mine)
        cls(options).check_options()
        avail = cls.can_build()
        if not avail.ok:
            raise TargetUnavailableError(f"target '{cls.name}' cannot be built on this host: {avail.reason}")
        specs = tuple(parse_pipeline(opts.passes or "default", default=cls.default_pipeline))
        if not cls.runs_stages and any(s.name == "split-stages" for s in specs):
            raise UsageError(
                f"target '{cls.name}' cannot run a staged model: drop split-stages from its pipeline "
                f"(targets that run stages: {', '.join(sorted(n for n, c in all_targets().items() if c.runs_stages))})"
            )
        tol = tolerance_for(cls.precision, opts, specs)  # also parses --accuracy-budget: a typo fails here
        plans.append(TargetPlan(cls, options, specs, tol))
    return tuple(plans)


def _check_writable_file(path: str | os.PathLike, option: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give a file path")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: folder {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path}: {parent} is not writable")


def plan_source(model: str | Source, opts: CompileOptions) -> SourcePlan:
    """The symbolic input dims and the kind of graph ``model`` will give, read without exporting it."""
    if isinstance(model, Source):
        from precast.ir.parity import io_signature

        inputs, _ = io_signature(model.model)
        step = True if "llm" in model.info else _step_graph(inputs, opts)
        return SourcePlan("given", None, model.name, _symbolic(inputs), step)
    kind, path = locate_source(model)
    if kind == "torch":
        specs = list(opts.inputs)
        known = _symbolic(specs) if specs else None
        return SourcePlan("torch", None, model, known, _step_graph(specs, opts) if specs else None)
    if kind == "onnx":
        inputs = _onnx_inputs(path)
        if inputs is None:
            return SourcePlan("onnx", path, path.stem, None, None)
        return SourcePlan("onnx", path, path.stem, _symbolic(inputs), _step_graph(inputs, opts))
    return _plan_hf(path, opts)


def _step_graph(inputs: Sequence[TensorSpec], opts: CompileOptions) -> bool | None:
    """Whether ``inputs`` are a causal-lm step graph's; asked only when it matters (text calibration)."""
    if not opts.calibration_text:
        return None
    from precast.ir.llm_text import (
        is_step_graph,  # imports the LLM runtime: only when needed
    )

    return is_step_graph(inputs)


def _plan_hf(folder: Path, opts: CompileOptions) -> SourcePlan:
    from precast.compiler.frontends.hf_source import read_config
    from precast.compiler.frontends.hf_tasks import infer_task, task_dims

    if opts.task == "causal-lm":
        return SourcePlan("hf", folder, folder.name, frozenset(), True)
    config = read_config(folder)
    task = opts.task or infer_task(config)  # the loader names an unknown task, or a head the model lacks
    dims = task_dims(config, task)
    return SourcePlan("hf", folder, folder.name, dims, None if dims is None else False)


def _symbolic(inputs: Sequence[TensorSpec]) -> frozenset[str]:
    return frozenset(d for s in inputs for d in (s.shape or ()) if isinstance(d, str))


def _onnx_inputs(path: Path) -> list[TensorSpec] | None:
    """The graph inputs (initializers excluded) of an ONNX file, weights left unread; None if unreadable
    (the loader then says why)."""
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # the loader names a truncated or foreign file
        return None
    init = {t.name for t in graph.initializer}
    specs = []
    for v in graph.input:
        if v.name in init:
            continue
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else ()
        specs.append(TensorSpec(v.name, "?", tuple(d.dim_param or d.dim_value for d in dims)))
    return specs


def check_source(source: SourcePlan, targets: Sequence[TargetPlan], opts: CompileOptions) -> None:
    """--dim against the source's real dims; calibration text for causal LMs only; a causal LM's text budget."""
    if opts.dims and source.dims is not None:
        if source.kind == "hf" and source.step_graph:  # refused, not ignored (the loader says the same)
            raise UsageError(
                f"--dim {next(iter(opts.dims))}=... does not apply to --task causal-lm: the step graph takes any "
                "batch of tokens and its context length comes from the model's config; drop --dim"
            )
        unknown = sorted(set(opts.dims) - source.dims)
        if unknown:
            have = ", ".join(sorted(source.dims)) or "none"
            raise UsageError(f"--dim '{unknown[0]}' is not a symbolic input dim of the model (has: {have})")
    if opts.calibration_text and not opts.calibration_feeds and source.step_graph is False:
        # quantizers would fall back to the random sample feeds, silently
        raise UsageError(
            "--calibration text calibrates causal-lm models (--task causal-lm); give this model an .npz of feeds"
        )
    if source.step_graph:  # a causal LM's top1/ppl_delta budget needs text: say so before any work
        from precast.ir.llm_text import check_text_budget

        for t in targets:
            bounds = budget_bounds(t.pipeline, opts.accuracy_budget, t.target.precision)
            check_text_budget(bounds, opts.calibration_text)


def check_loaded(source: Source, inputs: Sequence[TensorSpec], plan: CompilePlan) -> None:
    """The same checks on the loaded graph, where the plan could not read the dims (``dims`` None)."""
    if plan.source.dims is not None:
        return
    step = True if "llm" in source.info else _step_graph(inputs, plan.opts)
    loaded = SourcePlan(plan.source.kind, plan.source.path, source.name, _symbolic(inputs), step)
    check_source(loaded, plan.targets, plan.opts)
