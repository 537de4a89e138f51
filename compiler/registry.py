"""The pass registry: named passes with typed, frozen option dataclasses.

Adding a pass is a one-file change: drop ``passes/my_pass.py`` with a class decorated by
``@register("my-pass")``; ``load_all()`` imports every module of ``precast.passes``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import pkgutil
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args, get_origin

import onnx_ir as ir

from precast.runtime.errors import PassOptionError, UnknownPassError
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "Pass",
    "PassResult",
    "PassContext",
    "NoOptions",
    "register",
    "get_pass",
    "all_passes",
    "load_all",
    "parse_option_value",
    "option",
    "option_help",
]


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass
class PassContext:
    """What a pass may need beyond the graph: sample/calibration feeds and the reference outputs.

    The pass manager sets ``pass_.context`` before ``call``; passes that need nothing ignore it.
    """

    sample_feeds: dict[str, Any] | None = None  # feeds used for verification
    calibration_feeds: list[dict[str, Any]] | None = None  # --calibration data, one dict per batch
    calibration_text: str | None = None  # --calibration FILE.txt for language models
    source_dir: Any = None  # the source model's folder (tokenizer, config), when there is one
    extra: dict[str, Any] = field(default_factory=dict)
    # A long pass reports inside its step (GPTQ per MatMul, calibration per batch): precast.runtime.progress
    progress: ProgressReporter = SILENT


@dataclass
class PassResult:
    model: ir.Model
    stats: dict[str, Any] = field(default_factory=dict)


class Pass:
    """Base class. Subclasses set ``name`` (via @register), optionally ``Options`` and implement ``call``.

    ``call`` may mutate the model in place and return it; the pass manager hands it a model it owns.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # True: nothing may run after this pass (split-stages: a later pass would add nodes it did not annotate)
    must_be_last: ClassVar[bool] = False

    def __init__(self, options: Any = None, **kwargs: Any):
        if options is None:
            options = self.Options(**kwargs)
        self.options = options
        self.context = PassContext()

    def call(self, model: ir.Model) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, model: ir.Model) -> PassResult:
        return self.call(model)

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


_REGISTRY: dict[str, type[Pass]] = {}
_LOADED = False


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
    global _LOADED
    if _LOADED:
        return
    import precast.passes as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"precast.passes.{info.name}")
    _LOADED = True


def all_passes() -> dict[str, type[Pass]]:
    load_all()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> type[Pass]:
    load_all()
    if name in _REGISTRY:
        return _REGISTRY[name]
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; run 'precast passes' for the list"
    raise UnknownPassError(f"unknown pass '{name}'{hint}")


def _type_name(tp: Any) -> str:
    if get_origin(tp) in (typing.Union, types.UnionType):
        return "|".join("none" if a is type(None) else _type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if get_origin(tp) in (tuple, list):
        return f"[{_type_name(get_args(tp)[0])},...]"
    return getattr(tp, "__name__", str(tp))


def option_fields(options_cls: type) -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each option, with string annotations resolved."""
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, hints[f.name], default))
    return out


def option(default: Any, help: str) -> Any:
    """A pass option and its one-line help (shown by ``precast passes``): ``block: int = option(32, "...")``."""
    return dataclasses.field(default=default, metadata={"help": help})


def option_help(options_cls: type) -> dict[str, str]:
    """{option: its one-line help ('' when it has none)}."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(options_cls)}


def describe_options(options_cls: type) -> str:
    """One line per option: ``percdamp=0.01 (float): gptq: Hessian dampening, ...``."""
    helps = option_help(options_cls)
    return "\n".join(
        f"{n}={_fmt(d)} ({_type_name(t)})" + (f": {helps[n]}" if helps[n] else "")
        for n, t, d in option_fields(options_cls)
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def format_option_value(value: Any) -> str:
    return _fmt(value)


def parse_option_value(pass_name: str, key: str, raw: str | list, tp: Any) -> Any:
    """Convert the raw text of ``key=raw`` to the option's declared type."""
    origin = get_origin(tp)
    where = f"pass '{pass_name}' option '{key}'"
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if raw in ("none", "null"):
            return None
        return parse_option_value(pass_name, key, raw, args[0])
    if origin in (tuple, list):
        (inner,) = get_args(tp)[:1]
        items = raw if isinstance(raw, list) else [raw]
        return tuple(parse_option_value(pass_name, key, r, inner) for r in items)
    if isinstance(raw, list):
        raise PassOptionError(f"{where} takes a single value, got a list")
    if origin is Literal:
        choices = [str(a) for a in get_args(tp)]
        if raw not in choices:
            raise PassOptionError(f"{where} must be one of {'|'.join(choices)}, got '{raw}'")
        return next(a for a in get_args(tp) if str(a) == raw)
    if tp is bool:
        if raw.lower() in ("true", "1", "yes", "on"):
            return True
        if raw.lower() in ("false", "0", "no", "off"):
            return False
        raise PassOptionError(f"{where} must be true or false, got '{raw}'")
    # Every numeric pass option is a count, a size or a fraction: never negative.
    if tp is int:
        try:
            value = int(raw)
        except ValueError:
            raise PassOptionError(f"{where} must be an integer, got '{raw}'") from None
        if value < 0:
            raise PassOptionError(f"{where} must be >= 0, got {value}")
        return value
    if tp is float:
        try:
            value = float(raw)
        except ValueError:
            raise PassOptionError(f"{where} must be a number, got '{raw}'") from None
        if not 0 <= value < math.inf:
            raise PassOptionError(f"{where} must be a finite number >= 0, got {raw}")
        return value
    return raw


def build_options(pass_cls: type[Pass], raw: dict[str, Any]) -> Any:
    fields = {n: t for n, t, _ in option_fields(pass_cls.Options)}
    values = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = ", ".join(fields) or "none"
            raise PassOptionError(f"pass '{pass_cls.name}' has no option '{key}'{hint} (options: {known})")
        values[key] = parse_option_value(pass_cls.name, key, value, fields[key])
    try:
        return pass_cls.Options(**values)
    except (TypeError, ValueError) as e:
        raise PassOptionError(f"pass '{pass_cls.name}': {e}") from e
