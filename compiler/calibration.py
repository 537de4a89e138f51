"""Calibration data: read ``--calibration DATA`` and hand feeds to ONNX Runtime's quantizers.

    feeds.npz  with keys 'input_ids', 'attention_mask'        -> one feeds dict (one batch)
    feeds.npz  with keys '0/input_ids', '1/input_ids', ...    -> one feeds dict per prefix
    text.txt                                                  -> PassContext.calibration_text (LLMs; a causal-lm
                                                                 step graph calibrates on it as prefill steps)

A pass asks ``calibration_batches(context, inputs)`` for feeds checked against the model's inputs;
without --calibration data it falls back to the sample feeds and says so in its stats.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from precast.runtime.errors import InputError, UsageError
from precast.runtime.feeds import check_feeds
from precast.runtime.manifest import TensorSpec
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = ["load_calibration", "calibration_batches", "FeedsReader"]


def load_calibration(path: str | Path) -> tuple[list[dict[str, np.ndarray]] | None, str | None]:
    """(feeds list, None) for an .npz, (None, text) for a .txt."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"calibration file not found: {path}")
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise InputError(f"calibration text {path} is empty")
        return None, text
    if path.suffix != ".npz":
        raise UsageError(f"--calibration {path}: expected an .npz of feeds or a .txt file")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not a readable .npz of arrays ({str(e).splitlines()[0]})") from e
    if not arrays:
        raise InputError(f"calibration file {path} holds no arrays")
    prefixed = [k for k in arrays if "/" in k]
    if not prefixed:
        return [arrays], None
    if len(prefixed) != len(arrays):
        plain = sorted(set(arrays) - set(prefixed))[0]
        raise InputError(f"{path}: key '{plain}' has no 'N/' batch prefix while others do; use one style")
    batches: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in arrays.items():
        idx, _, name = key.partition("/")
        batches.setdefault(idx, {})[name] = arr
    order = sorted(batches, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    return [batches[i] for i in order], None


def calibration_batches(
    context: Any, inputs: Sequence[TensorSpec]
) -> tuple[list[dict[str, np.ndarray]], str]:
    """The feeds a quantizer calibrates on and where they came from ('calibration' or 'sample-feeds')."""
    feeds = getattr(context, "calibration_feeds", None)
    source = "calibration"
    text = getattr(context, "calibration_text", None)
    if not feeds and text:
        from precast.compiler.llm_text import is_step_graph, step_calibration_feeds

        if is_step_graph(inputs):  # a causal-lm step graph: the text, tokenized, as prefill steps
            feeds, source = (
                step_calibration_feeds(text, getattr(context, "source_dir", None), inputs),
                "calibration-text",
            )
    if feeds and hasattr(context, "extra"):
        context.extra["calibration_used"] = True  # (the driver warns about --calibration nothing used)
    if not feeds:
        sample = getattr(context, "sample_feeds", None)
        if not sample:
            raise UsageError("this pass needs calibration data: pass --calibration feeds.npz")
        feeds, source = [sample], "sample-feeds"
    checked = []
    for i, batch in enumerate(feeds):
        try:
            checked.append(check_feeds(batch, inputs))
        except InputError as e:
            raise InputError(f"calibration batch {i}: {e}") from e
    return checked, source


class FeedsReader:
    """A CalibrationDataReader (ONNX Runtime's duck type: get_next / iteration) over a list of feeds.

    ``progress`` hears ``advance(i, n, "calibration batch i+1 of n")`` as ONNX Runtime takes each batch."""

    def __init__(self, feeds: Iterable[dict[str, np.ndarray]], progress: ProgressReporter = SILENT):
        self._feeds = list(feeds)
        self._pos = 0
        self._progress = progress

    def get_next(self) -> dict[str, np.ndarray] | None:
        n = len(self._feeds)
        if self._pos >= n:
            self._progress.advance(n, n, "computing activation ranges")
            return None
        self._progress.advance(self._pos, n, f"calibration batch {self._pos + 1} of {n}")
        self._pos += 1
        return self._feeds[self._pos - 1]

    def rewind(self) -> None:
        self._pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item

    def __len__(self) -> int:
        return len(self._feeds)
