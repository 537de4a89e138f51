"""An encoder-decoder ("seq2seq") artifact as the server holds it: the engine, its waits, its metrics.

A seq2seq artifact is a directory with ``seq2seq.json`` (no top-level manifest.json), parts ``encoder/`` and
``decoder/``, and ``tokenizer/`` (artifact/seq2seq_spec.py). ``ModelHost`` loads it through
``Seq2SeqService.from_artifact`` (which checks every listed sha256, runs the parts' parity feeds unless
--no-verify, then one tiny generation); seq2seq_api.py's routes call it.

The engine is blocking (``handle.result()``, ``transcribe()``): the routes wait on it in this service's own
thread pool (``run``), never on the event loop and never in the request thread pool that JSON and form work
share. Requests that wait there at the same time decode together in the engine's step loop (its batching).
At most ``max_queue`` requests are held at once (429 beyond, as the batcher).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from precast.artifact.manifest import read_manifest
from precast.errors import TargetUnavailableError

__all__ = ["Seq2SeqService", "is_seq2seq_dir"]

# Threads that wait on the engine: more than the rows one decoder step runs (engine.MAX_ROWS) would only wait
# for the engine's admission.
WAIT_THREADS = 64


def is_seq2seq_dir(root: Path) -> bool:
    """An encoder-decoder artifact: ``seq2seq.json`` and no top-level manifest.json."""
    from precast.artifact.seq2seq_spec import SEQ2SEQ_FILE

    return root.is_dir() and (root / SEQ2SEQ_FILE).is_file() and not (root / "manifest.json").is_file()


class _ModelView:
    """What the generic routes need from a served model (target, name, IO): the encoder part's manifest, and
    no tensor inputs or outputs (KServe v2 infer is refused for seq2seq artifacts)."""

    def __init__(self, path: Path, manifest):
        self.path = path
        self.manifest = manifest
        self.inputs: list = []
        self.outputs: list = []

    @property
    def target(self) -> str:
        return self.manifest.target.name


class Seq2SeqService:
    def __init__(self, engine, path: Path):
        self.engine = engine
        self.path = Path(path)
        self.model = _ModelView(self.path, read_manifest(self.path / "encoder"))
        self.metrics = None  # ServerMetrics, bound by ServerState
        self.held = 0  # requests admitted and not finished (one event loop: no lock needed)
        self._pool = ThreadPoolExecutor(max_workers=WAIT_THREADS, thread_name_prefix="precast-seq2seq")

    @classmethod
    def from_artifact(cls, path: Path, *, threads: int | None = None, verify: bool = True) -> Seq2SeqService:
        from precast.runtime.seq2seq.engine import Seq2SeqEngine

        engine = Seq2SeqEngine.load(path, threads=threads, verify=verify)
        try:
            service = cls(engine, path)
            if service.speech:
                _require_multipart()
            service.warm_up()
        except BaseException:
            engine.close()  # a failed (re)load leaves no engine thread behind
            raise
        return service

    # -- what it is ------------------------------------------------------------------------------------------
    @property
    def spec(self):
        return self.engine.spec

    @property
    def speech(self) -> bool:
        return self.engine.spec.input == "speech"

    @property
    def multilingual(self) -> bool:
        whisper = getattr(self.engine, "whisper", None)
        return bool(whisper is not None and whisper.multilingual)

    @property
    def endpoints(self) -> str:
        if self.speech:
            return "/v1/audio/transcriptions and /v1/audio/translations"
        return "/v1/completions"

    @property
    def sampling_rate(self) -> int:
        return int(self.engine.features.sampling_rate)

    def warm_up(self) -> None:
        """One one-token generation, so a reload swaps in a model that has run."""
        if self.speech:
            item = np.zeros(self.sampling_rate, dtype=np.float32)  # 1 s of silence: one 30 s window
        else:
            item = [int(self.engine.spec.pad_id)]
        self.engine.submit(item, max_new_tokens=1).result()

    # -- waiting on the engine ------------------------------------------------------------------------------
    @contextmanager
    def admit(self, limit: int):
        """One request held (429 past ``limit`` held at once)."""
        from precast.runtime.server.batcher import QueueFullError

        if self.held >= limit:
            raise QueueFullError(self.held, 1.0)
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    async def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in this service's threads (a blocking engine call), awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # -- metrics ----------------------------------------------------------------------------------------------
    def bind_metrics(self, metrics) -> None:
        self.metrics = metrics
        metrics.seq2seq_gauges()  # registered only by servers of seq2seq artifacts

    def observe(self, t0: float, prompt_tokens: int | None, generated: int) -> None:
        """One finished request, in the LLM engine's request metrics (tokens, sizes, end-to-end latency)."""
        m = self.metrics
        if m is None:
            return
        if prompt_tokens is not None:
            m.tokens.labels("prompt").inc(prompt_tokens)
            m.llm_prompt_tokens.observe(prompt_tokens)
        m.tokens.labels("completion").inc(generated)
        m.llm_generation_tokens.observe(generated)
        m.llm_e2e.observe(time.perf_counter() - t0)

    def export_gauges(self, metrics) -> None:
        """At scrape time: the decoder's self-attention KV blocks (the LLM's gauges) and the cross-attention
        cache bytes the running requests hold."""
        engine = self.engine
        metrics.kv_used.set(engine.kv_blocks_used)
        metrics.kv_free.set(engine.pool.num_free)
        metrics.seq2seq_gauges().set(engine.cross_bytes)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _require_multipart() -> None:
    try:
        import python_multipart  # noqa: F401  (Starlette's form parser)
    except ImportError:
        raise TargetUnavailableError(
            "serving a speech artifact (/v1/audio/*, multipart uploads) needs python-multipart: "
            "pip install 'precast[serve]'"
        ) from None
