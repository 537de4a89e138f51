"""Load an artifact and run it: the whole runtime surface for non-LLM models."""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import Manifest, TensorSpec
from precast.errors import ArtifactError, InputError, UsageError, first_line
from precast.runtime.backends import Session, check_threads, create_session
from precast.runtime.feeds import check_feeds
from precast.runtime.hal import PREFERENCE, preference_order, resolve, target_order

if TYPE_CHECKING:
    from precast.runtime.staged.pipeline import StagePipeline

# (PREFERENCE, preference_order, target_order: the HAL's, runtime/hal.py; importable from here as before)
__all__ = ["PREFERENCE", "Model", "load", "preference_order", "target_order"]


class Model:
    """A loaded, integrity-checked artifact. ``run(feeds) -> {output name: array}``."""

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        session: Session,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        *,
        skipped: dict[str, str] | None = None,
        temp_dir: Path | None = None,
    ):
        self.path = path
        self.manifest = manifest
        # The backend session (runtime/backends/__init__.py's Session): the LLM runners, the stage pipeline and the
        # accuracy checks run on it; ``session.native`` is its backend's own handle.
        self.session = session
        self.inputs = inputs
        self.outputs = outputs
        self.skipped = dict(skipped or {})  # better targets passed over, and why
        # a packed artifact's temp dir (runtime/hal.py unpacked it): removed by close(), else with the Model
        self._cleanup: weakref.finalize | None = None
        if temp_dir is not None:
            from precast.artifact.archive import remove_temp

            self._cleanup = weakref.finalize(self, remove_temp, temp_dir)

    def close(self) -> None:
        """Remove the temp dir a packed artifact was unpacked into (nothing for a directory). Idempotent;
        without it the dir goes when the Model is garbage-collected, or at exit."""
        if self._cleanup is not None:
            self._cleanup()

    @property
    def target(self) -> str:
        return self.manifest.target.name

    @property
    def providers(self) -> list[str]:
        return list(self.session.get_providers())

    def pipeline(self, **options) -> StagePipeline:
        """The artifact's stages as a pipeline (runtime/staged/pipeline.py): one worker thread and session per stage,
        bounded queues, ``submit(feeds) -> Future``. Options: ``threads`` (per stage, default 1),
        ``queue_size``, ``max_batch``, ``batch_wait``. ``run`` stays sequential; close the pipeline (or use
        it as a context manager) when done."""
        from precast.runtime.staged.pipeline import StagePipeline

        return StagePipeline.from_model(self, **options)

    def run(self, feeds: Mapping[str, object], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        arrays = check_feeds(feeds, self.inputs)
        if isinstance(outputs, str):
            outputs = [outputs]
        names = list(outputs) if outputs is not None else [o.name for o in self.outputs]
        if not names:
            raise InputError("outputs is empty: name at least one output, or pass None for all")
        known = {o.name for o in self.outputs}
        for n in names:
            if n not in known:
                raise InputError(f"unknown output '{n}'; the model's outputs are: {', '.join(sorted(known))}")
        try:
            results = self.session.run(names, arrays)
        except Exception as e:  # the checked signature passed; the values did not (an index out of range,
            # a size too large to allocate): the backend's own words, on one line
            raise InputError(f"the model rejected these feeds: {first_line(e)}") from e
        return dict(zip(names, results))

    def __repr__(self) -> str:
        sig = ", ".join(f"{s.name}:{s.dtype}{s.shape_str()}" for s in self.inputs)
        return f"<precast.Model {self.path} target={self.target} inputs=({sig})>"


def load(
    path: str | os.PathLike,
    *,
    threads: int | None = None,
    verify: bool = True,
    prefer: str | None = None,
    pubkey: str | os.PathLike | None = None,
    expect_name: str | None = None,
    min_version: str | None = None,
    now: datetime | None = None,
    spinning: bool | None = None,
) -> Model:
    """Load an artifact directory: schema check, sha256 of every file, then a backend session.

    ``path`` may also be a packed artifact (``precast pack``): it is unpacked safely, every checksum
    checked, into a private temp dir. ``pubkey`` requires its signed statement (artifact/signing.py): a valid
    Ed25519 signature, not expired at ``now`` (default: the wall clock), named ``expect_name`` and at least
    ``min_version`` when given; anything else is a SignatureError (exit 3).

    A multi-target artifact loads the best target this host can run (``prefer`` puts one first; the
    choice is runtime/hal.py's, shared with Engine.load); ``model.skipped`` says why each better one was
    passed over.

    ``spinning`` (ONNX Runtime CPU sessions): whether idle intra-/inter-op threads spin-wait for the next
    run; None keeps ONNX Runtime's default (they do). Other backends ignore it.
    """
    check_threads(threads)
    if spinning is not None and not isinstance(spinning, bool):
        raise UsageError(f"spinning must be True, False or None, got {spinning!r}")

    def open_session(root: Path, manifest: Manifest) -> Session:
        return _open_session(root, manifest, threads, spinning)

    found = resolve(
        path,
        open_session,
        prefer=prefer,
        pubkey=pubkey,
        expect_name=expect_name,
        min_version=min_version,
        now=now,
        verify=verify,
    )
    manifest = found.manifest
    return Model(
        found.root,
        manifest,
        found.opened,
        list(manifest.io.inputs),
        list(manifest.io.outputs),
        skipped=dict(found.skipped),
        temp_dir=found.temp,
    )


def open_resolved(
    root: Path, manifest: Manifest, *, threads: int | None = None, spinning: bool | None = None
) -> Model:
    """The Model of one target the HAL already resolved (``root`` and its manifest, files checked), for an
    opener that needs the whole Model (the LLM runner factory): no second resolve or read of the manifest."""
    check_threads(threads)
    session = _open_session(root, manifest, threads, spinning)
    return Model(root, manifest, session, list(manifest.io.inputs), list(manifest.io.outputs))


def _open_session(root: Path, manifest: Manifest, threads: int | None, spinning: bool | None) -> Session:
    """The backend session of one (resolved) target, checked against the manifest's io and llm blocks."""
    if manifest.stages is not None:  # split-stages: one session per stage, run in order (threads: per stage)
        from precast.runtime.staged.session import open_staged

        session = open_staged(root, manifest.target, manifest.stages, threads=threads)
    else:
        session = create_session(root, manifest.target, threads=threads, spinning=spinning)
        if manifest.llm is not None:
            _check_llm_matches(root, session, manifest.llm)
    _check_io_matches(root, session, list(manifest.io.inputs), list(manifest.io.outputs))
    return session


def _check_llm_matches(root: Path, session, spec: LLMSpec) -> None:
    """A causal LM's ``llm`` block against the step graph it describes (names, layers, KV dims, vocab): an
    edited block is refused (exit 3) by every command that loads the artifact, not by the engine's first step
    (staged artifacts: runtime/llm/runners/staged.py checks each stage)."""
    from precast.runtime.backends.openvino import OpenVINOSession

    if isinstance(session, OpenVINOSession):
        from precast.runtime.llm.runners.openvino import check_compiled_matches_spec

        if spec.kv_layout != "ov-paged":
            raise ArtifactError(
                f"{root}/manifest.json: llm block: kv_layout {spec.kv_layout!r} does not fit an OpenVINO "
                "step graph (ov-paged)"
            )
        check_compiled_matches_spec(session.native, spec, root)
    elif hasattr(session, "get_inputs"):  # ONNX Runtime (TensorRT keeps its own checks)
        from precast.runtime.llm.runners.gather import check_graph_matches_spec

        check_graph_matches_spec(session, spec, root)


def _check_io_matches(root: Path, session, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """manifest.json cannot hash itself: an edited 'io' block would blame every caller's feeds. Compare it
    with what an ONNX Runtime session reports (other backends keep their own checks)."""
    if not hasattr(session, "get_inputs") or not hasattr(session, "get_outputs"):  # OpenVINO, TensorRT
        return
    actual = {a.name: a.type for a in [*session.get_inputs(), *session.get_outputs()]}
    for spec in (*inputs, *outputs):
        kind = actual.get(spec.name)
        if kind is None:
            raise ArtifactError(f"{root}: manifest lists '{spec.name}', which the model does not have")
        elem = kind[len("tensor(") : -1] if kind.startswith("tensor(") else None
        dtype = {"float": "float32", "double": "float64"}.get(elem, elem)
        # ORT spells float8 types 'float8e4m3fn', numpy (ml_dtypes) 'float8_e4m3fn': the same type
        if elem not in (None, "string") and dtype.replace("_", "") != spec.dtype.replace("_", ""):
            raise ArtifactError(
                f"{root}: manifest says '{spec.name}' is {spec.dtype}, the model says {dtype}: manifest.json was edited"
            )
