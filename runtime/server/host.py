"""The model being served, and hot reload: load -> verify -> warm up -> check the API -> swap, or keep the old one.

Readers take ``host.current`` once per request (the batcher leases it once per batch, ``lease()``) and
keep that reference, so a swap never changes the model under a running call: in-flight work finishes
on the old version. The old version is then closed: at once when nothing uses it, else by its last
lease (an LLM drains its running requests first). Closing removes the temp dir a packed artifact was
unpacked into, so a server reloading a packed artifact holds one copy, not one per reload.

A reload must keep the served API: an artifact of another kind (LLM / embeddings / tensor / seq2seq) or
with other inputs (a seq2seq artifact: another task) is refused (ReloadKindError, HTTP 409), since the
routes and clients were set up for the first one.

With a SignaturePolicy (``precast serve --pubkey``), every load, the first and each reload, must be a pack
whose signed statement meets it (artifact/signing.py); a directory is refused (it carries no signature). A
reload must also keep the signed name and not go back to an older signed version than the one served (a
replayed older pack); start a new server to roll back.
"""

from __future__ import annotations

import hashlib
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from precast.artifact.manifest import read_manifest
from precast.errors import ArtifactError, PrecastError, UsageError
from precast.runtime.server.pipelined import pipelined_if_staged

if TYPE_CHECKING:
    from precast.artifact.signing import SignaturePolicy

__all__ = ["ModelHost", "ReloadBusyError", "ReloadError", "ReloadKindError", "Served", "signed_change"]

_ENDPOINTS = {
    "llm": "/v1/completions and /v1/chat/completions",
    "embeddings": "/v1/embeddings and /v2 infer",
    "tensor": "/v2 infer",
    "seq2seq": "/v1/completions or /v1/audio/*",
}


class ReloadError(PrecastError):
    """A reload failed; the previous model keeps serving."""


class ReloadBusyError(PrecastError):
    """Another reload is in progress."""


class ReloadKindError(ReloadError):
    """The new artifact would change the served API (kind or inputs); the previous model keeps serving."""


@dataclass(eq=False)
class Served:
    model: object  # precast.runtime.Model (or the LLM service's view of its IO)
    path: Path  # what was asked for: an artifact dir or a packed file
    version: int
    digest: str  # sha256 of manifest.json: identifies the artifact build
    encoder: object | None = None  # embeddings.EncoderSpec
    task: object | None = (
        None  # tasks.TaskRunner of a Hugging Face task artifact (labels, raw images / audio)
    )
    llm: object | None = None  # llm_service.LLMService
    seq2seq: object | None = None  # seq2seq_service.Seq2SeqService (an encoder-decoder artifact)
    loaded_at: float = field(default_factory=time.time)
    unpacked: Path | None = None  # the temp dir a packed artifact was unpacked into: close() removes it
    statement: object | None = None  # signing.Statement the pack was checked against (serve --pubkey)
    users: int = 0  # leases held (batches running on this model)
    retired: bool = False  # swapped out: closed by its last lease
    closed: bool = False
    _close_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def manifest(self) -> dict:
        return self.model.manifest

    @property
    def kind(self) -> str:
        if self.seq2seq is not None:
            return "seq2seq"
        return "llm" if self.llm is not None else "embeddings" if self.encoder is not None else "tensor"

    def signature(self) -> list[str]:
        if self.seq2seq is not None:  # its routes follow from its task
            return [f"task:{self.seq2seq.spec.task}"]
        return [f"{s.name}:{s.dtype}" for s in self.model.inputs]

    def close(self, drain: float = 0.0) -> None:
        """Stop it (an LLM waits up to ``drain`` s for its requests) and remove its unpacked copy. Idempotent."""
        with self._close_lock:  # the last lease, a retire thread and shutdown may race here
            if self.closed:
                return
            self.closed = True
        try:
            if self.llm is not None:
                self.llm.close(drain)
            elif self.seq2seq is not None:
                self.seq2seq.close()
            elif hasattr(self.model, "close"):
                self.model.close()
            if self.encoder is not None:
                self.encoder.close()
        finally:
            if self.unpacked is not None:
                from precast.artifact.archive import remove_temp

                remove_temp(self.unpacked)


def _warm_up(model) -> None:
    """Run the stored parity feeds once, so the first real request does not pay ORT's lazy init."""
    parity = model.manifest.parity or {}
    feeds = {
        n: np.load(Path(model.path) / rel, allow_pickle=False)
        for n, rel in (parity.get("inputs") or {}).items()
    }
    if feeds:
        model.run(feeds)


def api_change(old: Served, new: Served) -> str | None:
    """What a swap from ``old`` to ``new`` would break for clients, or None."""
    if new.kind != old.kind:
        return (
            f"it is a {new.kind} artifact ({_ENDPOINTS[new.kind]}), this server serves a {old.kind} model "
            f"({_ENDPOINTS[old.kind]}); start a new server for it"
        )
    if new.kind != "llm" and new.signature() != old.signature():
        return (
            f"its inputs ({', '.join(new.signature())}) differ from the served model's "
            f"({', '.join(old.signature())}); start a new server for it"
        )
    return None


def signed_change(old: Served, new: Served) -> str | None:
    """Why a swap from ``old`` to ``new`` would give up the served signed identity (rollback), or None."""
    if old.statement is None or new.statement is None:
        return None
    from precast.artifact.signing import version_key

    was, now = old.statement, new.statement
    if now.name != was.name:
        return f"it is signed as '{now.name}', the served model as '{was.name}'"
    if version_key(now.version) < version_key(was.version):
        return f"its signed version {now.version} is older than the served signed version {was.version}"
    return None


class ModelHost:
    def __init__(
        self,
        path: str | Path,
        *,
        threads: int | None = None,
        verify: bool = True,
        llm_options: dict | None = None,
        text_limits=None,
        policy: SignaturePolicy | None = None,
    ):
        self.threads = threads
        self.verify = verify
        self.policy = policy  # what every pack loaded must meet, at start and on reload (serve --pubkey)
        self.llm_options = llm_options or {}
        self.text_limits = text_limits  # text_sandbox.TextLimits for the artifact's template and tokenizer
        self._reload_lock = threading.Lock()
        self._lock = threading.Lock()  # guards users / retired of every Served, and _retiring
        self._retiring: list[Served] = []  # swapped out, not closed yet
        self.last_reload: dict = {}
        self.current: Served = self._load(Path(path), version=1)

    # -- loading -----------------------------------------------------------------------------------
    def _load(self, path: Path, version: int) -> Served:
        if not path.is_file():
            if self.policy is not None:
                raise UsageError(
                    f"{path}: --pubkey serves packed artifacts only; a directory carries no signature"
                )
            return self._load_dir(path, path, version)
        # A packed artifact: unpacked once (every checksum, and the signed statement, checked) into a temp dir
        # this Served owns.
        from precast.artifact.archive import remove_temp, unpack_checked

        unpacked = unpack_checked(path, policy=self.policy)
        try:
            served = self._load_dir(unpacked.path, path, version)
        except BaseException:
            remove_temp(unpacked.path)
            raise
        served.unpacked = unpacked.path
        served.statement = unpacked.statement
        return served

    def _load_dir(self, root: Path, path: Path, version: int) -> Served:
        from precast.runtime.model import load
        from precast.runtime.server.seq2seq_service import is_seq2seq_dir

        if is_seq2seq_dir(root):
            return self._load_seq2seq(root, path, version)
        manifest = read_manifest(root) if root.is_dir() else None
        if manifest is not None and manifest.is_multi_target:  # a causal LM's index: its fastest target here
            from precast.runtime.llm.engine import llm_index_target
            from precast.runtime.llm.scheduler import SchedulerConfig
            from precast.runtime.llm.speculative_options import SpeculativeOptions

            # ranked for the batch it will serve (--max-num-seqs) and whether it speculates
            o = self.llm_options
            seqs = o.get("max_num_seqs") or SchedulerConfig().max_num_seqs
            spec = SpeculativeOptions(draft=o.get("draft"), speculative=o.get("speculative")).asked
            sub = llm_index_target(root, concurrency=seqs, speculative=spec)
            if sub is not None:
                root, manifest = sub, read_manifest(sub)
        is_llm = manifest is not None and manifest.llm is not None
        if self.llm_options and not is_llm:
            raise UsageError(
                f"{path}: LLM options ({', '.join(sorted(self.llm_options))}) given, but it is not an LLM artifact"
            )
        if self.verify and manifest is not None and (manifest.parity or {}).get("inputs"):
            from precast.runtime.verify import verify_artifact

            report = verify_artifact(root, threads=self.threads)
            bad = _parity_failures(report)
            if bad:
                raise ReloadError(f"{path}: parity check failed on {bad}")
        if is_llm:
            from precast.runtime.server.llm_service import LLMService

            llm = LLMService.from_artifact(root, text_limits=self.text_limits, **self.llm_options)
            return Served(llm.model_view(), path, version, _digest(root), llm=llm)
        staged = manifest is not None and manifest.stages is not None
        model = load(root, threads=(self.threads or 1) if staged else self.threads)  # staged: per stage
        try:
            from precast.runtime.server.embeddings import encoder_spec
            from precast.runtime.tasks import TaskRunner

            # preprocessing and labels of a task artifact; its tokenizer, if any, runs in the sandbox (encoder)
            task = TaskRunner.open(model, text=False)
            model = pipelined_if_staged(model)
            _warm_up(model)
            encoder = encoder_spec(model, task.spec.task if task is not None else None)
            if encoder is not None:
                encoder.start_text(self.text_limits)
        except BaseException:
            model.close()
            raise
        return Served(model, path, version, _digest(root), encoder=encoder, task=task)

    def _load_seq2seq(self, root: Path, path: Path, version: int) -> Served:
        """An encoder-decoder artifact (seq2seq.json): its engine, checked (sha256, parity) and warmed up."""
        from precast.runtime.server.seq2seq_service import Seq2SeqService

        if self.llm_options:
            raise UsageError(
                f"{path}: LLM options ({', '.join(sorted(self.llm_options))}) given, but it is a seq2seq artifact"
            )
        svc = Seq2SeqService.from_artifact(root, threads=self.threads, verify=self.verify)
        return Served(svc.model, path, version, _digest(root), seq2seq=svc)

    # -- serving -----------------------------------------------------------------------------------
    @contextmanager
    def lease(self):
        """The current Served, kept open until the block ends (a swap meanwhile closes it afterwards)."""
        with self._lock:
            served = self.current
            served.users += 1
        try:
            yield served
        finally:
            with self._lock:
                served.users -= 1
                last = served.retired and served.users == 0
            if last:
                self._close_retired(served)

    def reload(self, path: str | Path | None = None) -> Served:
        """Load a new version (default: the same path again); swap only if it loads, verifies, warms up
        and keeps the served API."""
        if not self._reload_lock.acquire(blocking=False):
            raise ReloadBusyError("a reload is already in progress")
        try:
            old = self.current
            target = Path(path) if path is not None else old.path
            t0 = time.perf_counter()
            try:
                new = self._load(target, version=old.version + 1)
            except Exception as e:
                why = str(e) if isinstance(e, PrecastError) else f"{type(e).__name__}: {e}"
                self.last_reload = {"ok": False, "path": str(target), "error": why}
                raise ReloadError(
                    f"reload from {target} failed, still serving version {old.version}: {why}"
                ) from e
            api = api_change(old, new)
            problem = api or signed_change(old, new)
            if problem is not None:
                new.close()
                self.last_reload = {"ok": False, "path": str(target), "error": problem}
                refused = ReloadKindError if api is not None else ReloadError
                raise refused(f"reload from {target} refused, still serving version {old.version}: {problem}")
            with self._lock:
                self.current = new  # the swap: one reference assignment, under the lease lock
                old.retired = True
                idle = old.users == 0
                self._retiring.append(old)
            if old.llm is not None:  # its requests drain in the background, then its engine stops
                threading.Thread(
                    target=self._close_retired, args=(old, 600.0), name="precast-retire", daemon=True
                ).start()
            elif idle:
                self._close_retired(old)
            self.last_reload = {
                "ok": True,
                "path": str(target),
                "version": new.version,
                "seconds": round(time.perf_counter() - t0, 3),
            }
            return new
        finally:
            self._reload_lock.release()

    def _close_retired(self, served: Served, drain: float = 0.0) -> None:
        served.close(drain)
        with self._lock:
            if served in self._retiring:
                self._retiring.remove(served)

    def ready(self) -> bool:
        """Whether the served endpoints can answer (an LLM's engine loop is running)."""
        served = self.current
        return not served.closed and (served.llm is None or served.llm.healthy())

    def close(self, drain: float = 0.0) -> None:
        """Close the current model and every retired one still open (shutdown: SIGTERM, SIGINT, lifespan)."""
        with self._lock:
            everything = [self.current, *self._retiring]
            self._retiring.clear()
        for served in everything:
            served.close(drain)


def _digest(root: Path) -> str:
    m = root / "manifest.json"
    if not m.is_file():  # an encoder-decoder artifact: its seq2seq.json holds every part's sha256
        m = root / "seq2seq.json"
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
