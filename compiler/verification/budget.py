"""The accuracy budget in the compile driver: which budget applies, the tolerance it implies, the check.

Precision-changing passes (quantize-int8, quantize-int4, convert-fp16) or an int8/int4 target make fp32's
elementwise atol/rtol meaningless; such compiles are held to ``--accuracy-budget`` (default
``cosine>=0.99``) per output instead. An explicit budget also applies on top of fp32 tolerances.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from precast.runtime.accuracy import (
    DEFAULT_QUANT_BUDGET,
    Bound,
    check_budget,
    format_budget,
    measure,
    parse_budget,
)
from precast.runtime.verify import Tolerance

__all__ = [
    "QUANTIZE_PASSES",
    "is_quantized",
    "budget_bounds",
    "budget_tolerance",
    "apply_budget",
    "budget_message",
]

QUANTIZE_PASSES = frozenset({"quantize-int8", "quantize-int4", "convert-fp16"})
_LOW_PRECISION_TARGETS = frozenset({"int8", "int4", "bf16"})


def is_quantized(specs: Sequence[Any], precision: str = "fp32") -> bool:
    return precision in _LOW_PRECISION_TARGETS or any(getattr(s, "name", s) in QUANTIZE_PASSES for s in specs)


def budget_bounds(
    specs: Sequence[Any], budget: str | None, precision: str = "fp32"
) -> tuple[Bound, ...] | None:
    """The bounds to enforce: the user's, the default for quantized compiles, or None (fp32 tolerances only)."""
    if budget:
        return parse_budget(budget)
    if is_quantized(specs, precision):
        return parse_budget(DEFAULT_QUANT_BUDGET)
    return None


def budget_tolerance(
    tol: Tolerance, bounds: tuple[Bound, ...] | None, quantized: bool, atol_given: bool
) -> Tolerance:
    """What `precast verify` re-checks later: for quantized compiles, the budget's cosine and no elementwise bound."""
    if not quantized or bounds is None:
        return tol
    cosine = next((b.value for b in bounds if b.metric == "cosine"), 0.0)
    if atol_given:
        return Tolerance(tol.atol, tol.rtol, cosine)
    return Tolerance(None, None, cosine)


def apply_budget(
    bounds: tuple[Bound, ...] | None,
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    report: dict[str, dict],
    extra: Mapping[str, Mapping[str, float]] | None = None,
) -> dict | None:
    """Measure, check, mark violating outputs not ok in ``report``; the manifest's parity.budget block.

    ``extra``: metrics measured elsewhere (a causal LM's top1 / ppl_delta on text, ir/llm_text.py);
    an extra top1 replaces the sample step's (a handful of random-token rows says little about top-1).
    """
    if bounds is None:
        return None
    metrics = measure(expected, actual)
    if extra:
        if any("top1" in m for m in extra.values()):
            for m in metrics.values():
                m.pop("top1", None)
        metrics.update({k: dict(v) for k, v in extra.items()})
    violations = check_budget(bounds, metrics)
    for name, r in report.items():
        if any(f"on output '{name}'" in v for v in violations):
            r["ok"] = False
        if name in metrics and "top1" in metrics[name]:
            r["top1"] = metrics[name]["top1"]
    block = {
        "budget": format_budget(bounds),
        "metrics": metrics,
        "violations": violations,
        "ok": not violations,
    }
    unmeasured = sorted({b.metric for b in bounds} - {k for m in metrics.values() for k in m})
    if unmeasured:  # e.g. ppl_delta: `precast eval --perplexity`, not the compile's parity feeds
        block["not_measured"] = unmeasured
    return block


def budget_message(target: str, violations: Sequence[str]) -> str:
    """The ParityError line: every violated bound, '; '-separated (a CI log shows this line, not the report)."""
    return f"target '{target}': accuracy budget exceeded: " + "; ".join(violations)
