import numpy as np
import pytest

from precast.errors import LLMRequestError, RequestCancelledError
from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig
from tests.llm.engine.fake_runner import FakeRunner, FakeSpec, reference_greedy

GREEDY = SamplingParams(max_tokens=12)


def _engine(num_blocks=64, budget=64, max_seqs=16, prefix=True, aging=64, spec=None, tokenizer=None):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, aging_steps=aging)
    return Engine(FakeRunner(spec, num_blocks), tokenizer, config=cfg, enable_prefix_caching=prefix)


def _prompts(n=8, seed=0, shared_prefix=0):
    rng = np.random.default_rng(seed)
    head = rng.integers(1, 64, shared_prefix).tolist()
    return [head + rng.integers(1, 64, int(rng.integers(1, 30))).tolist() for _ in range(n)]


def _assert_no_leak(engine):
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("shared_prefix", [0, 9])
@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (14, 16)])  # second: tight pool -> preemption
def test_batched_greedy_equals_alone_and_reference(shared_prefix, num_blocks, budget):
    prompts = _prompts(8, seed=shared_prefix, shared_prefix=shared_prefix)
    eng = _engine(num_blocks, budget)
    outs = eng.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(p, 12)
        alone = _engine(64, budget).generate([p], GREEDY)[0]
        assert alone.token_ids == out.token_ids
    m = eng.metrics()
    if shared_prefix:
        assert m.prefix_hit_tokens > 0
    if num_blocks == 14:
        assert m.preemptions > 0 and sum(o.num_preemptions for o in outs) > 0
    _assert_no_leak(eng)


def test_identical_prompts_share_blocks_and_copy_on_write():
    p = list(range(1, 9))  # exactly 2 blocks: the second request hits the whole prompt
    eng = _engine()
    h1 = eng.submit(p, GREEDY)
    eng.step()
    h2 = eng.submit(p, GREEDY)
    eng.step()
    t1, t2 = eng.kv.block_table(h1.request_id), eng.kv.block_table(h2.request_id)
    assert t1[0] == t2[0] and eng.pool.refcount(t1[0]) == 2  # first block shared
    assert t1[1] != t2[1] and eng.metrics().cow_copies == 1  # last one copied before the write
    eng.run_until_done()
    assert h1.result().token_ids == h2.result().token_ids == reference_greedy(p, 12)
    assert h2.result().num_cached_prompt_tokens == 7
    _assert_no_leak(eng)


def test_chunked_prefill_does_not_stall_decoding():
    eng = _engine(budget=8)
    short = eng.submit([5, 6, 7], SamplingParams(max_tokens=20))
    eng.step()
    long = eng.submit(list(range(1, 60)), SamplingParams(max_tokens=4))
    produced = []
    while not long.token_ids:
        eng.step()
        produced.append(len(short.token_ids))
        assert sum(eng.runner.steps[-1]["new"]) <= 8 or len(eng.runner.calls) > 1
    assert len(produced) >= 59 // 8  # the prompt took several chunks ...
    assert produced == list(range(2, 2 + len(produced)))  # ... and the short one decoded every step
    eng.run_until_done()
    assert long.result().token_ids == reference_greedy(list(range(1, 60)), 4)
    assert short.result().token_ids == reference_greedy([5, 6, 7], 20)


def test_token_budget_per_step():
    eng = _engine(budget=10)
    for p in _prompts(6, seed=4):
        eng.submit(p, GREEDY)
    while eng.has_unfinished():
        before = len(eng.runner.steps)
        eng.step()
        assert sum(sum(s["new"]) for s in eng.runner.steps[before:]) <= 10


def test_priority_order_and_aging():
    eng = _engine(max_seqs=1, aging=5)
    low = eng.submit([1, 2], SamplingParams(max_tokens=2), priority=3)
    highs = [eng.submit([3, 4], SamplingParams(max_tokens=2), priority=0) for _ in range(2)]
    eng.step()
    assert eng.scheduler.running[0] is highs[0].request  # urgent first, FCFS within a class
    # keep feeding urgent work: aging must still let the low-priority request in
    order = []
    for _ in range(200):
        if len(eng.scheduler.waiting) < 3:
            eng.submit([3, 4], SamplingParams(max_tokens=2), priority=0)
        eng.step()
        for r in eng.scheduler.running:
            if not order or order[-1] is not r:
                order.append(r)
        if low.finished:
            break
    assert low.finished and low.result().token_ids == reference_greedy([1, 2], 2)
    assert order.index(low.request) > 2  # it did wait behind urgent ones


def test_preempted_low_priority_first_and_recompute_identical():
    eng = _engine(num_blocks=10, budget=32)
    lo = eng.submit(list(range(1, 14)), SamplingParams(max_tokens=10), priority=5)
    hi = eng.submit(list(range(20, 33)), SamplingParams(max_tokens=10), priority=0)
    eng.run_until_done()
    assert lo.request.num_preemptions >= 1 and hi.request.num_preemptions == 0
    assert lo.result().token_ids == reference_greedy(list(range(1, 14)), 10)
    assert hi.result().token_ids == reference_greedy(list(range(20, 33)), 10)
    _assert_no_leak(eng)


def test_seeded_sampling_independent_of_batch_and_preemption():
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=i) for i in range(6)]
    prompts = _prompts(6, seed=7)
    alone = [_engine().generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    eng = _engine(num_blocks=12, budget=16)
    hs = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
    eng.run_until_done()
    assert [h.result().token_ids for h in hs] == alone
    assert (
        alone[0]
        != _engine()
        .generate([prompts[0]], SamplingParams(max_tokens=10, temperature=0.8, seed=99))[0]
        .token_ids
    )


def test_cancel_frees_blocks_and_others_continue():
    eng = _engine()
    a = eng.submit(list(range(1, 20)), SamplingParams(max_tokens=30))
    b = eng.submit([4, 5, 6], GREEDY)
    eng.step()
    eng.step()
    held = eng.pool.num_used
    assert eng.cancel(a.request_id) is True
    assert eng.pool.num_used < held and eng.metrics().requests_cancelled == 1
    with pytest.raises(RequestCancelledError, match=a.request_id):
        a.result()
    with pytest.raises(RequestCancelledError):
        list(a)
    assert b.result().token_ids == reference_greedy([4, 5, 6], 12)
    assert eng.cancel(b.request_id) is False  # already finished
    assert not eng._handles  # finished and cancelled requests are not kept (a server runs for months)
    with pytest.raises(LLMRequestError, match="nope"):
        eng.cancel("nope")
    _assert_no_leak(eng)


def test_cancel_waiting_request():
    eng = _engine(max_seqs=1)
    eng.submit([1, 2, 3], GREEDY)
    w = eng.submit([1, 2, 3, 4], GREEDY)
    eng.step()
    eng.cancel(w.request_id)
    eng.run_until_done()
    _assert_no_leak(eng)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([1 + i % 60 for i in range(128)], GREEDY, "128 tokens.*context is 128"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=-1), "max_tokens"),
        ([1, 64, 2], GREEDY, "unknown token id 64"),
        ([1, -1], GREEDY, "unknown token id -1"),
        ([], GREEDY, "empty prompt"),
        ("text", GREEDY, "no tokenizer"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
    ],
)
def test_bad_inputs_are_typed_errors_and_engine_keeps_serving(prompt, params, match):
    eng = _engine()
    ok = eng.submit([7, 8, 9], GREEDY)
    with pytest.raises(LLMRequestError, match=match):
        eng.submit(prompt, params)
    assert ok.result().token_ids == reference_greedy([7, 8, 9], 12)
    assert eng.metrics().requests_rejected == 1
    _assert_no_leak(eng)


def test_prompt_larger_than_pool_is_refused():
    eng = _engine(num_blocks=4)
    with pytest.raises(LLMRequestError, match="KV blocks"):
        eng.submit(list(range(1, 30)), GREEDY)


def test_length_cap_at_context_and_eos():
    eng = _engine(spec=FakeSpec(max_context=20))
    out = eng.generate([list(range(1, 16))], SamplingParams(max_tokens=50))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    ref = reference_greedy([1, 2, 3], 6)
    eng = _engine(spec=FakeSpec(eos_ids=(ref[2],)))
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=50))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:3]
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids == ref


class CharTokenizer:
    """token id i <-> chr(ord('a') + i % 26); ids >= 26 decode to digits."""

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i) if i < 26 else str(i % 10) for i in ids)


def test_streaming_iterator_callback_and_stop_strings():
    tok = CharTokenizer()
    ref = tok.decode(reference_greedy(tok.encode("hello"), 12))
    seen = []
    eng = _engine(tokenizer=tok)
    h = eng.submit("hello", GREEDY, on_token=seen.append)
    events = list(h)
    assert "".join(e.text for e in events) == ref == h.text
    assert [e.index for e in events] == list(range(12)) and events[-1].finish_reason == "length"
    assert [e.token_id for e in seen] == h.token_ids
    stop = ref[4:6]
    out = _engine(tokenizer=tok).submit("hello", SamplingParams(max_tokens=12, stop=(stop,)))
    streamed = "".join(e.text for e in out)
    assert out.finish_reason == "stop" and streamed == out.text == ref[: ref.find(stop)]


def test_token_ids_only_requests_skip_the_text():
    tok = CharTokenizer()
    eng = _engine(tokenizer=tok)
    plain = eng.generate(["hello"], GREEDY)[0]
    ids_only = eng.generate(["hello"], SamplingParams(max_tokens=12, detokenize=False))[0]
    assert ids_only.token_ids == plain.token_ids and plain.text and ids_only.text == ""
    with pytest.raises(LLMRequestError, match="detokenize"):
        eng.submit("hello", SamplingParams(stop=("x",), detokenize=False))


def test_metrics_counters():
    eng = _engine()
    outs = eng.generate(_prompts(3, seed=2), GREEDY)
    m = eng.metrics()
    assert m.requests_finished == 3 and m.running == 0 and m.waiting == 0
    assert m.generation_tokens == 36 and m.prompt_tokens == sum(len(o.prompt_ids) for o in outs)
    assert m.ttft_count == 3 and m.ttft_sum_s > 0 and all(o.ttft_s > 0 for o in outs)
    assert m.kv_blocks_used == 0 and m.kv_blocks_free == m.kv_blocks_total == 64
    assert "kv_usage" in m.as_dict()


def test_background_loop_serves_handles():
    eng = _engine()
    eng.start()
    try:
        hs = [eng.submit(p, GREEDY) for p in _prompts(4, seed=9)]
        assert [h.result().token_ids for h in hs] == [reference_greedy(h.request.prompt_ids, 12) for h in hs]
    finally:
        eng.stop()


# -- the steady path of plain requests (Engine._steady_tail) ---------------------------------------------
def _run_streams(engine, prompts, params_of, on_token=None):
    """Every request's events (token id, text, index, finish reason) and the engine's counters at the end."""
    handles = [engine.submit(p, params_of(i), on_token=on_token) for i, p in enumerate(prompts)]
    engine.run_until_done()
    events = [[tuple(e) for e in h._events] for h in handles]
    m = engine.metrics()
    counts = (m.generation_tokens, m.requests_finished, m.requests_failed, m.requests_cancelled, m.ttft_count)
    return handles, events, counts


def _generic(engine):
    engine._all_plain = lambda out: False  # every step through _sample / _stream / _emit
    return engine


def _tailed(engine):
    """Count the steps that take the steady tail (a test of the fast path must see it taken)."""
    engine.tails, engine.in_tail = 0, False
    tail = engine._steady_tail

    def counted(out, logits):
        engine.tails += 1
        engine.in_tail = True
        try:
            return tail(out, logits)
        finally:
            engine.in_tail = False

    engine._steady_tail = counted
    return engine


@pytest.mark.parametrize("max_tokens", [1, 2, 13, 25])
def test_steady_tail_streams_exactly_what_the_general_path_streams(max_tokens):
    # Mixed batch: plain greedy rows (the tail's), and rows that are not plain (seeded sampling, a
    # penalty, logprobs) keep the whole batch on the general path while they run; lengths end the rows
    # at different steps, some inside a block (ending a steady run), some at a block's end.
    prompts = _prompts(6, seed=5)
    kinds = [
        SamplingParams(max_tokens=max_tokens),
        SamplingParams(max_tokens=max_tokens + 3, temperature=0.8, seed=3),
        SamplingParams(max_tokens=max_tokens + 5),
        SamplingParams(max_tokens=max_tokens + 7, logprobs=2),
        SamplingParams(max_tokens=max_tokens + 30),  # (prompt + 55 stays under the fake's 128 context)
        SamplingParams(max_tokens=max_tokens + 2, repetition_penalty=1.3),
    ]
    fast = _tailed(_engine())
    hf, ef, cf = _run_streams(fast, prompts, kinds.__getitem__)
    _, eg, cg = _run_streams(_generic(_engine()), prompts, kinds.__getitem__)
    assert ef == eg and cf == cg
    assert hf[0].token_ids == reference_greedy(prompts[0], max_tokens)
    # the last plain row outlives the others by 23+ tokens: steady steps of plain rows only
    assert fast.tails > 0
    assert not fast._handles  # finished requests leave the engine on the tail too
    _assert_no_leak(fast)


def test_steady_tail_is_not_taken_for_text_stop_strings_or_logprobs():
    tok = CharTokenizer()
    for params in (
        SamplingParams(max_tokens=30),  # text
        SamplingParams(max_tokens=30, stop=("zz",)),
        SamplingParams(max_tokens=30, detokenize=False, logprobs=1),
        SamplingParams(max_tokens=30, detokenize=False, temperature=0.5, seed=1),
    ):
        eng = _tailed(_engine(tokenizer=tok))
        eng.generate(["hello there"], params)
        assert eng.tails == 0, params
    eng = _tailed(_engine(tokenizer=tok))
    out = eng.generate(["hello there"], SamplingParams(max_tokens=30, detokenize=False))[0]
    assert eng.tails > 0 and out.text == "" and out.token_ids == reference_greedy(tok.encode("hello there"), 30)


def _failing_and_cancelling_run(mode: str, prompts):
    eng = _tailed(_engine()) if mode == "tail" else _generic(_engine())
    params = SamplingParams(max_tokens=40)
    seen = {i: [] for i in range(4)}
    ids, where = {}, []

    def cb(i):
        def on_token(ev):
            seen[i].append(ev.token_id)
            if i == 0 and ev.index == 9:
                where.append(getattr(eng, "in_tail", None))
                raise ValueError("boom")
            if i == 1 and ev.index == 13:
                where.append(getattr(eng, "in_tail", None))
                eng.cancel(ids[2])

        return on_token

    hs = []
    for i, p in enumerate(prompts):
        hs.append(eng.submit(p, params, on_token=cb(i)))
        ids[i] = hs[-1].request_id
    eng.run_until_done()
    with pytest.raises(LLMRequestError, match="boom"):
        hs[0].result()
    with pytest.raises(RequestCancelledError):
        hs[2].result()
    # nothing streamed after the failure, or after the cancel (row 2 comes after row 1 in the step's batch)
    assert len(seen[0]) == 10 and len(seen[2]) == 13
    for i in (1, 3):
        assert hs[i].result().token_ids == seen[i] == reference_greedy(prompts[i], 40)
    m = eng.metrics()
    assert (m.requests_failed, m.requests_cancelled, m.requests_finished) == (1, 1, 2)
    _assert_no_leak(eng)
    assert where == ([True, True] if mode == "tail" else [None, None])
    return seen, m.requests_failed, m.requests_cancelled, m.requests_finished, m.generation_tokens


def test_steady_tail_callback_failure_and_cancel_of_another_row():
    # During steady steps of plain rows: one row's callback raises (that request fails, its blocks are
    # freed), another's cancels a third request (which then streams nothing more); the rest go on.
    # (prompt lengths equal modulo the block size 4: the rows leave their blocks together, so runs of
    # steady steps happen; both events fall in one, asserted)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20]]
    assert _failing_and_cancelling_run("tail", prompts) == _failing_and_cancelling_run("generic", prompts)
