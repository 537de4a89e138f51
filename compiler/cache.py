"""The compile cache: an unchanged model compiled with unchanged options and toolchain is a copy.

    key = sha256(source hash, canonical pipeline per target, target names + options, tolerances,
                 the user's sample/calibration feeds, toolchain versions, a hash of precast's own code)
          (CompilePlan.cache_key_parts: for an HF folder, computed before the export)
    <cache dir>/<key>/entry.json   what the entry belongs to: the key, what it hashes, its manifest's sha256
    <cache dir>/<key>/artifact/    a whole artifact, exactly as published

An entry is data from whoever can write the cache dir, so it is used only when it is bound to this compile:
its recorded key and key inputs equal this compile's, its recorded manifest hash is its manifest's, and that
manifest names this source's sha256, these targets and their canonical pipelines. Anything else is a mismatch
(another model's entry copied over this key, an entry of an older layout): removed and rebuilt, with a note
naming it. A writer of the cache dir can still forge all of these for a model of their choosing (nothing in
them is secret; see SECURITY.md, "The compile cache"): the cache dir must be writable only by trusted builders. Its files are checked by their manifests' sha256s (the entry's, then the published copy's);
a corrupt entry is removed and rebuilt too, but only when it is still precast's (a real directory holding an
artifact whose manifest precast reads): anything else under a key's name is refused, never deleted. Parity
is not re-run on a hit. Writes are atomic (staged sibling dir + rename), so concurrent CI jobs sharing a
cache never see half an entry; the last writer of identical content wins. Temporary entries of killed jobs
(``.<key>.tmp-<pid>-...``) are cleaned by the next cached compile.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from precast.runtime.errors import ArtifactError, UsageError
from precast.runtime.manifest import MANIFEST_NAME, Manifest, check_integrity, read_manifest, sha256_file
from precast.runtime.staging import clean_stale, temp_name

__all__ = [
    "ARTIFACT_NAME",
    "CACHE_ENV",
    "EntryKey",
    "RECORD_NAME",
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
RECORD_NAME = "entry.json"  # inside an entry: what it belongs to
ARTIFACT_NAME = "artifact"  # inside an entry: the artifact as published
RECORD_FORMAT = 1
_RECORD_MAX_BYTES = 1 << 20  # a real record is a few KiB; a bigger one is not precast's


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
    return hashlib.sha256(_canonical({"key_version": KEY_VERSION, **parts}).encode()).hexdigest()


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class EntryKey:
    """What a compile looks up: the key, what it hashes, and what the artifact under it must say it is."""

    digest: str  # cache_key(parts): the entry's folder name
    parts: str  # the canonical JSON the digest hashes (recorded in the entry, compared on lookup)
    source_sha256: str  # the source's hash: the artifact's manifest must name it
    pipelines: Mapping[str, str]  # target name -> canonical pipeline: the artifact's targets, exactly

    @classmethod
    def of(cls, parts: Mapping[str, Any], source_sha256: str, pipelines: Mapping[str, str]) -> EntryKey:
        canonical = _canonical({"key_version": KEY_VERSION, **parts})
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        return cls(digest, canonical, source_sha256, dict(pipelines))


class _Mismatch(Exception):
    """An entry that is intact but does not provably belong to the key it is stored under."""


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
    cache_dir: str | os.PathLike, key: EntryKey, output: Path, say=lambda _m: None
) -> tuple[dict | None, str]:
    """On a hit, publish a copy of the entry's artifact at ``output`` (atomically): (manifest, "hit").

    Otherwise (None, "miss"), (None, "corrupt: ...") or (None, "mismatch: ...") - the caller builds and stores.
    """
    from precast.compiler.artifact import publish, staging_dir

    clean_stale(cache_dir, legacy=_KEY_NAME.match)  # temp entries of killed jobs
    entry, status = lookup(cache_dir, key)
    if entry is None:
        if status.startswith("mismatch: "):
            why = status.removeprefix("mismatch: ")
            say(f"cache entry {Path(cache_dir) / key.digest} is not this compile's: {why}; rebuilding")
        elif status != "miss":
            say(f"cache entry {key.digest[:12]} is {status}; rebuilding")
        return None, status
    with staging_dir(Path(output)) as stage:
        copy_entry(entry / ARTIFACT_NAME, stage)
        manifest = check_artifact_tree(stage)  # the copy, not only the entry, must be intact ...
        try:  # ... and still this compile's (the entry may have been swapped since the lookup)
            _check_manifest(stage, manifest, key)
        except _Mismatch as e:
            raise ArtifactError(f"cache entry {entry} changed while it was copied: {e}") from None
        publish(stage, Path(output))
    say(f"cache hit {key.digest[:12]}: copied {entry}")
    return manifest.to_json(), "hit"


def check_artifact_tree(root: Path) -> Manifest:
    """read_manifest + check_integrity of an artifact, and of each sub-artifact of a multi-target one."""
    manifest = read_manifest(root)
    check_integrity(root, manifest)
    for sub in sorted(manifest.target_dirs().values()):
        check_artifact_tree(root / sub)
    return manifest


def lookup(cache_dir: str | os.PathLike, key: EntryKey) -> tuple[Path | None, str]:
    """(entry dir, "hit") when an intact entry of this key exists; otherwise (None, "miss"),
    (None, "corrupt: <why>") or (None, "mismatch: <why>") (an intact entry that is not provably this key's).

    A corrupt or mismatched entry is deleted so that the following build replaces it.
    """
    entry = Path(cache_dir) / key.digest
    if not os.path.lexists(entry):
        return None, "miss"
    _check_removable(entry)
    try:
        _check_record(entry, key)
        artifact = entry / ARTIFACT_NAME
        _check_manifest(artifact, check_artifact_tree(artifact), key)
    except ArtifactError as e:
        _remove(entry)
        return None, f"corrupt: {e}"
    except _Mismatch as e:
        _remove(entry)
        return None, f"mismatch: {e}"
    return entry, "hit"


def _check_record(entry: Path, key: EntryKey) -> None:
    """The entry's record names this key, the same key inputs, and the manifest the entry holds."""
    path = entry / RECORD_NAME
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _RECORD_MAX_BYTES:
            raise _Mismatch(f"its {RECORD_NAME} is not a small regular file")
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise _Mismatch(f"it has no {RECORD_NAME} (an older precast's entry, or not precast's)") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, UTF-8 or a huge integer
        raise _Mismatch(f"its {RECORD_NAME} is unreadable ({type(e).__name__})") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise _Mismatch(f"its {RECORD_NAME} is not precast's (format {RECORD_FORMAT})")
    recorded = record.get("key")
    if recorded != key.digest:
        raise _Mismatch(f"it was recorded under key {str(recorded)[:12]}, not {key.digest[:12]}")
    if _canonical(record.get("key_parts")) != key.parts:
        raise _Mismatch("its recorded key inputs are not this compile's")
    try:
        manifest_sha = sha256_file(entry / ARTIFACT_NAME / MANIFEST_NAME)
    except OSError:
        manifest_sha = None  # an older layout with a record planted beside it
    if record.get("manifest_sha256") != manifest_sha:
        raise _Mismatch(f"its {MANIFEST_NAME} is not the one recorded")


def _check_manifest(root: Path, manifest: Manifest, key: EntryKey) -> None:
    """The artifact at ``root`` (checked by check_artifact_tree) is of this source, these targets and pipelines."""
    if manifest.is_multi_target:
        dirs = manifest.target_dirs()
        _check_source(manifest, key)
        if sorted(dirs) != sorted(key.pipelines):
            raise _Mismatch(f"its targets {sorted(dirs)} are not {sorted(key.pipelines)}")
        subs = {name: read_manifest(root / d) for name, d in dirs.items()}
    else:
        subs = {manifest.target.name: manifest}
        if len(key.pipelines) != 1:
            raise _Mismatch(f"it holds one target, not {sorted(key.pipelines)}")
    for name, sub in subs.items():
        _check_source(sub, key)
        if name not in key.pipelines or sub.target.name != name:
            raise _Mismatch(f"its target '{sub.target.name}' is not {sorted(key.pipelines)}")
        if sub.pipeline != key.pipelines[name]:
            raise _Mismatch(
                f"target '{name}' was built with pipeline '{sub.pipeline}', not '{key.pipelines[name]}'"
            )


def _check_source(manifest: Manifest, key: EntryKey) -> None:
    sha = (manifest.source or {}).get("sha256")
    if sha != key.source_sha256:
        raise _Mismatch(
            f"it was built from source sha256 {str(sha)[:12]}, not this source's {key.source_sha256[:12]}"
        )


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _check_removable(entry: Path) -> None:
    """An entry precast may delete: a real directory holding its record and an artifact whose manifest precast
    reads (or, as older precasts stored them, that artifact itself). Anything else under a key's name is not
    precast's (a link, a user's folder), so it is refused rather than deleted."""
    is_dir = False
    try:
        is_dir = stat.S_ISDIR(os.lstat(entry).st_mode)
        if is_dir and set(os.listdir(entry)) <= {RECORD_NAME, ARTIFACT_NAME}:
            artifact = entry / ARTIFACT_NAME
            is_manifest = stat.S_ISDIR(os.lstat(artifact).st_mode) and _is_file(artifact / MANIFEST_NAME)
        else:
            artifact = entry
            is_manifest = is_dir and _is_file(entry / MANIFEST_NAME)
        if is_manifest:
            read_manifest(artifact)
    except (OSError, ArtifactError):
        is_manifest = False
    if not is_manifest:
        what = "a directory" if is_dir else "a symlink or a file"
        raise UsageError(
            f"cache entry {entry} is {what} that is not a precast artifact; refusing to delete it "
            "(move it away, or use another --cache-dir)"
        )


def copy_entry(artifact: Path, dest: Path) -> None:
    """Copy a cache entry's artifact into an (empty, staged) artifact dir."""
    shutil.copytree(artifact, dest, dirs_exist_ok=True, symlinks=True)


def store(cache_dir: str | os.PathLike, key: EntryKey, artifact: Path) -> Path:
    """Copy a published artifact into the cache atomically, with the record that binds it to ``key``;
    returns the entry's path."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key.digest
    tmp = cache_dir / temp_name(key.digest, "tmp")
    try:
        shutil.copytree(artifact, tmp / ARTIFACT_NAME, symlinks=True)
        record = {
            "format": RECORD_FORMAT,
            "key": key.digest,
            "key_parts": json.loads(key.parts),
            "manifest_sha256": sha256_file(tmp / ARTIFACT_NAME / MANIFEST_NAME),
        }
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if os.path.lexists(entry):
            _check_removable(entry)
            _remove(entry)
        os.replace(tmp, entry)
    except OSError:
        # Another job stored the same key first; a lookup checks whatever it wrote.
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def _remove(entry: Path) -> None:
    # Rename first so a concurrent reader never sees a half-deleted entry under the key's name.
    trash = entry.parent / temp_name(entry.name, "trash")
    try:
        os.replace(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
