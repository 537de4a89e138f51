"""The hardware abstraction layer: which target of an artifact this host runs, for every loader.

    resolve(path, open, prefer=..., pubkey=...) -> Resolved(root, manifest, opened, skipped, temp)

``path`` is an artifact directory, a multi-target index, or a packed file (unpacked, checksums and signature
checked, into a temp dir the caller then owns). An index's targets are tried best first (``prefer``; then,
given the ``concurrency`` the caller will run at, the target whose measured rate at that load is highest (a
causal-lm compile records each target's decode rate alone and its aggregate rate at 8 and 32 requests; a
speculating caller alone also weighs the rate of one request's 8-token verify rows); else
the compile's measured ``fallback_order``; else PREFERENCE): ``open(root, manifest)`` opens one, and a
TargetUnavailableError from it passes to the next, its reason kept in ``skipped``. runtime.load opens a
backend session this way, Engine.load a step runner; both get the same order, signature policy and errors.

The target names live here, on the artifact side: the runtime may not import ``precast.targets``, so the
compiler's target registry checks its names against TARGET_NAMES instead of keeping a list of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Generic, TypeVar

from precast.artifact.manifest import Manifest, check_integrity, read_manifest
from precast.artifact.target_blocks import TargetBlock
from precast.errors import ArtifactError, TargetUnavailableError, UnknownTargetError

__all__ = [
    "PREFERENCE",
    "TARGET_NAMES",
    "VERIFY_FIGURE",
    "Opener",
    "Resolved",
    "check_target_name",
    "preference_order",
    "rate_at",
    "resolve",
    "speed_figure",
    "target_order",
]

# Every target precast compiles (targets/base.py's register_target refuses a name not listed here).
TARGET_NAMES = ("ort-cpu", "openvino", "ort-qnn", "tensorrt", "triton")

# Best first: the order when a multi-target artifact offers several (a GPU engine, then NPU execution
# providers, then OpenVINO, then the portable CPU build).
PREFERENCE = ["tensorrt", "ort-qnn", "openvino", "ort-cpu"]

T = TypeVar("T")
Opener = Callable[[Path, Manifest], T]


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """The target a loader opened: its directory and manifest, what ``open`` returned for it, the better
    targets passed over (name -> reason), and the temp dir a packed artifact was unpacked into (None for a
    directory; the caller removes it with archive.remove_temp when done)."""

    root: Path
    manifest: Manifest
    opened: T
    skipped: Mapping[str, str] = field(default_factory=dict)
    temp: Path | None = None


def check_target_name(name: str, what: str = "to prefer") -> None:
    """A target name the caller typed (``--prefer``): not one precast knows -> UnknownTargetError (exit 4) with
    the closest known name. Whether the artifact has it is the loader's question."""
    if name in TARGET_NAMES:
        return
    import difflib

    close = difflib.get_close_matches(str(name), TARGET_NAMES, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise UnknownTargetError(f"unknown target '{name}' {what}{hint} (targets: {', '.join(TARGET_NAMES)})")


def preference_order(names: Iterable[str], prefer: str | None = None) -> list[str]:
    """``names`` best first by PREFERENCE (unknown names last, in their given order); ``prefer`` first of all."""
    names = list(names)
    rank = {n: PREFERENCE.index(n) if n in PREFERENCE else len(PREFERENCE) + i for i, n in enumerate(names)}
    return sorted(names, key=lambda n: (n != prefer, rank[n]))


# The rates a causal-lm compile measures per target (its manifest's parity.speed), by the concurrency each
# stands for (compiler/decoder/llm_speed.py).
SPEED_FIGURES = ((1, "decode_b1_tok_s"), (8, "batch8_tok_s"), (32, "batch32_tok_s"))
# One request's tokens per second in steps of 8 rows (a chunked prefill: a speculative verify step's rows
# through the layers, at most 7 drafts; a verify step also takes those rows through the lm head, a prefill
# chunk one). Speculation at batch 1 pays by that rate against the decode rate: a backend whose
# weights are read once for 8 rows (OpenVINO's INT4 MatMul) can win there while ONNX Runtime, whose INT4
# MatMul's cost grows with every row, wins plain decoding (issue 43, measured on a 150 MB INT4 target).
VERIFY_FIGURE = "verify8_b1_tok_s"


def speed_figure(speed: object, key: str) -> float | None:
    """speed[key] when it is a finite, non-negative number (an artifact is untrusted data), else None."""
    v = speed.get(key) if isinstance(speed, Mapping) else None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        v = float(v)  # (a JSON integer of 400 digits: OverflowError)
    except OverflowError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def rate_at(speed: object, concurrency: int, speculative: bool = False) -> float | None:
    """The recorded rate measured nearest ``concurrency`` requests (on a log scale: 1, 8, 32), or None when
    ``speed`` records none (an artifact is untrusted data: only finite, non-negative numbers count).
    ``speculative`` at batch 1 (where speculation runs: it turns itself off in large batches): the geometric
    mean of the decode rate and the verify-row rate, where both are recorded (what speculation reaches lies
    between them, by its acceptance: all rejected, it decodes at the first; all kept, near the second)."""
    figures = [(n, v) for n, key in SPEED_FIGURES if (v := speed_figure(speed, key)) is not None]
    if not figures:
        return None
    at = math.log(max(1, int(concurrency)))
    n, rate = min(figures, key=lambda f: abs(math.log(f[0]) - at))
    verify = speed_figure(speed, VERIFY_FIGURE) if speculative and n == 1 else None
    return math.sqrt(rate * verify) if verify is not None else rate


def _measured_order(
    root: Path, entries: Mapping[str, str], concurrency: int, speculative: bool = False
) -> list[str] | None:
    """The index's targets by their recorded rate at ``concurrency`` (fastest first), or None unless every
    target records one."""
    speeds = {}
    for name, rel in entries.items():
        try:
            speeds[name] = (read_manifest(root / rel).parity or {}).get("speed")
        except (ArtifactError, OSError):
            return None
    # (the verify-row rate only where every target records one: one unit for all)
    speculative = speculative and all(speed_figure(sp, VERIFY_FIGURE) is not None for sp in speeds.values())
    rates = {}
    for name, speed in speeds.items():
        rates[name] = rate_at(speed, concurrency, speculative)
        if rates[name] is None:
            return None
    return sorted(entries, key=lambda n: -rates[n])


def target_order(
    root: Path,
    manifest: Manifest,
    prefer: str | None = None,
    concurrency: int | None = None,
    speculative: bool = False,
) -> list[str]:
    """An index's targets in the order to try: ``prefer`` first; then, for a caller that says the
    ``concurrency`` it will run at, by the rate each target recorded nearest that load; else the index's
    ``fallback_order`` (a causal-lm compile's ranking over both loads), else PREFERENCE's."""
    entries = manifest.target_dirs()
    if prefer is not None and prefer not in entries:
        raise ArtifactError(
            f"{root}: no target '{prefer}' in this artifact (has: {', '.join(sorted(entries))})"
        )
    measured = _measured_order(root, entries, concurrency, speculative) if concurrency is not None else None
    if measured is not None:
        return sorted(measured, key=lambda n: n != prefer)
    recorded = manifest.fallback_order or []
    if sorted(recorded) != sorted(entries):  # absent, or not this index's targets: the static order
        return preference_order(entries, prefer)
    return sorted(recorded, key=lambda n: n != prefer)


def resolve(
    path: str | os.PathLike,
    open: Opener[T],
    *,
    prefer: str | None = None,
    pubkey: str | os.PathLike | None = None,
    expect_name: str | None = None,
    min_version: str | None = None,
    now: datetime | None = None,
    verify: bool = True,
    concurrency: int | None = None,
    speculative: bool = False,
) -> Resolved[T]:
    """The target of the artifact at ``path`` that this host runs, opened by ``open`` (see the module doc).

    ``pubkey`` requires a packed artifact's signed statement (artifact/signing.py): a valid Ed25519
    signature, not expired at ``now``, named ``expect_name`` and at least ``min_version`` when given.
    ``verify``: the sha256 of every file of the manifests read on the way. ``concurrency``: the requests the
    caller will run at once (an LLM engine's batch): an index's targets are ranked by their rate there;
    ``speculative``: the caller speculates (rate_at)."""
    if prefer is not None:  # a typo: exit 4 with the close match, not "no target ... in this artifact"
        check_target_name(prefer)
    from precast.artifact.signing import signature_policy

    policy = signature_policy(pubkey, expect_name, min_version)  # requirements without a key: UsageError
    root = Path(path)
    if not root.is_file():
        if policy is not None:
            raise ArtifactError(
                f"{root}: signatures live in packed artifacts; pack it, or drop the public key"
            )
        return _resolve_dir(root, open, prefer, verify, concurrency, speculative)
    from precast.artifact.archive import remove_temp, unpack_to_temp

    temp = unpack_to_temp(root, policy=policy, now=now)
    try:
        found = _resolve_dir(temp, open, prefer, verify, concurrency, speculative)
        return dataclasses.replace(found, temp=temp)
    except BaseException:
        remove_temp(temp)
        raise


def _resolve_dir(
    root: Path,
    open: Opener[T],
    prefer: str | None,
    verify: bool,
    concurrency: int | None = None,
    speculative: bool = False,
) -> Resolved[T]:
    manifest = read_manifest(root)
    if verify:
        check_integrity(root, manifest)
    if manifest.is_multi_target:
        entries, skipped = manifest.target_dirs(), {}
        for name in target_order(root, manifest, prefer, concurrency, speculative):
            try:
                found = _resolve_dir(root / entries[name], open, None, verify)
            except TargetUnavailableError as e:
                skipped[name] = str(e)
                continue
            return dataclasses.replace(found, skipped=skipped)
        reasons = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        raise TargetUnavailableError(f"{root}: no target of this artifact can run on this host ({reasons})")
    own = manifest.target.name
    if prefer is not None and prefer != own:
        raise ArtifactError(f"{root}: no target '{prefer}' in this artifact (has: {own})")
    if not isinstance(manifest.target, TargetBlock):
        raise ArtifactError(f"{root}: target '{own}' is a multi-target index's, but the manifest is no index")
    return Resolved(root, manifest, open(root, manifest))
