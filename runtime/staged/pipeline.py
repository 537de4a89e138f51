"""Run a staged artifact as a pipeline: one worker thread per stage, bounded queues between the stages.

    submit(feeds) -> Future ─> [input slots] ─> stage 0 worker ─> [queue] ─> stage 1 worker ─> ... ─> futures
                               (queue_size)     micro-batch:       (queue_size)                  last stage: split
                                                + compatible queued                              the rows back,
                                                requests, concat dim 0                           resolve in order

Each stage has its own backend session with its own intra-op thread budget (``threads``, default 1 per
stage); ONNX Runtime releases the GIL inside ``run``, so stage k works on micro-batch i while stage k+1 works
on i-1. A stage is fed only the tensors it reads, and each micro-batch carries along only what a later stage
or the caller still needs.

- Order: one worker per stage and FIFO queues, so futures complete in submission order.
- Backpressure: every queue is bounded; when the stages fall behind, ``submit`` blocks (or, with a
  ``timeout``, raises PipelineFullError) instead of buffering without limit.
- Errors: a request whose feeds do not match the signature fails at once (its future, not ``submit``). A
  micro-batch that a stage rejects is rerun request by request through the whole chain, so one bad request
  fails its own future and its neighbours still get their outputs.
- Micro-batching (``max_batch`` > 1): the stage-0 worker concatenates consecutive queued requests along the
  batch dim while their other dims and dtypes agree, up to ``max_batch`` rows (waiting up to ``batch_wait``
  seconds for more), and the last stage splits the outputs back. Only models whose inputs and outputs share
  one symbolic leading dim batch; others run request by request.
- Shutdown: ``close()`` refuses new requests, finishes everything accepted, then joins the workers;
  ``close(cancel=True)`` fails every request that has not finished with PipelineClosedError. A pipeline that
  is never closed is closed (cancelling) when it is garbage-collected; its threads are daemons.

The Model API: ``precast.runtime.load(artifact).pipeline(threads=1, ...)`` (``StagePipeline.from_model``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.errors import InputError, PrecastError, UsageError, first_line
from precast.runtime.batching import ROWS, Feeds, rerun_alone, shared_leading_dim
from precast.runtime.feeds import check_feeds
from precast.runtime.staged.stage_pool import STOP, StagePool

__all__ = ["PipelineStage", "StagePipeline", "PipelineClosedError", "PipelineFullError"]


class PipelineClosedError(UsageError):
    """The pipeline was closed: no new requests, or (``close(cancel=True)``) this request was dropped."""


class PipelineFullError(PrecastError):
    """``submit(timeout=...)`` found every queue of the pipeline full for that long."""


@dataclass(frozen=True)
class PipelineStage:
    """One stage: a session and the tensor names it reads and writes (a staged artifact's StageEntry)."""

    name: str
    session: object  # runtime.backends.Session: run(output names, feeds) -> arrays
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class _Request:
    index: int
    feeds: dict[str, np.ndarray]
    rows: int
    outputs: tuple[str, ...]
    future: Future


@dataclass
class _Batch:
    """A micro-batch in flight: its live requests and the tensors it carries (a StagePool item)."""

    requests: list[_Request]
    tensors: dict[str, np.ndarray]
    results: list | None = None  # set when answered early: rerun request by request, cancelled, failed

    @property
    def settled(self) -> bool:
        return self.results is not None or not self.requests

    def fail(self, error: BaseException) -> None:
        self.results = [error] * len(self.requests)


@dataclass
class _Stats:
    batches: int = 0
    rows: int = 0
    max_rows: int = 0
    busy_seconds: list[float] = field(default_factory=list)  # per stage, inside session.run
    max_depths: list[int] = field(default_factory=list)  # per queue, the most items seen waiting


class StagePipeline:
    """Stages as a pipeline of worker threads. ``submit(feeds) -> Future`` of ``{output name: array}``."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        *,
        queue_size: int = 2,
        max_batch: int = 1,
        batch_wait: float = 0.0,
        owner: object = None,
    ):
        _check_options(queue_size, max_batch, batch_wait)
        if not stages:
            raise UsageError("a pipeline needs at least one stage")
        self.stages = list(stages)
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.queue_size = queue_size
        self.max_batch = max_batch if shared_leading_dim(self.inputs, self.outputs) is not None else 1
        self.owner = owner  # the Model this came from, kept alive as long as the pipeline
        self._core = _Core(
            self.stages, [o.name for o in self.outputs], queue_size, self.max_batch, batch_wait
        )
        self._finalizer = weakref.finalize(self, self._core.shutdown, True, 5.0)

    @classmethod
    def from_model(
        cls,
        model,
        *,
        threads: int | Sequence[int] | None = 1,
        queue_size: int = 2,
        max_batch: int = 1,
        batch_wait: float = 0.0,
    ) -> StagePipeline:
        """A pipeline over a loaded artifact's stages (``manifest.stages``), each with a fresh session of
        ``threads`` intra-op threads (one number for every stage, or one per stage); ``threads=None`` shares
        the Model's own stage sessions instead (no second copy of the weights; ``load()``'s thread budget).
        An artifact without stages runs as a one-stage pipeline (the same queueing and micro-batching)."""
        _check_options(queue_size, max_batch, batch_wait)
        spec = model.manifest.stages
        if threads is None:
            own = model.session
            pairs = own.stages if spec is not None and hasattr(own, "stages") else [(None, own)]
            stages = [_stage(model, entry, session) for entry, session in pairs]
        else:
            from precast.runtime.backends import check_threads, create_session

            entries = [None] if spec is None else list(spec.stages)
            budgets = [threads] * len(entries) if isinstance(threads, numbers.Integral) else list(threads)
            if len(budgets) != len(entries):
                raise UsageError(
                    f"threads lists {len(budgets)} budgets for {len(entries)} stages of {model.path}"
                )
            for t in budgets:
                check_threads(t)
            target = model.manifest.target
            stages = []
            for entry, t in zip(entries, budgets):
                block = target if entry is None else dataclasses.replace(target, model=entry.model)
                stages.append(_stage(model, entry, create_session(model.path, block, threads=t)))
        return cls(
            stages, model.inputs, model.outputs,
            queue_size=queue_size, max_batch=max_batch, batch_wait=batch_wait, owner=model,
        )  # fmt: skip

    # -- public -------------------------------------------------------------------------------------------
    def submit(
        self, feeds: Mapping[str, object], outputs: Sequence[str] | None = None, timeout: float | None = None
    ) -> Future:
        """Queue one request; the Future gets its outputs dict or its error. Blocks while the pipeline is full
        (``timeout`` seconds at most: then PipelineFullError); PipelineClosedError once closed."""
        if self._core.closed:
            raise PipelineClosedError("the pipeline is closed: it takes no new requests")
        future: Future = Future()
        try:
            arrays = check_feeds(feeds, self.inputs)
            names = self._output_names(outputs)
        except InputError as e:  # this request's own error, delivered as its neighbours' results are
            future.set_exception(e)
            return future
        rows = ROWS.rows(arrays)
        self._core.put(_Request(0, arrays, rows, names, future), timeout)
        return future

    def run(self, feeds: Mapping[str, object], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """``submit(...).result()``: one request through the pipeline, waiting for it."""
        return self.submit(feeds, outputs).result()

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Refuse new requests, finish the accepted ones (``cancel``: fail them instead), join the workers
        (``timeout`` seconds at most). Idempotent."""
        self._core.shutdown(cancel, timeout)

    @property
    def closed(self) -> bool:
        return self._core.closed

    def depths(self) -> list[int]:
        """Requests waiting now: the input slots in use, then each queue between stages."""
        return self._core.depths()

    @property
    def stats(self) -> _Stats:
        return self._core.stats

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._core.threads)

    def __enter__(self) -> StagePipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        names = " -> ".join(s.name for s in self.stages)
        return f"<precast.StagePipeline {names} queue_size={self.queue_size} max_batch={self.max_batch}>"

    def _output_names(self, outputs) -> tuple[str, ...]:
        known = [o.name for o in self.outputs]
        if outputs is None:
            return tuple(known)
        names = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        if not names:
            raise InputError("outputs is empty: name at least one output, or pass None for all")
        for n in names:
            if n not in known:
                raise InputError(f"unknown output '{n}'; the model's outputs are: {', '.join(sorted(known))}")
        return names


class _Core:
    """The stage workers (a StagePool) and the input slots; holds no reference to the StagePipeline, so that it
    can be collected. A micro-batch is merged at stage 0 and split at the last stage (runtime/batching.py's
    RowMerge); a stage that rejects it reruns its requests one by one (batching.rerun_alone)."""

    def __init__(
        self, stages: list[PipelineStage], outputs: list[str], queue_size: int, max_batch: int, wait
    ):
        self.stages, self.outputs = stages, outputs
        self.max_batch, self.batch_wait = max_batch, wait
        self.closed = self.cancelled = False
        self._lock = threading.Lock()
        self._next_index = 0
        # The input queue is bounded by slots (a semaphore) so that close() can always add its stop mark.
        self._slots = threading.Semaphore(queue_size)
        self._inbox: queue.Queue = queue.Queue()
        self._held: list = []  # stage 0: a request taken while batching that did not fit, first next time
        self.stats = _Stats(busy_seconds=[0.0] * len(stages), max_depths=[0] * len(stages))
        self._keep = _kept_tensors(stages, outputs)
        steps = [partial(self._step, k) for k in range(len(stages))]
        self._pool: StagePool[_Batch] = StagePool(
            steps, self._take_batch, self._finish, queue_size=queue_size, name="precast-stage",
            on_queued=self._note_depth,
        )  # fmt: skip
        self.threads = self._pool.threads

    # -- requests in ---------------------------------------------------------------------------------------
    def put(self, request: _Request, timeout: float | None) -> None:
        if self.closed:
            raise PipelineClosedError("the pipeline is closed: it takes no new requests")
        if not self._slots.acquire(timeout=timeout):
            raise PipelineFullError(f"pipeline full: no room for a request within {timeout} s; retry later")
        with self._lock:
            if self.closed:
                self._slots.release()
                raise PipelineClosedError("the pipeline is closed: it takes no new requests")
            request.index = self._next_index
            self._next_index += 1
            self._inbox.put(request)
        self._note_depth(0, self._inbox.qsize())

    def shutdown(self, cancel: bool, timeout: float | None) -> None:
        with self._lock:
            if cancel:
                self.cancelled = True
            if not self.closed:
                self.closed = True
                self._inbox.put(STOP)
        # (from a future's callback, on a worker: returns at once, the workers finish on their own)
        self._pool.join(timeout)

    def depths(self) -> list[int]:
        return [self._inbox.qsize(), *self._pool.depths()]

    def _note_depth(self, k: int, depth: int) -> None:
        if depth > self.stats.max_depths[k]:
            self.stats.max_depths[k] = depth

    # -- stage 0: a micro-batch of consecutive compatible requests -----------------------------------------
    def _take(self):
        item = self._inbox.get()
        if item is not STOP:
            self._slots.release()
        return item

    def _take_batch(self):
        head = self._held.pop() if self._held else self._take()
        if head is STOP:
            return STOP
        requests, rows = [head], head.rows
        key = ROWS.key(head.feeds) if self.max_batch > 1 else None
        deadline = time.monotonic() + self.batch_wait
        while key is not None and rows < self.max_batch and not self.cancelled:
            try:
                wait = deadline - time.monotonic()
                nxt = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is not STOP:
                self._slots.release()
            if nxt is STOP or ROWS.key(nxt.feeds) != key or rows + nxt.rows > self.max_batch:
                self._held.append(nxt)  # keeps the order: it heads the next micro-batch
                break
            requests.append(nxt)
            rows += nxt.rows
        live = [r for r in requests if r.future.set_running_or_notify_cancel()]  # skip cancelled futures
        tensors = ROWS.join([r.feeds for r in live]) if live else {}
        self.stats.batches += 1
        self.stats.rows += sum(r.rows for r in live)
        self.stats.max_rows = max(self.stats.max_rows, sum(r.rows for r in live))
        return _Batch(live, tensors)

    # -- every stage ---------------------------------------------------------------------------------------
    def _step(self, k: int, batch: _Batch) -> None:
        if self.cancelled:
            batch.fail(PipelineClosedError("the pipeline was closed (cancel) before this request ran"))
            return
        t0 = time.perf_counter()
        try:
            self._run_stage(k, batch.tensors)
        except Exception as e:  # noqa: BLE001 - one bad request must not fail its neighbours
            batch.results = rerun_alone(
                [r.feeds for r in batch.requests], e, self._run_alone, partial(_rejected, self.stages[k])
            )
            batch.tensors = {}
        finally:
            self.stats.busy_seconds[k] += time.perf_counter() - t0

    def _run_stage(self, k: int, tensors: dict[str, np.ndarray]) -> None:
        stage = self.stages[k]
        values = stage.session.run(list(stage.outputs), {n: tensors[n] for n in stage.inputs if n in tensors})
        tensors.update(zip(stage.outputs, values))
        for name in [n for n in tensors if n not in self._keep[k]]:
            del tensors[name]  # what no later stage and no caller reads

    def _run_alone(self, feeds: Feeds) -> dict[str, np.ndarray]:
        """One request through the whole chain; raises the error of the stage that rejected it."""
        tensors = dict(feeds)
        for k, stage in enumerate(self.stages):
            try:
                self._run_stage(k, tensors)
            except Exception as e:
                raise _rejected(stage, e)  # noqa: B904 - _rejected sets the cause (or is ``e`` itself)
        return tensors

    # -- the last stage: split the rows back, answer the futures in order ----------------------------------
    def _finish(self, batch: _Batch) -> None:
        if batch.results is None and batch.requests:
            feeds = [r.feeds for r in batch.requests]
            try:
                batch.results = ROWS.split({n: batch.tensors[n] for n in self.outputs}, feeds)
            except Exception as e:  # noqa: BLE001 - the merged outputs did not split: each request alone
                batch.results = rerun_alone(feeds, e, self._run_alone)
        for request, result in zip(batch.requests, batch.results or []):
            if isinstance(result, BaseException):
                request.future.set_exception(result)
            else:
                request.future.set_result({n: result[n] for n in request.outputs})


def _stage(model, entry, session) -> PipelineStage:
    """A stage from a StageEntry (None: the whole unstaged model)."""
    if entry is None:
        return PipelineStage(
            "model", session, tuple(s.name for s in model.inputs), tuple(s.name for s in model.outputs)
        )
    return PipelineStage(entry.model, session, tuple(entry.inputs), tuple(entry.outputs))


def _rejected(stage: PipelineStage, e: Exception) -> Exception:
    if isinstance(e, PrecastError):
        return e
    err = InputError(f"stage '{stage.name}' rejected these feeds: {first_line(e)}")
    err.__cause__ = e
    return err


def _kept_tensors(stages: list[PipelineStage], outputs: list[str]) -> list[set[str]]:
    """Per stage k: the tensors a micro-batch still carries after stage k (later stages' inputs, outputs)."""
    keep, needed = [], set(outputs)
    for stage in reversed(stages):
        keep.append(set(needed))
        needed |= set(stage.inputs)
    return keep[::-1]


def _check_options(queue_size, max_batch, batch_wait) -> None:
    for name, value in (("queue_size", queue_size), ("max_batch", max_batch)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
    if (
        isinstance(batch_wait, bool)
        or not isinstance(batch_wait, numbers.Real)
        or not math.isfinite(batch_wait)
        or batch_wait < 0
    ):
        raise UsageError(f"batch_wait must be a finite number of seconds >= 0, got {batch_wait!r}")
