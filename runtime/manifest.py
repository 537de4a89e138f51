"""The artifact manifest: reading, schema checks and file integrity.

An artifact is a directory holding ``manifest.json`` plus the files it lists with their sha256.
``build-info.json`` (wall times, host) is the one file left out of the hashes: it is the only part of an
artifact that is allowed to differ between two builds of the same input.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from precast.runtime.errors import ArtifactError, IntegrityError, SchemaVersionError, first_line

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "BUILD_INFO_NAME",
    "TensorSpec",
    "sha256_file",
    "read_manifest",
    "check_integrity",
    "dump_json",
    "parse_json",
    "artifact_path",
    "model_path",
]

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
BUILD_INFO_NAME = "build-info.json"


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: name, numpy dtype name, shape (int = static, str = symbolic, None = unknown)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
        }

    @classmethod
    def from_json(cls, d: dict) -> TensorSpec:
        try:
            shape = d["shape"]
            return cls(str(d["name"]), str(d["dtype"]), None if shape is None else tuple(shape))
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"manifest: malformed tensor entry {d!r}") from e

    def shape_str(self) -> str:
        if self.shape is None:
            return "[?]"
        return "[" + ",".join("?" if d is None else str(d) for d in self.shape) + "]"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dump_json(obj, path: str | os.PathLike) -> None:
    """Deterministic JSON (sorted keys, fixed indent, trailing newline)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def parse_json(text: str | bytes, where: str) -> object:
    """JSON from an untrusted source, every failure an ArtifactError naming ``where``.

    Besides syntax errors, ``json`` raises RecursionError on deep nesting and ValueError on integers
    past Python's digit limit (and on lone surrogates when given bytes): all are a malformed file here.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ArtifactError(f"{where}: JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ArtifactError(f"{where}: not valid JSON ({first_line(e)})") from None


def artifact_path(root: str | os.PathLike, rel: object, what: str) -> Path:
    """``root / rel`` for a path the manifest names, refused (ArtifactError) unless it stays inside ``root``.

    An artifact is untrusted data: an absolute path, ``..`` or a symlink leading out would make the
    runtime open (and run) a file the artifact's hashes never covered.
    """
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise ArtifactError(f"artifact {root}: manifest '{what}' must be a relative path, got {rel!r}")
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or ".." in Path(rel.replace("\\", "/")).parts:
        raise ArtifactError(f"artifact {root}: manifest '{what}' = {rel!r} points outside the artifact")
    base = Path(root).resolve()
    full = (base / p).resolve()
    if full != base and base not in full.parents:
        raise ArtifactError(
            f"artifact {root}: manifest '{what}' = {rel!r} resolves outside the artifact (a symlink?)"
        )
    return Path(root) / p


_DEFAULT_MODEL = {"openvino": "model.xml", "tensorrt": "model.engine", "tensorrt-plan": "model.engine"}


def model_path(root: str | os.PathLike, target: dict) -> Path:
    """The target block's model file, checked to stay inside the artifact."""
    default = _DEFAULT_MODEL.get(target.get("backend"), "model.onnx")
    return artifact_path(root, target.get("model", default), "target.model")


def _named_paths(manifest: dict):
    """(what, relative path) for every path the manifest names, whatever its kind."""
    target = manifest.get("target")
    if isinstance(target, dict) and "model" in target:
        yield "target.model", target["model"]
    llm = manifest.get("llm")
    if isinstance(llm, dict) and llm.get("tokenizer") is not None:
        yield "llm.tokenizer", llm["tokenizer"]
    parity = manifest.get("parity")
    if isinstance(parity, dict):
        for key in ("inputs", "expected"):
            table = parity.get(key)
            if table is None:
                continue
            if not isinstance(table, dict):
                yield f"parity.{key}", table
                continue
            for name, rel in table.items():
                yield f"parity.{key}.{name}", rel
    targets = manifest.get("targets")
    if manifest.get("kind") == "multi-target" or targets is not None:
        if not isinstance(targets, dict):
            raise ArtifactError("manifest 'targets' must be a JSON object")
        for name, entry in targets.items():
            if not isinstance(entry, dict):
                raise ArtifactError(f"manifest 'targets.{name}' must be a JSON object")
            yield f"targets.{name}.dir", entry.get("dir", name)


def read_manifest(artifact_dir: str | os.PathLike) -> dict:
    """Read and sanity-check ``manifest.json``; raise ArtifactError / SchemaVersionError."""
    root = Path(artifact_dir)
    if not root.exists():
        raise ArtifactError(f"artifact not found: {root}")
    if not root.is_dir():
        raise ArtifactError(f"artifact must be a directory, got a file: {root}")
    mpath = root / MANIFEST_NAME
    if not mpath.is_file():
        raise ArtifactError(f"not a precast artifact: {root} has no {MANIFEST_NAME}")
    manifest = parse_json(mpath.read_bytes(), f"{mpath}: manifest")
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: manifest must be a JSON object")
    version = manifest.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ArtifactError(f"{mpath}: missing or non-integer schema_version")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{root}: manifest schema version {version} is newer than this runtime supports "
            f"({SCHEMA_VERSION}); written by precast {manifest.get('precast_version', '?')} - upgrade precast"
        )
    if version < 1:
        raise ArtifactError(f"{mpath}: invalid schema_version {version}")
    for key in ("files", "target", "io"):
        if key not in manifest:
            raise ArtifactError(f"{mpath}: manifest lacks '{key}'")
        if key != "files" and not isinstance(manifest[key], dict):
            raise ArtifactError(f"{mpath}: '{key}' must be a JSON object, got {type(manifest[key]).__name__}")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise ArtifactError(f"{mpath}: 'files' must map relative paths to sha256 strings")
    for rel in files:
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or rel in (MANIFEST_NAME, ""):
            raise ArtifactError(f"{mpath}: unsafe file entry {rel!r}")
    try:
        _check_types(manifest)
        for what, rel in _named_paths(manifest):
            artifact_path(root, rel, what)
    except ArtifactError as e:
        raise ArtifactError(f"{mpath}: {e.message.removeprefix(f'artifact {root}: ')}") from None
    return manifest


_TOLERANCE_KEYS = {"atol", "rtol", "min_cosine"}


def _check_types(manifest: dict) -> None:
    """The shapes of the fields the runtime reads, so a malformed one is exit 3 naming it, not a TypeError."""
    target = manifest["target"]
    providers = target.get("providers", [])
    if not isinstance(providers, list) or not all(isinstance(p, str) for p in providers):
        raise ArtifactError("'target.providers' must be a list of execution provider names")
    for key in ("model", "backend", "name"):
        if key in target and not isinstance(target[key], str):
            raise ArtifactError(f"'target.{key}' must be a string")
    io = manifest["io"]
    for key in ("inputs", "outputs"):
        if key in io and (not isinstance(io[key], list) or not all(isinstance(t, dict) for t in io[key])):
            raise ArtifactError(f"'io.{key}' must be a list of tensor entries")
    parity = manifest.get("parity")
    if parity is None:
        return
    if not isinstance(parity, dict):
        raise ArtifactError("'parity' must be a JSON object")
    for key in ("inputs", "expected"):
        if key in parity and not isinstance(parity[key], dict):
            raise ArtifactError(f"'parity.{key}' must map tensor names to stored files")
    tol = parity.get("tolerance")
    if tol is not None:
        if not isinstance(tol, dict) or set(tol) - _TOLERANCE_KEYS:
            raise ArtifactError(f"'parity.tolerance' must be an object with keys {sorted(_TOLERANCE_KEYS)}")
        for k, v in tol.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ArtifactError(f"'parity.tolerance.{k}' must be a number")


def check_integrity(artifact_dir: str | os.PathLike, manifest: dict) -> None:
    """Every listed file exists and matches its sha256; nothing unlisted sits beside them."""
    root = Path(artifact_dir)
    for rel, digest in sorted(manifest["files"].items()):
        path = root / rel
        if not path.is_file():
            raise IntegrityError(f"artifact {root}: file '{rel}' is missing")
        if path.is_symlink() or root.resolve() not in path.resolve().parents:
            raise IntegrityError(f"artifact {root}: file '{rel}' is a symlink or lies behind one")
        actual = sha256_file(path)
        if actual != digest:
            raise IntegrityError(
                f"artifact {root}: file '{rel}' was modified (sha256 {actual[:12]}..., manifest says {digest[:12]}...)"
            )
    listed = set(manifest["files"]) | {MANIFEST_NAME, BUILD_INFO_NAME}
    # One walk for both rules; it does not follow links, so each link is reported, not entered.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in dirnames + sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                raise IntegrityError(
                    f"artifact {root}: '{rel}' is a symlink (an artifact holds plain files and folders only)"
                )
            if name in filenames and rel not in listed and not _is_subartifact(rel, manifest):
                raise IntegrityError(f"artifact {root}: unexpected file '{rel}' not listed in the manifest")


def _is_subartifact(rel: str, manifest: dict) -> bool:
    # Multi-target artifacts hold whole sub-artifacts, each checked by its own manifest.
    subs = manifest.get("targets") or {}
    return any(
        rel.startswith(f"{d}/") for d in (v.get("dir", k) for k, v in subs.items() if isinstance(v, dict))
    )
