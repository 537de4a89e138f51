"""The one option schema: passes, targets, `precast serve` and the LLM scheduler declare options the same way.

Options are dataclasses whose fields say everything a user sees: the type (``Literal[...]`` for a choice,
``X | None`` for "unset", ``tuple[X, ...]`` for a list), the default, and in ``opt()``'s metadata the one-line
help and the bounds of a number. From that one declaration come

- ``parse()``: raw ``{key: "value"}`` text (a pipeline's ``{block=32}``, ``--target-option k=v``) or typed
  values -> the options instance, or one line naming the owner, the key and what it accepts;
- ``describe()``: ``{option: {default, type, help}}`` for ``precast passes`` / ``precast targets``;
- ``click_options()``: click options for a command (``precast serve``), so a flag's default, bound and help
  are written once, next to the field; ``precast.toml`` keys follow from the click options (cli/config_file).

A number without a declared ``min`` is never negative: every such option is a count, a size or a fraction.

    @dataclass(frozen=True)
    class Options:
        block: int = opt(32, "weights per quantization block", min=16, max=256)
        algo: Literal["rtn", "gptq"] = opt("rtn", "rounding, or GPTQ's error-compensating updates")
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from precast.errors import UsageError

__all__ = [
    "OptionField",
    "Owner",
    "click_options",
    "describe",
    "fields_of",
    "format_value",
    "opt",
    "parse",
    "parse_value",
    "type_name",
]

_NONE = type(None)


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    min: float | None = None,
    max: float | None = None,
    env: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that carries its help and bounds: ``block: int = opt(32, "...", min=16)``.

    ``env``: the environment variable that gives the value when it is not set (the CLI reads it too);
    ``parse``: a text -> value function for a value with its own syntax (a memory size: ``128MiB``), raising
    UsageError; ``metavar``: the name that syntax goes by in ``--help``."""
    meta = {"help": help, "min": min, "max": max, "env": env, "parse": parse, "metavar": metavar}
    return dataclasses.field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


@dataclass(frozen=True)
class OptionField:
    """One option as the schema sees it: its resolved type, its default (``dataclasses.MISSING`` when
    required) and what ``opt()`` recorded."""

    name: str
    type: Any
    default: Any
    help: str = ""
    min: float | None = None
    max: float | None = None
    env: str | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None

    @property
    def low(self) -> float:
        """The least a number may be: the declared ``min``, else 0."""
        return 0 if self.min is None else self.min


@dataclass(frozen=True)
class Owner:
    """Whose options these are. Every error names it (``pass 'fold-constants' option 'x' ...``) and is raised
    as ``error``: a pass's as PassOptionError (a pipeline error), a target's as UsageError."""

    kind: str
    name: str
    error: type[Exception] = UsageError

    def __str__(self) -> str:
        return f"{self.kind} '{self.name}'"


@functools.lru_cache(maxsize=None)
def fields_of(options_cls: type) -> tuple[OptionField, ...]:
    """The options of a dataclass, in declaration order, with string annotations resolved."""
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        meta = {
            k: f.metadata[k] for k in ("help", "min", "max", "env", "parse", "metavar") if k in f.metadata
        }
        out.append(OptionField(f.name, hints[f.name], default, **meta))
    return tuple(out)


def type_name(tp: Any) -> str:
    """What an option accepts, as ``precast passes`` prints it: ``int``, ``rtn|gptq``, ``int|none``, ``[str,...]``."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return "|".join("none" if a is _NONE else type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if get_origin(tp) in (tuple, list):
        return f"[{type_name(get_args(tp)[0])},...]"
    return getattr(tp, "__name__", str(tp))


def format_value(value: Any) -> str:
    """A value as option text that ``parse`` reads back: ``none``, ``true``, ``[a,b]``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


def describe(options_cls: type) -> dict[str, dict[str, Any]]:
    """{option: {default, type, help}}."""
    return {
        f.name: {"default": f.default, "type": type_name(f.type), "help": f.help}
        for f in fields_of(options_cls)
    }


def parse(options_cls: type, raw: Mapping[str, Any], owner: Owner) -> Any:
    """``{key: value}`` (text, or values of the option's type) -> an ``options_cls`` instance. An unknown key
    names the closest option; a bad value says what the option accepts; a check of the dataclass's own
    (``__post_init__`` raising TypeError/ValueError) is reported under the owner's name."""
    fields = {f.name: f for f in fields_of(options_cls)}
    values = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = ", ".join(fields) or "none"
            raise owner.error(f"{owner} has no option '{key}'{hint} (options: {known})")
        values[key] = parse_value(owner, fields[key], value)
    try:
        return options_cls(**values)
    except (TypeError, ValueError) as e:
        raise owner.error(f"{owner}: {e}") from e


def parse_value(owner: Owner, field: OptionField, raw: Any, tp: Any = None) -> Any:
    """One option's value (``raw``: text, or a value of its type) -> the declared type ``tp`` (default: the
    field's). ``none``/``null`` unset an optional; a list fills a tuple; a choice matches in any case."""
    tp = field.type if tp is None else tp
    where = f"{owner} option '{field.name}'"
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if raw is None or raw in ("none", "null"):
            return None
        return parse_value(owner, field, raw, next(a for a in get_args(tp) if a is not _NONE))
    if origin in (tuple, list):
        items = raw if isinstance(raw, (list, tuple)) else [raw]
        return tuple(parse_value(owner, field, r, get_args(tp)[0]) for r in items)
    if isinstance(raw, (list, tuple)):
        raise owner.error(f"{where} takes a single value, got a list")
    if field.parse is not None and isinstance(raw, str):
        try:
            return field.parse(raw)
        except UsageError as e:
            raise owner.error(f"{where}: {e}") from None
    text = str(raw).lower() if isinstance(raw, bool) else str(raw)
    if origin is Literal:
        return _choice(owner.error, where, text, tp)
    if tp is bool:
        return _bool(owner.error, where, text)
    if tp is int or tp is float:
        return _number(owner.error, where, text, tp, field)
    return text if tp is str else raw


def _choice(error: type[Exception], where: str, text: str, tp: Any) -> Any:
    choices = {str(a).lower(): a for a in get_args(tp)}
    if text.lower() not in choices:
        close = difflib.get_close_matches(text, [str(a) for a in get_args(tp)], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise error(f"{where} must be one of {type_name(tp)}, got '{text}'{hint}")
    return choices[text.lower()]


def _bool(error: type[Exception], where: str, text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise error(f"{where} must be true or false, got '{text}'")


def _number(error: type[Exception], where: str, text: str, tp: type, field: OptionField) -> Any:
    low, high = field.low, field.max
    try:
        value = tp(text)
    except ValueError:
        what = "an integer" if tp is int else "a number"
        raise error(f"{where} must be {what}, got '{text}'") from None
    if tp is float and not low <= value < math.inf:
        raise error(f"{where} must be a finite number >= {low}, got {text}")
    if value < low:
        raise error(f"{where} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise error(f"{where} must be <= {high}, got {value}")
    return value


# -- click ---------------------------------------------------------------------------------------------------


def click_options(
    options_cls: type,
    only: Iterable[str] | None = None,
    *,
    rename: Mapping[str, str] | None = None,
    callbacks: Mapping[str, Callable[..., Any]] | None = None,
    unset: bool = False,
    prefix: str = "",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that adds one click option per field (those named in ``only``, in that order; default:
    every field with a help), so that a flag's default, type, bound and help are the field's.

    The flag is ``--field-name`` (``rename``: {field: flag name}); the parameter keeps the field's name.
    ``unset``: the flag's default is None (the owner applies its own default; the help says which), for
    options handed on only when given. ``prefix`` starts every help (``"LLM: "``)."""
    by_name = {f.name: f for f in fields_of(options_cls)}
    names = list(only) if only is not None else [n for n, f in by_name.items() if f.help]
    made = [_click_option(by_name[n], rename or {}, callbacks or {}, unset, prefix) for n in names]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(made):  # click lists the options in the order their decorators are written
            fn = option(fn)
        return fn

    return decorate


def _click_option(f: OptionField, rename: Mapping[str, str], callbacks: Mapping, unset: bool, prefix: str):
    import click

    flag = "--" + rename.get(f.name, f.name).replace("_", "-")
    help = prefix + f.help
    default = f.default
    if unset and default is not None:
        help, default = f"{help.rstrip('.')} (default {format_value(default)}).", None
    # show_default None (not False): the context's setting decides, as for a hand-written option
    kwargs: dict[str, Any] = {"default": default, "help": help or None, "envvar": f.env}
    kwargs["show_default"] = True if default is not None else None
    if f.name in callbacks:
        kwargs["callback"] = callbacks[f.name]
    tp = _inner(f.type)
    if tp is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", f.name, **kwargs)
    return click.option(flag, f.name, type=_click_type(f, tp), **kwargs)


def _inner(tp: Any) -> Any:
    """``X | None`` -> X (an unset flag is None)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not _NONE)
    return tp


def _click_type(f: OptionField, tp: Any):
    import click

    if f.parse is not None:
        return _parsed_type(f.metavar or "value", f.parse)
    if get_origin(tp) is Literal:
        return click.Choice([str(a) for a in get_args(tp)])
    if tp is int:
        return click.IntRange(f.low, f.max)
    if tp is float:
        return _finite_type()(f.low, f.max)
    return click.STRING


@functools.lru_cache(maxsize=None)
def _finite_type() -> type:
    import click

    class FiniteFloatRange(click.FloatRange):
        """A FloatRange that also refuses nan and inf (nan passes every range comparison)."""

        def convert(self, value, param, ctx):
            out = super().convert(value, param, ctx)
            if not math.isfinite(out):
                self.fail(f"{value!r} is not a finite number.", param, ctx)
            return out

    return FiniteFloatRange


def _parsed_type(name: str, fn: Callable[[str], Any]):
    """A click type for a value with its own syntax: ``fn`` reads the text (a value already converted, e.g. a
    default or a precast.toml number, passes as it is); its UsageError becomes click's usage error."""
    import click

    class Parsed(click.ParamType):
        def convert(self, value, param, ctx):
            if not isinstance(value, str):
                return value
            try:
                return fn(value)
            except UsageError as e:
                self.fail(str(e), param, ctx)

    Parsed.name = name
    return Parsed()
