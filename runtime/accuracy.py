"""Accuracy budgets: ``cosine>=0.99,top1>=0.95,max_abs<=0.1`` parsed, measured and checked (numpy only).

Quantized artifacts are not held to fp32's elementwise tolerances; they are held to the budget, per
output, and the compile fails naming the metric, the output and the shortfall.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from precast.errors import UsageError
from precast.runtime.option_text import option_groups

__all__ = ["Bound", "parse_budget", "format_budget", "measure", "check_budget", "DEFAULT_QUANT_BUDGET"]

# metric -> the direction that is "better": a budget bound must point the same way.
_METRICS = {"cosine": ">=", "top1": ">=", "max_abs": "<=", "ppl_delta": "<="}
_ITEM = re.compile(r"^\s*([a-z_0-9]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")
DEFAULT_QUANT_BUDGET = "cosine>=0.99"


@dataclass(frozen=True)
class Bound:
    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:.10g}"


def parse_budget(text: str) -> tuple[Bound, ...]:
    """'cosine>=0.99,top1>=0.95' -> bounds; an unknown metric or wrong direction is a UsageError."""
    bounds = []
    for item in filter(str.strip, text.split(",")):
        expected = "METRIC>=VALUE or METRIC<=VALUE"
        metric, op, raw = option_groups(_ITEM, item.strip(), "accuracy budget item", expected)
        if metric not in _METRICS:
            raise UsageError(f"unknown accuracy metric '{metric}' in budget (metrics: {', '.join(_METRICS)})")
        if op != _METRICS[metric]:
            raise UsageError(
                f"accuracy budget '{item.strip()}': {metric} is bounded with '{_METRICS[metric]}'"
            )
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"accuracy budget '{item.strip()}': '{raw}' is not a number") from None
        bounds.append(Bound(metric, op, value))
    if not bounds:
        raise UsageError("empty accuracy budget")
    return tuple(bounds)


def format_budget(bounds: tuple[Bound, ...]) -> str:
    return ",".join(str(b) for b in bounds)


def measure(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]
) -> dict[str, dict[str, float]]:
    """Per float output: cosine, max_abs, and top1 (argmax agreement over the last axis, when it has > 1 entry)."""
    out: dict[str, dict[str, float]] = {}
    for name, ref in expected.items():
        ref = np.asarray(ref)
        if name not in actual or ref.dtype.kind != "f":
            continue
        got = np.asarray(actual[name])
        if got.shape != ref.shape:
            continue
        a, b = ref.astype(np.float64), got.astype(np.float64)
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        cosine = float(a.ravel() @ b.ravel() / (na * nb)) if na > 0 and nb > 0 else float(na == nb)
        metrics = {"cosine": round(cosine, 7), "max_abs": float(f"{np.abs(a - b).max(initial=0.0):.3g}")}
        if ref.ndim >= 1 and ref.shape[-1] > 1:
            metrics["top1"] = round(float(np.mean(a.argmax(-1) == b.argmax(-1))), 6)
        if not np.isfinite(b).all():
            metrics["cosine"] = 0.0
        out[name] = metrics
    return out


def check_budget(bounds: tuple[Bound, ...], metrics: Mapping[str, Mapping[str, float]]) -> list[str]:
    """One message per violated bound and output, e.g. "cosine 0.9712 on output 'y' misses >=0.99 by 0.0188"."""
    problems = []
    for bound in bounds:
        for name, m in metrics.items():
            if bound.metric not in m:
                continue
            got = m[bound.metric]
            short = bound.value - got if bound.op == ">=" else got - bound.value
            if short > 0:
                problems.append(f"{bound.metric} {got:.6g} on output '{name}' misses {bound} by {short:.4g}")
    return problems
