"""The target interface and registry.

A target turns an optimized ``onnx_ir.Model`` into files in an artifact directory:

    Target(options).build(model, out_dir, BuildContext) -> BuildResult(block, precision, stages, llm, io, ...)

``BuildContext`` is everything the driver hands a build besides the model (the feeds the passes saw, their
facts, the source's own lowerings); ``BuildResult`` is everything the driver reads back (the manifest's
``target`` block, which tells the runtime how to run the files, and the rest). Nothing is set on the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.schema import IOSignature
from precast.artifact.stages_spec import StagesSpec
from precast.artifact.target_blocks import TargetBlock
from precast.errors import UnknownTargetError
from precast.ir.registry import PassContext, PassFacts, PluginTable
from precast.options import Owner, describe, parse
from precast.runtime.progress import ProgressReporter

__all__ = [
    "Target",
    "BuildContext",
    "BuildResult",
    "NoTargetOptions",
    "Availability",
    "register_target",
    "get_target",
    "all_targets",
]


@dataclass(frozen=True)
class NoTargetOptions:
    pass


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class BuildContext:
    """What the driver hands ``Target.build`` besides the optimized model.

    A target that calibrates (ort-qnn) reads the same feeds the passes saw; one that builds several static
    shapes re-runs the pipeline per shape; one that ships its own lowering of the source (openvino's causal-lm
    step graph) finds it by its name."""

    pass_context: PassContext = field(default_factory=PassContext)  # sample/calibration feeds, progress
    facts: PassFacts = field(default_factory=PassFacts)  # what the pipeline's passes learned (pin-dims' io)
    lowerings: Mapping[str, Callable[..., Any]] = field(default_factory=dict)  # Source.lowerings
    # The target's pipeline re-run on the source with other sample feeds (ort-qnn: one model per bucket size)
    rerun_pipeline: Callable[[Feeds], ir.Model] | None = None

    @property
    def sample_feeds(self) -> Feeds:
        return self.pass_context.sample_feeds or {}

    @property
    def progress(self) -> ProgressReporter:
        return self.pass_context.progress


@dataclass(frozen=True)
class BuildResult:
    """What a target's build hands back to the driver (nothing is set on the target object)."""

    block: TargetBlock  # the manifest's target block
    precision: str  # what the files compute in (openvino weights=int4: "int4"): the tolerance/budget to hold
    stages: StagesSpec | None = None  # the manifest's stages block, when the build wrote stages
    # A target that wrote its own lowering of the source (openvino causal-lm: a PagedAttention step graph):
    # the manifest's llm block and io, in place of the ONNX graph's
    llm: LLMSpec | None = None
    io: IOSignature | None = None
    calibration_used: bool = False  # the build calibrated on the user's --calibration data


class Target:
    """A target. Its options are a frozen dataclass ``Options`` (like a pass's): each field's type says what
    ``--target-option key=value`` accepts (``Literal`` for a choice) and ``field(metadata={"help": ...})`` says
    what it does."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    default_pipeline: ClassVar[str] = ""
    precision: ClassVar[str] = "fp32"
    Options: ClassVar[type] = NoTargetOptions
    # {option: default}, derived from ``Options`` (the plan routes --target-option keys by it)
    option_defaults: ClassVar[dict[str, Any]] = {}
    # Whether the target writes a split-stages model as stages (precast.ir.stages); the plan refuses
    # split-stages in the pipeline of a target that does not.
    runs_stages: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__:
            cls.option_defaults = {f.name: f.default for f in dataclasses.fields(cls.Options)}

    def __init__(self, options: Any = None):
        """``options``: an ``Options`` instance, or raw ``{key: "value"}`` strings (parsed as the CLI does)."""
        # The frozen Options instance the build reads (``self.options.threads``): typed, no dict view
        self.options: Any = options if isinstance(options, self.Options) else self.parse_typed(options or {})

    @classmethod
    def parse_typed(cls, raw: dict[str, str]) -> Any:
        """Raw ``key=value`` strings -> ``Options``; an unknown key or a bad value is a one-line UsageError
        naming the target, the option and (for a misspelt key) the closest option."""
        return parse(cls.Options, raw, Owner("target", cls.name))

    @classmethod
    def describe_options(cls) -> dict[str, dict[str, Any]]:
        """{option: {default, type, help}} for ``precast targets``."""
        return describe(cls.Options)

    def check_options(self) -> None:
        """Checks across options (or of a value's form) that the types cannot say; raise UsageError.
        The compile plan calls it before any work."""

    @classmethod
    def can_build(cls) -> Availability:
        return Availability(True)

    @classmethod
    def can_run(cls) -> Availability:
        return Availability(True)

    def build(self, model: ir.Model, out_dir: Path, ctx: BuildContext) -> BuildResult:
        """Write the target's files into ``out_dir``; return the manifest ``target`` block (the
        runtime's record for the target's backend, artifact/target_blocks.py) and what else the manifest needs."""
        raise NotImplementedError

    def stand_in(self, out_dir: Path, built: BuildResult) -> Callable[[Feeds], Feeds] | None:
        """For artifacts that cannot run on the build host (a TensorRT build plan): a ``feeds -> outputs``
        callable the driver verifies instead, named in the block's ``verified_as``. None: load the artifact."""
        return None


_TABLE: PluginTable[type[Target]] = PluginTable("precast.targets", skip=("base",))
_TARGETS = _TABLE.classes


def register_target(name: str):
    # the one list of target names: the runtime's (which may not import this package)
    from precast.runtime.hal import TARGET_NAMES

    if name not in TARGET_NAMES:
        raise ValueError(f"target '{name}' is not in precast.runtime.hal.TARGET_NAMES: add it there first")

    def deco(cls: type[Target]) -> type[Target]:
        cls.name = name
        _TARGETS[name] = cls
        return cls

    return deco


def all_targets() -> dict[str, type[Target]]:
    return _TABLE.all()


def get_target(name: str) -> type[Target]:
    return _TABLE.get(
        name,
        lambda hint: UnknownTargetError(f"unknown target '{name}'{hint} (targets: {', '.join(_TARGETS)})"),
    )
