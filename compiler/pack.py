"""Packing an artifact directory into one deterministic tar file (``precast pack``).

    manifest.json, [statement.json, statement.sig], then every other file in sorted order;
    regular files only, mode 0644, mtime 0, uid/gid 0, no owner names.

``build-info.json`` (wall times, host: the one unhashed file) stays out unless asked for, so two builds
of the same input pack to the same bytes (Ed25519 signatures are deterministic too) and a packed file
can be cached and compared by its sha256. A signature covers a statement naming the artifact, its version,
the manifest's sha256 and an optional expiry (artifact/signing.py). Reading is the runtime's job
(artifact/archive.py).
"""

from __future__ import annotations

import io
import os
import tarfile
from datetime import datetime
from pathlib import Path

from precast.artifact.manifest import BUILD_INFO_NAME, MANIFEST_NAME, sha256_file
from precast.artifact.signing import (
    LEGACY_SIGNATURE_NAME,
    STATEMENT_NAME,
    STATEMENT_SIG_NAME,
    Statement,
    check_name,
    sign_statement,
)
from precast.artifact.staging import clean_stale, temp_name
from precast.compiler.cache import check_artifact_tree
from precast.errors import UsageError

__all__ = ["pack_artifact"]

# Archive members outside the manifest's hashes: an artifact file of that name could not be packed.
_RESERVED = (STATEMENT_NAME, STATEMENT_SIG_NAME, LEGACY_SIGNATURE_NAME)


def _info(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


def pack_artifact(
    artifact_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    sign_key: str | os.PathLike | None = None,
    name: str | None = None,
    version: str = "0",
    expires: datetime | None = None,
    build_info: bool = False,
) -> dict:
    """Check the artifact's integrity, then write it as one tar (atomically). Returns a summary.

    With ``sign_key``, the pack carries a statement signed with it: ``name`` (default: the artifact folder's
    name), ``version`` (default "0", the lowest: any least version above 0 refuses it; `precast pack`
    requires one), the manifest's sha256 and ``expires`` (optional ``not_after``)."""
    root, out = Path(artifact_dir), Path(out_file)
    if out.exists() and out.is_dir():
        raise UsageError(f"pack output {out} is a directory; give a file name such as model.precast")
    check_artifact_tree(root)  # refuse to ship a tampered or half-written artifact
    files = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise UsageError(
                f"artifact {root}: '{path.relative_to(root)}' is a symlink; packs hold regular files only"
            )
        rel = path.relative_to(root).as_posix()
        if rel in _RESERVED:
            raise UsageError(f"artifact {root}: '{rel}' is a name packs reserve for the signature")
        if path.is_file() and (build_info or path.name != BUILD_INFO_NAME):
            files.append(rel)
    manifest_bytes = (root / MANIFEST_NAME).read_bytes()
    statement = signature = None
    if sign_key is not None:
        if name is None:  # the folder's name, unless it cannot be a signed name
            name = check_name(root.resolve().name, "signed name (the artifact folder's; give --name)")
        statement = Statement.of(manifest_bytes, name, version, expires)
        signature = sign_statement(statement, sign_key)
    elif (name, version, expires) != (None, "0", None):
        raise UsageError("name, version and expires are parts of the signed statement: give sign_key too")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out.parent, legacy=lambda base: base == out.name)  # half-written packs of killed runs
    tmp = out.parent / temp_name(out.name, "tmp")
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
            tf.addfile(_info(MANIFEST_NAME, len(manifest_bytes)), io.BytesIO(manifest_bytes))
            if statement is not None and signature is not None:
                body = statement.to_bytes()
                tf.addfile(_info(STATEMENT_NAME, len(body)), io.BytesIO(body))
                tf.addfile(_info(STATEMENT_SIG_NAME, len(signature)), io.BytesIO(signature))
            for rel in files:
                if rel == MANIFEST_NAME:
                    continue
                path = root / rel
                with open(path, "rb") as f:
                    tf.addfile(_info(rel, path.stat().st_size), f)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "output": str(out),
        "files": len(files),
        "bytes": out.stat().st_size,
        "sha256": sha256_file(out),
        "signed": statement is not None,
        "statement": statement.to_json() if statement is not None else None,
    }
