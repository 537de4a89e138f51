"""The model being served, and hot reload: load -> verify -> warm up -> swap, or keep the old one.

Readers take ``host.current`` once per batch (or per LLM request) and keep that reference, so a swap
never changes the model under a running call: in-flight work finishes on the old version, and the old
model is freed when its last user lets go.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from precast.runtime.errors import ArtifactError, PrecastError
from precast.runtime.manifest import read_manifest

__all__ = ["ModelHost", "ReloadBusyError", "ReloadError", "Served"]


class ReloadError(PrecastError):
    """A reload failed; the previous model keeps serving."""


class ReloadBusyError(PrecastError):
    """Another reload is in progress."""


@dataclass
class Served:
    model: object  # precast.runtime.Model
    path: Path
    version: int
    digest: str  # sha256 of manifest.json: identifies the artifact build
    encoder: object | None = None  # embeddings.EncoderSpec
    llm: object | None = None  # llm_api.LLMService
    loaded_at: float = field(default_factory=time.time)

    @property
    def manifest(self) -> dict:
        return self.model.manifest


def _warm_up(model) -> None:
    """Run the stored parity feeds once, so the first real request does not pay ORT's lazy init."""
    parity = model.manifest.get("parity") or {}
    feeds = {
        n: np.load(Path(model.path) / rel, allow_pickle=False)
        for n, rel in (parity.get("inputs") or {}).items()
    }
    if feeds:
        model.run(feeds)


class ModelHost:
    def __init__(
        self,
        path: str | Path,
        *,
        threads: int | None = None,
        verify: bool = True,
        llm_options: dict | None = None,
    ):
        self.threads = threads
        self.verify = verify
        self.llm_options = llm_options or {}
        self._reload_lock = threading.Lock()
        self.last_reload: dict = {}
        self.current: Served = self._load(Path(path), version=1)

    def _load(self, path: Path, version: int) -> Served:
        from precast.runtime.model import load

        manifest = read_manifest(path) if path.is_dir() else None
        is_llm = bool(manifest and manifest.get("llm"))
        if self.llm_options and not is_llm:
            from precast.runtime.errors import UsageError

            raise UsageError(
                f"{path}: LLM options ({', '.join(sorted(self.llm_options))}) given, but it is not an LLM artifact"
            )
        if self.verify and manifest is not None and (manifest.get("parity") or {}).get("inputs"):
            from precast.runtime.verify import verify_artifact

            report = verify_artifact(path, threads=self.threads)
            bad = _parity_failures(report)
            if bad:
                raise ReloadError(f"{path}: parity check failed on {bad}")
        if is_llm:
            from precast.runtime.server.llm_service import LLMService

            llm = LLMService.from_artifact(path, **self.llm_options)
            served = Served(llm.model_view(), path, version, _digest(path), llm=llm)
            return served
        model = load(path, threads=self.threads)
        _warm_up(model)
        from precast.runtime.server.embeddings import encoder_spec

        return Served(model, path, version, _digest(path), encoder=encoder_spec(model))

    def reload(self, path: str | Path | None = None) -> Served:
        """Load a new version (default: the same path again); swap only if it loads, verifies and warms up."""
        if not self._reload_lock.acquire(blocking=False):
            raise ReloadBusyError("a reload is already in progress")
        try:
            old = self.current
            target = Path(path) if path is not None else old.path
            t0 = time.perf_counter()
            try:
                new = self._load(target, version=old.version + 1)
            except PrecastError as e:
                self.last_reload = {"ok": False, "path": str(target), "error": str(e)}
                raise ReloadError(
                    f"reload from {target} failed, still serving version {old.version}: {e}"
                ) from e
            except Exception as e:
                self.last_reload = {"ok": False, "path": str(target), "error": f"{type(e).__name__}: {e}"}
                raise ReloadError(
                    f"reload from {target} failed, still serving version {old.version}: {type(e).__name__}: {e}"
                ) from e
            self.current = new  # the atomic swap: one reference assignment
            if old.llm is not None:
                old.llm.retire()  # stops taking new work; finishes what it runs
            self.last_reload = {
                "ok": True,
                "path": str(target),
                "version": new.version,
                "seconds": round(time.perf_counter() - t0, 3),
            }
            return new
        finally:
            self._reload_lock.release()

    def close(self) -> None:
        if self.current.llm is not None:
            self.current.llm.retire()


def _digest(path: Path) -> str:
    m = path / "manifest.json"
    return hashlib.sha256(m.read_bytes()).hexdigest()[:16] if m.is_file() else "packed"


def _parity_failures(report: dict) -> list[str]:
    if "ok" in report:
        return [n for n, r in report.get("outputs", {}).items() if not r.get("ok")]
    return [f"{t}:{n}" for t, sub in report.items() for n in _parity_failures(sub)]


def check_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise ArtifactError(f"artifact not found: {p}")
    return p
