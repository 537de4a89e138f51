"""Check feeds against an IO signature before they reach the backend, with messages that name the input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from precast.runtime.errors import InputError, first_line
from precast.runtime.manifest import TensorSpec

__all__ = ["check_feeds"]


def check_feeds(feeds: Mapping[str, object], specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """Return feeds as numpy arrays, or raise InputError naming the input, expected vs got."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"feeds must be a mapping of input name -> array, got {type(feeds).__name__}")
    expected = {s.name: s for s in specs}
    unknown = sorted(set(feeds) - set(expected))
    if unknown:
        raise InputError(f"unknown input '{unknown[0]}'; the model's inputs are: {', '.join(expected)}")
    missing = [n for n in expected if n not in feeds]
    if missing:
        spec = expected[missing[0]]
        raise InputError(f"missing input '{spec.name}' ({spec.dtype}{spec.shape_str()})")
    out: dict[str, np.ndarray] = {}
    bound: dict[str, tuple[int, str]] = {}  # symbolic dim -> (value, input that set it)
    for name, spec in expected.items():
        value = feeds[name]
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise InputError(f"input '{name}': not a rectangular array ({first_line(e)})") from None
        if arr.dtype == object:
            raise InputError(f"input '{name}': expected {spec.dtype}, got a non-numeric value")
        if arr.dtype.name != spec.dtype:
            raise InputError(f"input '{name}': expected dtype {spec.dtype}, got {arr.dtype.name}")
        if not arr.dtype.isnative:  # same name, other byte order: the backend would read the bytes as native
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if arr.size == 0 and arr.ndim:
            raise InputError(f"input '{name}': has no elements {list(arr.shape)}")
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
