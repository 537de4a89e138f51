"""The engine over a real compiled tiny Llama: batched, chunked, prefix-shared, preempted greedy == HF generate."""

from __future__ import annotations

import collections

import pytest

from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

NEW = 24
HEAD = "def wrap(text, width=70, initial_indent='', subsequent_indent=''):\n"
TEXTS = [HEAD + "    return", HEAD + '    """Wrap', "import os", "x = [", "class A:"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """The tiny Llama with head size 64: mapped KV blocks of 16 tokens (one 4 KiB page per head), so the
    shared prompt prefix fills a whole block and a 7-block pool forces preemption."""
    from tests.llm.fixtures import build_llama

    return build_llama(tmp_path_factory.mktemp("llm") / "llama-d64", head_dim=64)


@pytest.fixture(scope="module")
def llama(llama_dir, tmp_path_factory):
    from tests.llm.test_causal_lm import compile_llm

    return compile_llm(llama_dir, tmp_path_factory.mktemp("art") / "llama").output


@pytest.fixture(scope="module")
def expected(llama, llama_dir):
    return _hf_tokens(llama, llama_dir)


def _hf_tokens(artifact, folder) -> dict[str, list[int]]:
    """Hugging Face generate()'s greedy tokens for each of TEXTS, tokenized by the artifact's tokenizer."""
    from tests.llm.test_causal_lm import hf_greedy

    tok = Engine.load(artifact, num_blocks=8).tokenizer
    return {t: hf_greedy(folder, tok.encode(t), NEW) for t in TEXTS}


@pytest.mark.slow
@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (7, 24)])  # roomy; tight pool -> chunked + preempted
def test_engine_greedy_matches_hf_generate(llama, expected, num_blocks, budget):
    eng = Engine.load(llama, num_blocks=num_blocks, config=SchedulerConfig(max_num_batched_tokens=budget))
    kinds = _count_kinds(eng)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    handles = [eng.submit(TEXTS[0], params)]
    eng.step()  # the first prompt's full blocks are now cached for the second
    handles += [eng.submit(t, params, priority=i % 2) for i, t in enumerate(TEXTS[1:])]
    eng.run_until_done()
    for t, h in zip(TEXTS, handles):
        assert h.result().token_ids == expected[t], t
    m = eng.metrics()
    assert m.block_size == 16 and eng.runner.kv.mmap_calls > 0  # the mapped layout
    assert kinds["steady"] > 0  # steady deltas ran (reusing the mapped runner's slots: checked by the tokens)
    assert m.kv_blocks_used == 0 and m.requests_finished == len(TEXTS)
    if num_blocks == 7:
        assert m.preemptions > 0
    else:
        assert m.prefix_hit_tokens >= 16  # the two "def wrap" prompts share a block


def _count_kinds(eng) -> collections.Counter:
    """Counts of the step kinds the engine executes (StepKind values)."""
    kinds: collections.Counter = collections.Counter()
    inner = eng.runner.execute
    eng.runner.execute = lambda out: kinds.update([out.kind.value]) or inner(out)
    return kinds


@pytest.fixture(scope="module")
def gpt2(compiled, tiny_gpt2_dir):
    """The tiny GPT-2: the gather ("paged") KV layout, run by ModelRunner itself."""
    return compiled(tiny_gpt2_dir, targets=("ort-cpu",), task="causal-lm").output


@pytest.fixture(scope="module")
def gpt2_expected(gpt2, tiny_gpt2_dir):
    return _hf_tokens(gpt2, tiny_gpt2_dir)


@pytest.mark.slow
@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (6, 24)])
def test_gather_layout_engine_matches_hf_generate(gpt2, gpt2_expected, num_blocks, budget):
    eng = Engine.load(gpt2, num_blocks=num_blocks, config=SchedulerConfig(max_num_batched_tokens=budget))
    assert eng.runner.spec.kv_layout == "paged"
    kinds = _count_kinds(eng)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    handles = [eng.submit(t, params, priority=i % 2) for i, t in enumerate(TEXTS)]
    eng.run_until_done()
    for t, h in zip(TEXTS, handles):
        assert h.result().token_ids == gpt2_expected[t], t
    m = eng.metrics()
    assert kinds["steady"] > 0 and m.kv_blocks_used == 0 and m.requests_finished == len(TEXTS)
    if num_blocks == 6:
        assert m.preemptions > 0 and kinds["mixed"] > len(TEXTS)


@pytest.mark.slow
def test_steady_plans_survive_arrivals_cancels_and_finishes(llama, expected):
    # Requests arrive mid-generation, one is cancelled mid-plan, others finish at different lengths: each
    # change must end the steady plan (slots re-derived), and the survivors still match HF generate.
    eng = Engine.load(llama, num_blocks=64)
    kinds = _count_kinds(eng)
    lengths = [NEW, 5, NEW, 11, NEW]
    handles = [eng.submit(TEXTS[0], SamplingParams(max_tokens=lengths[0], ignore_eos=True))]
    for _ in range(7):
        eng.step()
    victim = eng.submit("to be cancelled", SamplingParams(max_tokens=NEW, ignore_eos=True))
    for t, n in zip(TEXTS[1:3], lengths[1:3]):
        handles.append(eng.submit(t, SamplingParams(max_tokens=n, ignore_eos=True)))
    for _ in range(6):
        eng.step()
    assert eng.cancel(victim.request_id)
    for t, n in zip(TEXTS[3:], lengths[3:]):
        handles.append(eng.submit(t, SamplingParams(max_tokens=n, ignore_eos=True)))
    eng.run_until_done()
    for t, n, h in zip(TEXTS, lengths, handles):
        assert h.result().token_ids == expected[t][:n], t
    assert kinds["steady"] > 0 and eng.metrics().kv_blocks_used == 0


def _ids_run(eng, prompt, params, stepwise: bool, on_token=None):
    """One request through run_until_done (batch-1 steady bursts) or step() by step() (never a burst); the
    handle and how many steps ran the model through the runner's execute()."""
    calls = []
    real = eng.runner.execute
    eng.runner.execute = lambda out: (calls.append(out.kind), real(out))[1]
    try:
        h = eng.submit(prompt, params, on_token=on_token)
        if stepwise:
            while eng.has_unfinished():
                eng.step()
        else:
            eng.run_until_done()
    finally:
        del eng.runner.execute
    return h, len(calls)


@pytest.mark.slow
def test_batch1_steady_burst_equals_single_steps(llama, expected):
    # A plain batch-1 request decodes to each block's end without the step loop (engine._burst): the same
    # tokens as HF and as step() by step(), the same counters, a stop token honoured mid-burst, and far
    # fewer execute() calls (the proof that the burst ran at all).
    text = TEXTS[0]
    want = expected[text]
    for stop_at in (None, 13):  # 13: a stop token id inside a block's run, not at its end
        params = SamplingParams(
            max_tokens=NEW,
            ignore_eos=True,
            detokenize=False,
            stop_token_ids=() if stop_at is None else (want[stop_at],),
        )
        got = {}
        for stepwise in (True, False):
            eng = Engine.load(llama, num_blocks=64)
            h, calls = _ids_run(eng, text, params, stepwise)
            m = eng.metrics()
            got[stepwise] = (h.result().token_ids, h.result().finish_reason, m.generation_tokens, calls)
            assert m.kv_blocks_used == 0 and m.requests_finished == 1
        n = NEW if stop_at is None else want.index(want[stop_at]) + 1
        assert got[True][0] == got[False][0] == want[:n]
        assert got[True][1] == got[False][1] == ("length" if stop_at is None else "stop")
        assert got[True][2] == got[False][2] == n
        assert got[True][3] >= n and got[False][3] <= n // 2, got  # step(): one execute per token


@pytest.mark.slow
def test_batch1_burst_yields_to_an_arrival(llama, expected):
    # A request submitted from inside the stream (its on_token callback) must be scheduled at the next
    # step, not after the burst reaches its block's end: its first token comes within 2 tokens of the first
    # request's, and both still match HF.
    eng = Engine.load(llama, num_blocks=64)
    events, later = [], []
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)

    def on_token(ev):
        events.append(("a", ev.index))
        if ev.index == 3 and not later:
            later.append(eng.submit(TEXTS[2], params, on_token=lambda e: events.append(("b", e.index))))

    h, _ = _ids_run(eng, TEXTS[0], params, stepwise=False, on_token=on_token)
    assert h.result().token_ids == expected[TEXTS[0]]
    assert later[0].result().token_ids == expected[TEXTS[2]]
    first_b = events.index(("b", 0))
    assert [e for e in events[:first_b] if e[0] == "a"][-1][1] <= 5, events[:first_b]


@pytest.mark.slow
def test_generate_cli_streams(llama, expected):
    from click.testing import CliRunner

    from precast.cli.main import _register, cli

    _register()
    res = CliRunner().invoke(
        cli, ["generate", str(llama), TEXTS[0], "--max-tokens", "5", "--stream", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert '"finish_reason"' in res.output
    res = CliRunner().invoke(cli, ["generate", str(llama), TEXTS[0], "--max-tokens", "0"])
    assert res.exit_code != 0 and "max_tokens" in str(res.exception or res.output)


def _spinning(session) -> tuple[str, str]:
    opts = session.get_session_options()
    return tuple(
        opts.get_session_config_entry(f"session.{p}.allow_spinning") for p in ("intra_op", "inter_op")
    )


@pytest.mark.slow
def test_spinning_auto_by_default_and_every_way_matches_hf(llama, expected):
    # ONNX Runtime's threads spin-wait unless told not to. The default "auto" holds a calm session and a
    # spinning one (the spin switch picks per step from the host's load); True / False hold one: same tokens.
    from precast.errors import UsageError

    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for kwargs, want, spin in (
        ({}, ("0", "0"), ("1", "1")),
        ({"spinning": True}, ("1", "1"), None),
        ({"spinning": False}, ("0", "0"), None),
    ):
        eng = Engine.load(llama, num_blocks=64, threads=2, **kwargs)
        assert _spinning(eng.runner._session) == want, kwargs
        sw = eng.runner.spin_switch
        assert (None if sw is None else _spinning(sw.spinning)) == spin, kwargs
        assert eng.generate(TEXTS[0], params)[0].token_ids == expected[TEXTS[0]]
    with pytest.raises(UsageError, match="spinning must be True, False or 'auto', got 'no'"):
        Engine.load(llama, num_blocks=8, spinning="no")
