"""``precast bisect``: run a pipeline prefix by prefix against the reference; name the first pass that breaks it.

The reference is ONNX Runtime on the unoptimized source graph, so the search isolates precast's passes
from the exporter (a torch-vs-export mismatch is not any pass's fault).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from precast.compiler.driver import source_of
from precast.compiler.frontends.source import Source
from precast.compiler.plan import CompileOptions
from precast.compiler.verification.verify import Verifier, sample_feeds
from precast.ir.parity import io_signature
from precast.ir.pipeline import parse_pipeline
from precast.runtime.progress import reporter
from precast.targets.base import get_target

__all__ = ["BisectResult", "bisect_model"]


@dataclass
class BisectResult:
    passes: list[str]
    tolerance: dict
    index: int | None = None  # first bad pass (0-based), None when every prefix keeps parity
    error: str | None = None
    after: list[str] = field(default_factory=list)

    @property
    def culprit(self) -> str | None:
        return None if self.index is None else self.passes[self.index]

    def to_json(self) -> dict:
        return {
            "ok": self.index is None,
            "passes": self.passes,
            "first_bad_index": self.index,
            "first_bad_pass": self.culprit,
            "after": self.after,
            "error": self.error,
            "tolerance": self.tolerance,
        }


def bisect_model(
    model: str | Source, opts: CompileOptions, target: str = "ort-cpu", progress=None
) -> BisectResult:
    """Bisect ``opts.passes`` (default: the target's pipeline) with ``opts``'s feeds and tolerances.

    ``progress`` (a precast.runtime.progress reporter, or a callable) hears the steps and each prefix."""
    report = reporter(progress)
    target_cls = get_target(target)
    specs = parse_pipeline(opts.passes or "default", default=target_cls.default_pipeline)
    report.step(f"loading {model if isinstance(model, str) else model.name}")
    source = source_of(model, opts, report)
    inputs, _ = io_signature(source.model)
    # The compile's own feeds, tolerance (a quantized pipeline's budget included) and pass context.
    verifier = Verifier(source, sample_feeds(source, inputs, opts), opts, report)
    tol = verifier.tolerance(target_cls.precision, specs)
    names = [str(s) for s in specs]
    result = BisectResult(names, {"atol": tol.atol, "rtol": tol.rtol, "min_cosine": tol.min_cosine})
    report.step(f"bisecting {len(specs)} passes against onnxruntime on the source graph")
    found = verifier.bisect(specs, tol)
    if found is not None:
        result.index, result.error = found
        result.after = names[: result.index]
    return result
