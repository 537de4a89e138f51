"""The stage-worker pool: one thread per stage, bounded FIFO queues between the stages.

    take() ─> worker 0: step 0 ─> [queue] ─> worker 1: step 1 ─> ... ─> last worker: step n-1, finish(item)
              (item i)             (bounded)  (item i-1)

Stage k works on item i while stage k+1 works on item i-1 (the backends release the GIL inside their runs).
One worker per stage and FIFO queues keep the items in order. A step that raises fails its item
(``item.fail(error)``), never its worker; a failed (or otherwise settled) item passes the later steps untouched
and is still finished, so whoever waits on it is answered. ``take`` returning ``STOP`` ends the workers, each
after the items ahead of it.

Used by the stage pipeline (runtime/staged/pipeline.py: items are micro-batches of requests) and the staged LLM runners
(runtime/llm/runners/stage_workers.py: items are one engine step's micro-batch jobs).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

__all__ = ["STOP", "StageItem", "StagePool"]

STOP = object()  # what ``take`` returns to end the workers


class StageItem(Protocol):
    """What flows through a StagePool: once ``settled`` (failed, or answered early), later steps skip it."""

    @property
    def settled(self) -> bool: ...

    def fail(self, error: BaseException) -> None: ...


T = TypeVar("T", bound=StageItem)


class StagePool(Generic[T]):
    """``steps[k](item)`` on worker thread ``{name}-{k}``; stage 0 gets items from ``take()``, the last stage
    hands each to ``finish(item)``; ``queue_size`` items at most wait before each later stage."""

    def __init__(
        self,
        steps: Sequence[Callable[[T], None]],
        take: Callable[[], object],
        finish: Callable[[T], None],
        *,
        queue_size: int,
        name: str,
        on_queued: Callable[[int, int], None] | None = None,
    ):
        # on_queued(k, depth): an item was queued before stage k, which now holds ``depth`` (statistics)
        self._steps = list(steps)
        self._take = take
        self._finish = finish
        self._on_queued = on_queued
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=queue_size) for _ in self._steps[1:]]
        self.threads = [
            threading.Thread(target=self._work, args=(k,), name=f"{name}-{k}", daemon=True)
            for k in range(len(self._steps))
        ]
        for t in self.threads:
            t.start()

    def depths(self) -> list[int]:
        """Items waiting now before each stage after the first."""
        return [q.qsize() for q in self._queues]

    def join(self, timeout: float | None = None) -> None:
        """Wait for the workers to end (after ``take`` returned STOP), ``timeout`` seconds at most. Called from a
        worker itself (an item's callback closing its owner) it returns at once: joining would deadlock."""
        if threading.current_thread() in self.threads:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _work(self, k: int) -> None:
        step, last = self._steps[k], k == len(self._steps) - 1
        take = self._take if k == 0 else self._queues[k - 1].get
        while True:
            item = take()
            if item is STOP:
                if not last:
                    self._queues[k].put(STOP)
                return
            if not item.settled:
                try:
                    step(item)
                except BaseException as e:  # noqa: BLE001 - a bug in a step fails its item, not the worker
                    item.fail(e)
            if last:
                self._finish(item)
            else:
                self._queues[k].put(item)
                if self._on_queued is not None:
                    self._on_queued(k + 1, self._queues[k].qsize())
