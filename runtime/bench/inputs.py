"""Feeds for ``precast bench``, generated from an artifact's IO signature (no compiler, no graph).

    dims, defaulted = resolve_dims(model.inputs, {"batch": 8})      # symbolic dims -> sizes
    feeds, notes = generate_feeds(model.inputs, dims, hints)          # arrays + how each one was made

The rules are those of the compiler's sample feeds (ir/parity.py), which the runtime may not import:
floats standard normal, masks ones, type / segment ids zeros, bools random. The compiler bounds index inputs by
the graph's Gather tables; here the graph is not read, so integer inputs take their bound from what the
artifact ships: its tokenizer's vocabulary for token ids, else the range of the stored parity inputs (which
the compiler drew inside the table), else [0, 100).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.artifact.manifest import Manifest, TensorSpec, artifact_path
from precast.errors import ArtifactError, UsageError

__all__ = [
    "MAX_FEED_BYTES",
    "FeedHints",
    "InputInfo",
    "dim_key",
    "generate_feeds",
    "leading_batch",
    "resolve_dims",
]

# The compiler's cap on generated sample feeds (ir/parity.py MAX_SAMPLE_BYTES), the same here.
MAX_FEED_BYTES = 1 << 30
DEFAULT_BATCH = 1  # a symbolic dim on axis 0
DEFAULT_DIM = 128  # any other symbolic dim (a sequence length, most often)


@dataclass(frozen=True)
class FeedHints:
    """What the artifact says about its integer inputs: the tokenizer's vocabulary, the stored samples."""

    vocab: int | None = None
    stored: Mapping[str, np.ndarray] | None = None

    @classmethod
    def from_artifact(cls, root: Path, manifest: dict) -> FeedHints:
        return cls(vocab=tokenizer_vocab(root, manifest), stored=stored_inputs(root, manifest))


@dataclass(frozen=True)
class InputInfo:
    """One generated input, as the report shows it."""

    name: str
    dtype: str
    shape: list[int]
    values: str  # how the values were made, e.g. "ids < 30522 (tokenizer vocabulary)"


def dim_key(spec: TensorSpec, axis: int) -> str:
    """The --dim name of a dim: its symbolic name, or '<input>_<axis>' for an unnamed one (as the compiler)."""
    d = spec.shape[axis] if spec.shape is not None else None
    return d if isinstance(d, str) and d else f"{spec.name}_{axis}"


def resolve_dims(specs: Sequence[TensorSpec], given: Mapping[str, int]) -> tuple[dict[str, int], list[str]]:
    """Sizes of every symbolic dim: ``given`` ones, the others defaulted (axis 0: 1, else 128).

    Returns (dims, the names that were defaulted). A given name the signature does not have is a UsageError
    naming the known ones.
    """
    symbolic: dict[str, int] = {}  # name -> axis of its first use
    for spec in specs:
        if spec.shape is None:
            raise UsageError(
                f"input '{spec.name}' has unknown rank: pass your own feeds with --input feeds.npz"
            )
        for axis, d in enumerate(spec.shape):
            if not isinstance(d, int):
                symbolic.setdefault(dim_key(spec, axis), axis)
    unknown = sorted(set(given) - set(symbolic))
    if unknown:
        if symbolic:
            known = ", ".join(symbolic)
            raise UsageError(f"unknown --dim '{unknown[0]}'; this artifact's symbolic dims are: {known}")
        sig = ", ".join(f"{s.name}{s.shape_str()}" for s in specs)
        raise UsageError(f"unknown --dim '{unknown[0]}'; this artifact's inputs are all static: {sig}")
    for name, size in given.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UsageError(f"bad --dim '{name}={size}': the size must be a positive integer")
    dims = {n: given.get(n, DEFAULT_BATCH if axis == 0 else DEFAULT_DIM) for n, axis in symbolic.items()}
    return dims, [n for n in symbolic if n not in given]


def _shape(spec: TensorSpec, dims: Mapping[str, int]) -> list[int]:
    return [d if isinstance(d, int) else dims[dim_key(spec, i)] for i, d in enumerate(spec.shape or ())]


def leading_batch(specs: Sequence[TensorSpec], dims: Mapping[str, int]) -> int:
    """Items per request: the size of axis 0 when every input of rank >= 1 shares it (same symbolic name or
    the same static size), else 1."""
    firsts = {(dim_key(s, 0) if not isinstance(s.shape[0], int) else s.shape[0]) for s in specs if s.shape}
    if len(firsts) != 1:
        return 1
    (first,) = firsts
    return int(first if isinstance(first, int) else dims[first])


def _np_dtype(spec: TensorSpec) -> np.dtype:
    try:
        dt = np.dtype(spec.dtype)
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "biuf":
        raise UsageError(
            f"input '{spec.name}': cannot generate {spec.dtype} values; pass your own feeds with --input feeds.npz"
        )
    return dt


def generate_feeds(
    specs: Sequence[TensorSpec], dims: Mapping[str, int], hints: FeedHints | None = None, seed: int = 0
) -> tuple[dict[str, np.ndarray], list[InputInfo]]:
    """One array per input (sized by ``dims``), and how each was made. Sized before anything is allocated:
    more than MAX_FEED_BYTES in all is a UsageError naming the input that crosses it."""
    hints = hints or FeedHints()
    rng = np.random.default_rng(seed)
    shapes = {s.name: _shape(s, dims) for s in specs}
    total = 0
    for s in specs:
        need = math.prod(shapes[s.name]) * _np_dtype(s).itemsize
        total += need
        if total > MAX_FEED_BYTES:
            raise UsageError(
                f"input '{s.name}': {shapes[s.name]} {s.dtype} needs {need / 1e6:.1f} MB "
                f"({total / 1e6:.1f} MB with the inputs before it; bench generates at most "
                f"{MAX_FEED_BYTES / 2**30:.0f} GiB): use smaller --dim sizes"
            )
    feeds: dict[str, np.ndarray] = {}
    infos: list[InputInfo] = []
    for s in specs:
        shape, dt = shapes[s.name], _np_dtype(s)
        arr, how = _values(s.name, shape, dt, hints, rng)
        feeds[s.name] = np.asarray(arr, dtype=dt)  # (a 0-d result stays a 0-d array, not a numpy scalar)
        infos.append(InputInfo(s.name, s.dtype, shape, how))
    return feeds, infos


def _values(name: str, shape: list[int], dt: np.dtype, hints: FeedHints, rng) -> tuple[np.ndarray, str]:
    lname = name.lower()
    if dt.kind == "b":
        return rng.random(shape) > 0.5, "random bools"
    if dt.kind == "f":
        return rng.standard_normal(shape), "standard normal"
    if "mask" in lname:
        return np.ones(shape), "ones (a mask)"
    if "type" in lname or "segment" in lname:
        return np.zeros(shape), "zeros (type ids)"
    if "position" in lname and shape:
        return np.broadcast_to(np.arange(shape[-1]), shape), f"positions 0..{shape[-1] - 1}"
    info = np.iinfo(dt)
    stored = (hints.stored or {}).get(name)
    if hints.vocab and ("ids" in lname or "token" in lname):
        lo, hi, why = 0, hints.vocab, f"ids < {hints.vocab} (tokenizer vocabulary)"
    elif stored is not None and stored.size and stored.dtype.kind in "iu":
        lo, hi = int(stored.min()), int(stored.max()) + 1
        why = f"random in [{lo}, {hi - 1}] (the range of the stored sample inputs)"
    else:
        lo, hi, why = 0, 100, "random in [0, 99] (no bound known)"
    lo, hi = max(lo, int(info.min)), min(hi, int(info.max) + 1)
    return rng.integers(lo, hi, size=shape), why


def tokenizer_vocab(root: Path, manifest: Manifest) -> int | None:
    """Vocabulary size of the artifact's tokenizer/tokenizer.json (model vocab and added tokens), if it ships one."""
    rel = manifest.llm.tokenizer if manifest.llm is not None else "tokenizer/tokenizer.json"
    if rel not in manifest.files:
        return None
    try:
        data = json.loads(artifact_path(root, rel, "tokenizer").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    ids: list[int] = []
    if isinstance(vocab, dict):
        ids = [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = [len(vocab) - 1] if vocab else []
    ids += [
        t["id"]
        for t in data.get("added_tokens") or ()
        if isinstance(t, dict) and isinstance(t.get("id"), int)
    ]
    return max(ids) + 1 if ids else None


def stored_inputs(root: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """The parity inputs the artifact ships (integrity-checked by load()); unreadable ones are skipped."""
    out: dict[str, np.ndarray] = {}
    for name, rel in ((manifest.parity or {}).get("inputs") or {}).items():
        try:
            out[name] = np.load(artifact_path(root, rel, f"parity input '{name}'"), allow_pickle=False)
        except (ArtifactError, OSError, ValueError):
            continue
    return out
