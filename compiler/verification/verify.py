"""The Verifier: what a compile (and ``precast bisect``) checks a compiled model against, in one place.

feeds      the user's (--sample-inputs), else the source's own (a causal LM's step), else generated
reference  torch for torch/HF sources, ONNX Runtime on the unoptimized graph for ONNX ones
masks      the source's don't-care rules (padded positions, a causal LM's unwritten KV rows)
tolerance  per target precision, the user's --atol/--rtol/--min-cosine, the accuracy budget's cosine
budget     --accuracy-budget (quantized pipelines default to cosine>=0.99; top1/ppl_delta on text)
bisection  on failure, the pipeline re-run prefix by prefix against ONNX Runtime on the source graph
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from precast.artifact.manifest import TensorSpec
from precast.compiler.frontends.source import Source
from precast.compiler.verification.budget import (
    apply_budget,
    budget_bounds,
    budget_message,
    budget_tolerance,
    is_quantized,
)
from precast.errors import ParityError, PassFailedError, PrecastError, UnsupportedOpError, first_line
from precast.ir.parity import (
    DEFAULT_TOL,
    Tolerance,
    compare_outputs,
    make_sample_feeds,
    ort_run_model,
)
from precast.ir.pipeline import PassManager, PassSpec, clone_model
from precast.ir.registry import PassContext
from precast.runtime.backends import explain_ort_error
from precast.runtime.feeds import check_feeds
from precast.runtime.progress import reporter
from precast.runtime.verify import mask_dont_cares

__all__ = ["Verifier", "bisect_parity", "describe_failure", "sample_feeds", "tolerance_for"]

Outputs = dict[str, np.ndarray]


def sample_feeds(source: Source, inputs: Sequence[TensorSpec], opts: Any) -> dict:
    """The feeds a compile (and ``precast bisect``) verifies on: the user's, else the source's own (a causal
    LM's step feeds, consistent with its KV layout), else generated from the IO signature."""
    if opts.sample_inputs is not None:
        return check_feeds(opts.sample_inputs, inputs)  # zero-size tensors are valid ONNX feeds
    if source.sample_feeds is not None:
        return source.sample_feeds
    return make_sample_feeds(source.model, inputs, opts.dims, seed=opts.seed)


def tolerance_for(precision: str, opts: Any, specs: Sequence[PassSpec] = ()) -> Tolerance:
    """The precision's default tolerance, overridden by the user's; quantized compiles get the budget's cosine."""
    base = DEFAULT_TOL.get(precision, DEFAULT_TOL["fp32"])
    tol = Tolerance(
        atol=opts.atol if opts.atol is not None else base.atol,
        rtol=opts.rtol if opts.rtol is not None else base.rtol,
        min_cosine=opts.min_cosine if opts.min_cosine is not None else base.min_cosine,
    )
    # Quantized compiles are held to the accuracy budget, not to fp32's elementwise tolerances.
    bounds = budget_bounds(specs, opts.accuracy_budget, precision)
    return budget_tolerance(tol, bounds, is_quantized(specs, precision), opts.atol is not None)


def first_failure(report: dict[str, dict]) -> tuple[str, dict] | None:
    return next(((n, r) for n, r in report.items() if not r.get("ok")), None)


def describe_failure(name: str, r: dict, tol: Tolerance) -> str:
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
    progress: Any = None,
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
        try:
            got = ort_run_model(model, feeds)
        except Exception as e:  # noqa: BLE001  (ONNX Runtime's errors have no common type)
            return i, f"its graph no longer runs: {first_line(e)}"
        report = compare_outputs(expected, mask_dont_cares(got, feeds, rules), tol)
        bad = first_failure(report)
        if bad:
            return i, describe_failure(bad[0], bad[1], tol)
    return None


def _ort_reference(model: ir.Model, feeds: Outputs) -> Outputs:
    try:
        return ort_run_model(model, feeds)
    except PrecastError:
        raise
    except Exception as e:
        node, op, first = explain_ort_error(e)
        if op:
            where = f"node '{node}' (op {op})" if node else f"op {op}"
            raise UnsupportedOpError(f"{where} cannot run on onnxruntime: {first}") from e
        raise UnsupportedOpError(f"onnxruntime cannot run the source model: {first}") from e


@dataclass
class Verifier:
    """Checks one source's compiled targets: ``reference()`` once, then ``check(...)`` per target.

    ``opts`` is the compile's CompileOptions (tolerances, budget, calibration text, bisect on/off)."""

    source: Source
    feeds: Outputs
    opts: Any
    progress: Any = None

    def __post_init__(self) -> None:
        self.progress = reporter(self.progress)
        self.rules: Mapping = (
            self.source.info
        )  # padding_mask / kv_valid: positions whose values do not matter
        self.expected: Outputs | None = None

    def tolerance(self, precision: str, specs: Sequence[PassSpec] = ()) -> Tolerance:
        return tolerance_for(precision, self.opts, specs)

    def reference(self) -> Outputs:
        """The reference outputs on the feeds (torch for torch/HF sources, else ORT on the source graph)."""
        if self.expected is None:
            ref = self.source.reference
            self.expected = (
                ref(self.feeds) if ref is not None else _ort_reference(self.source.model, self.feeds)
            )
        return self.expected

    def check(
        self,
        target: str,
        precision: str,
        specs: Sequence[PassSpec],
        actual: Outputs,
        text_metrics: Callable[[Any], dict | None] | None = None,
        context: PassContext | None = None,
    ) -> dict:
        """Compare ``actual`` with the reference; the manifest's parity block, or ParityError naming the output
        (and, when bisection is on, the first pass that broke it). ``text_metrics(bounds)``: a causal LM's
        top1 / ppl_delta measured on text (None when there is none)."""
        tol = self.tolerance(precision, specs)
        expected = mask_dont_cares(self.reference(), self.feeds, self.rules)
        actual = mask_dont_cares(actual, self.feeds, self.rules)
        report = compare_outputs(expected, actual, tol)
        bounds = budget_bounds(specs, self.opts.accuracy_budget, precision)
        extra = text_metrics(bounds) if text_metrics is not None and bounds is not None else None
        budget = apply_budget(bounds, expected, actual, report, extra=extra)
        parity = self._parity_block(tol, report, budget)
        if budget and budget["violations"]:
            raise ParityError(budget_message(target, budget["violations"]), parity)
        bad = first_failure(report)
        if bad:
            msg = f"target '{target}': parity failed: {describe_failure(bad[0], bad[1], tol)}"
            if self.opts.bisect and specs:
                msg += self._culprit(target, specs, tol, context)
            raise ParityError(msg, parity)
        return parity

    def _parity_block(self, tol: Tolerance, report: dict, budget: dict | None) -> dict:
        mask_input, kv_rule = self.rules.get("padding_mask"), self.rules.get("kv_valid")
        return {
            "ok": all(r["ok"] for r in report.values()),
            "reference": self.source.reference_name,
            "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "min_cosine": tol.min_cosine},
            "outputs": report,
            **({"padding_mask": mask_input} if mask_input else {}),
            **({"kv_valid": kv_rule} if kv_rule else {}),
            **({"budget": budget} if budget else {}),
        }

    def rejected(self, target: str, precision, specs: Sequence[PassSpec], error, context) -> PassFailedError:
        """The error for a compiled model that cannot run the feeds the source ran (a pass left a graph the
        backend refuses): a compile failure, naming the first pass whose graph no longer runs."""
        msg = f"target '{target}': the compiled model does not run on the verification inputs: {error}"
        if self.opts.bisect and specs:
            msg += self._culprit(target, specs, self.tolerance(precision, specs), context, "does not run")
        return PassFailedError(msg)

    def _culprit(
        self, target: str, specs: Sequence[PassSpec], tol: Tolerance, context, what: str = "parity failed"
    ) -> str:
        self.progress.step(f"[{target}] {what}; bisecting the pipeline")
        found = self.bisect(specs, tol, context)
        if not found:
            return "; every pass keeps parity on its own, so the target build or the export broke it"
        i, why = found
        done = [s.name for s in specs[:i]]
        return f"; first broken by pass '{specs[i]}' (after [{', '.join(done)}]): {why}"

    def bisect(
        self, specs: Sequence[PassSpec], tol: Tolerance, context: PassContext | None = None
    ) -> tuple[int, str] | None:
        """Against ORT on the source graph: that isolates the passes from the exporter."""
        base = (
            self.reference()
            if self.source.reference is None
            else _ort_reference(self.source.model, self.feeds)
        )
        context = context or self.pass_context()
        return bisect_parity(
            self.source.model, specs, self.feeds, base, tol, context, self.progress, dont_cares=self.rules
        )

    def pass_context(self) -> PassContext:
        """The PassContext a compile's passes see (also bisection's, so a quantize pass re-runs as it did)."""
        return PassContext(
            sample_feeds=self.feeds,
            calibration_feeds=self.opts.calibration_feeds,
            calibration_text=self.opts.calibration_text,
            source_dir=self.source.info.get("folder") or _tokenizer_dir(self.source),
            task=self.source.info.get("task"),
            source_name=self.source.name,
            progress=self.progress,
        )


def _tokenizer_dir(source: Source) -> Path | None:
    """Where the source's tokenizer.json lives (causal-lm sources ship it; passes tokenize calibration text)."""
    tok = source.ship_files.get("tokenizer/tokenizer.json")
    return Path(tok).parent if tok else None
