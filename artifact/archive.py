"""Reading packed artifacts (``.precast``: one tar file) safely, with the standard library only.

A packed artifact is a tar of regular files: ``manifest.json`` first, then ``statement.json`` and
``statement.sig`` when signed (artifact/signing.py), then the other files in sorted order (zeroed
mtimes/owners; see compiler/pack.py). The reader trusts nothing in the archive: it rejects absolute paths,
``..``, links, device files, directories, sparse members, duplicate names, members not listed in the
manifest and size bombs (bounded member count, total size and total/archive size ratio); it checks the
signed statement (when given a SignaturePolicy: signature, manifest sha256, name, least version, expiry)
before anything else is written, and the sha256 of every file while writing it into a private staging dir,
re-checks the result, and only then renames it into place. Nothing is ever written outside that staging dir.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import posixpath
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from precast.artifact.manifest import (
    BUILD_INFO_NAME,
    MANIFEST_NAME,
    Manifest,
    check_integrity,
    parse_json,
    read_manifest,
)
from precast.artifact.signing import (
    LEGACY_SIGNATURE_NAME,
    MAX_STATEMENT_BYTES,
    STATEMENT_NAME,
    STATEMENT_SIG_NAME,
    SignatureError,
    SignaturePolicy,
    Statement,
    signature_policy,
    verify_statement,
)
from precast.artifact.staging import clean_stale, temp_name
from precast.errors import ArtifactError, IntegrityError, UsageError, first_line

__all__ = [
    "ArchiveError",
    "Limits",
    "Unpacked",
    "read_packed_manifest",
    "remove_temp",
    "unpack_artifact",
    "unpack_checked",
    "unpack_to_temp",
]

# Members outside the manifest's hashes: the signature's (never written out). manifest.sig is format v1's,
# still unpacked without a key, refused with one (_check_signature).
_SIGNATURE_MEMBERS = (STATEMENT_NAME, STATEMENT_SIG_NAME, LEGACY_SIGNATURE_NAME)


class ArchiveError(ArtifactError):
    """A packed artifact is unreadable or holds something it must not (link, device, unlisted file...)."""


@dataclass(frozen=True)
class Unpacked:
    """What an unpack produced: the artifact dir, its manifest, and the signed statement it was checked
    against (None when no signature was required)."""

    path: Path
    manifest: Manifest
    statement: Statement | None = None


@dataclass(frozen=True)
class Limits:
    max_members: int = 100_000
    max_total_bytes: int = 64 << 30  # sum of member sizes
    max_ratio: float = 100.0  # unpacked bytes per archive byte (compressed tars); plain tar is ~1
    ratio_slack_bytes: int = 16 << 20  # small archives may compress very well; allow this much regardless
    max_manifest_bytes: int = 64 << 20
    max_build_info_bytes: int = 1 << 20
    max_header_bytes: int = 1 << 20  # one GNU long-name / pax header's payload (real ones are < 1 KiB)


_CHUNK = 1 << 20
_READ_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, ValueError, UnicodeError)
_OK_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
_KIND = {
    tarfile.SYMTYPE: "a symlink",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.DIRTYPE: "a directory entry",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}


_META_TYPES = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


def _bounded_tarinfo(where: str, limit: int) -> type[tarfile.TarInfo]:
    """A TarInfo that refuses oversized metadata headers before tarfile reads them.

    tarfile reads a GNU long-name or pax header's whole declared payload into memory before returning
    the member (``_proc_gnulong`` / ``_proc_pax``), so an 859-byte bz2 declaring a 1 GB name used 1 GB of
    RAM before any check of ours ran. ``_proc_member`` is tarfile's documented hook for subclasses.
    """

    class BoundedTarInfo(tarfile.TarInfo):
        def _proc_member(self, tf):
            if self.type in _META_TYPES and self.size > limit:
                raise ArchiveError(
                    f"{where}: a tar metadata header declares {self.size} bytes (limit {limit}; size bomb?)"
                )
            return super()._proc_member(tf)

    return BoundedTarInfo


def _check_name(where: str, name: str) -> None:
    bad = None
    if not name:
        bad = "empty name"
    elif "\0" in name or "\\" in name:
        bad = "NUL or backslash in the name"
    elif name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        bad = "absolute path"
    elif ".." in name.split("/"):
        bad = "'..' in the path"
    elif posixpath.normpath(name) != name or name.startswith("./"):
        bad = "non-canonical path"
    elif any(ord(c) < 32 for c in name):
        bad = "control character in the name"
    if bad:
        raise ArchiveError(f"{where}: member {name!r} rejected: {bad}")


def _scan(tf: tarfile.TarFile, where: str, archive_size: int, limits: Limits) -> dict[str, tarfile.TarInfo]:
    """Validate every member header (before any data is used); return {name: member}."""
    members: dict[str, tarfile.TarInfo] = {}
    folded: set[str] = set()
    total = 0
    budget = min(limits.max_total_bytes, int(limits.max_ratio * archive_size) + limits.ratio_slack_bytes)
    while True:
        try:
            m = tf.next()
        except _READ_ERRORS as e:
            raise ArchiveError(f"{where}: not a readable precast archive ({first_line(e)})") from e
        if m is None:
            break
        _check_name(where, m.name)
        if m.type not in _OK_TYPES:
            kind = _KIND.get(m.type, f"member type {m.type!r}")
            raise ArchiveError(
                f"{where}: member {m.name!r} rejected: {kind} (only regular files are allowed)"
            )
        if m.name in members or m.name.casefold() in folded:
            raise ArchiveError(f"{where}: member {m.name!r} appears twice")
        members[m.name] = m
        folded.add(m.name.casefold())
        total += m.size
        if len(members) > limits.max_members:
            raise ArchiveError(f"{where}: more than {limits.max_members} members (size bomb?)")
        if total > budget:
            raise ArchiveError(
                f"{where}: members unpack to more than {budget} bytes for a {archive_size}-byte archive (size bomb?)"
            )
    if MANIFEST_NAME not in members:
        raise ArchiveError(f"{where}: not a precast archive (no {MANIFEST_NAME})")
    return members


def _read_member(tf: tarfile.TarFile, m: tarfile.TarInfo, where: str, cap: int) -> bytes:
    if m.size > cap:
        raise ArchiveError(f"{where}: member {m.name!r} is {m.size} bytes (limit {cap})")
    try:
        f = tf.extractfile(m)
        data = f.read(cap + 1) if f is not None else b""
    except _READ_ERRORS as e:
        raise ArchiveError(f"{where}: member {m.name!r} is unreadable ({first_line(e)})") from e
    if len(data) != m.size:
        raise ArchiveError(f"{where}: member {m.name!r} is truncated")
    return data


def _write_member(
    tf: tarfile.TarFile, m: tarfile.TarInfo, stage: Path, where: str, digest: str | None
) -> None:
    dest = stage / m.name
    if stage.resolve() not in dest.resolve().parents:  # defence in depth; names were checked already
        raise ArchiveError(f"{where}: member {m.name!r} would land outside the target dir")
    h = hashlib.sha256()
    n = 0
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = tf.extractfile(m)
        with open(dest, "xb") as out:  # O_EXCL: never follows or replaces anything already there
            while src is not None and (block := src.read(min(_CHUNK, m.size - n + 1))):
                n += len(block)
                if n > m.size:
                    break
                h.update(block)
                out.write(block)
    except _READ_ERRORS as e:
        raise ArchiveError(f"{where}: cannot unpack member {m.name!r} ({first_line(e)})") from e
    if n != m.size:
        raise ArchiveError(f"{where}: member {m.name!r} is truncated ({n} of {m.size} bytes)")
    if digest is not None and h.hexdigest() != digest:
        raise IntegrityError(
            f"{where}: file '{m.name}' does not match its manifest sha256 ({h.hexdigest()[:12]}..., "
            f"manifest says {digest[:12]}...)"
        )


def _plan(tf, members, stage: Path, where: str, written: set[str]) -> tuple[dict[str, str], set[str]]:
    """{member: sha256} the manifests promise (sub-artifacts included), and the optional unhashed members.

    Manifests are written to ``stage`` as they are read (sub-manifests after their hash is checked).
    """
    expected: dict[str, str] = {}
    optional: set[str] = set()
    queue = [""]
    while queue:
        prefix = queue.pop(0)
        name = prefix + MANIFEST_NAME
        if prefix:
            if name not in members:
                raise IntegrityError(f"{where}: sub-artifact manifest '{name}' is missing")
            _write_member(tf, members[name], stage, where, expected[name])
            written.add(name)
        try:
            manifest = read_manifest(stage / prefix) if prefix else read_manifest(stage)
        except ArtifactError as e:
            raise ArchiveError(f"{where}: {e}") from e
        optional.add(prefix + BUILD_INFO_NAME)
        for rel, digest in manifest.files.items():
            expected[prefix + rel] = digest
        if manifest.is_multi_target:
            for tname, sub in sorted(manifest.target_dirs().items()):
                if not sub:
                    raise ArchiveError(f"{where}: malformed target entry '{tname}'")
                _check_name(where, prefix + sub)
                if prefix + sub + "/" + MANIFEST_NAME not in expected:
                    raise ArchiveError(
                        f"{where}: target '{tname}' manifest is not hashed by its parent manifest"
                    )
                queue.append(prefix + sub + "/")
    return expected, optional


def _check_signature(
    tf, members, manifest_bytes: bytes, policy: SignaturePolicy, where: str, now
) -> Statement:
    if STATEMENT_NAME not in members:
        if LEGACY_SIGNATURE_NAME in members:
            raise SignatureError(
                f"{where}: signature format v1 ({LEGACY_SIGNATURE_NAME}: manifest only, no name, version or "
                "expiry) is no longer accepted: re-sign it with `precast pack --sign-key KEY --version V` "
                "(format v2)"
            )
        raise SignatureError(f"{where}: not signed (no {STATEMENT_NAME}), but --pubkey was given")
    if STATEMENT_SIG_NAME not in members:
        raise SignatureError(f"{where}: {STATEMENT_NAME} has no signature ({STATEMENT_SIG_NAME} is missing)")
    statement = _read_member(tf, members[STATEMENT_NAME], where, MAX_STATEMENT_BYTES)
    sig = _read_member(tf, members[STATEMENT_SIG_NAME], where, 1024)
    return verify_statement(statement, sig, manifest_bytes, policy, where, now)


def _policy(pubkey, policy: SignaturePolicy | None) -> SignaturePolicy | None:
    if pubkey is not None and policy is not None:
        raise UsageError("give pubkey or policy, not both (a SignaturePolicy names its public key)")
    return policy if policy is not None else signature_policy(pubkey)


def unpack_artifact(
    archive: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    pubkey: str | os.PathLike | None = None,
    policy: SignaturePolicy | None = None,
    now: datetime | None = None,
    limits: Limits = Limits(),
) -> Manifest:
    """Unpack a packed artifact into ``dest`` (which must not exist, or be empty); return its manifest.

    ``pubkey`` requires a valid signature; ``policy`` also a name and a least version (see unpack_checked)."""
    return unpack_checked(archive, dest, policy=_policy(pubkey, policy), now=now, limits=limits).manifest


def unpack_checked(
    archive: str | os.PathLike,
    dest: str | os.PathLike | None = None,
    *,
    policy: SignaturePolicy | None = None,
    now: datetime | None = None,
    limits: Limits = Limits(),
) -> Unpacked:
    """Unpack ``archive`` into ``dest`` (new or empty; None: a private temp dir that ``remove_temp`` or the
    process's exit removes). With ``policy``, the signed statement must be valid for its public key, name
    these manifest bytes and meet the policy (name, least version, not expired at ``now``: default the
    wall clock), or nothing is unpacked (SignatureError, exit 3)."""
    if dest is None:
        tmp = tempfile.mkdtemp(prefix="precast-")
        _TEMP_DIRS.append(tmp)
        try:
            return _unpack(Path(archive), Path(tmp) / "artifact", policy, now, limits)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _TEMP_DIRS.remove(tmp)
            raise
    return _unpack(Path(archive), Path(dest), policy, now, limits)


def _unpack(archive: Path, dest: Path, policy: SignaturePolicy | None, now, limits: Limits) -> Unpacked:
    where = str(archive)
    if not archive.is_file():
        raise ArtifactError(f"packed artifact not found: {archive}")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ArtifactError(f"unpack target {dest} exists and is not empty; refusing to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest.parent)  # stages of unpacks that were killed (their owner's pid is gone)
    stage = dest.parent / temp_name(dest.name, "unpack")
    stage.mkdir()
    try:
        try:
            tf = tarfile.open(  # noqa: SIM115 (closed by the `with tf:` below)
                archive, "r:*", tarinfo=_bounded_tarinfo(where, limits.max_header_bytes)
            )
        except _READ_ERRORS as e:
            raise ArchiveError(f"{where}: not a readable precast archive ({first_line(e)})") from e
        with tf:
            members = _scan(tf, where, archive.stat().st_size, limits)
            manifest_bytes = _read_member(tf, members[MANIFEST_NAME], where, limits.max_manifest_bytes)
            statement = None
            if policy is not None:
                statement = _check_signature(tf, members, manifest_bytes, policy, where, now)
            (stage / MANIFEST_NAME).write_bytes(manifest_bytes)
            written = {MANIFEST_NAME, *_SIGNATURE_MEMBERS}
            expected, optional = _plan(tf, members, stage, where, written)
            for name in members:
                if name not in expected and name not in optional and name not in written:
                    raise ArchiveError(f"{where}: member {name!r} is not listed in the manifest")
            missing = sorted(set(expected) - set(members))
            if missing:
                raise IntegrityError(f"{where}: file '{missing[0]}' listed in the manifest is missing")
            for name, m in members.items():
                if name in written:
                    continue  # the manifest(s) are already written and checked; the signature is not kept
                if name in optional and m.size > limits.max_build_info_bytes:
                    raise ArchiveError(
                        f"{where}: member {name!r} is {m.size} bytes (limit {limits.max_build_info_bytes})"
                    )
                _write_member(tf, m, stage, where, expected.get(name))
        for name in optional:
            if (stage / name).is_file():
                _check_json(stage / name, where, name)
        manifest = _check_tree(stage, where)
        os.replace(stage, dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return Unpacked(dest, manifest, statement)


def _check_json(path: Path, where: str, name: str) -> None:
    try:
        parse_json(path.read_bytes(), name)
    except ArtifactError:
        raise ArchiveError(f"{where}: member {name!r} is not valid JSON") from None


def _check_tree(root: Path, where: str) -> Manifest:
    try:
        manifest = read_manifest(root)
        check_integrity(root, manifest)
        for sub in sorted(manifest.target_dirs().values()):
            check_integrity(root / sub, read_manifest(root / sub))
    except IntegrityError as e:
        raise IntegrityError(f"{where}: {e}") from e
    return manifest


def read_packed_manifest(
    archive: str | os.PathLike,
    *,
    pubkey: str | os.PathLike | None = None,
    policy: SignaturePolicy | None = None,
    now: datetime | None = None,
) -> Manifest:
    """Unpack into a private temp dir (full checks), return the manifest, and clean up."""
    with tempfile.TemporaryDirectory(prefix="precast-verify-") as tmp:
        return unpack_artifact(archive, Path(tmp) / "artifact", pubkey=pubkey, policy=policy, now=now)


_TEMP_DIRS: list[str] = []


@atexit.register  # once: whatever is still unpacked goes when the process exits
def _remove_all_temp() -> None:
    for d in list(_TEMP_DIRS):
        shutil.rmtree(d, ignore_errors=True)
    _TEMP_DIRS.clear()


def unpack_to_temp(
    archive: str | os.PathLike,
    *,
    pubkey: str | os.PathLike | None = None,
    policy: SignaturePolicy | None = None,
    now: datetime | None = None,
) -> Path:
    """Unpack into a fresh private temp dir (removed when the process exits); return the artifact dir."""
    return unpack_checked(archive, policy=_policy(pubkey, policy), now=now).path


def remove_temp(artifact: str | os.PathLike) -> None:
    """Remove the temp dir unpack_to_temp made for ``artifact`` (the dir it returned) now, not at exit:
    its owner (a Model, an Engine, a served model) calls this when closed. Idempotent; other paths are
    left alone."""
    tmp = str(Path(artifact).parent)
    try:
        _TEMP_DIRS.remove(tmp)
    except ValueError:  # removed already, or not one of ours
        return
    shutil.rmtree(tmp, ignore_errors=True)
