"""Writing artifacts: atomic (temp dir + rename), deterministic (sorted JSON, no timestamps in hashed files)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from precast.runtime.errors import UsageError
from precast.runtime.manifest import BUILD_INFO_NAME, MANIFEST_NAME, dump_json, sha256_file

__all__ = ["staging_dir", "finalize_manifest", "write_index", "save_tensors", "load_tensors", "publish"]


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A fresh sibling temp dir of ``final``; removed on any failure (nothing half-written is left)."""
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise UsageError(f"output {final} exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not (final / MANIFEST_NAME).is_file():
        raise UsageError(f"output {final} exists and is not a precast artifact; refusing to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, final: Path) -> None:
    """Swap the staged artifact into place; an old artifact at ``final`` is replaced as a whole."""
    final = Path(final)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _safe_name(name: str, i: int) -> str:
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:60]
    return f"{i:02d}_{keep}.npy"


def save_tensors(arrays: Mapping[str, np.ndarray], folder: Path, rel_prefix: str) -> dict[str, str]:
    """Save arrays as .npy (deterministic bytes, unlike .npz). Returns {tensor name: relative path}."""
    folder.mkdir(parents=True, exist_ok=True)
    index = {}
    for i, (name, arr) in enumerate(arrays.items()):
        fname = _safe_name(name, i)
        np.save(folder / fname, np.asarray(arr, order="C"), allow_pickle=False)  # keeps 0-d arrays 0-d
        index[name] = f"{rel_prefix}/{fname}"
    return index


def load_tensors(root: Path, index: Mapping[str, str]) -> dict[str, np.ndarray]:
    return {name: np.load(root / rel, allow_pickle=False) for name, rel in index.items()}


def finalize_manifest(
    root: Path, manifest: dict, build_info: dict | None = None, files: dict[str, str] | None = None
) -> dict:
    """Hash every file under ``root`` into ``manifest['files']`` and write manifest.json (+ build-info).

    ``files``: hashes already taken (the files have not changed since); a model of several GB is then not
    read again just to rewrite the manifest.
    """
    if files is None:
        files = {}
        for path in sorted(root.rglob("*")):
            if path.is_file():
                rel = path.relative_to(root).as_posix()
                if rel not in (MANIFEST_NAME, BUILD_INFO_NAME):
                    files[rel] = sha256_file(path)
    manifest = dict(manifest, files=files)
    dump_json(manifest, root / MANIFEST_NAME)
    if build_info is not None:
        dump_json(build_info, root / BUILD_INFO_NAME)
    return manifest


def write_index(root: Path, index: dict) -> dict:
    """A multi-target index hashes only the sub-manifests; each sub-artifact hashes its own files."""
    files = {
        f"{d}/{MANIFEST_NAME}": sha256_file(root / d / MANIFEST_NAME)
        for d in sorted(e["dir"] for e in index["targets"].values())
    }
    manifest = dict(index, files=files)
    dump_json(manifest, root / MANIFEST_NAME)
    return manifest
