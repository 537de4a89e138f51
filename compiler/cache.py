"""The compile cache: an unchanged model compiled with unchanged options and toolchain is a copy.

    key = sha256(source hash, canonical pipeline per target, target names + options, tolerances,
                 the user's sample/calibration feeds, toolchain versions, a hash of precast's own code)
          (CompilePlan.cache_key_parts: for an HF folder, computed before the export)
    <cache dir>/<key>/            a whole artifact, exactly as published
    <cache dir>/<key>.json        a small note: what went into the key (for humans debugging misses)

Entries are checked by their own manifests' sha256s before use; a corrupt entry is removed and rebuilt,
but only when it is still a precast artifact (a real directory whose manifest precast reads): anything else
under a key's name is refused, never deleted. Writes are atomic (staged sibling dir + rename), so
concurrent CI jobs sharing a cache never see half an entry; the last writer of identical content wins.
Temporary entries of killed jobs (``.<key>.tmp-<pid>-...``) are cleaned by the next cached compile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from precast.runtime.errors import ArtifactError, UsageError
from precast.runtime.manifest import Manifest, check_integrity, read_manifest
from precast.runtime.staging import clean_stale, temp_name

__all__ = [
    "CACHE_ENV",
    "cache_key",
    "check_artifact_tree",
    "code_hash",
    "hash_sources",
    "hash_feeds",
    "lookup",
    "restore",
    "store",
]

CACHE_ENV = "PRECAST_CACHE_DIR"
KEY_VERSION = 1  # bump when what goes into the key changes meaning
_KEY_NAME = re.compile(r"^[0-9a-f]{64}(\.json)?$")  # what precast names entries and notes (legacy temp names)


def hash_feeds(feeds: Mapping[str, np.ndarray] | None) -> str | None:
    """Content hash of named arrays (name, dtype, shape, bytes), order-independent."""
    if feeds is None:
        return None
    h = hashlib.sha256()
    for name in sorted(feeds):
        arr = np.asarray(feeds[name], order="C")
        h.update(f"{name}\0{arr.dtype.str}\0{list(arr.shape)}\0".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def cache_key(parts: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``parts`` (what decides the artifact's bytes)."""
    blob = json.dumps(
        {"key_version": KEY_VERSION, **parts}, sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()


# precast's own packages whose code decides an artifact's bytes (the version alone does not move between
# releases, so a cache would hand out artifacts built by older code).
_CODE_PACKAGES = ("precast.compiler", "precast.passes", "precast.targets", "precast.runtime")


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """sha256 over precast's Python sources (the packages that build artifacts), once per process."""
    import importlib

    return hash_sources(str(Path(importlib.import_module(m).__file__).parent) for m in _CODE_PACKAGES)


def hash_sources(roots) -> str:
    """sha256 over the .py files below each root: relative path (under the root's name) and bytes."""
    h = hashlib.sha256()
    for root in roots:
        base = Path(root)
        for f in sorted(base.rglob("*.py")):
            h.update(f"{base.name}/{f.relative_to(base).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def restore(
    cache_dir: str | os.PathLike, key: str, output: Path, say=lambda _m: None
) -> tuple[dict | None, str]:
    """On a hit, publish a copy of the entry at ``output`` (atomically): (manifest, "hit").

    Otherwise (None, "miss") or (None, "corrupt: ...") - the caller builds and stores.
    """
    from precast.compiler.artifact import publish, staging_dir

    clean_stale(cache_dir, legacy=_KEY_NAME.match)  # temp entries of killed jobs
    entry, status = lookup(cache_dir, key)
    if entry is None:
        if status != "miss":
            say(f"cache entry {key[:12]} is {status}; rebuilding")
        return None, status
    with staging_dir(Path(output)) as stage:
        copy_entry(entry, stage)
        manifest = check_artifact_tree(stage)  # the copy, not only the entry, must be intact
        publish(stage, Path(output))
    say(f"cache hit {key[:12]}: copied {entry}")
    return manifest.to_json(), "hit"


def check_artifact_tree(root: Path) -> Manifest:
    """read_manifest + check_integrity of an artifact, and of each sub-artifact of a multi-target one."""
    manifest = read_manifest(root)
    check_integrity(root, manifest)
    for sub in sorted(manifest.target_dirs().values()):
        check_artifact_tree(root / sub)
    return manifest


def lookup(cache_dir: str | os.PathLike, key: str) -> tuple[Path | None, str]:
    """(entry dir, "hit") when a valid entry exists; (None, "miss") or (None, "corrupt: <why>") otherwise.

    A corrupt entry is deleted so that the following build replaces it.
    """
    entry = Path(cache_dir) / key
    if not os.path.lexists(entry):
        return None, "miss"
    _check_removable(entry)
    try:
        check_artifact_tree(entry)
    except ArtifactError as e:
        _remove(entry)
        return None, f"corrupt: {e}"
    return entry, "hit"


def _check_removable(entry: Path) -> None:
    """An entry precast may delete: a real directory holding a manifest precast reads. Anything else under a
    key's name is not precast's (a link, a user's folder), so it is refused rather than deleted."""
    is_dir = False
    try:
        is_dir = stat.S_ISDIR(os.lstat(entry).st_mode)
        is_manifest = is_dir and stat.S_ISREG(os.lstat(entry / "manifest.json").st_mode)
        if is_manifest:
            read_manifest(entry)
    except (OSError, ArtifactError):
        is_manifest = False
    if not is_manifest:
        what = "a directory" if is_dir else "a symlink or a file"
        raise UsageError(
            f"cache entry {entry} is {what} that is not a precast artifact; refusing to delete it "
            "(move it away, or use another --cache-dir)"
        )


def copy_entry(entry: Path, dest: Path) -> None:
    """Copy a cache entry into an (empty, staged) artifact dir."""
    shutil.copytree(entry, dest, dirs_exist_ok=True, symlinks=True)


def store(
    cache_dir: str | os.PathLike, key: str, artifact: Path, note: Mapping[str, Any] | None = None
) -> Path:
    """Copy a published artifact into the cache atomically; returns the entry's path."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key
    tmp = cache_dir / temp_name(key, "tmp")
    shutil.copytree(artifact, tmp, symlinks=True)
    try:
        if os.path.lexists(entry):
            _check_removable(entry)
            _remove(entry)
        os.replace(tmp, entry)
    except OSError:
        # Another job stored the same key first; its content is the same by construction.
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if note is not None:
        note_tmp = cache_dir / temp_name(f"{key}.json", "tmp")
        note_tmp.write_text(json.dumps(dict(note), indent=2, sort_keys=True, default=str) + "\n")
        os.replace(note_tmp, cache_dir / f"{key}.json")
    return entry


def _remove(entry: Path) -> None:
    # Rename first so a concurrent reader never sees a half-deleted entry under the key's name.
    trash = entry.parent / temp_name(entry.name, "trash")
    try:
        os.replace(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
