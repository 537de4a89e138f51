"""Dynamic batching: requests that arrive close together run as one model call, then are split again.

    submit(feeds) -> bounded queue -> worker thread: take the oldest request, wait up to
    ``max_queue_delay`` for compatible ones (same dtypes and non-batch dims) until ``max_batch_size``
    rows, concatenate along dim 0, run once on the model current *at that moment* (leased for the
    batch, so a hot reload closes the old model only after it), split the outputs.

Only models whose inputs and outputs share one symbolic leading dim can batch; others run request by
request. Requests may also be "padded" (token inputs of different lengths): they are right-padded along
dim 1 to the longest one, and outputs of that length are cropped back per request. Merging, splitting and
the rerun of a failed batch request by request are runtime/batching.py's ``run_merged``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from precast.errors import PrecastError
from precast.runtime.batching import RowMerge, run_merged, shared_leading_dim
from precast.runtime.feeds import check_feeds

__all__ = ["BatchConfig", "Batcher", "QueueFullError", "WorkItem", "batch_dim"]


class QueueFullError(PrecastError):
    """The bounded request queue is full (HTTP 429)."""

    def __init__(self, depth: int, retry_after: float):
        super().__init__(f"server busy: {depth} requests queued (the limit); retry after {retry_after:.0f} s")
        self.retry_after = retry_after


@dataclass(frozen=True)
class BatchConfig:
    max_batch_size: int = 8  # rows per model call (1 = batching off)
    max_queue_delay: float = 0.002  # seconds the oldest request may wait for others
    max_queue: int = 256  # requests waiting to run before 429


def batch_dim(model) -> str | None:
    """The symbolic leading dim shared by every input and output, or None if the model cannot batch."""
    return shared_leading_dim(list(model.inputs), list(model.outputs))


@dataclass
class WorkItem:
    feeds: dict[str, np.ndarray]
    rows: int
    rule: RowMerge  # how it merges: along dim 0, its token inputs padded along dim 1 or not
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def key(self):
        """Items with equal keys merge; None: this one merges with no other."""
        return self.rule.key(self.feeds)


class Batcher:
    """A bounded queue plus one worker thread per model instance (``instances``)."""

    def __init__(
        self,
        lease_model: Callable[[], AbstractContextManager],
        config: BatchConfig,
        on_batch: Callable[[int, list[float], float], None] | None = None,
        instances: int = 1,
    ):
        # Entered per batch, yielding the model: a hot reload takes effect at the next batch.
        self._lease_model = lease_model
        self.config = config
        self._on_batch = on_batch or (lambda rows, waits, seconds: None)
        self._queue: queue.Queue[WorkItem | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet started
        self._running = 0  # in a model call right now
        self._stopping = False
        self.batches = 0
        self.max_rows_seen = 0
        self._threads = [
            threading.Thread(target=self._worker, name=f"precast-batcher-{i}", daemon=True)
            for i in range(max(1, instances))
        ]
        for t in self._threads:
            t.start()

    # -- public ---------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return self._pending

    @property
    def busy(self) -> int:
        return self._pending + self._running

    async def submit(
        self, feeds: dict[str, np.ndarray], pad: Mapping[str, int] | None = None, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        """Queue one request and wait for its outputs; raises QueueFullError, TimeoutError or the run's error."""
        loop = asyncio.get_running_loop()
        rule = RowMerge(pad)
        item = WorkItem(feeds, rule.rows(feeds), rule, loop, loop.create_future())
        with self._lock:
            if self._stopping:
                raise QueueFullError(self._pending, 1.0)
            if self._pending >= self.config.max_queue:
                raise QueueFullError(self._pending, self._retry_after())
            self._pending += 1
        self._queue.put(item)
        try:
            return await asyncio.wait_for(asyncio.shield(item.future), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            item.cancelled = True  # the worker skips it if it has not started yet
            raise

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, finish every queued one (up to drain_timeout), then end the workers."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + drain_timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)

    # -- worker ---------------------------------------------------------------------------------------
    def _retry_after(self) -> float:
        return max(1.0, round(self.config.max_queue_delay * 10 + 0.5))

    def _worker(self) -> None:
        backlog: deque[WorkItem] = deque()
        while True:
            head = backlog.popleft() if backlog else self._queue.get()
            if head is None:
                return
            with self._lease_model() as model:
                self._collect_and_run(model, head, backlog)

    def _collect_and_run(self, model, head: WorkItem, backlog: deque[WorkItem]) -> None:
        batch = [head]
        limit = self.config.max_batch_size if batch_dim(model) is not None else 1
        rows = head.rows
        key = head.key()
        deadline = head.enqueued + self.config.max_queue_delay
        # Compatible requests already set aside, then new arrivals until full or the delay runs out.
        for other in list(backlog):
            if rows >= limit or key is None:
                break
            if other.key() == key and rows + other.rows <= limit:
                backlog.remove(other)
                batch.append(other)
                rows += other.rows
        while rows < limit:
            wait = deadline - time.perf_counter()
            try:
                nxt = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # let the loop above see it after this batch
                break
            if key is not None and nxt.key() == key and rows + nxt.rows <= limit:
                batch.append(nxt)
                rows += nxt.rows
            else:
                backlog.append(nxt)
        self._run(model, batch)

    def _run(self, model, batch: list[WorkItem]) -> None:
        live = [it for it in batch if not it.cancelled and not it.future.done()]
        with self._lock:
            self._pending -= len(batch)
            self._running += len(live)
        try:
            if not live:
                return
            t0 = time.perf_counter()
            results = run_merged([it.feeds for it in live], partial(_run_checked, model), rule=live[0].rule)
            if len(live) == 1 and isinstance(results[0], Exception):
                _resolve(live[0], results[0])  # a lone request the model refused: not a batch in the metrics
                return
            rows = sum(it.rows for it in live)
            self.batches += 1
            self.max_rows_seen = max(self.max_rows_seen, rows)
            self._on_batch(rows, [t0 - it.enqueued for it in live], time.perf_counter() - t0)
            for it, res in zip(live, results):
                _resolve(it, res)
        except Exception as e:  # noqa: BLE001
            for it in live:
                _resolve(it, e)
        finally:
            with self._lock:
                self._running -= len(live)


def _run_checked(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return model.run(check_feeds(feeds, model.inputs))


def _resolve(item: WorkItem, result) -> None:
    def done() -> None:
        if item.future.done():
            return
        if isinstance(result, BaseException):
            item.future.set_exception(result)
        else:
            item.future.set_result(result)

    try:
        item.loop.call_soon_threadsafe(done)
    except RuntimeError:  # the request's event loop is gone (client test harness closed)
        pass
