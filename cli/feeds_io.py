"""Reading feeds for ``precast run`` / ``--sample-inputs``: .npz (strict dtypes) or .json (cast to the spec)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.errors import InputError, UsageError, first_line

__all__ = ["read_feeds"]


def read_feeds(path: str | Path, specs: Sequence[TensorSpec] | None = None) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"feeds file not found: {path}")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise InputError(f"{path}: expected a JSON object of input name -> nested list")
        by_name = {s.name: s for s in specs or []}
        feeds = {}
        for name, value in raw.items():
            dtype = by_name[name].dtype if name in by_name else None
            try:
                arr = np.asarray(value)
                if dtype is not None:
                    if (
                        np.dtype(dtype).kind in "iu"
                        and arr.dtype.kind == "f"
                        and not np.all(arr == np.round(arr))
                    ):
                        raise InputError(
                            f"input '{name}': expected integers ({dtype}), got fractional numbers"
                        )
                    if dtype == "bool" and arr.dtype != bool and not np.isin(arr, (0, 1)).all():
                        # astype(bool) calls any non-zero number True: a 2 or 0.5 is a mistake, not a flag
                        raise InputError(
                            f"input '{name}': expected bool (true/false or 0/1), got other numbers"
                        )
                    arr = arr.astype(dtype)
            except (ValueError, TypeError) as e:
                raise InputError(f"input '{name}' in {path}: not a rectangular numeric array ({e})") from e
            feeds[name] = arr
        return feeds
    if not zipfile.is_zipfile(path):  # np.load would call any other file "pickled data"
        raise InputError(f"{path}: not an .npz (zip of .npy arrays) or .json feeds file")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not a readable .npz of arrays ({first_line(e)})") from e
