"""The target interface and registry.

A target turns an optimized ``onnx_ir.Model`` into files in an artifact directory and returns the
manifest's ``target`` block, which tells the runtime how to run them.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import onnx_ir as ir

from precast.runtime.errors import UnknownTargetError, UsageError

__all__ = ["Target", "Availability", "register_target", "get_target", "all_targets"]


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


class Target:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    default_pipeline: ClassVar[str] = ""
    precision: ClassVar[str] = "fp32"
    # Target options (--target-option key=value) and their defaults; values are strings on the CLI.
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, options: dict[str, str] | None = None):
        self.options = self.parse_options(options or {})
        # The compile's PassContext (sample/calibration feeds), set by the driver before build().
        self.context: Any = None

    @classmethod
    def parse_options(cls, raw: dict[str, str]) -> dict[str, Any]:
        out = dict(cls.option_defaults)
        for key, value in raw.items():
            if key not in cls.option_defaults:
                close = difflib.get_close_matches(key, list(cls.option_defaults), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise UsageError(
                    f"target '{cls.name}' has no option '{key}'{hint} (options: {', '.join(cls.option_defaults) or 'none'})"
                )
            default = cls.option_defaults[key]
            try:
                out[key] = (
                    type(default)(value)
                    if not isinstance(default, bool)
                    else value.lower() in ("1", "true", "yes")
                )
            except ValueError:
                raise UsageError(
                    f"target '{cls.name}' option '{key}' expects {type(default).__name__}, got '{value}'"
                ) from None
            # Numeric target options are counts and sizes (threads, batch sizes, MB): never negative.
            if isinstance(out[key], int | float) and not isinstance(out[key], bool) and out[key] < 0:
                raise UsageError(f"target '{cls.name}' option '{key}' must be >= 0, got {value}")
        return out

    @classmethod
    def can_build(cls) -> Availability:
        return Availability(True)

    @classmethod
    def can_run(cls) -> Availability:
        return Availability(True)

    def build(self, model: ir.Model, out_dir: Path) -> dict:
        """Write the target's files into ``out_dir``; return the manifest ``target`` block."""
        raise NotImplementedError

    def stand_in(self, out_dir: Path, block: dict):
        """For artifacts that cannot run on the build host (a TensorRT build plan): a ``feeds -> outputs``
        callable the driver verifies instead, named in the block's ``verified_as``. None: load the artifact."""
        return None


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
