"""What precast's Triton Python-backend models share (targets/_triton_python_model.py, _triton_stage_model.py).

Those two files are copied into a Triton model repository and run inside Triton's Python stub, which imports
``precast.runtime`` from the stub's Python environment: so what they share lives here, in the runtime (numpy
only; no compiler, no ``triton_python_backend_utils``: they pass in the one call of it this needs).

    initialize(args) -> StubConfig.from_args(args), drop_pycache(__file__)
    execute(requests) -> request_feeds(...) -> run_requests(...) -> one response per request
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.errors import InputError
from precast.runtime.batching import ROWS, Feeds, Result, run_merged

__all__ = ["StubConfig", "drop_pycache", "request_feeds", "run_requests"]


@dataclass(frozen=True)
class StubConfig:
    """A Python model's config.pbtxt, as Triton hands it to ``initialize``."""

    artifact: Path  # precast_artifact, resolved against the model's directory (default "../..")
    params: Mapping[str, str]  # every parameter's string_value
    max_batch_size: int  # 0: Triton does not batch this model's requests
    threads: int | None  # precast_threads (None: 0 or absent, the session's default)

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> StubConfig:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        artifact = Path(params.get("precast_artifact") or "../..")
        if not artifact.is_absolute():
            artifact = (Path(args["model_repository"]) / artifact).resolve()
        threads = int(params.get("precast_threads") or 0) or None
        return cls(artifact, params, int(config.get("max_batch_size", 0)), threads)


def drop_pycache(model_file: str) -> None:
    """Remove the __pycache__ the stub's import of ``model_file`` wrote beside it (the stub ignores
    PYTHONDONTWRITEBYTECODE), so the artifact stays exactly what its manifest lists (``load`` checks)."""
    shutil.rmtree(Path(model_file).resolve().parent / "__pycache__", ignore_errors=True)


def request_feeds(
    requests: Sequence[object],
    names: Sequence[str],
    get_input: Callable[[object, str], object],
    where: str = "",
) -> list[Feeds | InputError]:
    """Each request's input arrays by name, or an InputError naming its first missing input (prefixed by
    ``where``). ``get_input`` is ``pb_utils.get_input_tensor_by_name``."""
    return [_feeds(request, names, get_input, where) for request in requests]


def _feeds(request, names, get_input, where: str) -> Feeds | InputError:
    feeds = {}
    for name in names:
        tensor = get_input(request, name)
        if tensor is None:
            return InputError(f"{where}missing input '{name}'")
        feeds[name] = tensor.as_numpy()
    return feeds


def run_requests(
    feeds: Sequence[Feeds | Exception],
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
    *,
    batched: bool,
    blame: Callable[[Exception], Exception] | None = None,
) -> list[Result]:
    """One dynamic batch's requests: those whose inputs agree past dim 0 run as one call when Triton batches
    this model (``batched``), each group through ``run_merged`` (its rerun and error policy); a request whose
    feeds are already an error keeps it. One result per request, in order."""
    results: dict[int, Result] = {}
    groups: dict[Hashable, list[tuple[int, Feeds]]] = {}
    for i, f in enumerate(feeds):
        if isinstance(f, Exception):
            results[i] = f
        else:
            key = ROWS.key(f) if batched else None
            groups.setdefault(("alone", i) if key is None else key, []).append((i, f))
    for members in groups.values():
        merged = run_merged([f for _, f in members], run, blame=blame)
        results.update((i, r) for (i, _), r in zip(members, merged))
    return [results[i] for i in range(len(feeds))]
