"""``precast profile``: ONNX Runtime's profiler on an artifact, summed per operator type.

ORT writes a Chrome trace (``chrome://tracing`` / Perfetto) with one ``<node>_kernel_time`` event per
node per run; summing ``dur`` by ``args.op_name`` shows where the time goes and so what to fuse next.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from precast.errors import ArtifactError, UsageError
from precast.runtime.feeds import check_feeds
from precast.runtime.verify import load_parity_value

__all__ = ["profile_artifact", "summarize_trace"]


def summarize_trace(events: list, runs: int) -> list[dict]:
    """Per op type: total/mean microseconds per run, node count, share of kernel time; slowest first."""
    per_op: dict[str, dict] = {}
    for ev in events:
        if (
            not isinstance(ev, dict)
            or ev.get("cat") != "Node"
            or not str(ev.get("name", "")).endswith("_kernel_time")
        ):
            continue
        args = ev.get("args") or {}
        op = str(args.get("op_name", "?"))
        row = per_op.setdefault(
            op, {"op": op, "total_us": 0, "calls": 0, "nodes": set(), "provider": args.get("provider", "")}
        )
        row["total_us"] += int(ev.get("dur", 0))
        row["calls"] += 1
        row["nodes"].add(str(ev["name"])[: -len("_kernel_time")])
    grand = sum(r["total_us"] for r in per_op.values()) or 1
    rows = []
    for r in per_op.values():
        rows.append(
            {
                "op": r["op"],
                "provider": r["provider"],
                "nodes": len(r["nodes"]),
                "calls": r["calls"],
                "total_us": r["total_us"],
                "us_per_run": round(r["total_us"] / max(runs, 1), 1),
                "share": round(r["total_us"] / grand, 4),
            }
        )
    return sorted(rows, key=lambda r: (-r["total_us"], r["op"]))


def profile_artifact(
    path: str | os.PathLike,
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    runs: int = 10,
    warmup: int = 2,
    trace: str | os.PathLike | None = None,
    threads: int | None = None,
    prefer: str | None = None,
) -> dict:
    """Profile ``warmup`` + ``runs`` runs of the artifact (per-run numbers divide by both).

    ``feeds`` default to the artifact's stored parity inputs. Returns {"ops": [...], "runs", "trace"}.
    """
    from precast.artifact.target_blocks import OrtBlock
    from precast.runtime.model import load

    if runs < 1:
        raise UsageError(f"--runs must be at least 1, got {runs}")
    model = load(path, threads=threads, prefer=prefer)  # integrity, packed files, multi-target choice
    target = model.manifest.target
    if not isinstance(target, OrtBlock):
        raise UsageError(
            f"{path}: target '{model.target}' runs on {target.backend}, and profile uses ONNX Runtime's "
            "profiler; pick an ONNX Runtime target with --prefer"
        )
    arrays = check_feeds(_stored_feeds(model, path) if feeds is None else feeds, model.inputs)
    with tempfile.TemporaryDirectory(prefix="precast-profile-") as tmp:
        sessions = _profiling_sessions(model, threads, Path(tmp))
        for _ in range(warmup + runs):  # warm-up runs are in the trace too; per-run numbers count them
            _run_once(sessions, arrays)
        produced = [Path(sess.end_profiling()) for sess, _, _ in sessions]
        events = [ev for p in produced for ev in json.loads(p.read_text())]
        if trace is not None:
            Path(trace).parent.mkdir(parents=True, exist_ok=True)
            if len(produced) == 1:
                shutil.copyfile(produced[0], trace)
            else:
                Path(trace).write_text(json.dumps(events))
    return {
        "ops": summarize_trace(events, runs + warmup),
        "runs": runs,
        "warmup": warmup,
        "trace": None if trace is None else str(trace),
        "target": model.target,
    }


def _stored_feeds(model, path) -> dict[str, np.ndarray]:
    """The artifact's stored parity inputs: the feeds a profile runs when it is given none."""
    stored = (model.manifest.parity or {}).get("inputs")
    if not stored:
        raise ArtifactError(f"{path}: no stored sample inputs; pass --input feeds.npz")
    return {n: load_parity_value(model.path, rel) for n, rel in stored.items()}


def _parts(model) -> list[tuple[Path, list[str] | None, list[str]]]:
    """(model file, the tensors it reads (None: the feeds), the tensors it writes); a staged artifact
    (split-stages) runs its stages in order, each profiled by its own session."""
    from precast.artifact.manifest import artifact_path, model_path

    root = model.path
    if model.manifest.stages is None:
        return [(model_path(root, model.manifest.target), None, [o.name for o in model.outputs])]
    return [
        (artifact_path(root, e.model, f"stage '{e.model}'"), list(e.inputs), list(e.outputs))
        for e in model.manifest.stages.stages
    ]


def _profiling_sessions(model, threads: int | None, tmp: Path) -> list[tuple]:
    """One ONNX Runtime session with profiling on per part, each writing its trace under ``tmp``."""
    import onnxruntime as ort

    from precast.runtime.backends import ort_session_options
    from precast.runtime.hugepages import collapse_new_memory

    target = model.manifest.target
    sessions = []
    for k, (file, ins, outs) in enumerate(_parts(model)):
        so = ort_session_options(target.session_settings, threads)
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp / f"profile_{k}")
        # the same memory as a loaded model's
        with collapse_new_memory(target.session_settings.to_json()):
            sess = ort.InferenceSession(str(file), sess_options=so, providers=target.provider_list)
        sessions.append((sess, ins, outs))
    return sessions


def _run_once(sessions: list[tuple], arrays: dict[str, np.ndarray]) -> None:
    env = dict(arrays)
    for sess, ins, outs in sessions:
        env.update(zip(outs, sess.run(outs, arrays if ins is None else {n: env[n] for n in ins})))
