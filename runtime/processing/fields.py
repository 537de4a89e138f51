"""Strict readers for the values of an untrusted ``preprocessor_config.json``.

An artifact ships the model folder's file as-is, so every value is checked for type and range before use, and a
bad one is an ArtifactError naming the key and what it holds. JSON ``null`` means the processor's default, as in
transformers (a ``None`` keyword falls back to the class attribute). Keys nobody reads are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from precast.errors import ArtifactError

__all__ = [
    "CONFIG",
    "bad",
    "check_float",
    "check_int",
    "processor_type",
    "read_bool",
    "read_float",
    "read_floats",
    "read_int",
]

CONFIG = "preprocessor_config.json"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad(key: str, value: object, expected: str) -> ArtifactError:
    return ArtifactError(f"{CONFIG}: '{key}' is {_shown(value)}; expected {expected}")


def processor_type(cfg: object) -> str:
    """The class a config names: ``image_processor_type`` first, then ``feature_extractor_type`` (transformers'
    order). A ``Fast`` or ``Pil`` suffix names the same processor on another backend."""
    if not isinstance(cfg, Mapping):
        raise ArtifactError(f"{CONFIG}: expected a JSON object, got {type(cfg).__name__}")
    for key in ("image_processor_type", "feature_extractor_type"):
        name = cfg.get(key)
        if name is None:
            continue
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 100:
            raise bad(key, name, "a processor class name")
        for suffix in ("Fast", "Pil"):
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
        return name
    raise ArtifactError(f"{CONFIG}: names no image_processor_type or feature_extractor_type")


def read_bool(cfg: Mapping, key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, value, "true or false")
    return value


def check_int(key: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(key, value, f"an integer in {lo}..{hi}")
    return value


def read_int(cfg: Mapping, key: str, default: int, lo: int, hi: int) -> int:
    value = cfg.get(key)
    return default if value is None else check_int(key, value, lo, hi)


def check_float(key: str, value: object, lo: float, hi: float, *, above_lo: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or not (lo < value if above_lo else lo <= value) or not value <= hi:
        raise bad(key, value, f"a finite number in {'(' if above_lo else '['}{lo:g}, {hi:g}]")
    return float(value)


def read_float(
    cfg: Mapping, key: str, default: float, lo: float, hi: float, *, above_lo: bool = False
) -> float:
    value = cfg.get(key)
    return default if value is None else check_float(key, value, lo, hi, above_lo=above_lo)


def read_floats(
    cfg: Mapping,
    key: str,
    default: tuple[float, ...],
    n: int,
    lo: float,
    hi: float,
    *,
    above_lo: bool = False,
) -> tuple[float, ...]:
    """``n`` numbers: a list of n, or one number meaning n copies (transformers' rule for image_mean/std)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, list):
        return (check_float(key, value, lo, hi, above_lo=above_lo),) * n
    if len(value) != n:
        raise bad(key, value, f"a list of {n} numbers")
    return tuple(check_float(f"{key}[{i}]", v, lo, hi, above_lo=above_lo) for i, v in enumerate(value))
