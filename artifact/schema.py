"""The artifact schema: typed records for ``manifest.json`` and the checks every one of them gets.

A ``Record`` is a frozen dataclass whose fields are the JSON object's keys. ``Record.from_json(obj, where)``
checks the object against the field types, refuses a key the record does not have and a required key that is
missing (ArtifactError, exit 3, naming the key and ``where``: ``manifest.json: target block 'ort-cpu':
unknown key 'ort_levle'``); ``to_json()`` gives the object back as it was written.

Optional fields default to None, which means "absent": ``to_json`` leaves them out, so a record written
and read back is the same JSON (artifacts stay byte-identical); a key written as null is refused. A record whose every key is always written
(the ``llm`` block) sets ``WRITE_NONE = True``.

Free-form parts (the source's info, pass stats, the parity report, vendor settings) stay ``dict``: the
record that holds one says so in its docstring, and the code that reads one checks what it reads.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, TypeVar, Union

from precast.errors import ArtifactError

__all__ = ["Record", "TensorSpec", "IOSignature", "TargetEntry", "type_name"]

R = TypeVar("R", bound="Record")


class Record:
    """Base of every schema record (subclasses are frozen dataclasses)."""

    WRITE_NONE: ClassVar[bool] = False  # True: None fields are written as null, not left out

    @classmethod
    def from_json(cls: type[R], obj: object, where: str, path: str = "") -> R:
        """``obj`` checked and typed; errors name ``where`` (the file and block) and the key, dotted
        from the block (``path`` is the prefix of a nested record's keys, e.g. ``session.``)."""
        if not isinstance(obj, dict):
            what = f"'{path[:-1]}'" if path else "the block"
            raise ArtifactError(f"{where}: {what} must be a JSON object, got {type_name(obj)}")
        hints = _hints(cls)
        for key in obj:
            if key not in hints:
                raise ArtifactError(f"{where}: unknown key '{path}{key}'")
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in obj:
                if obj[f.name] is None and not cls.WRITE_NONE:  # absent keys are left out, never null
                    want = _describe(_without_null(hints[f.name]))
                    raise ArtifactError(f"{where}: '{path}{f.name}' must be {want}, got null")
                parse = cls.field_parser(f.name)
                values[f.name] = (
                    parse(obj[f.name], where)
                    if parse is not None
                    else check_value(obj[f.name], hints[f.name], where, f"{path}{f.name}")
                )
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ArtifactError(f"{where}: missing required key '{path}{f.name}'")
        record = cls(**values)
        record.validate(where)
        return record

    @classmethod
    def field_parser(cls, name: str) -> Callable[[object, str], object] | None:
        """A field read by its own function (a block with its own label, a class picked by a key)."""
        return None

    def validate(self, where: str) -> None:
        """Checks across fields (a subclass adds its own); raise ArtifactError naming ``where``."""

    def to_json(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and not self.WRITE_NONE:
                continue
            out[f.name] = _dump(value)
        return out


def _dump(value: object) -> object:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _without_null(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Union[tuple(args)]
    return tp


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        return f"an array (each entry {_describe(args[0])})" if args else "an array"
    if origin is dict or tp is dict:
        return f"an object (each value {_describe(args[1])})" if args else "an object"
    if isinstance(tp, type) and issubclass(tp, Record):
        return "an object"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def check_value(value: object, tp: Any, where: str, key: str) -> object:
    """``value`` (at ``key``) checked against the annotation ``tp``; arrays for tuple fields become tuples."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def wrong() -> ArtifactError:
        return ArtifactError(f"{where}: '{key}' must be {_describe(tp)}, got {type_name(value)}")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for arg in options:
            try:
                return check_value(value, arg, where, key)
            except ArtifactError:
                if len(options) == 1 or isinstance(arg, type) and issubclass(arg, Record):
                    raise  # the one option's own words name the exact entry
        raise wrong()
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json(value, where, f"{key}.")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise wrong()
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length, e.g. a K/V name pair
            if len(value) != len(args):
                raise ArtifactError(f"{where}: '{key}' must have {len(args)} entries, got {len(value)}")
            return tuple(check_value(v, a, where, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        items = (
            [check_value(v, args[0], where, f"{key}[{i}]") for i, v in enumerate(value)] if args else value
        )
        return tuple(items) if origin is tuple else list(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise wrong()
        return {k: check_value(v, args[1], where, f"{key}.{k}") for k, v in value.items()} if args else value
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"schema annotation {tp!r} is not supported")  # a bug in a record, not in the file
    if not ok:
        raise wrong()
    return value


@dataclass(frozen=True)
class TensorSpec(Record):
    """One model input or output: name, numpy dtype name, shape (int = static, str = symbolic, None = unknown)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None
    WRITE_NONE: ClassVar[bool] = True  # "shape": null is an unknown rank

    @classmethod
    def from_json(cls, obj: object, where: str = "manifest: tensor entry", path: str = "") -> TensorSpec:
        return super().from_json(obj, where, path)

    def shape_str(self) -> str:
        if self.shape is None:
            return "[?]"
        return "[" + ",".join("?" if d is None else str(d) for d in self.shape) + "]"


@dataclass(frozen=True)
class IOSignature(Record):
    """The model's inputs and outputs, in order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class TargetEntry(Record):
    """One target of a multi-target index: its sub-artifact folder (default: the target's name)."""

    dir: str | None = None
    target: str | None = None
    precision: str | None = None
