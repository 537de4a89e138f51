"""The stage workers of a staged causal-LM runner: one thread per stage, bounded queues, micro-batch jobs.

    caller: run_jobs([job A, job B, ...])  ->  queue 0  ->  worker 0: stage 0 (A), stage 0 (B), ...
                                                queue 1  ->  worker 1:             stage 1 (A), stage 1 (B), ...
                                                last worker: job done -> the step's countdown; run_jobs returns

A job carries one micro-batch's step inputs, the tensors that cross each cut (``boundary``), and its logits
once the last stage ran. A stage that fails marks the job; later stages pass it on untouched, and
``run_jobs`` raises the first error after every job is through (the workers go on serving the next step).
Shared by the mapped (runners/staged.py) and paged (runners/staged_paged.py) staged runners; the threads and
queues are runtime/staged/stage_pool.py's StagePool, the stage pipeline's too.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from precast.errors import InputError
from precast.runtime.staged.stage_pool import STOP, StagePool

__all__ = ["Countdown", "Job", "StageWorkers", "chunks"]


class Countdown:
    """Set when ``n`` micro-batches of a step are through the last stage."""

    def __init__(self, n: int):
        self.left, self.lock, self.event = n, threading.Lock(), threading.Event()

    def tick(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.event.set()


class Job:
    """One micro-batch: its first slot (mapped layout) and rows, its step inputs, what crosses each cut."""

    __slots__ = ("slot", "rows", "arrays", "boundary", "logits", "error", "done")

    def __init__(self, slot: int, rows: int, arrays: dict[str, np.ndarray], done: Countdown):
        self.slot, self.rows, self.arrays = slot, rows, arrays
        self.boundary: dict[str, object] = {}  # name -> tensor, from the stages before
        self.logits: np.ndarray | None = None
        self.error: BaseException | None = None
        self.done = done

    @property
    def settled(self) -> bool:
        """A stage failed it: the later stages pass it on (StagePool's StageItem)."""
        return self.error is not None

    def fail(self, error: BaseException) -> None:
        self.error = error


class StageWorkers:
    """One daemon thread per stage callable ``run(job)``, queues of ``queue_depth`` jobs between them."""

    def __init__(self, runs: Sequence[Callable[[Job], None]], queue_depth: int = 4):
        self._inbox: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._pool: StagePool[Job] = StagePool(
            list(runs), self._inbox.get, _tick, queue_size=queue_depth, name="precast-llm-stage"
        )
        self.threads = self._pool.threads
        self.closed = False

    def run_jobs(self, jobs: list[Job]) -> None:
        """Put every job of one step (sharing one Countdown) into the pipeline; return when all are done."""
        if self.closed:
            raise InputError("the staged runner is shut down (its engine was closed)")
        for job in jobs:
            self._inbox.put(job)
        jobs[0].done.event.wait()
        for job in jobs:
            if job.error is not None:
                raise job.error

    def shutdown(self) -> None:
        """Stop and join the workers. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._inbox.put(STOP)
        self._pool.join()


def _tick(job: Job) -> None:
    job.done.tick()


class StageWorkersOwner:
    """What a runner whose stages run on ``self._pipe`` (StageWorkers) offers the engine: its worker threads,
    and ``shutdown`` (Engine.close calls it; idempotent)."""

    _pipe: StageWorkers

    @property
    def workers(self) -> list:
        """The stage worker threads (alive until shutdown)."""
        return self._pipe.threads

    def shutdown(self) -> None:
        """Stop and join the stage workers. Idempotent."""
        self._pipe.shutdown()


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) as up to ``parts`` contiguous (first, rows) runs of near-equal size."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for k in range(parts):
        rows = base + (k < extra)
        out.append((lo, rows))
        lo += rows
    return out
