"""runtime/staged/stage_pool.py: the stage-worker pool shared by the stage pipeline and the staged LLM runners."""

from __future__ import annotations

import queue
import threading

from precast.runtime.llm.runners.stage_workers import Job
from precast.runtime.staged.stage_pool import STOP, StageItem, StagePool


class Item:
    def __init__(self, n: int):
        self.n, self.trail, self.error = n, [], None

    @property
    def settled(self) -> bool:
        return self.error is not None

    def fail(self, error: BaseException) -> None:
        self.error = error


def pool_of(steps, name="test-stage"):
    inbox, done = queue.Queue(), queue.Queue()
    pool = StagePool(steps, inbox.get, done.put, queue_size=2, name=name)
    return pool, inbox, done


def test_items_pass_every_stage_in_order_on_named_threads():
    seen = []
    steps = [
        lambda it, k=k: (it.trail.append(k), seen.append(threading.current_thread().name)) for k in range(3)
    ]
    pool, inbox, done = pool_of(steps)
    for n in range(5):
        inbox.put(Item(n))
    inbox.put(STOP)
    pool.join(10)
    out = [done.get_nowait() for _ in range(5)]
    assert [it.n for it in out] == list(range(5)) and all(it.trail == [0, 1, 2] for it in out)
    assert sorted(set(seen)) == ["test-stage-0", "test-stage-1", "test-stage-2"]
    assert not any(t.is_alive() for t in pool.threads)


def test_a_failing_step_fails_its_item_which_skips_the_rest_and_is_still_finished():
    def bad(it):
        if it.n == 1:
            raise RuntimeError("stage 0 broke")
        it.trail.append(0)

    pool, inbox, done = pool_of([bad, lambda it: it.trail.append(1)])
    for n in range(3):
        inbox.put(Item(n))
    inbox.put(STOP)
    pool.join(10)
    out = [done.get_nowait() for _ in range(3)]
    assert [it.trail for it in out] == [[0, 1], [], [0, 1]]
    assert str(out[1].error) == "stage 0 broke"


def test_join_from_a_worker_returns_at_once():
    pool = None
    joined = threading.Event()

    def last(it):
        pool.join(10)  # an item's callback closing its owner, on the last worker: must not deadlock
        joined.set()

    pool, inbox, _ = pool_of([lambda it: None, last])
    inbox.put(Item(0))
    assert joined.wait(10)
    inbox.put(STOP)
    pool.join(10)


def test_the_llm_job_is_a_stage_item():
    job: StageItem = Job(0, 1, {}, None)
    assert not job.settled
    job.fail(ValueError("x"))
    assert job.settled
