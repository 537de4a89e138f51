"""The target interface and registry.

A target turns an optimized ``onnx_ir.Model`` into files in an artifact directory and returns the
manifest's ``target`` block, which tells the runtime how to run them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

import onnx_ir as ir

from precast.runtime.errors import UnknownTargetError, UsageError
from precast.runtime.target_blocks import TargetBlock

__all__ = ["Target", "NoTargetOptions", "Availability", "register_target", "get_target", "all_targets"]


@dataclass(frozen=True)
class NoTargetOptions:
    pass


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


class Target:
    """A target. Its options are a frozen dataclass ``Options`` (like a pass's): each field's type says what
    ``--target-option key=value`` accepts (``Literal`` for a choice) and ``field(metadata={"help": ...})`` says
    what it does. A target that declares only ``option_defaults`` gets an ``Options`` built from them."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    default_pipeline: ClassVar[str] = ""
    precision: ClassVar[str] = "fp32"
    Options: ClassVar[type] = NoTargetOptions
    # {option: default}, derived from ``Options`` (older targets declare this instead)
    option_defaults: ClassVar[dict[str, Any]] = {}
    # Whether the target writes a split-stages model as stages (precast.compiler.stages); the plan refuses
    # split-stages in the pipeline of a target that does not.
    runs_stages: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__:
            cls.option_defaults = {f.name: f.default for f in dataclasses.fields(cls.Options)}
        elif "option_defaults" in cls.__dict__:
            cls.Options = _options_from_defaults(cls.__name__, cls.option_defaults)

    def __init__(self, options: Any = None):
        """``options``: an ``Options`` instance, or raw ``{key: "value"}`` strings (parsed as the CLI does)."""
        typed = options if isinstance(options, self.Options) else self.parse_typed(options or {})
        self.typed_options = typed
        # The plain {key: value} view the target's build reads (and the cache key hashes).
        self.options: dict[str, Any] = dataclasses.asdict(typed)
        # The compile's PassContext (sample/calibration feeds), set by the driver before build().
        self.context: Any = None
        # The manifest's stages block (runtime.stages_spec.StagesSpec), set by build() when it wrote stages.
        self.stages: Any = None
        # Set by build() when the target wrote its own lowering of the source (openvino causal-lm: a
        # PagedAttention step graph): the manifest's llm block (dict) and io ([inputs], [outputs]).
        self.llm: Any = None
        self.io: Any = None

    @classmethod
    def parse_typed(cls, raw: dict[str, str]) -> Any:
        """Raw ``key=value`` strings -> ``Options``; an unknown key or a bad value is a one-line UsageError
        naming the target, the option and (for a misspelt key) the closest option."""
        fields = {f.name: hints for f, hints in _option_types(cls.Options)}
        values = {}
        for key, value in raw.items():
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise UsageError(
                    f"target '{cls.name}' has no option '{key}'{hint} (options: {', '.join(fields) or 'none'})"
                )
            values[key] = _convert(cls.name, key, value, fields[key])
        try:
            return cls.Options(**values)
        except (TypeError, ValueError) as e:
            raise UsageError(f"target '{cls.name}': {e}") from e

    @classmethod
    def parse_options(cls, raw: dict[str, str]) -> dict[str, Any]:
        return dataclasses.asdict(cls.parse_typed(raw))

    @classmethod
    def describe_options(cls) -> dict[str, dict[str, Any]]:
        """{option: {default, type, help}} for ``precast targets``."""
        return {
            f.name: {"default": f.default, "type": _type_name(tp), "help": f.metadata.get("help", "")}
            for f, tp in _option_types(cls.Options)
        }

    def check_options(self) -> None:
        """Checks across options (or of a value's form) that the types cannot say; raise UsageError.
        The compile plan calls it before any work."""

    @classmethod
    def can_build(cls) -> Availability:
        return Availability(True)

    @classmethod
    def can_run(cls) -> Availability:
        return Availability(True)

    def build(self, model: ir.Model, out_dir: Path) -> TargetBlock:
        """Write the target's files into ``out_dir``; return the manifest ``target`` block (the
        runtime's record for the target's backend, runtime/target_blocks.py)."""
        raise NotImplementedError

    def stand_in(self, out_dir: Path, block: TargetBlock):
        """For artifacts that cannot run on the build host (a TensorRT build plan): a ``feeds -> outputs``
        callable the driver verifies instead, named in the block's ``verified_as``. None: load the artifact."""
        return None


def _option_types(options_cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(options_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(options_cls)]


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "|".join(str(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _options_from_defaults(owner: str, defaults: dict[str, Any]) -> type:
    """A frozen Options dataclass whose field types are the defaults' types."""
    fields = [(k, type(v), dataclasses.field(default=v)) for k, v in defaults.items()]
    return dataclasses.make_dataclass(f"{owner}Options", fields, frozen=True)


def _convert(target: str, key: str, raw: Any, tp: Any) -> Any:
    """One ``--target-option`` value (a string on the CLI) to its declared type."""
    where = f"target '{target}' option '{key}'"
    if not isinstance(raw, str):
        raw = str(raw).lower() if isinstance(raw, bool) else str(raw)
    if get_origin(tp) is Literal:
        choices = {str(a).lower(): a for a in get_args(tp)}
        if raw.lower() not in choices:
            close = difflib.get_close_matches(raw, [str(a) for a in get_args(tp)], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UsageError(f"{where} must be one of {_type_name(tp)}, got '{raw}'{hint}")
        return choices[raw.lower()]
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"{where} must be true or false, got '{raw}'")
    if tp in (int, float):
        try:
            value = tp(raw)
        except ValueError:
            raise UsageError(f"{where} expects {tp.__name__}, got '{raw}'") from None
        # Numeric target options are counts and sizes (threads, batch sizes, MB): never negative.
        if not 0 <= value < float("inf"):
            raise UsageError(f"{where} must be >= 0, got {raw}")
        return value
    return raw


_TARGETS: dict[str, type[Target]] = {}
_LOADED = False


def register_target(name: str):
    def deco(cls: type[Target]) -> type[Target]:
        cls.name = name
        _TARGETS[name] = cls
        return cls

    return deco


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    import precast.targets as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base",) and not info.name.startswith("_"):
            importlib.import_module(f"precast.targets.{info.name}")
    _LOADED = True


def all_targets() -> dict[str, type[Target]]:
    _load_all()
    return dict(sorted(_TARGETS.items()))


def get_target(name: str) -> type[Target]:
    _load_all()
    if name in _TARGETS:
        return _TARGETS[name]
    close = difflib.get_close_matches(name, list(_TARGETS), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise UnknownTargetError(f"unknown target '{name}'{hint} (targets: {', '.join(_TARGETS)})")
