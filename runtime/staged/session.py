"""A staged artifact (``split-stages``) run as one session: its stages in order, each fed only what it reads.

    feeds ─> stage 0 ─> boundary tensors ─> stage 1 ─> ... ─> the requested outputs

One backend session per stage (``create_session`` with the target block pointed at the stage's file), each
with the caller's ``threads`` as its own intra-op budget. The stage entries are checked against what each
session says it reads and writes, so an edited ``stages`` block fails at load (exit 3), not inside a run.
``stages`` exposes the (entry, session) pairs: ``runtime/staged/pipeline.py`` runs them concurrently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from precast.artifact.stages_spec import StageEntry, StagesSpec
from precast.artifact.target_blocks import TargetBlock
from precast.errors import ArtifactError
from precast.runtime.backends import Session, create_session

__all__ = ["StagedSession", "open_staged"]


class _Arg(NamedTuple):
    """What ``get_inputs`` / ``get_outputs`` report (ONNX Runtime's NodeArg has the same fields)."""

    name: str
    type: str
    shape: list


class StagedSession:
    """The ``Session`` protocol over a chain of stage sessions (``stages``: [(StageEntry, Session)])."""

    def __init__(self, root: Path, spec: StagesSpec, stages: Sequence[tuple[StageEntry, Session]]):
        self.root = Path(root)
        self.spec = spec
        self.stages = list(stages)
        produced: set[str] = set()
        self._model_inputs: dict[str, None] = {}
        for entry, _ in self.stages:
            for name in entry.inputs:
                if name not in produced:
                    self._model_inputs[name] = None
            produced |= set(entry.outputs)
        for entry, session in self.stages:
            _check_entry(self.root, entry, session)

    def run(self, output_names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list:
        wanted = list(output_names)
        env: dict[str, object] = dict(feeds)
        for entry, session in self.stages:
            if all(name in env for name in wanted):
                break  # the rest of the chain computes nothing asked for
            results = session.run(list(entry.outputs), {name: env[name] for name in entry.inputs})
            env.update(zip(entry.outputs, results))
        missing = [name for name in wanted if name not in env]
        if missing:
            raise ArtifactError(f"artifact {self.root}: no stage produces output '{missing[0]}'")
        return [env[name] for name in wanted]

    @property
    def native(self) -> list[Session]:
        """The stages' own sessions, in order (Session.native: a stage's fast path uses its session's)."""
        return [session for _, session in self.stages]

    def get_providers(self) -> list[str]:
        return list(self.stages[0][1].get_providers())

    def get_inputs(self) -> list:
        """The model's inputs: what the stages read that no earlier stage produced (ORT's NodeArgs)."""
        args = {a.name: a for _, s in self.stages if hasattr(s, "get_inputs") for a in s.get_inputs()}
        return [_arg(args.get(name), name) for name in self._model_inputs]

    def get_outputs(self) -> list:
        """Every tensor some stage writes (the model's outputs are among them)."""
        out: dict[str, object] = {}
        for _, session in self.stages:
            if hasattr(session, "get_outputs"):
                for a in session.get_outputs():
                    out.setdefault(a.name, a)
        return [_arg(a, name) for name, a in out.items()]


def open_staged(
    root: Path, target: TargetBlock, spec: StagesSpec, threads: int | None = None
) -> StagedSession:
    """One session per stage of ``spec`` (``threads``: each stage's intra-op budget), as a StagedSession."""
    sessions = [
        (entry, create_session(root, dataclasses.replace(target, model=entry.model), threads=threads))
        for entry in spec.stages
    ]
    return StagedSession(root, spec, sessions)


def _arg(a, name: str) -> _Arg:
    if a is None:
        return _Arg(name, "unknown", [])
    return _Arg(a.name, a.type, list(a.shape or []))


def _check_entry(root: Path, entry: StageEntry, session: Session) -> None:
    """The stage's model reads exactly the entry's inputs and writes (at least) its outputs."""
    if not hasattr(session, "get_inputs") or not hasattr(session, "get_outputs"):
        return  # a backend that cannot say (the names are checked when the stage runs)
    reads = {a.name for a in session.get_inputs()}
    writes = {a.name for a in session.get_outputs()}
    where = f"{root}/manifest.json: stages block: stage '{entry.model}'"
    for name in entry.inputs:
        if name not in reads:
            raise ArtifactError(f"{where} lists input '{name}', which its model does not read")
    unlisted = sorted(reads - set(entry.inputs))
    if unlisted:
        raise ArtifactError(f"{where}: its model reads '{unlisted[0]}', which the block does not list")
    for name in entry.outputs:
        if name not in writes:
            raise ArtifactError(f"{where} lists output '{name}', which its model does not write")
