"""Sequence buckets: one static-shape session per sequence length, the smallest that fits runs each call.

NPUs (the QNN HTP) run static shapes only, so an ``ort-qnn`` artifact compiled with
``--target-option buckets=64,128`` holds one EP-context model per length. The manifest's ``buckets`` block:

    {"dim": "sequence", "sizes": [64, 128], "models": {"64": "model_seq64.onnx", "128": "model.onnx"},
     "inputs": {"input_ids": 1, "attention_mask": 1, ...}, "outputs": {"last_hidden_state": 1}}

``inputs`` / ``outputs`` name the axis of that dim in each tensor. A call with n tokens runs the smallest
bucket >= n: inputs are padded with zeros along their axis (an attention mask of 0 marks the padding, so
the real positions see the same attention), and outputs are sliced back to n. Longer than the largest
bucket is an InputError naming it, and so is length 0. A model compiled for batch 1 given more rows runs
them one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from precast.artifact.manifest import artifact_path
from precast.errors import ArtifactError, InputError

__all__ = ["BucketedSession", "bucket_shapes", "pad_to", "parse_buckets"]


def parse_buckets(block: Mapping) -> tuple[list[int], dict[int, str], dict[str, int], dict[str, int]]:
    """(sizes ascending, size -> model file, input axes, output axes) from a manifest ``buckets`` block."""
    try:
        sizes = sorted(int(s) for s in block["sizes"])
        models = {int(k): str(v) for k, v in block["models"].items()}
        inputs = {str(k): int(v) for k, v in block["inputs"].items()}
        outputs = {str(k): int(v) for k, v in block.get("outputs", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(f"manifest: malformed 'buckets' block ({type(e).__name__}: {e})") from None
    if not sizes or sorted(models) != sizes or not inputs or min(sizes) < 1:
        raise ArtifactError(
            "manifest: 'buckets' needs sizes >= 1, one model per size and the bucketed inputs"
        )
    return sizes, models, inputs, outputs


def bucket_shapes(static_shapes: Mapping | None, block: Mapping, size: int) -> dict[str, list[int]]:
    """The static input shapes of the ``size`` bucket: the block's bucketed axes set to ``size``."""
    _, _, inputs, _ = parse_buckets(block)
    shapes = {k: list(v) for k, v in (static_shapes or {}).items()}
    for name, axis in inputs.items():
        if name in shapes and 0 <= axis < len(shapes[name]):
            shapes[name][axis] = size
    return shapes


def pad_to(array: np.ndarray, axis: int, size: int, value: int | float = 0) -> np.ndarray:
    """``array`` padded with ``value`` (or cut) along ``axis`` to ``size``."""
    n = array.shape[axis]
    if n >= size:
        return np.take(array, np.arange(size), axis=axis) if n > size else array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - n)
    return np.pad(array, widths, constant_values=value)


class BucketedSession:
    """Sessions by bucket size; ``run`` pads to the smallest bucket that fits and slices the outputs back."""

    def __init__(
        self,
        sessions: dict[int, object],
        inputs: dict[str, int],
        outputs: dict[str, int],
        dim: str = "sequence",
    ):
        self.sessions = dict(sorted(sessions.items()))
        self.inputs, self.outputs, self.dim = inputs, outputs, dim
        self.last_bucket: int | None = None  # the size the latest run used (tests and tools read it)

    @classmethod
    def open(cls, root: Path, block: Mapping, open_one: Callable[[Path, int], object]) -> BucketedSession:
        """``open_one(model file, size)`` -> a session for that bucket (files resolved inside ``root``)."""
        sizes, models, inputs, outputs = parse_buckets(block)
        sessions = {s: open_one(artifact_path(root, models[s], "target.buckets.models"), s) for s in sizes}
        return cls(sessions, inputs, outputs, str(block.get("dim", "sequence")))

    @property
    def assignment(self):
        return getattr(self.sessions[max(self.sessions)], "assignment", None)

    def get_providers(self) -> list[str]:
        return self.sessions[max(self.sessions)].get_providers()

    def pick(self, feeds: Mapping[str, np.ndarray]) -> tuple[int, int]:
        """(tokens in these feeds, the bucket size that runs them)."""
        lengths = {name: feeds[name].shape[axis] for name, axis in self.inputs.items() if name in feeds}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"'{k}' {v}" for k, v in lengths.items())
            raise InputError(f"the bucketed inputs disagree on the {self.dim} length: {detail}")
        n = next(iter(lengths.values()), 0)
        if n == 0 and lengths:  # every position padding: the outputs would be the model's answer to nothing
            raise InputError(f"the bucketed inputs have {self.dim} length 0: nothing to run")
        fits = [s for s in self.sessions if s >= n]
        if not fits:
            largest = max(self.sessions)
            raise InputError(
                f"{self.dim} length {n} is longer than this artifact's largest bucket ({largest}); "
                f"truncate the input or recompile with a bucket >= {n}"
            )
        return n, fits[0]

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list:
        n, size = self.pick(feeds)
        rows = self._rows_over_compiled_batch(self.sessions[size], feeds)
        if rows:  # batch 1 compiled (the NPU's static shape), more rows given: one row at a time
            parts = [self.run(names, {k: v[i : i + 1] for k, v in feeds.items()}) for i in range(rows)]
            return [np.concatenate(outs, axis=0) for outs in zip(*parts)]
        padded = {k: pad_to(v, self.inputs[k], size) if k in self.inputs else v for k, v in feeds.items()}
        results = self.sessions[size].run(list(names), padded)
        self.last_bucket = size
        return [
            np.take(r, np.arange(n), axis=self.outputs[name]) if name in self.outputs else r
            for name, r in zip(names, results)
        ]

    def _rows_over_compiled_batch(self, session, feeds: Mapping[str, np.ndarray]) -> int:
        """The feeds' row count when the session was compiled for batch 1 and every feed has more rows
        (then each row runs alone, as the server's batcher and a multi-text /v1/embeddings send them), else 0."""
        static = getattr(session, "static_shapes", None) or {}
        axis0 = {tuple(static[k])[:1] for k in self.inputs if k in static and self.inputs[k] != 0}
        rows = {np.shape(v)[0] if np.ndim(v) else None for v in feeds.values()}
        if axis0 != {(1,)} or len(rows) != 1 or None in rows:
            return 0
        (count,) = rows
        return count if count > 1 else 0
