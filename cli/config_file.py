"""``precast.toml``: defaults for a command's options, read from its table (``[compile]``).

Every key is one of the command's own click options, so the file cannot drift from the command line: a new
``--option`` is accepted as ``option = ...`` the day it is added. A key is an option's long name with ``_`` or
``-`` (``min_cosine``, ``min-cosine``) or its parameter name (``targets`` for ``--target``). Values go through
the option's own click type; a repeatable option takes a list, and a ``KEY=VALUE`` one (``dim``,
``target_option``) also a table. The command line wins over the file; paths are relative to the working
directory, as on the command line. Mistakes are one line naming the file and the key (exit 1):

    precast.toml: unknown key 'min_cosin' in [compile]; did you mean 'min_cosine'?

Use ``config_option()`` as the command's ``--config`` option: it is eager, so the file's values are in the
context's ``default_map`` before click reads any other option.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import click

from precast.errors import UsageError

__all__ = ["DEFAULT_FILE", "config_keys", "config_option", "read_config"]

DEFAULT_FILE = "precast.toml"
_NOT_KEYS = {"config", "help"}


def config_keys(command: click.Command) -> dict[str, click.Option]:
    """Every key the command's table accepts -> the option it sets."""
    keys: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in _NOT_KEYS or param.hidden:
            continue
        keys[param.name] = param
        for opt in param.opts:
            if opt.startswith("--"):
                keys.setdefault(opt[2:].replace("-", "_"), param)
    return keys


def read_config(command: click.Command, path: str | None, table: str | None = None) -> dict[str, object]:
    """The command's defaults from ``path`` (or ./precast.toml when present): {parameter name: value}."""
    import tomllib  # Python 3.11+ (the file is optional: 3.10 fails only when it reads one)

    table = table or command.name
    cfg = Path(path) if path else Path(DEFAULT_FILE)
    if not cfg.is_file():
        if path:
            raise UsageError(f"config file not found: {cfg}")
        return {}
    try:
        data = tomllib.loads(cfg.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{cfg}: invalid TOML ({e})") from None
    section = data.get(table)
    if section is None:
        if path:  # named explicitly, so it was meant to configure this command
            raise UsageError(f"{cfg}: no [{table}] table")
        return {}
    if not isinstance(section, dict):
        raise UsageError(f"{cfg}: '{table}' must be a table ([{table}])")
    keys = config_keys(command)
    out: dict[str, object] = {}
    for key, value in section.items():
        option = keys.get(key.replace("-", "_"))
        if option is None:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(keys), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (keys: {', '.join(sorted(keys))})"
            raise UsageError(f"{cfg}: unknown key '{key}' in [{table}]{hint}")
        if option.name in out:
            raise UsageError(f"{cfg}: [{table}] sets '{option.name}' twice (as '{key}')")
        out[option.name] = _value(cfg, table, key, option, value)
    return out


def _value(cfg: Path, table: str, key: str, option: click.Option, value: object) -> object:
    where = f"{cfg}: [{table}] {key}"
    if option.multiple:
        if isinstance(value, dict):  # dim = {batch = 2} -> ("batch=2",)
            value = [f"{k}={v}" for k, v in value.items()]
        if not isinstance(value, list):
            raise UsageError(f"{where} must be a list (it is repeatable: {option.opts[-1]})")
        value = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        for i, v in enumerate(value):
            _check_kind(f"{where}[{i}]", option, v)
    else:
        _check_kind(where, option, value)
    try:
        return option.type_cast_value(click.Context(click.Command(key)), value)
    except click.BadParameter as e:
        raise UsageError(f"{where}: {e.format_message()}") from None


def _check_kind(where: str, option: click.Option, value: object) -> None:
    """The TOML value is of the option's kind: click would cast true to 1.0 for a float and fail inside
    on 5 for a path, so a value of another kind is refused here, naming the key."""
    kind = option.type
    if isinstance(kind, click.types.BoolParamType):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(kind, (click.types.FloatParamType, click.types.IntParamType)):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:  # strings, paths, choices
        ok, want = isinstance(value, str), "a string"
    if not ok:
        got = {bool: str(value).lower(), list: "a list", dict: "a table"}.get(type(value), repr(value))
        raise UsageError(f"{where} must be {want}, got {got}")


def _load(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    defaults = read_config(ctx.command, value)
    if defaults:
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def config_option(help: str | None = None):
    """The ``--config PATH`` option: read the command's table before any other option."""
    return click.option(
        "--config",
        "config",
        default=None,
        is_eager=True,
        callback=_load,
        help=help
        or f"{DEFAULT_FILE} with defaults for these options (default: ./{DEFAULT_FILE} if present).",
    )
