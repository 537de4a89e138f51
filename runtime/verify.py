"""Parity checks with numpy only, so a production host can re-verify an artifact without the compiler."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.artifact.manifest import artifact_path, check_integrity, read_manifest
from precast.errors import ArtifactError, TargetUnavailableError

__all__ = [
    "SEQUENCE_LENGTH",
    "SEQUENCE_SUFFIX",
    "load_parity_value",
    "Tolerance",
    "compare_outputs",
    "mask_dont_cares",
    "mask_kv_tail",
    "mask_padding",
    "verify_artifact",
]


SEQUENCE_SUFFIX = ".seq"  # a stored sequence value: a folder of .npy elements
SEQUENCE_LENGTH = "length"  # ... with its element count (an empty sequence has no other file)


def load_parity_value(root: Path, rel: str):
    """A stored parity feed or expected output: an array, or a list of arrays for a sequence."""
    path = artifact_path(root, rel, "parity value")
    try:
        if rel.endswith(SEQUENCE_SUFFIX):
            n = int((path / SEQUENCE_LENGTH).read_text())
            return [np.load(path / f"{j:06d}.npy", allow_pickle=False) for j in range(n)]
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"artifact {root}: stored parity value '{rel}' is unreadable ({e})") from None


@dataclass(frozen=True)
class Tolerance:
    """atol/rtol None: no elementwise bound, only the cosine (quantized targets' budget)."""

    atol: float | None = 1e-4
    rtol: float | None = 1e-3
    min_cosine: float = 0.9999


def mask_padding(
    outputs: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray], mask_input: str | None
) -> dict[str, np.ndarray]:
    """Zero the padded positions of outputs laid out [batch, seq, ...] like the model's attention mask.

    A padded position's output is whatever the model computes for a token it was told to ignore: a
    don't-care that no caller reads. Zeroing it on both sides of a comparison leaves max abs and cosine
    measured over the real tokens only.
    """
    mask = feeds.get(mask_input) if mask_input else None
    if mask is None or mask.ndim != 2 or mask.all():
        return dict(outputs)
    keep = mask.astype(bool)
    out = {}
    for name, arr in outputs.items():
        if isinstance(arr, (list, tuple)):  # a sequence output is not laid out [batch, seq, ...]
            out[name] = arr
            continue
        arr = np.asarray(arr)
        if arr.ndim >= 2 and arr.shape[:2] == keep.shape:
            arr = np.where(keep.reshape(keep.shape + (1,) * (arr.ndim - 2)), arr, np.zeros((), arr.dtype))
        out[name] = arr
    return out


def mask_kv_tail(
    outputs: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray], rule: Mapping | None
) -> dict[str, np.ndarray]:
    """Zero the rows of KV outputs past each request's valid length (a causal LM's ``present`` K/V).

    ``rule``: {"lengths": [input names summed per batch row], "offset": added to that sum (default 0),
    "axis": the sequence axis, "outputs": [...]}.
    Rows past past_lens + new_lens hold whatever the buffer held (ONNX Runtime copies only the valid past),
    a don't-care the runtime never reads.
    """
    out = dict(outputs)
    if not rule:
        return out
    valid = sum(np.asarray(feeds[n], dtype=np.int64) for n in rule["lengths"]) + int(rule.get("offset", 0))
    axis = int(rule["axis"])
    for name in rule["outputs"]:
        if name not in out:
            continue
        arr = np.asarray(out[name])
        rows = np.arange(arr.shape[axis]).reshape([-1 if a == axis else 1 for a in range(arr.ndim)])
        keep = rows < valid.reshape([-1] + [1] * (arr.ndim - 1))
        out[name] = np.where(keep, arr, np.zeros((), arr.dtype))
    return out


def mask_dont_cares(
    outputs: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray], rules: Mapping
) -> dict[str, np.ndarray]:
    """Both masks, as ``rules`` names them (a parity block or a source's info: "padding_mask", "kv_valid")."""
    masked = mask_padding(outputs, feeds, rules.get("padding_mask"))
    return mask_kv_tail(masked, feeds, rules.get("kv_valid"))


def compare_outputs(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray], tol: Tolerance
) -> dict[str, dict]:
    """Per output: max_abs, max_rel, cosine, and ok (allclose(atol, rtol) and cosine >= min_cosine)."""
    report: dict[str, dict] = {}
    for name, ref in expected.items():
        if name not in actual:
            report[name] = {"ok": False, "error": "missing from compiled outputs"}
            continue
        if isinstance(ref, (list, tuple)) or isinstance(actual[name], (list, tuple)):
            report[name] = _compare_sequences(ref, actual[name], tol)
            continue
        got = np.asarray(actual[name])
        ref = np.asarray(ref)
        if got.shape != ref.shape:
            report[name] = {"ok": False, "error": f"shape {list(got.shape)} != reference {list(ref.shape)}"}
            continue
        if ref.dtype.kind in "OUS" or got.dtype.kind in "OUS":  # strings: equal or not
            mismatch = int(np.count_nonzero(got.astype(str) != ref.astype(str)))
            report[name] = {"ok": mismatch == 0, "mismatches": mismatch}
            continue
        if ref.dtype.kind in "biu":
            mismatch = int(np.count_nonzero(got != ref))
            report[name] = {
                "ok": mismatch == 0,
                "mismatches": mismatch,
                "max_abs": float(np.max(np.abs(got.astype(np.int64) - ref.astype(np.int64)), initial=0)),
            }
            continue
        a = ref.astype(np.float64).ravel()
        b = got.astype(np.float64).ravel()
        # NaN vs NaN and inf vs inf (same sign) at the same place are agreement; any other non-finite
        # value is a mismatch; the numbers are measured over the places finite on both sides.
        fa, fb = np.isfinite(a), np.isfinite(b)
        same_nonfinite = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
        finite = bool(np.all((fa & fb) | same_nonfinite))
        a, b = a[fa & fb], b[fa & fb]
        diff = np.abs(a - b)
        max_abs = float(diff.max(initial=0.0))
        max_rel = float((diff / np.maximum(np.abs(a), 1e-12)).max(initial=0.0))
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        cosine = float(a @ b / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
        if tol.atol is None or not a.size:
            close = True
        else:
            close = bool(np.all(diff <= tol.atol + (tol.rtol or 0.0) * np.abs(a)))
        report[name] = {
            "ok": finite and close and cosine >= tol.min_cosine,
            "max_abs": float(f"{max_abs:.3g}"),
            "max_rel": float(f"{max_rel:.3g}"),
            "cosine": float(f"{cosine:.7f}"),
        }
        if not finite:
            report[name]["nonfinite_mismatches"] = int(np.count_nonzero(~((fa & fb) | same_nonfinite)))
    return report


def _compare_sequences(ref, got, tol: Tolerance) -> dict:
    """A sequence output: the same length, and every element within tolerance."""
    if not isinstance(ref, (list, tuple)) or not isinstance(got, (list, tuple)):
        return {"ok": False, "error": "a sequence on one side only"}
    if len(ref) != len(got):
        return {"ok": False, "error": f"sequence of {len(got)} elements != reference {len(ref)}"}
    elems = compare_outputs(
        {str(i): r for i, r in enumerate(ref)}, {str(i): g for i, g in enumerate(got)}, tol
    )
    bad = next(((i, r) for i, r in elems.items() if not r["ok"]), None)
    if bad is None:
        return {"ok": True, "elements": len(ref)}
    i, r = bad
    return {"ok": False, "error": f"element {i}: " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "ok")}


def _verify_or_skip(path: Path, name: str, threads: int | None) -> dict:
    """A sub-target this host cannot run (a TensorRT plan on a CPU host, an NPU EP that is absent) still
    has its files checked; its parity re-run is reported as skipped, with the reason."""
    try:
        return verify_artifact(path, threads)
    except TargetUnavailableError as e:
        check_integrity(path, read_manifest(path))
        return {"ok": True, "target": name, "outputs": {}, "skipped": str(e)}


def verify_artifact(path: str | Path, threads: int | None = None) -> dict:
    """Integrity (sha256 of every file) + re-run the stored parity feeds; returns the per-output report."""
    from precast.runtime.model import load

    root = Path(path)
    if (root / "seq2seq.json").is_file() and not (root / "manifest.json").exists():
        # an encoder-decoder artifact: its listed files' sha256 (seq2seq.json), then each part as an artifact
        from precast.runtime.seq2seq.engine import read_spec
        from precast.runtime.seq2seq.runner import Seq2SeqRunner

        Seq2SeqRunner(root, read_spec(root), num_blocks=1, threads=threads)  # seq2seq.json's sizes vs the graphs
        out = {}
        for part in ("encoder", "decoder"):
            report = verify_artifact(root / part, threads)
            reports = report if "ok" not in report else {report["target"]: report}
            out.update({f"{part}:{name}": r for name, r in reports.items()})
        return out
    manifest = read_manifest(root)
    if manifest.is_multi_target:
        return {
            name: _verify_or_skip(root / d, name, threads) for name, d in sorted(manifest.target_dirs().items())
        }
    model = load(root, threads=threads)
    parity = manifest.parity or {}
    if "inputs" not in parity or "expected" not in parity:
        raise ArtifactError(f"{root}: manifest has no stored parity feeds to re-run")
    feeds = {n: load_parity_value(root, rel) for n, rel in parity["inputs"].items()}
    expected = {n: load_parity_value(root, rel) for n, rel in parity["expected"].items()}
    tol = Tolerance(**parity.get("tolerance", {}))
    if manifest.llm is not None and manifest.llm.kv_layout == "ov-paged":  # feeds: the ort-cpu contract
        from precast.runtime.llm.runners.ov_contract import ContractStep

        run = ContractStep(model.path, manifest.target, manifest.llm, threads)
    else:
        run = model.run
    actual = mask_dont_cares(run(feeds), feeds, parity)
    report = compare_outputs(mask_dont_cares(expected, feeds, parity), actual, tol)
    return {
        "ok": all(r["ok"] for r in report.values()),
        "target": model.target,
        "outputs": report,
        "tolerance": parity.get("tolerance"),
    }
