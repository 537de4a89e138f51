"""The compile cache: an unchanged model compiled with unchanged options and toolchain is a copy.

    key = sha256(source hash, canonical pipeline per target, target names + options, tolerances,
                 the user's sample/calibration feeds, toolchain versions, a hash of precast's own code)
          (CompilePlan.cache_key_parts: for an HF folder, computed before the export)
    <cache dir>/<key>/entry.json   what the entry belongs to: the key, what it hashes, its manifest's sha256
    <cache dir>/<key>/artifact/    a whole artifact, exactly as published

An entry is data from whoever can write the cache dir, so it is used only when it is bound to this compile:
its recorded key and key inputs equal this compile's, its recorded manifest hash is its manifest's, that
manifest names this source's sha256, these targets and their canonical pipelines, and its record carries
``mac`` = HMAC-SHA256(secret, canonical {key, key inputs, manifest sha256}). Nothing but the MAC is secret: a
writer of the cache dir can forge everything else for a model of their choosing. The secret is
``$PRECAST_CACHE_SECRET`` (CI: a repository secret, shared by the jobs that may write entries the others
trust), else a per-user key file outside the cache dir, ``$XDG_CONFIG_HOME/precast/cache-secret`` (32 random
bytes, 0600, created on first use; one that is a link, someone else's, or readable by others is refused and
the cache is not used). Anything else is a mismatch (another model's entry copied over this key, an entry of
an older layout, an entry signed with another secret): removed and rebuilt, with a note naming it. Its files
are checked by their manifests' sha256s (the entry's, then the published copy's, whose manifest must be the
signed one); a corrupt entry is removed and rebuilt too, but only when it is still precast's (a real
directory holding an artifact whose manifest precast reads): anything else under a key's name is refused,
never deleted. Parity is not re-run on a hit. Writes are atomic (staged sibling dir + rename), so concurrent
CI jobs sharing a cache never see half an entry; the last writer of identical content wins. Temporary entries
of killed jobs (``.<key>.tmp-<pid>-...``) are cleaned by the next cached compile.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from precast.artifact.manifest import (
    MANIFEST_NAME,
    Manifest,
    check_integrity,
    read_manifest,
    sha256_file,
)
from precast.artifact.staging import clean_stale, temp_name
from precast.errors import ArtifactError, UsageError

__all__ = [
    "ARTIFACT_NAME",
    "CACHE_ENV",
    "EntryKey",
    "RECORD_NAME",
    "SECRET_ENV",
    "cache_key",
    "cache_secret",
    "check_artifact_tree",
    "code_hash",
    "hash_sources",
    "hash_feeds",
    "lookup",
    "restore",
    "secret_path",
    "store",
]

CACHE_ENV = "PRECAST_CACHE_DIR"
KEY_VERSION = 1  # bump when what goes into the key changes meaning
_KEY_NAME = re.compile(r"^[0-9a-f]{64}(\.json)?$")  # what precast names entries and notes (legacy temp names)
RECORD_NAME = "entry.json"  # inside an entry: what it belongs to
ARTIFACT_NAME = "artifact"  # inside an entry: the artifact as published
RECORD_FORMAT = 1
_RECORD_MAX_BYTES = 1 << 20  # a real record is a few KiB; a bigger one is not precast's
SECRET_ENV = "PRECAST_CACHE_SECRET"
_SECRET_BYTES = 32  # a key file's size
_SECRET_WHERE = f"${SECRET_ENV} or ~/.config/precast/cache-secret"


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


class _UnsafeKeyFile(Exception):
    """A key file that others could have written or read: no secret at all is safer."""


def secret_path() -> Path:
    """The per-user key file: ``$XDG_CONFIG_HOME/precast/cache-secret`` (default ``~/.config/...``)."""
    config = os.environ.get("XDG_CONFIG_HOME", "")  # the XDG spec: an empty or relative one is ignored
    root = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return root / "precast" / "cache-secret"


def cache_secret(say: Callable[[str], None] = lambda _m: None) -> bytes | None:
    """The key that signs cache entries: ``$PRECAST_CACHE_SECRET``, else the per-user key file (created on
    first use). None, with a note, when the key file cannot be made or is not safely this user's alone: the
    caller then neither uses nor writes the cache. An empty ``$PRECAST_CACHE_SECRET`` is a UsageError."""
    value = os.environ.get(SECRET_ENV)
    if value is not None:
        if not value.strip():
            raise UsageError(
                f"${SECRET_ENV} is set but empty (a CI secret this job does not get?): set it to the secret "
                f"shared by this cache's builders, or unset it to use the key file {secret_path()}"
            )
        return value.encode()
    path = secret_path()
    try:
        try:
            return _read_key_file(path)
        except FileNotFoundError:
            _create_key_file(path)
            return _read_key_file(path)
    except _UnsafeKeyFile as e:
        say(
            f"cache not used: the key file {path} {e}; it must be a file of yours, mode 0600 (or set ${SECRET_ENV})"
        )
    except OSError as e:
        say(
            f"cache not used: cannot read or create the key file {path} ({e.strerror or e}); or set ${SECRET_ENV}"
        )
    return None


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _read_key_file(path: Path) -> bytes:
    if stat.S_ISLNK(os.lstat(path).st_mode):  # FileNotFoundError: not made yet
        raise _UnsafeKeyFile("is a symlink")
    # O_NOFOLLOW: swapped for a link since the lstat; O_NONBLOCK: a FIFO does not hang the compile
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _UnsafeKeyFile("is not a regular file")
        if os.name == "posix" and st.st_uid != os.geteuid():
            raise _UnsafeKeyFile("is not owned by you")
        if os.name == "posix" and st.st_mode & 0o077:
            raise _UnsafeKeyFile(f"is group/world readable or writable ({stat.filemode(st.st_mode)})")
        data = os.read(fd, _SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != _SECRET_BYTES:
        raise _UnsafeKeyFile(f"is not a {_SECRET_BYTES}-byte key")
    return data


def _create_key_file(path: Path) -> None:
    """32 random bytes, mode 0600, published whole: written to an exclusive temp file, then hard-linked to
    ``path``, which never replaces a key that a concurrent first compile made (then that one is used)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _mac(secret: bytes, key: EntryKey, manifest_sha256: str) -> str:
    """HMAC-SHA256 binding an entry's manifest to its key and key inputs (what entry.json records)."""
    message = _canonical(
        {
            "precast_cache_entry": RECORD_FORMAT,
            "key": key.digest,
            "key_parts": json.loads(key.parts),
            "manifest_sha256": manifest_sha256,
        }
    )
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


# precast's own code that decides an artifact's bytes (the version alone does not move between releases, so a
# cache would hand out artifacts built by older code): every package but the CLI, and the top package's
# modules (tests/ci/test_cache.py checks this against setup.py's list of packages).
_CODE_PACKAGES = (
    "precast.artifact",
    "precast.runtime",
    "precast.ir",
    "precast.passes",
    "precast.targets",
    "precast.compiler",
)
_CODE_MODULES = ("precast.errors", "precast.options")


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """sha256 over precast's Python sources (the packages and modules that build artifacts), once per process."""
    import importlib

    roots = [Path(importlib.import_module(m).__file__).parent for m in _CODE_PACKAGES]
    return hash_sources(roots, [Path(importlib.import_module(m).__file__) for m in _CODE_MODULES])


def hash_sources(roots, files=()) -> str:
    """sha256 over the .py files below each root (relative path under the root's name, and bytes), then over
    each of ``files`` (its name and bytes)."""
    h = hashlib.sha256()
    for root in roots:
        base = Path(root)
        for f in sorted(base.rglob("*.py")):
            h.update(f"{base.name}/{f.relative_to(base).as_posix()}\0".encode())
            h.update(f.read_bytes())
    for f in files:
        h.update(f"{Path(f).name}\0".encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def restore(
    cache_dir: str | os.PathLike, key: EntryKey, output: Path, secret: bytes, say=lambda _m: None
) -> tuple[dict | None, str]:
    """On a hit, publish a copy of the entry's artifact at ``output`` (atomically): (manifest, "hit").

    Otherwise (None, "miss"), (None, "corrupt: ...") or (None, "mismatch: ...") - the caller builds and stores.
    ``secret``: cache_secret()'s, which signed the entries this compile may use.
    """
    from precast.compiler.artifact import publish, staging_dir

    clean_stale(cache_dir, legacy=_KEY_NAME.match)  # temp entries of killed jobs
    entry, signed_sha, status = _find(cache_dir, key, secret)
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
            if sha256_file(stage / MANIFEST_NAME) != signed_sha:
                raise _Mismatch(f"its {MANIFEST_NAME} is not the signed one")
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


def lookup(cache_dir: str | os.PathLike, key: EntryKey, secret: bytes) -> tuple[Path | None, str]:
    """(entry dir, "hit") when an intact entry of this key, signed with ``secret``, exists; otherwise
    (None, "miss"), (None, "corrupt: <why>") or (None, "mismatch: <why>") (an intact entry that is not
    provably this key's).

    A corrupt or mismatched entry is deleted so that the following build replaces it.
    """
    entry, _sha, status = _find(cache_dir, key, secret)
    return entry, status


def _find(cache_dir: str | os.PathLike, key: EntryKey, secret: bytes) -> tuple[Path | None, str | None, str]:
    """lookup(), with the manifest sha256 that the entry's MAC vouches for (a hit's copy must have it)."""
    entry = Path(cache_dir) / key.digest
    if not os.path.lexists(entry):
        return None, None, "miss"
    _check_removable(entry)
    try:
        record, manifest_sha = _check_record(entry, key)
        artifact = entry / ARTIFACT_NAME
        _check_manifest(artifact, check_artifact_tree(artifact), key)
        # Last, so that an entry of another model or pipeline is named as such; everything above can be forged.
        mac = str(record.get("mac", "")).encode()  # bytes: compare_digest refuses non-ASCII str
        if not hmac.compare_digest(mac, _mac(secret, key, manifest_sha).encode()):
            raise _Mismatch(f"not signed with this cache's secret ({_SECRET_WHERE})")
    except ArtifactError as e:
        _remove(entry)
        return None, None, f"corrupt: {e}"
    except _Mismatch as e:
        _remove(entry)
        return None, None, f"mismatch: {e}"
    return entry, manifest_sha, "hit"


def _check_record(entry: Path, key: EntryKey) -> tuple[dict, str]:
    """The entry's record names this key, the same key inputs, and the manifest the entry holds:
    (the record, that manifest's sha256)."""
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
    if manifest_sha is None or record.get("manifest_sha256") != manifest_sha:
        raise _Mismatch(f"its {MANIFEST_NAME} is not the one recorded")
    return record, manifest_sha


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


def store(cache_dir: str | os.PathLike, key: EntryKey, artifact: Path, secret: bytes) -> Path:
    """Copy a published artifact into the cache atomically, with the record that binds it to ``key``, signed
    with ``secret``; returns the entry's path."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key.digest
    tmp = cache_dir / temp_name(key.digest, "tmp")
    try:
        shutil.copytree(artifact, tmp / ARTIFACT_NAME, symlinks=True)
        manifest_sha = sha256_file(tmp / ARTIFACT_NAME / MANIFEST_NAME)
        record = {
            "format": RECORD_FORMAT,
            "key": key.digest,
            "key_parts": json.loads(key.parts),
            "manifest_sha256": manifest_sha,
            "mac": _mac(secret, key, manifest_sha),
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
