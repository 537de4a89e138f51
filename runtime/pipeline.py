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

import numpy as np

from precast.runtime.errors import InputError, PrecastError, UsageError, first_line
from precast.runtime.feeds import check_feeds
from precast.runtime.manifest import TensorSpec

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

    def key(self) -> tuple:
        """Requests with equal keys concatenate along dim 0."""
        return tuple((n, a.dtype.str, a.shape[1:]) for n, a in sorted(self.feeds.items()))


@dataclass
class _Batch:
    requests: list[_Request]
    tensors: dict[str, np.ndarray]
    results: list | None = None  # set when the batch was rerun request by request (outputs or errors)


_STOP = object()


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
        self.max_batch = max_batch if _batch_dim(self.inputs, self.outputs) is not None else 1
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
            own = model._session
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
        rows = _rows(arrays)
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
    """The workers and their queues; holds no reference to the StagePipeline, so that it can be collected."""

    def __init__(
        self, stages: list[PipelineStage], outputs: list[str], queue_size: int, max_batch: int, wait
    ):
        self.stages = stages
        self.outputs = outputs
        self.max_batch = max_batch
        self.batch_wait = wait
        self.closed = False
        self.cancelled = False
        self._lock = threading.Lock()
        self._next_index = 0
        # The input queue is bounded by slots (a semaphore) so that close() can always add its stop mark.
        self._slots = threading.Semaphore(queue_size)
        self._inbox: queue.Queue = queue.Queue()
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=queue_size) for _ in stages[1:]]
        self.stats = _Stats(busy_seconds=[0.0] * len(stages), max_depths=[0] * len(stages))
        self._keep = _kept_tensors(stages, outputs)
        self.threads = [
            threading.Thread(target=self._work, args=(k,), name=f"precast-stage-{k}", daemon=True)
            for k in range(len(stages))
        ]
        for t in self.threads:
            t.start()

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
                self._inbox.put(_STOP)
        if threading.current_thread() in self.threads:
            return  # closed from a future's callback: the workers finish on their own; joining would deadlock
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def depths(self) -> list[int]:
        return [self._inbox.qsize()] + [q.qsize() for q in self._queues]

    def _note_depth(self, k: int, depth: int) -> None:
        if depth > self.stats.max_depths[k]:
            self.stats.max_depths[k] = depth

    # -- workers -------------------------------------------------------------------------------------------
    def _work(self, k: int) -> None:
        last = k == len(self.stages) - 1
        held: list = []  # stage 0: a request taken while batching that did not fit, first next time
        while True:
            item = self._take_batch(held) if k == 0 else self._queues[k - 1].get()
            if item is _STOP:
                if not last:
                    self._queues[k].put(_STOP)
                return
            try:
                self._step(k, item)
            except BaseException as e:  # noqa: BLE001 - a bug here must fail these requests, not hang them
                item.results = [e] * len(item.requests)
            if last:
                self._finish(item)
            else:
                self._queues[k].put(item)
                self._note_depth(k + 1, self._queues[k].qsize())

    def _take(self):
        item = self._inbox.get()
        if item is not _STOP:
            self._slots.release()
        return item

    def _take_batch(self, held: list):
        head = held.pop() if held else self._take()
        if head is _STOP:
            return _STOP
        requests = [head]
        rows, key = head.rows, (head.key() if self.max_batch > 1 else None)
        deadline = time.monotonic() + self.batch_wait
        while rows < self.max_batch and not self.cancelled:
            try:
                wait = deadline - time.monotonic()
                nxt = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is not _STOP:
                self._slots.release()
            if nxt is _STOP or nxt.key() != key or rows + nxt.rows > self.max_batch:
                held.append(nxt)  # keeps the order: it heads the next micro-batch
                break
            requests.append(nxt)
            rows += nxt.rows
        live = [r for r in requests if r.future.set_running_or_notify_cancel()]  # skip cancelled futures
        tensors = (
            {n: np.concatenate([r.feeds[n] for r in live], axis=0) for n in head.feeds}
            if len(live) > 1
            else (dict(live[0].feeds) if live else {})
        )
        self.stats.batches += 1
        self.stats.rows += sum(r.rows for r in live)
        self.stats.max_rows = max(self.stats.max_rows, sum(r.rows for r in live))
        return _Batch(live, tensors)

    def _step(self, k: int, batch: _Batch) -> None:
        if batch.results is not None or not batch.requests:
            return
        if self.cancelled:
            batch.results = [
                PipelineClosedError("the pipeline was closed (cancel) before this request ran")
            ] * len(batch.requests)
            return
        t0 = time.perf_counter()
        try:
            self._run_stage(k, batch.tensors)
        except Exception as e:
            if len(batch.requests) == 1:
                batch.results = [_rejected(self.stages[k], e)]
            else:  # one bad request must not fail its neighbours: each alone through the whole chain
                batch.results = [self._run_alone(r) for r in batch.requests]
            batch.tensors = {}
        finally:
            self.stats.busy_seconds[k] += time.perf_counter() - t0

    def _run_stage(self, k: int, tensors: dict[str, np.ndarray]) -> None:
        stage = self.stages[k]
        values = stage.session.run(list(stage.outputs), {n: tensors[n] for n in stage.inputs if n in tensors})
        tensors.update(zip(stage.outputs, values))
        for name in [n for n in tensors if n not in self._keep[k]]:
            del tensors[name]  # what no later stage and no caller reads

    def _run_alone(self, request: _Request):
        tensors = dict(request.feeds)
        for k in range(len(self.stages)):
            try:
                self._run_stage(k, tensors)
            except Exception as e:  # noqa: BLE001 - this request's own error
                return _rejected(self.stages[k], e)
        return tensors

    def _finish(self, batch: _Batch) -> None:
        if batch.results is None:
            try:
                batch.results = _split(batch.tensors, batch.requests, self.outputs)
            except Exception as e:  # noqa: BLE001
                batch.results = [e] * len(batch.requests)
        for request, result in zip(batch.requests, batch.results):
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


def _split(tensors: dict[str, np.ndarray], requests: list[_Request], outputs: list[str]) -> list[dict]:
    if len(requests) == 1:
        return [{n: tensors[n] for n in outputs}]
    total = sum(r.rows for r in requests)
    for name in outputs:
        arr = tensors[name]
        if arr.ndim == 0 or arr.shape[0] != total:
            raise InputError(
                f"output '{name}' has leading dim {arr.shape[:1]}, cannot split a batch of {total} rows"
            )
    results, start = [], 0
    for r in requests:
        results.append({n: tensors[n][start : start + r.rows] for n in outputs})
        start += r.rows
    return results


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


def _batch_dim(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str | None:
    """The symbolic leading dim every input and output shares (as the server's batcher), or None."""
    specs = [*inputs, *outputs]
    if not specs or any(not s.shape for s in specs):
        return None
    first = {s.shape[0] for s in specs}
    dim = first.pop() if len(first) == 1 else None
    return dim if isinstance(dim, str) else None


def _rows(arrays: Mapping[str, object]) -> int:
    first = next((a for a in arrays.values() if isinstance(a, np.ndarray) and a.ndim), None)
    return int(first.shape[0]) if first is not None else 1


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
