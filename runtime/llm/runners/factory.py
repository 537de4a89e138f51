"""One factory for the LLM step runners: the manifest picks the implementation, callers never branch on layouts.

    manifest                        runner                                      opened by
    stages, kv_layout "mapped"      StagedRunner (runners/staged.py)            open_runner
    stages, kv_layout "paged"       StagedPagedRunner (runners/staged_paged.py) open_runner
    kv_layout "ov-paged"            OVStepRunner (runners/openvino.py)          open_runner / runner_on
    kv_layout "mapped"              MappedModelRunner (runners/mapped.py)       open_runner / runner_on
    kv_layout "paged"               ModelRunner (runners/gather.py)             open_runner / runner_on

``open_runner(root, manifest, ...)`` opens a target the HAL resolved (runtime/hal.py: Engine.load, the
perplexity scorer, the compiler's text accuracy); ``runner_on(session, spec, ...)`` runs a session the caller
already holds (the compiler's fp32 reference graph). Every runner is a runners/base.py StepRunner.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import Manifest
from precast.errors import ArtifactError, UsageError
from precast.runtime.llm.runners.base import RunnerBase, StepRunner

__all__ = ["RunnerOptions", "open_artifact_runner", "open_runner", "runner_on"]


@dataclass(frozen=True)
class RunnerOptions:
    """How to open a runner (Engine.load's keyword options). ``threads``: intra-op threads (a staged
    artifact's: per stage, default 1; OpenVINO's INFERENCE_NUM_THREADS). ``verify``: the sha256 of every
    file, checked by the HAL before the runner opens. ``spinning``: whether ONNX Runtime's idle threads
    spin-wait between runs (True, False or "auto": both sessions, runners/spin_switch.py); None is the runner's
    default ("auto"; a staged artifact's False; OpenVINO has none). ``micro_batches``: a staged
    artifact's micro-batches per step (default one per stage). ``state_slots``: a hybrid or state-space
    model's recurrent state slots, the most requests it runs at once (Engine.load: the scheduler's
    max_num_seqs; default runners/recurrent.MAX_STATE_SLOTS)."""

    threads: int | None = None
    verify: bool = True
    spinning: bool | str | None = None
    micro_batches: int | None = None
    state_slots: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object], caller: str) -> RunnerOptions:
        """The options a caller passed as keywords; an unknown one is a UsageError naming the known ones."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise UsageError(f"{caller} got an unknown option '{unknown[0]}' (known: {', '.join(known)})")
        return cls(**kwargs)


def open_artifact_runner(
    path: str | os.PathLike, num_blocks: int | None = None, options: RunnerOptions = RunnerOptions()
) -> StepRunner:
    """open_runner of the artifact at ``path``: a directory, an index (the HAL tries its targets best first,
    passing over one this host cannot run, as Engine.load does) or a packed file (unpacked into a temp dir
    removed when the runner is garbage collected)."""
    import weakref

    from precast.runtime.hal import resolve

    found = resolve(
        path,
        lambda root, manifest: open_runner(root, manifest, num_blocks, options, where=path),
        verify=options.verify,
    )
    if found.temp is not None:
        from precast.artifact.archive import remove_temp

        weakref.finalize(found.opened, remove_temp, found.temp)
    return found.opened


def open_runner(
    root: Path,
    manifest: Manifest,
    num_blocks: int | None = None,
    options: RunnerOptions = RunnerOptions(),
    where: str | os.PathLike | None = None,
) -> StepRunner:
    """The runner of a resolved causal-lm target (``root``, its ``manifest``; files already checked),
    with K/V pools of ``num_blocks`` blocks (default LLMSpec.default_num_blocks()). ``where``: the path the
    caller named, for the errors (default ``root``)."""
    where = root if where is None else where
    if manifest.llm is None:
        raise ArtifactError(f"{where}: not a causal-lm artifact (manifest has no 'llm' block)")
    if manifest.stages is not None and manifest.llm.states:
        raise ArtifactError(f"{where}: a step graph with recurrent states cannot run in pipeline stages")
    if manifest.stages is not None:  # one worker per stage, micro-batches pipelined through them
        from precast.runtime.llm.runners.staged import open_staged_runner

        spinning = False if options.spinning is None else options.spinning
        return open_staged_runner(
            root, manifest, num_blocks, options.threads, spinning, options.micro_batches
        )
    if options.micro_batches is not None:
        raise UsageError(f"{where}: micro_batches applies to staged artifacts; this one has no stages")
    spinning = "auto" if options.spinning is None else options.spinning
    if spinning not in (True, False, "auto"):
        raise UsageError(f"spinning must be True, False or 'auto', got {spinning!r}")
    from precast.runtime.model import open_resolved

    auto = spinning == "auto"
    model = open_resolved(root, manifest, threads=options.threads, spinning=False if auto else spinning)
    spec = LLMSpec.from_manifest(model.manifest, str(root))
    runner = runner_on(
        model.session,
        spec,
        spec.default_num_blocks() if num_blocks is None else num_blocks,
        root,
        options.state_slots,
    )
    if auto and spec.kv_layout != "ov-paged":
        _add_spin_switch(runner, model, options.threads)
    return runner


def runner_on(
    session, spec: LLMSpec, num_blocks: int, path: Path | None = None, state_slots: int | None = None
) -> StepRunner:
    """A runner over an open session of a step graph (no stages), by the spec's ``kv_layout``."""
    if spec.kv_layout == "ov-paged":  # OpenVINO's PagedAttention over the engine's block tables
        from precast.runtime.backends.openvino import OpenVINOSession

        if not isinstance(session, OpenVINOSession):
            raise ArtifactError(f"{path}: kv_layout 'ov-paged' needs an OpenVINO artifact")
        from precast.runtime.llm.runners.openvino import OVStepRunner

        return OVStepRunner(session.native, spec, num_blocks, path)
    if spec.kv_layout == "mapped":  # the pool mapped into per-request views, bound in place
        from precast.runtime.llm.runners.mapped import MappedModelRunner

        return MappedModelRunner(session, spec, num_blocks, path)
    if spec.states:  # a hybrid or state-space model: recurrent states in per-request slots
        from precast.runtime.llm.runners.recurrent import RecurrentRunner

        return RecurrentRunner(session, spec, num_blocks, path, state_slots)
    from precast.runtime.llm.runners.gather import ModelRunner

    return ModelRunner(session, spec, num_blocks, path)


def _add_spin_switch(runner: RunnerBase, model, threads: int | None) -> None:
    """spinning="auto": a second, spinning session of the same files, and the SpinSwitch that picks one of
    the two each step (runners/spin_switch.py), for an ONNX Runtime artifact up to AUTO_SPIN_MAX_BYTES."""
    from precast.runtime.backends import create_session
    from precast.runtime.backends.ort_session import native_session
    from precast.runtime.llm.runners.gather import AUTO_SPIN_MAX_BYTES
    from precast.runtime.llm.runners.spin_switch import SpinSwitch

    root = Path(model.path)
    if native_session(model.session) is None or _weights_bytes(root) > AUTO_SPIN_MAX_BYTES:
        return
    # (the files were checked by the HAL a moment ago; this session reads the same ones)
    spin = create_session(root, model.manifest.target, threads=threads, spinning=True)
    runner.attach_spin_switch(SpinSwitch(model.session, spin))


def _weights_bytes(root: Path) -> int:
    return sum(
        p.stat().st_size for p in root.rglob("*") if p.is_file() and p.suffix in (".onnx", ".data", ".bin")
    )
