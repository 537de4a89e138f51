"""The pass registry: named passes with typed, frozen option dataclasses.

Adding a pass is a one-file change: drop ``passes/my_pass.py`` with a class decorated by
``@register("my-pass")``; ``load_all()`` imports every module of ``precast.passes``.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import onnx_ir as ir

from precast.errors import PassOptionError, UnknownPassError
from precast.options import (
    Owner,
    describe,
    fields_of,
    format_value,
    opt,
)
from precast.options import parse as parse_options
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "Pass",
    "PassResult",
    "PassContext",
    "PassFacts",
    "NoOptions",
    "PluginTable",
    "register",
    "get_pass",
    "all_passes",
    "load_all",
    "option",
    "option_help",
]


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class PassContext:
    """What a compile hands its passes beyond the graph: sample/calibration feeds, the source's identity.

    Frozen: every pass of a pipeline (and bisection's re-runs) sees the same inputs; what a pass learns goes
    back out through ``PassResult.facts``, never into the context.
    """

    sample_feeds: dict[str, Any] | None = None  # feeds used for verification
    calibration_feeds: list[dict[str, Any]] | None = None  # --calibration data, one dict per batch
    calibration_text: str | None = None  # --calibration FILE.txt for language models
    source_dir: str | Path | None = None  # the source model's folder (tokenizer, config), when there is one
    task: str | None = None  # the source's task ("causal-lm" sets quantize-int4's default accuracy level)
    source_name: str | None = None  # named in errors about the model (split-stages: too few layers)
    # A long pass reports inside its step (GPTQ per MatMul, calibration per batch): precast.runtime.progress
    progress: ProgressReporter = SILENT


@dataclass(frozen=True)
class PassFacts:
    """What a pass learned that a later stage needs; the pass manager merges them in pipeline order and the
    driver hands them to the target (``BuildContext.facts``) and to its own warnings."""

    # pin-dims: each graph input's and output's shape before pinning (str for a symbolic dim), so a target
    # that builds several sizes of one dim (ort-qnn sequence buckets) knows which axis it is
    symbolic_io: Mapping[str, tuple[int | str, ...]] | None = None
    # a pass calibrated on the user's --calibration data (feeds or text): the driver warns when none did
    calibration_used: bool = False

    def merge(self, later: PassFacts) -> PassFacts:
        """These facts, then ``later``'s: a later pass's symbolic io replaces an earlier one's."""
        return PassFacts(
            symbolic_io=later.symbolic_io if later.symbolic_io is not None else self.symbolic_io,
            calibration_used=self.calibration_used or later.calibration_used,
        )


@dataclass(frozen=True)
class PassResult:
    """What a pass returns (onnx-ir's ``PassResult(model, modified)`` plus the counts users read and facts)."""

    model: ir.Model
    modified: bool  # whether the pass changed the graph (a fusion that found nothing: False)
    stats: dict[str, Any] = field(default_factory=dict)  # e.g. {"fused": 3}: reported per pass
    facts: PassFacts = field(default_factory=PassFacts)


class Pass:
    """Base class. Subclasses set ``name`` (via @register), optionally ``Options`` and implement ``call``.

    ``call`` may mutate the model in place and return it; the pass manager hands it a model it owns.
    ``context``: the compile's frozen PassContext (an empty one for a pass run on its own, ``FusePass()(m)``).
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # True: nothing may run after this pass (split-stages: a later pass would add nodes it did not annotate)
    must_be_last: ClassVar[bool] = False

    def __init__(self, options: Any = None, *, context: PassContext | None = None, **kwargs: Any):
        if options is None:
            options = self.Options(**kwargs)
        self.options = options
        self.context = context if context is not None else PassContext()

    def call(self, model: ir.Model) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, model: ir.Model) -> PassResult:
        return self.call(model)

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


T = TypeVar("T")


class PluginTable(Generic[T]):
    """Plugin classes of one kind by name (passes, targets). Each module of ``package`` registers its own with
    a decorator, and the package is imported on the first lookup: adding one is a one-file change."""

    def __init__(self, package: str, skip: tuple[str, ...] = ()):
        self.package, self.skip = package, skip
        self.classes: dict[str, T] = {}
        self.loaded = False

    def load_all(self) -> None:
        if self.loaded:
            return
        for info in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
            if info.name not in self.skip and not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")
        self.loaded = True

    def all(self) -> dict[str, T]:
        self.load_all()
        return dict(sorted(self.classes.items()))

    def get(self, name: str, unknown: Callable[[str], Exception]) -> T:
        """The class registered as ``name``, or ``unknown(hint)`` raised (hint: "; did you mean 'x'?" or "")."""
        self.load_all()
        if name not in self.classes:
            close = difflib.get_close_matches(name, list(self.classes), n=1, cutoff=0.5)
            raise unknown(f"; did you mean '{close[0]}'?" if close else "")
        return self.classes[name]


_PASSES: PluginTable[type[Pass]] = PluginTable("precast.passes")
_LIST_HINT = "; run 'precast passes' for the list"
_REGISTRY = _PASSES.classes


def register(name: str):
    def deco(cls: type[Pass]) -> type[Pass]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"pass '{name}' registered twice ({_REGISTRY[name].__module__}, {cls.__module__})"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def load_all() -> None:
    """Import every module in precast.passes so that their @register decorators run."""
    _PASSES.load_all()


def all_passes() -> dict[str, type[Pass]]:
    return _PASSES.all()


def get_pass(name: str) -> type[Pass]:
    return _PASSES.get(name, lambda hint: UnknownPassError(f"unknown pass '{name}'{hint or _LIST_HINT}"))


def _owner(pass_name: str) -> Owner:
    """A pass's option errors name the pass and are PipelineErrors (exit 2, like a bad pipeline string)."""
    return Owner("pass", pass_name, PassOptionError)


def option_fields(options_cls: type) -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each option, with string annotations resolved."""
    return [(f.name, f.type, f.default) for f in fields_of(options_cls)]


# A pass option and its one-line help (shown by ``precast passes``): ``block: int = option(32, "...")``.
option = opt


def option_help(options_cls: type) -> dict[str, str]:
    """{option: its one-line help ('' when it has none)}."""
    return {f.name: f.help for f in fields_of(options_cls)}


def describe_options(options_cls: type) -> str:
    """One line per option: ``percdamp=0.01 (float): gptq: Hessian dampening, ...``."""
    return "\n".join(
        f"{n}={format_value(d['default'])} ({d['type']})" + (f": {d['help']}" if d["help"] else "")
        for n, d in describe(options_cls).items()
    )


format_option_value = format_value


def build_options(pass_cls: type[Pass], raw: dict[str, Any]) -> Any:
    """A pipeline item's ``{key=value}`` text -> the pass's ``Options`` (precast/options.py parses)."""
    return parse_options(pass_cls.Options, raw, _owner(pass_cls.name))
