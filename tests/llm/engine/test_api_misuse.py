"""User mistakes at the LLM engine's Python API: each is a typed error naming the culprit, raised at submit or
load time, and never breaks the engine for the other requests."""

from __future__ import annotations

import json
import shutil
import threading
import warnings

import numpy as np
import pytest

from precast.errors import ArtifactError, LLMRequestError, UsageError
from precast.runtime.llm import Engine, LLMSpec, SamplingParams, SchedulerConfig
from precast.runtime.llm.sampler import filtered_probs, sample
from tests.fake_llm import fake_engine
from tests.helpers import tiny_llm_block
from tests.llm.engine.fake_runner import reference_greedy

GREEDY = SamplingParams(max_tokens=6)
OK_PROMPT = [7, 8, 9]


def _serves_others(eng, make_bad):
    """A good request queued before the bad one still gets exactly its tokens, and nothing leaks."""
    ok = eng.submit(OK_PROMPT, GREEDY)
    with pytest.raises(LLMRequestError) as err:
        make_bad()
    assert ok.result().token_ids == reference_greedy(OK_PROMPT, 6)
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.has_unfinished()
    return str(err.value)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"stop": [1]}, "stop"),
        ({"stop": [b"x"]}, "stop"),
        ({"stop": ["a", None]}, "stop"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"top_p": "0.9"}, "top_p"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [1.7]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"top_k": True}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"ignore_eos": "no"}, "ignore_eos"),
    ],
)
def test_bad_sampling_params_are_refused_at_submit(kwargs, needle):
    eng = fake_engine(max_context=128)
    params = SamplingParams(**{"max_tokens": 3, **kwargs})  # building one never raises a raw error
    msg = _serves_others(eng, lambda: eng.submit("hi", params))
    assert msg.startswith(needle) and "\n" not in msg


def test_numpy_integers_and_none_lists_are_accepted():
    p = SamplingParams(
        max_tokens=np.int64(3), top_k=np.int32(2), seed=np.int64(5), temperature=np.float32(0.7)
    )
    assert type(p.max_tokens) is int and type(p.top_k) is int and type(p.seed) is int
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids == (4,)
    out = fake_engine().submit([1, 2, 3], p).result()
    assert len(out.token_ids) == 3


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"params": {"max_tokens": 2}}, "params must be a SamplingParams, got dict"),
        ({"params": 5}, "params must be a SamplingParams"),
        ({"priority": "high"}, "priority"),
        ({"priority": None}, "priority"),
        ({"priority": float("nan")}, "priority"),
        ({"priority": 1.7}, "priority"),
        ({"priority": True}, "priority"),
        ({"request_id": ["a"]}, "request_id must be a string"),
        ({"request_id": 5}, "request_id must be a string"),
        ({"on_token": 5}, "on_token must be callable"),
    ],
)
def test_bad_submit_arguments_are_refused(kwargs, needle):
    eng = fake_engine()
    msg = _serves_others(eng, lambda: eng.submit([1, 2], **kwargs))
    assert needle in msg
    assert eng.metrics().requests_rejected == 1


@pytest.mark.parametrize(
    "prompt,needle",
    [
        (b"hello", "got bytes"),
        ([1.9, 2.5], "item 0 is 1.9"),
        (np.array([1.9, 2.5]), "1-D float64"),
        ([True, False], "item 0 is True"),
        ([1, float("nan")], "item 1 is nan"),
        ({1: "a", 2: "b"}, "got dict"),
        ({3, 1, 2}, "got set"),
        ((i for i in [1, 2]), "got generator"),
        (np.array([[1, 2], [3, 4]]), "2-D int64"),
        (5, "got int"),
    ],
)
def test_prompts_are_text_or_integer_ids(prompt, needle):
    eng = fake_engine()
    assert needle in _serves_others(eng, lambda: eng.submit(prompt, GREEDY))


def test_integer_id_prompts_of_any_integer_type():
    eng = fake_engine()
    ref = reference_greedy([1, 2, 3], 6)
    for prompt in ([1, 2, 3], (1, 2, 3), np.array([1, 2, 3], np.int32), [np.int64(1), 2, np.uint8(3)]):
        h = eng.submit(prompt, GREEDY, priority=np.int64(1))
        assert h.request.prompt_ids == [1, 2, 3] and h.result().token_ids == ref


def test_generate_with_one_bad_prompt_queues_none():
    eng = fake_engine()
    with pytest.raises(LLMRequestError, match="unknown token id 999"):
        eng.generate(["hello", [999], "x"], GREEDY)
    m = eng.metrics()
    assert m.requests_submitted == 0 and m.requests_rejected == 1 and not eng.has_unfinished()
    assert eng.pool.num_free == eng.pool.num_blocks
    with pytest.raises(LLMRequestError, match="got generator"):
        eng.generate(p for p in ["a", "b"])
    assert [len(c.token_ids) for c in eng.generate(["ab", [1, 2]], GREEDY)] == [6, 6]


def _boom(ev):
    raise ConnectionError("client went away")


@pytest.mark.parametrize("background", [False, True])
def test_raising_callback_fails_only_its_request(background):
    eng = fake_engine(max_context=128)
    if background:
        eng.start()
    try:
        good = eng.submit(OK_PROMPT, SamplingParams(max_tokens=20))
        bad = eng.submit([1, 2], SamplingParams(max_tokens=20), on_token=_boom)
        if not background:
            eng.run_until_done()  # (the old engine let the callback's error out of step() here)
        assert good.result().token_ids == reference_greedy(OK_PROMPT, 20)
        events = []
        with pytest.raises(
            LLMRequestError, match="on_token callback raised ConnectionError: client went away"
        ):
            events.extend(bad)
        assert len(events) == 1 and bad.finish_reason == "error" and len(bad.token_ids) == 1
        with pytest.raises(LLMRequestError, match=f"request '{bad.request_id}' failed") as err:
            bad.result()
        assert isinstance(err.value.__cause__, ConnectionError)
        if background:
            assert eng._thread.is_alive()
        assert eng.submit([4, 5], GREEDY).result().token_ids == reference_greedy([4, 5], 6)
        m = eng.metrics()
        assert m.requests_failed == 1 and m.requests_finished == 2 and m.kv_blocks_used == 0
    finally:
        eng.stop()
    eng.pool.check()


def test_callback_failing_on_the_last_token_fails_the_request():
    eng = fake_engine()
    h = eng.submit([1, 2], SamplingParams(max_tokens=1), on_token=_boom)
    with pytest.raises(LLMRequestError, match="ConnectionError"):
        h.result()
    m = eng.metrics()
    assert h.finish_reason == "error" and m.requests_failed == 1 and m.requests_finished == 0


def test_wait_for_a_request_another_thread_just_finished():
    # The interleaving behind a rare "unfinished but the engine has no work": thread A's iterator saw its
    # request unfinished, then thread B's step finished it (and the engine's last work) before A waited.
    eng = fake_engine()
    h = eng.submit([1, 2], GREEDY)
    eng.run_until_done()  # thread B
    eng.wait_for(h)  # thread A: returns (the check is made again under the engine's lock)
    assert h.result().token_ids == reference_greedy([1, 2], 6)


def test_threads_iterating_without_the_background_loop():
    eng = fake_engine()
    errors: list[Exception] = []

    def worker(i, barrier):
        barrier.wait()
        try:
            assert [ev.token_id for ev in eng.submit([1 + i], SamplingParams(max_tokens=2))] == (
                reference_greedy([1 + i], 2)
            )
        except Exception as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    for _ in range(60):
        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=worker, args=(i, barrier)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and eng.pool.num_free == eng.pool.num_blocks


def test_tiny_temperature_is_greedy_and_never_nan():
    logits = np.array([1.0, 3.0, 2.0, 3.0 - 1e-6], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow on the way
        p = filtered_probs(logits, SamplingParams(temperature=1e-310))
    assert np.isfinite(p).all() and p.argmax() == 1 and p[1] == 1.0
    eng = fake_engine()
    out = eng.submit([1, 2, 3], SamplingParams(temperature=1e-310, seed=0, max_tokens=8)).result()
    assert out.token_ids == reference_greedy([1, 2, 3], 8)
    with pytest.raises(LLMRequestError, match="not finite"):
        sample(np.array([np.nan, 1.0]), SamplingParams(temperature=1.0), [], np.random.default_rng(0))


def test_nan_logits_fail_only_their_request():
    eng = fake_engine(max_context=128)
    step = eng.runner._step

    def nan_for_63(ids, *rest):  # the model breaks down on prompts starting with token 63
        logits = step(ids, *rest)
        logits[np.asarray(ids)[:, 0] == 63] = np.nan
        return logits

    eng.runner._step = nan_for_63
    seen = []
    bad = eng.submit([63, 1], SamplingParams(max_tokens=5, temperature=1.0, seed=0), on_token=seen.append)
    good = eng.submit(OK_PROMPT, GREEDY)
    eng.run_until_done()
    assert good.result().token_ids == reference_greedy(OK_PROMPT, 6)
    with pytest.raises(LLMRequestError, match="logits are not finite"):
        bad.result()
    assert seen == [(-1, "", 0, "error")] and bad.token_ids == []  # an on_token stream hears the end
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"num_blocks": "4"}, "num_blocks must be a positive integer"),
        ({"num_blocks": 2.5}, "num_blocks"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": True}, "num_blocks"),
        ({"config": {"max_num_seqs": 2}}, "config must be a SchedulerConfig, got dict"),
        ({"foo": 1}, "unknown option 'foo'"),
    ],
)
def test_engine_load_arguments_are_checked_first(kwargs, needle, tmp_path):
    with pytest.raises(UsageError, match=needle):
        Engine.load(tmp_path / "not-even-there", **kwargs)


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "aging_steps"])
def test_scheduler_config_is_checked(field):
    with pytest.raises(UsageError, match=f"SchedulerConfig.{field} must be a positive integer, got 0"):
        fake_engine().__class__(fake_engine().runner, config=SchedulerConfig(**{field: 0}))


@pytest.mark.parametrize(
    "field,value", [("block_size", 0), ("vocab", "512"), ("layers", -1), ("pad_id", None)]
)
def test_malformed_llm_block_is_an_artifact_error(field, value):
    block = tiny_llm_block()
    del block["model_type"], block["batched_prefill"]  # optional keys: a minimal block
    assert LLMSpec.from_json(block).block_size == 16
    with pytest.raises(ArtifactError, match=f"art: llm block: '{field}'|art: llm block: {field}"):
        LLMSpec.from_json({**block, field: value}, "art")


def test_engine_load_packed_artifact_threads_and_bad_manifest(llm_artifact, tmp_path):
    from precast.compiler.pack import pack_artifact

    packed = tmp_path / "llama.precast"
    pack_artifact(llm_artifact, packed)
    want = Engine.load(llm_artifact, num_blocks=4).generate("hi", SamplingParams(max_tokens=3))
    got = Engine.load(packed, num_blocks=np.int64(4)).generate("hi", SamplingParams(max_tokens=3))
    assert got[0].token_ids == want[0].token_ids
    for threads in ("2", 1.5, -1, 10**4):
        with pytest.raises(UsageError, match="threads must be an integer in 1..256"):
            Engine.load(llm_artifact, threads=threads)
    bad = tmp_path / "bad"
    shutil.copytree(llm_artifact, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["llm"]["block_size"] = 0
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="block_size must be a positive integer, got 0"):
        Engine.load(bad, verify=False)
