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

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.schema import IOSignature, Record, TargetEntry, TensorSpec
from precast.artifact.stages_spec import StagesSpec
from precast.artifact.target_blocks import (
    IndexTargetBlock,
    TargetBlock,
    target_block_from_json,
)
from precast.errors import ArtifactError, IntegrityError, SchemaVersionError, UsageError, first_line

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "BUILD_INFO_NAME",
    "Manifest",
    "MULTI_TARGET",
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
    try:
        base = Path(root).resolve()
        full = (base / p).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ArtifactError(
            f"artifact {root}: manifest '{what}' = {rel!r} cannot be resolved ({e})"
        ) from None
    if full != base and base not in full.parents:
        raise ArtifactError(
            f"artifact {root}: manifest '{what}' = {rel!r} resolves outside the artifact (a symlink?)"
        )
    return Path(root) / p


def model_path(root: str | os.PathLike, target: TargetBlock) -> Path:
    """The target block's model file, checked to stay inside the artifact."""
    return artifact_path(root, target.model_file, "target.model")


MULTI_TARGET = "multi-target"
_TOLERANCE_KEYS = {"atol", "rtol", "min_cosine"}


@dataclass(frozen=True)
class Manifest(Record):
    """``manifest.json``: one target's artifact, or (``kind: multi-target``) the index of several.

    Typed: ``target`` (one TargetBlock per backend, artifact/target_blocks.py), ``io``, ``llm`` (LLMSpec),
    ``files`` (relative path -> sha256), ``targets`` (the index's entries). Free-form objects, checked where
    read: ``source`` (kind, name, sha256 and the frontend's info), ``toolchain`` (package -> version),
    ``passes`` (per-pass records with their stats), ``parity`` (the verification report: runtime/verify.py
    reads its ``inputs``/``expected``/``tolerance``; the shapes of those are checked here) and ``failed``
    (target -> error of a partial multi-target compile).
    """

    schema_version: int
    files: dict[str, str]
    target: TargetBlock | IndexTargetBlock
    io: IOSignature
    precast_version: str | None = None
    toolchain: dict | None = None
    source: dict | None = None
    llm: LLMSpec | None = None
    pipeline: str | None = None
    passes: list[dict] | None = None
    extra_files: list[str] | None = None
    parity: dict | None = None
    kind: str | None = None
    targets: dict[str, TargetEntry] | None = None
    fallback_order: list[str] | None = None
    failed: dict[str, dict] | None = None
    stages: StagesSpec | None = None

    @classmethod
    def field_parser(cls, name: str):
        if name == "target":
            return target_block_from_json
        if name == "llm":
            return LLMSpec.from_json
        if name == "stages":
            return StagesSpec.from_json
        return None

    @property
    def is_multi_target(self) -> bool:
        return self.kind == MULTI_TARGET

    def __getitem__(self, key: str):
        """``manifest["files"]``: the key's JSON value, as the previous release's ``read_manifest`` (a dict)
        gave it. Code shipped inside artifacts it wrote reads it so (the Triton target's model.py), and
        runs against whatever precast the serving host has."""
        return self.to_json()[key]

    def get(self, key: str, default=None):
        return self.to_json().get(key, default)

    def target_dirs(self) -> dict[str, str]:
        """Target name -> its sub-artifact folder (a multi-target index; empty otherwise)."""
        return {name: e.dir if e.dir is not None else name for name, e in (self.targets or {}).items()}

    def validate(self, where: str) -> None:
        if self.schema_version < 1:
            raise ArtifactError(f"{where}: invalid schema_version {self.schema_version}")
        for rel in self.files:
            p = Path(rel)
            if p.is_absolute() or ".." in p.parts or rel in (MANIFEST_NAME, ""):
                raise ArtifactError(f"{where}: unsafe file entry {rel!r}")
        if self.kind not in (None, MULTI_TARGET):
            raise ArtifactError(f"{where}: unknown kind {self.kind!r} (known: '{MULTI_TARGET}')")
        if self.is_multi_target and self.targets is None:
            raise ArtifactError(f"{where}: a multi-target manifest needs 'targets'")
        if self.parity is not None:
            _check_parity(self.parity, where)
        if self.llm is not None:
            _check_llm_against_io(self.llm, self.io, where)

    def named_paths(self):
        """(what, relative path) for every path the manifest names, whatever its kind."""
        if isinstance(self.target, TargetBlock) and self.target.model is not None:
            yield "target.model", self.target.model
        if self.llm is not None:
            yield "llm.tokenizer", self.llm.tokenizer
        for k, stage in enumerate(self.stages.stages if self.stages is not None else ()):
            yield f"stages.stages[{k}].model", stage.model
        for key in ("inputs", "expected"):
            for name, rel in ((self.parity or {}).get(key) or {}).items():
                yield f"parity.{key}.{name}", rel
        for name, d in self.target_dirs().items():
            yield f"targets.{name}.dir", d


def _check_llm_against_io(llm: LLMSpec, io: IOSignature, where: str) -> None:
    """The llm block's sizes against the manifest's own ``io`` (the step graph's shapes as compiled), where
    those are static: one edited without the other is refused without opening the model. (load() compares
    the block with the graph itself: runtime/model.py.)"""
    specs = {t.name: t for t in (*io.inputs, *io.outputs)}
    logits = specs.get("logits")
    if logits is not None and logits.shape and isinstance(logits.shape[-1], int):
        if logits.shape[-1] != llm.vocab:
            raise ArtifactError(
                f"{where}: llm block does not match 'io': 'logits' is {logits.shape_str()}, the block says "
                f"vocab={llm.vocab}"
            )
    sizes = [(n, k) for k, v in llm.kv_inputs for n in ((k, "head_size"), (v, "value_size"))]
    for name, size_key in sizes:  # [rows or blocks, KV heads, rows, head size]
        kv = specs.get(name)
        if kv is None or kv.shape is None or len(kv.shape) != 4:
            continue
        want = {
            "kv_heads": llm.kv_heads,
            size_key: llm.head_size if size_key == "head_size" else llm.value_head_size,
        }
        for axis, key in ((1, "kv_heads"), (3, size_key)):
            dim = kv.shape[axis]
            if isinstance(dim, int) and dim != want[key]:
                raise ArtifactError(
                    f"{where}: llm block does not match 'io': {name!r} is {kv.shape_str()}, the block says "
                    f"{key}={want[key]}"
                )


def _check_parity(parity: dict, where: str) -> None:
    """The parts of the free-form parity report the runtime reads (runtime/verify.py)."""
    for key in ("inputs", "expected"):
        if key in parity and not isinstance(parity[key], dict):
            raise ArtifactError(f"{where}: 'parity.{key}' must map tensor names to stored files")
    if "tolerance" in parity:
        tol = parity["tolerance"]
        if not isinstance(tol, dict) or set(tol) - _TOLERANCE_KEYS:
            raise ArtifactError(
                f"{where}: 'parity.tolerance' must be an object with keys {sorted(_TOLERANCE_KEYS)}"
            )
        for k, v in tol.items():  # atol / rtol null: no elementwise bound (runtime/verify.Tolerance)
            if (v is not None or k == "min_cosine") and (
                isinstance(v, bool) or not isinstance(v, (int, float))
            ):
                raise ArtifactError(f"{where}: 'parity.tolerance.{k}' must be a number")


def read_manifest(artifact_dir: str | os.PathLike) -> Manifest:
    """Read and check ``manifest.json`` (schema version first, then every key against the schema)."""
    root = Path(artifact_dir)
    if not root.exists():
        raise ArtifactError(f"artifact not found: {root}")
    if not root.is_dir():
        raise ArtifactError(f"artifact must be a directory, got a file: {root}")
    mpath = root / MANIFEST_NAME
    if not mpath.is_file():
        if (root / "seq2seq.json").is_file():  # (artifact/seq2seq_spec.py: two part artifacts, not one model)
            raise UsageError(
                f"{root} is an encoder-decoder artifact (seq2seq.json), which this does not take yet: `precast "
                "run`, `serve` and `verify` do (Python: precast.runtime.seq2seq.engine.Seq2SeqEngine.load)"
            )
        raise ArtifactError(f"not a precast artifact: {root} has no {MANIFEST_NAME}")
    data = parse_json(mpath.read_bytes(), f"{mpath}: manifest")
    if not isinstance(data, dict):
        raise ArtifactError(f"{mpath}: manifest must be a JSON object")
    version = data.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ArtifactError(f"{mpath}: missing or non-integer schema_version")
    if version > SCHEMA_VERSION:  # before the keys: a newer schema may have keys this one lacks
        raise SchemaVersionError(
            f"{root}: manifest schema version {version} is newer than this runtime supports "
            f"({SCHEMA_VERSION}); written by precast {data.get('precast_version', '?')} - upgrade precast"
        )
    manifest = Manifest.from_json(data, str(mpath))
    try:
        for what, rel in manifest.named_paths():
            artifact_path(root, rel, what)
    except ArtifactError as e:
        raise ArtifactError(f"{mpath}: {e.message.removeprefix(f'artifact {root}: ')}") from None
    if manifest.is_multi_target:
        _check_index_targets(root, mpath, manifest)
    return manifest


def _check_index_targets(root: Path, mpath: Path, index: Manifest) -> None:
    """An index lists single-target artifacts, each in a sub-folder. A target folder that is the index's own
    (``dir: "."``) or holds another index would send every reader round in circles (a RecursionError) or
    down a chain the readers do not follow: refused here, where every command reads the index."""
    base = root.resolve()
    for name, rel in index.target_dirs().items():
        sub = root / rel
        if sub.resolve() == base:
            raise ArtifactError(
                f"{mpath}: 'targets.{name}.dir' = {rel!r} is the index's own folder "
                "(a target lives in a sub-folder)"
            )
        sub_manifest = sub / MANIFEST_NAME
        if not sub_manifest.is_file():
            continue  # reported by whoever opens that target (artifact not found)
        try:
            data = parse_json(sub_manifest.read_bytes(), f"{sub_manifest}: manifest")
        except ArtifactError:
            continue  # a malformed sub-manifest is reported by whoever opens that target
        if isinstance(data, dict) and data.get("kind") == MULTI_TARGET:
            raise ArtifactError(
                f"{mpath}: 'targets.{name}.dir' = {rel!r} holds another multi-target index "
                "(an index lists single-target artifacts)"
            )


def check_integrity(artifact_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Every listed file exists and matches its sha256; nothing unlisted sits beside them."""
    root = Path(artifact_dir)
    for rel, digest in sorted(manifest.files.items()):
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
    listed = set(manifest.files) | {MANIFEST_NAME, BUILD_INFO_NAME}
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


def _is_subartifact(rel: str, manifest: Manifest) -> bool:
    # Multi-target artifacts hold whole sub-artifacts, each checked by its own manifest.
    return any(rel.startswith(f"{d}/") for d in manifest.target_dirs().values())
