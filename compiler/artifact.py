"""Writing artifacts: atomic (temp dir + rename), deterministic (sorted JSON, no timestamps in hashed files)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import (
    BUILD_INFO_NAME,
    MANIFEST_NAME,
    MULTI_TARGET,
    SCHEMA_VERSION,
    Manifest,
    dump_json,
    read_manifest,
    sha256_file,
)
from precast.artifact.schema import IOSignature, TargetEntry, TensorSpec
from precast.artifact.stages_spec import StagesSpec
from precast.artifact.staging import clean_stale, temp_name
from precast.artifact.target_blocks import IndexTargetBlock, TargetBlock
from precast.errors import ArtifactError, UsageError
from precast.runtime.verify import SEQUENCE_LENGTH, SEQUENCE_SUFFIX, load_parity_value

__all__ = [
    "staging_dir",
    "finalize_manifest",
    "write_index",
    "save_tensors",
    "load_tensors",
    "publish",
    "check_replaceable",
    "clean_stale_siblings",
    "build_manifest",
    "build_index",
]


def _not_replaceable(root: Path, why: str) -> UsageError:
    return UsageError(f"output {root} {why}; refusing to replace it (move it away or choose another -o)")


def check_replaceable(final: str | os.PathLike, *, shown: str | os.PathLike | None = None) -> None:
    """Raise UsageError unless publishing at ``final`` can lose nothing: no entry there, an empty directory,
    or a precast artifact (a manifest precast reads, listing every file in the folder; the sub-artifacts of a
    multi-target one alike). Symlinks, in or at the output, are never replaced. ``shown``: the path the
    message names (default ``final``)."""
    final = Path(final)
    shown = Path(shown) if shown is not None else final
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _not_replaceable(shown, "is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise _not_replaceable(shown, "exists and is not a directory")
    try:
        with os.scandir(final) as entries:
            empty = next(entries, None) is None
    except OSError as e:
        raise _not_replaceable(shown, f"cannot be read ({e.strerror or e})") from None
    if not empty:
        _check_artifact_files(final, shown)


def _check_seq2seq_files(root: Path, shown: Path) -> None:
    """An encoder-decoder artifact: its two part artifacts, and only the top-level files seq2seq.json lists."""
    import json

    from precast.artifact.seq2seq_spec import PARTS, SEQ2SEQ_FILE, Seq2SeqSpec

    try:
        spec = Seq2SeqSpec.from_json(json.loads((root / SEQ2SEQ_FILE).read_text()), str(root))
    except (ArtifactError, OSError, ValueError) as e:
        raise _not_replaceable(shown, f"is not a precast artifact ({e})") from None
    for dirpath, dirs, files in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        if rel in PARTS:
            dirs.clear()
            _check_artifact_files(Path(dirpath), shown / rel)
            continue
        for name in [*files, *dirs]:
            path = name if rel == "." else f"{rel}/{name}"
            if os.path.islink(Path(dirpath) / name):
                raise _not_replaceable(shown, f"holds a symlink '{path}', which precast never writes")
            if name in files and path not in spec.files and path != SEQ2SEQ_FILE:
                raise _not_replaceable(shown, f"holds '{path}', which its {SEQ2SEQ_FILE} does not list")


def _check_artifact_files(root: Path, shown: Path) -> None:
    if not os.path.lexists(root / MANIFEST_NAME) and os.path.isfile(root / "seq2seq.json"):
        _check_seq2seq_files(root, shown)
        return
    try:
        if not stat.S_ISREG(os.lstat(root / MANIFEST_NAME).st_mode):
            raise ArtifactError(f"{root}: {MANIFEST_NAME} is not a regular file")
        manifest = read_manifest(root)
    except FileNotFoundError:
        raise _not_replaceable(shown, f"is not a precast artifact (no {MANIFEST_NAME})") from None
    except ArtifactError as e:
        raise _not_replaceable(shown, f"is not a precast artifact ({_why(e, root)})") from None
    listed = set(manifest.files) | {MANIFEST_NAME, BUILD_INFO_NAME}
    subs = set()
    if manifest.is_multi_target:
        for d in manifest.target_dirs().values():
            if d in ("", ".", "..") or "/" in d or "\\" in d:
                raise _not_replaceable(shown, f"is not a precast artifact (bad target dir {d!r})")
            subs.add(d)

    def walk(folder: Path, rel: str) -> None:
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise _not_replaceable(
                shown, f"has a folder precast cannot read ('{rel or '.'}': {e.strerror or e})"
            ) from None
        for e in entries:
            path = f"{rel}{e.name}"
            if e.is_symlink():
                raise _not_replaceable(shown, f"holds a symlink '{path}', which precast never writes")
            if e.is_dir(follow_symlinks=False):
                if not rel and e.name in subs:
                    _check_artifact_files(Path(e.path), shown / e.name)
                else:
                    walk(Path(e.path), f"{path}/")
            elif path not in listed:
                raise _not_replaceable(shown, f"holds '{path}', which its {MANIFEST_NAME} does not list")

    walk(root, "")


def _why(e: ArtifactError, root: Path) -> str:
    """read_manifest's reason without the path it starts with (the message names the output already)."""
    text = str(e)
    for prefix in (f"{root / MANIFEST_NAME}: ", f"{root}: "):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def clean_stale_siblings(final: str | os.PathLike) -> None:
    """Remove the staging dirs (and half-replaced old artifacts) that killed compiles left beside ``final``."""
    final = Path(os.path.abspath(final))
    clean_stale(final.parent, legacy=lambda base: base == final.name, old_ok=_replaceable)


def _replaceable(path: Path) -> bool:
    try:
        check_replaceable(path)
    except UsageError:
        return False
    return True


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A fresh sibling temp dir of ``final``; removed on any failure (nothing half-written is left)."""
    final = Path(final)
    check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / temp_name(final.name, "tmp")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, final: Path) -> None:
    """Swap the staged artifact into place; an old artifact at ``final`` is replaced as a whole.

    What sits at ``final`` is checked again here (it may have appeared or changed since the compile began),
    and once more after it is moved aside, before anything is deleted; on a refusal it is put back as it was.
    On any failure the staged dir is removed.
    """
    final = Path(final)
    old = None
    try:
        check_replaceable(final)
        if os.path.lexists(final):
            old = final.parent / temp_name(final.name, "old")
            os.replace(final, old)
            try:
                check_replaceable(old, shown=final)  # what was moved aside is what was checked
            except UsageError:
                os.replace(old, final)
                old = None
                raise
        try:
            os.replace(tmp, final)
        except BaseException:
            if old is not None:
                os.replace(old, final)
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
        if arr is None:  # an absent optional value: nothing to store, nothing to feed
            continue
        if isinstance(arr, (list, tuple)):  # a sequence: one .npy per element in a '<name>.seq' folder
            seq = fname.removesuffix(".npy") + SEQUENCE_SUFFIX
            (folder / seq).mkdir()
            (folder / seq / SEQUENCE_LENGTH).write_text(
                f"{len(arr)}\n"
            )  # an empty sequence has no other file
            for j, elem in enumerate(arr):
                np.save(folder / seq / f"{j:06d}.npy", _storable(elem), allow_pickle=False)
            index[name] = f"{rel_prefix}/{seq}"
            continue
        np.save(folder / fname, _storable(arr), allow_pickle=False)  # keeps 0-d arrays 0-d
        index[name] = f"{rel_prefix}/{fname}"
    return index


def _storable(arr) -> np.ndarray:
    # strings live in ONNX Runtime as object arrays; .npy stores them as fixed-width str without pickle
    arr = np.asarray(arr, order="C")
    return arr.astype(str) if arr.dtype == object else arr


def load_tensors(root: Path, index: Mapping[str, str]) -> dict[str, object]:
    return {name: load_parity_value(root, rel) for name, rel in index.items()}


def finalize_manifest(
    root: Path, manifest: Manifest, build_info: dict | None = None, files: dict[str, str] | None = None
) -> dict:
    """Hash every file under ``root`` into the manifest's ``files``, write manifest.json (+ build-info) and
    return the JSON written.

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
    return _write(root, dataclasses.replace(manifest, files=files), build_info)


def _write(root: Path, manifest: Manifest, build_info: dict | None = None) -> dict:
    data = manifest.to_json()
    # Read back as the runtime will: a field the compiler filled with the wrong type fails here, not at load.
    Manifest.from_json(json.loads(json.dumps(data)), f"{root / MANIFEST_NAME} (as compiled)")
    dump_json(data, root / MANIFEST_NAME)
    if build_info is not None:
        dump_json(build_info, root / BUILD_INFO_NAME)
    return data


def write_index(root: Path, index: Manifest) -> dict:
    """A multi-target index hashes only the sub-manifests; each sub-artifact hashes its own files."""
    files = {
        f"{d}/{MANIFEST_NAME}": sha256_file(root / d / MANIFEST_NAME)
        for d in sorted(index.target_dirs().values())
    }
    return _write(root, dataclasses.replace(index, files=files))


# Manifest assembly: the typed records of artifact/manifest.py (the artifact package owns the schema).


def build_manifest(
    *,
    source,
    pipeline: str,
    passes: list[dict],
    target_block: TargetBlock,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    toolchain: dict[str, str],
    parity: dict,
    stages: StagesSpec | None = None,
) -> Manifest:
    """One target's manifest (``finalize_manifest`` adds ``files``). ``source``: a compiler Source;
    ``stages``: the block of a target that wrote a split-stages model as stages."""
    from precast import __version__

    llm = source.info.get("llm")
    llm_spec = LLMSpec.from_json(llm, f"source {source.name}") if llm is not None else None
    if llm_spec is not None and stages is not None:  # a staged causal LM: each stage owns its layers' KV
        from precast.runtime.llm.runners.staged import staged_llm_block

        if llm_spec.states:
            from precast.errors import UsageError

            raise UsageError(
                f"{source.name}: '{llm_spec.model_type}' has recurrent-state layers; its step graph cannot be "
                "split into pipeline stages (drop split-stages)"
            )

        stages = staged_llm_block(stages, llm_spec)
    return Manifest(
        schema_version=SCHEMA_VERSION,
        files={},
        target=target_block,
        io=IOSignature(tuple(inputs), tuple(outputs)),
        precast_version=__version__,
        toolchain=toolchain,
        source={
            "kind": source.kind,
            "name": source.name,
            "sha256": source.sha256,
            **{k: v for k, v in source.info.items() if k != "llm"},
        },
        llm=llm_spec,
        pipeline=pipeline,
        passes=passes,
        extra_files=sorted(source.ship_files),
        parity=parity,
        stages=stages,
    )


def build_index(
    manifests: Mapping[str, dict], precisions: Mapping[str, str], failed: Mapping[str, dict]
) -> Manifest:
    """A multi-target index (``write_index`` adds ``files``): one entry per written target (``manifests``:
    their JSON as written), in the runtime's fallback order, and the ``failed`` table of those not written."""
    from precast import __version__
    from precast.runtime.model import preference_order

    first = next(iter(manifests.values()))
    return Manifest(
        schema_version=SCHEMA_VERSION,
        files={},
        target=IndexTargetBlock(name="multi"),
        io=IOSignature.from_json(first["io"], "index"),
        kind=MULTI_TARGET,
        precast_version=__version__,
        source=first["source"],
        targets={n: TargetEntry(dir=n, target=n, precision=precisions[n]) for n in manifests},
        fallback_order=preference_order(manifests),
        failed=dict(failed) or None,
    )
