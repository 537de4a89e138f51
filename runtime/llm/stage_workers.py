"""The stage workers of a staged causal-LM runner: one thread per stage, bounded queues, micro-batch jobs.

    caller: run_jobs([job A, job B, ...])  ->  queue 0  ->  worker 0: stage 0 (A), stage 0 (B), ...
                                                queue 1  ->  worker 1:             stage 1 (A), stage 1 (B), ...
                                                last worker: job done -> the step's countdown; run_jobs returns

A job carries one micro-batch's step inputs, the tensors that cross each cut (``boundary``), and its logits
once the last stage ran. A stage that fails marks the job; later stages pass it on untouched, and
``run_jobs`` raises the first error after every job is through (the workers go on serving the next step).
Shared by the mapped (staged_runner.py) and paged (staged_paged_runner.py) staged runners.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from precast.runtime.errors import InputError

__all__ = ["Countdown", "Job", "StageWorkers", "chunks"]

_STOP = object()


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


class StageWorkers:
    """One daemon thread per stage callable ``run(job)``, queues of ``queue_depth`` jobs between them."""

    def __init__(self, runs: Sequence[Callable[[Job], None]], queue_depth: int = 4):
        self._runs = list(runs)
        self._queues = [queue.Queue(maxsize=queue_depth) for _ in self._runs]
        self.threads = [
            threading.Thread(target=self._work, args=(k,), name=f"precast-llm-stage-{k}", daemon=True)
            for k in range(len(self._runs))
        ]
        self.closed = False
        for t in self.threads:
            t.start()

    def _work(self, k: int) -> None:
        run, inbox = self._runs[k], self._queues[k]
        nxt = self._queues[k + 1] if k + 1 < len(self._queues) else None
        while True:
            job = inbox.get()
            if job is _STOP:
                if nxt is not None:
                    nxt.put(_STOP)
                return
            if job.error is None:
                try:
                    run(job)
                except BaseException as e:  # reported to the step's caller; the worker goes on
                    job.error = e
            if nxt is None:
                job.done.tick()
            else:
                nxt.put(job)

    def run_jobs(self, jobs: list[Job]) -> None:
        """Put every job of one step (sharing one Countdown) into the pipeline; return when all are done."""
        if self.closed:
            raise InputError("the staged runner is shut down (its engine was closed)")
        for job in jobs:
            self._queues[0].put(job)
        jobs[0].done.event.wait()
        for job in jobs:
            if job.error is not None:
                raise job.error

    def shutdown(self) -> None:
        """Stop and join the workers. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._queues[0].put(_STOP)
        for t in self.threads:
            t.join()


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
