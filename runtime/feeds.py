"""Check feeds against an IO signature before they reach the backend, with messages that name the input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.errors import InputError, first_line

__all__ = ["check_feeds"]


def _array(name: str, dtype: str, value: object) -> np.ndarray:
    """One tensor feed as a native-order array of ``dtype`` (strings: an object array of str)."""
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise InputError(f"input '{name}': not a rectangular array ({first_line(e)})") from None
    if dtype == "object":  # ONNX strings: numpy str/bytes arrays are accepted and handed over as objects
        if arr.dtype.kind in "US" or (arr.dtype == object and all(isinstance(v, str) for v in arr.flat)):
            return np.asarray(arr.astype(str), dtype=object) if arr.dtype.kind == "S" else arr.astype(object)
        raise InputError(f"input '{name}': expected strings, got {arr.dtype.name}")
    if arr.dtype == object:
        raise InputError(f"input '{name}': expected {dtype}, got a non-numeric value")
    if arr.dtype.name != dtype:
        raise InputError(f"input '{name}': expected dtype {dtype}, got {arr.dtype.name}")
    if not arr.dtype.isnative:  # same name, other byte order: the backend would read the bytes as native
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def _checked_value(name: str, dtype: str, value: object):
    """A feed for ``dtype``: an array, a list of arrays (``seq(...)``) or None (an absent ``optional(...)``)."""
    if dtype.startswith("optional(") and dtype.endswith(")"):
        return None if value is None else _checked_value(name, dtype[len("optional(") : -1], value)
    if dtype.startswith("seq(") and dtype.endswith(")"):
        if not isinstance(value, (list, tuple)):
            raise InputError(f"input '{name}': expected a sequence (a list of arrays), got {type(value).__name__}")
        elem = dtype[len("seq(") : -1]
        return [_checked_value(f"{name}[{i}]", elem, v) for i, v in enumerate(value)]
    if value is None:
        raise InputError(f"input '{name}': expected {dtype}, got None")
    return _array(name, dtype, value)


def check_feeds(feeds: Mapping[str, object], specs: Sequence[TensorSpec]) -> dict[str, object]:
    """Return feeds as numpy arrays (lists of them for sequence inputs; absent optionals left out), or raise
    InputError naming the input, expected vs got. Zero-size tensors are valid ONNX feeds."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"feeds must be a mapping of input name -> array, got {type(feeds).__name__}")
    expected = {s.name: s for s in specs}
    unknown = sorted(set(feeds) - set(expected))
    if unknown:
        raise InputError(f"unknown input '{unknown[0]}'; the model's inputs are: {', '.join(expected)}")
    missing = [n for n, s in expected.items() if n not in feeds and not s.dtype.startswith("optional(")]
    if missing:
        spec = expected[missing[0]]
        raise InputError(f"missing input '{spec.name}' ({spec.dtype}{spec.shape_str()})")
    out: dict[str, object] = {}
    bound: dict[str, tuple[int, str]] = {}  # symbolic dim -> (value, input that set it)
    for name, spec in expected.items():
        value = _checked_value(name, spec.dtype, feeds.get(name))
        if value is None:  # an absent optional input: the backend sees it as missing
            continue
        if not isinstance(value, np.ndarray):  # a sequence: checked element by element already
            out[name] = value
            continue
        arr = value
        if spec.shape is not None:
            if arr.ndim != len(spec.shape):
                raise InputError(
                    f"input '{name}': expected rank {len(spec.shape)} {spec.shape_str()}, "
                    f"got rank {arr.ndim} {list(arr.shape)}"
                )
            for axis, (want, got) in enumerate(zip(spec.shape, arr.shape)):
                if isinstance(want, int) and want != got:
                    raise InputError(
                        f"input '{name}': dim {axis} must be {want} {spec.shape_str()}, got {got} {list(arr.shape)}"
                    )
                if isinstance(want, str):
                    if want in bound and bound[want][0] != got:
                        value0, other = bound[want]
                        raise InputError(
                            f"input '{name}': dim {axis} ('{want}') is {got} but input '{other}' has '{want}'={value0}"
                        )
                    bound.setdefault(want, (got, name))
        out[name] = np.asarray(arr, order="C")  # C order, 0-d stays 0-d (ascontiguousarray makes it 1-d)
    return out
