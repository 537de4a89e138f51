"""The scheduler's one path: schedule() deltas (the steady fast path) and update_from_output."""

from __future__ import annotations

import pytest

from precast.runtime.llm import SamplingParams, SchedulerConfig
from precast.runtime.llm.block_pool import BlockPool
from precast.runtime.llm.kv_cache_manager import KVCacheManager
from precast.runtime.llm.request import Request, Status
from precast.runtime.llm.scheduler import Scheduler, StepKind
from tests.llm.engine.fake_runner import reference_greedy
from tests.llm.engine.test_engine import _assert_no_leak, _engine

BS = 4  # the fake runner's block size


def _scheduler(num_blocks=16, eos=(), **config) -> Scheduler:
    return Scheduler(KVCacheManager(BlockPool(num_blocks, BS)), SchedulerConfig(**config), eos_ids=eos)


def _request(rid="r", prompt=(1, 2, 3), **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, list(prompt), SamplingParams(**params), max_total_tokens=64)


def _recording(eng) -> list:
    """Every SchedulerOutput the engine's scheduler returns."""
    outs, inner = [], eng.scheduler.schedule
    eng.scheduler.schedule = lambda: outs.append(inner()) or outs[-1]
    return outs


# -- the steady delta ------------------------------------------------------------------------------
def test_steady_decode_is_the_same_delta_without_rescheduling():
    eng = _engine()
    outs = _recording(eng)
    general = []
    inner = eng.scheduler._schedule_running
    eng.scheduler._schedule_running = lambda *a: general.append(1) or inner(*a)
    (out,) = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=12))
    assert out.token_ids == reference_greedy([1, 2, 3], 12)
    # prompt [0, 3): position 3 ends block 0, 4 starts block 1 (allocates), 5-7 stay in it (steady), ...
    assert eng.runner.kinds[:10] == ["mixed", "decode", "decode", *["steady"] * 3, "decode", *["steady"] * 3]
    assert eng.runner.kinds[10:] == ["decode", "steady"] and len(eng.runner.kinds) == 12
    assert len(general) == 2  # only the prefill and the first decode took the general path
    steady = [o for o in outs if o.kind is StepKind.STEADY]
    assert all(o is steady[0] for o in steady)  # one object: "same batch, one token further"
    assert not steady[0].copies and not steady[0].preempted and not steady[0].new_requests
    _assert_no_leak(eng)


def test_batch_decodes_as_a_run_until_a_request_finishes():
    eng = _engine()
    outs = _recording(eng)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    a, b = (eng.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, (12, 6)))
    eng.run_until_done()
    assert a.result().token_ids == reference_greedy(prompts[0], 12)
    assert b.result().token_ids == reference_greedy(prompts[1], 6)
    kinds = [o.kind.value for o in outs]
    assert kinds.count("steady") >= 4 and kinds[0] == "mixed"
    # b finishes on its 6th token (step 6): the step after it is general, then the run of a alone starts
    assert outs[6] is not outs[5] and outs[6].rows == [a.request]
    assert all(o.rows == [a.request] for o in outs[6:])


def test_arrival_and_cancel_end_the_steady_run():
    eng = _engine()
    a = eng.submit([1, 2, 3], SamplingParams(max_tokens=20))
    for _ in range(3):
        eng.step()  # mixed, decode, decode: a steady run is next
    outs = _recording(eng)
    b = eng.submit([5, 6], SamplingParams(max_tokens=20))
    eng.step()
    assert outs[-1].kind is StepKind.MIXED and outs[-1].new_requests == [b.request]
    for _ in range(3):
        eng.step()
    assert outs[-1].kind in (StepKind.STEADY, StepKind.DECODE)
    eng.cancel(b.request_id)
    eng.step()
    assert outs[-1].kind is StepKind.DECODE and outs[-1].rows == [a.request]  # rescheduled, not steady
    eng.run_until_done()
    assert a.result().token_ids == reference_greedy([1, 2, 3], 20)
    _assert_no_leak(eng)


def test_one_token_prefill_chunks_are_no_steady_run():
    # A budget of 2: a decoding request and a prompt cut into 1-token chunks make all-one-token steps;
    # the chunk samples nothing, so the batch is no decode run (a steady step would feed the wrong token).
    eng = _engine(budget=2)
    a = eng.submit([1, 2, 3], SamplingParams(max_tokens=12))
    eng.step()
    b = eng.submit(list(range(10, 19)), SamplingParams(max_tokens=4))
    eng.run_until_done()
    assert "steady" in eng.runner.kinds
    assert a.result().token_ids == reference_greedy([1, 2, 3], 12)
    assert b.result().token_ids == reference_greedy(list(range(10, 19)), 4)


def test_a_steady_delta_after_a_table_change_would_read_wrong_blocks():
    # The fake runner's steady path reuses the tables of the decode before it, as the real runners reuse
    # their arrays and slot mappings: a scheduler that kept the run across a block boundary is caught.
    eng = _engine()
    eng.scheduler._start_run = _broken_start_run.__get__(eng.scheduler)
    with pytest.raises(AssertionError, match="block table too short"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=12))


def _broken_start_run(self, out):
    Scheduler._start_run(self, out)
    if self._run is not None:
        self._steady_left = 8  # past the block's end


# -- update_from_output ----------------------------------------------------------------------------
def _admit(sch: Scheduler, req: Request):
    sch.add(req)
    out = sch.schedule()
    assert out.rows == [req] and out.num_new == [len(req.token_ids)]
    return out


def test_update_finishes_on_eos_and_frees_blocks():
    sch = _scheduler(eos=(7,))
    req = _request()
    out = _admit(sch, req)
    assert sch.kv.pool.num_used == 1
    assert sch.update_from_output(out, [7]) == [req]
    assert req.status is Status.FINISHED and req.finish_reason == "stop" and req.output_ids == [7]
    assert sch.kv.pool.num_free == 16 and not sch.running and not sch.has_work()


def test_update_ignore_eos_and_stop_token_ids():
    sch = _scheduler(eos=(7,))
    a, b = _request("a", ignore_eos=True), _request("b", stop_token_ids=(9,))
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert sch.update_from_output(out, [7, 3]) == []  # a ignores EOS; 3 stops nobody
    out = sch.schedule()
    assert out.kind is StepKind.DECODE
    assert sch.update_from_output(out, [7, 9]) == [b] and b.finish_reason == "stop"
    assert sch.running == [a] and a.output_ids == [7, 7]


def test_update_finishes_on_max_tokens_and_context_cap():
    sch = _scheduler()
    short = _request("short", max_tokens=2)
    capped = Request("capped", [1, 2, 3], SamplingParams(max_tokens=50), max_total_tokens=5)
    sch.add(short)
    sch.add(capped)
    out = sch.schedule()
    assert sch.update_from_output(out, [4, 4]) == []
    out = sch.schedule()
    assert sch.update_from_output(out, [5, 5]) == [short, capped]
    assert short.finish_reason == capped.finish_reason == "length"
    assert short.output_ids == capped.output_ids == [4, 5] and sch.kv.pool.num_free == 16


def test_update_prefill_chunks_advance_without_a_token():
    sch = _scheduler(max_num_batched_tokens=4)
    req = _request(prompt=range(1, 11))
    sch.add(req)
    out = sch.schedule()
    assert out.num_new == [4] and out.kind is StepKind.MIXED
    sch.update_from_output(out, [None])
    assert req.num_computed == 4 and req.output_ids == []
    out = sch.schedule()
    sch.update_from_output(out, [None])
    out = sch.schedule()
    assert out.num_new == [2]
    sch.update_from_output(out, [11])
    assert req.num_computed == 10 and req.output_ids == [11] and req.num_pending == 1


def test_preempted_request_resumes_with_its_tokens():
    # 3 blocks of 4: two requests of 5 tokens hold 2 + 2 blocks once they decode; the low-priority one is
    # preempted, recomputes prompt + output later and goes on with identical tokens.
    eng = _engine(num_blocks=3, budget=16, prefix=False)  # (no prefix cache: it recomputes everything)
    lo = eng.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=6), priority=5)
    hi = eng.submit([6, 7, 8], SamplingParams(max_tokens=6), priority=0)
    outs = _recording(eng)
    eng.run_until_done()
    assert lo.request.num_preemptions >= 1 and hi.request.num_preemptions == 0
    resumed = [o for o in outs if lo.request in o.new_requests][-1]
    i = resumed.rows.index(lo.request)
    assert resumed.num_new[i] > len(lo.request.prompt_ids)  # prompt and the output it had, recomputed
    assert lo.result().token_ids == reference_greedy([1, 2, 3, 4, 5], 6)
    assert hi.result().token_ids == reference_greedy([6, 7, 8], 6)
    _assert_no_leak(eng)


def test_finish_keeps_a_new_reason_and_frees_once():
    sch = _scheduler()
    req = _request(max_tokens=1)
    out = _admit(sch, req)
    sch.update_from_output(out, [4])
    assert req.finish_reason == "length"
    sch.finish(req, "stop")  # a stop string found in the text of that very token
    assert req.finish_reason == "stop" and sch.kv.pool.num_free == 16
    sch.kv.pool.check()
