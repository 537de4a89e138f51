"""Speculative decoding (runtime/llm/speculative.py) over real compiled tiny models: greedy output identical to the
engine without speculation (draft model and prompt lookup; alone and batched; preemption, cancellation, stop ids
inside the kept drafts), the sampling rule exact in distribution (a chi-square test a wrong rule fails), the
adaptive off-switch, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from precast.errors import UsageError
from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig
from precast.runtime.llm.speculative import SpecState, SpeculativeConfig, verify

NEW = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft, self-draft) artifacts: a tiny Llama (N(0, 0.1) weights), a smaller one with another seed
    and the same tokenizer (it rarely agrees: drafts get rejected), and the target as its own draft (it
    always agrees: long kept runs)."""
    from tests.llm.fixtures import build_llama
    from tests.llm.test_causal_lm import compile_llm

    root = tmp_path_factory.mktemp("spec")
    target = compile_llm(build_llama(root / "target"), root / "target-art").output
    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2}
    draft = compile_llm(build_llama(root / "draft", seed=1, **small), root / "draft-art").output
    return target, draft


def _prompts(n: int = 8) -> list[list[int]]:
    """Prompts of different lengths; every other one repeats a span (prompt lookup finds matches)."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        ids = rng.integers(3, 500, size=5 + 7 * i).tolist()
        out.append(ids + ids[: 4 + i] if i % 2 else ids)
    return out


@pytest.fixture(scope="module")
def plain(models):
    """The engine without speculation: each prompt's greedy tokens (alone)."""
    eng = Engine.load(models[0], threads=1)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    return [eng.generate([p], params)[0].token_ids for p in _prompts()]


def _spec(models, method: str, k: int, draft: str = "draft", **kw) -> Engine:
    target, other = models
    path = {"draft": other, "self": target}[draft] if method == "draft" else None
    cfg = SpeculativeConfig(method=method, num_tokens=k, draft=path, max_batch=8)
    return _pinned(Engine.load(target, threads=1, speculative=cfg, **kw))


def _pinned(engine: Engine) -> Engine:
    """Its governor pinned on: whether speculating pays on this host (the real clock) must not decide what a
    test about tokens sees (the governor's own test drives it with a clock of its own)."""
    engine._governor.speculate = lambda batch: True
    engine._governor.plain_wins = lambda batch: False
    return engine


@pytest.mark.parametrize(
    "method,k,draft", [("draft", 2, "draft"), ("draft", 5, "self"), ("draft", 8, "draft"), ("ngram", 4, "")]
)
def test_greedy_equals_plain_alone_and_batched(models, plain, method, k, draft):
    eng = _spec(models, method, k, draft or "draft")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    alone = [eng.generate([p], params)[0].token_ids for p in _prompts()]
    batched = [c.token_ids for c in eng.generate(_prompts(), params)]
    assert alone == plain
    assert batched == plain
    m = eng.metrics()
    assert m.spec_proposed_tokens > 0 and sum(m.spec_accepted_per_row) > 0
    if draft == "self":  # it always agrees: every proposal kept, several tokens per step
        assert m.spec_accepted_tokens == m.spec_proposed_tokens
        assert m.steps < m.generation_tokens / 2
    else:  # rejections happened and were rolled back
        assert m.spec_accepted_tokens < m.spec_proposed_tokens
    assert m.kv_blocks_used == 0
    if method == "draft":
        assert eng._proposer.pool.num_used == 0  # the draft's KV went back too
    eng.close()


def test_preemption_and_cancellation_leave_the_others_unchanged(models, plain):
    """A pool too small for all prompts at once: requests are preempted (their drafts dropped, recomputed
    later) and one is cancelled mid-way; every other request's tokens are the plain engine's."""
    eng = _spec(models, "draft", 4, "self", num_blocks=4, config=SchedulerConfig(max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    handles = [eng.submit(p, params) for p in _prompts()]
    for _ in range(6):
        eng.step()
    assert eng.cancel(handles[3].request_id)
    eng.run_until_done()
    m = eng.metrics()
    assert m.preemptions > 0 and m.spec_accepted_tokens > 0
    for i, h in enumerate(handles):
        if i != 3:
            assert h.result().token_ids == plain[i], i
    assert handles[3].cancelled and handles[3].request.finish_reason == "cancelled"
    assert m.kv_blocks_used == 0 and eng._proposer.pool.num_used == 0
    eng.close()


def test_a_stop_id_inside_the_kept_drafts_ends_there(models, plain):
    """The self-draft keeps whole runs of drafts: a stop token among them ends the output at that token,
    and a max_tokens in mid-run ends it at that length, as without speculation."""
    prompt = _prompts()[2]
    out = plain[2]  # (a completion's token_ids are its output)
    stop = out[6]
    want = out[: out.index(stop) + 1]
    eng = _spec(models, "draft", 6, "self")
    got = eng.generate([prompt], SamplingParams(max_tokens=NEW, stop_token_ids=[stop], ignore_eos=True))[0]
    assert got.token_ids == want and got.finish_reason == "stop"
    got = eng.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert got.token_ids == out[:9] and got.finish_reason == "length"
    assert eng.metrics().spec_accepted_tokens > 0
    eng.close()


def test_a_draft_that_never_agrees_turns_itself_off(models):
    """The other-seed draft rarely agrees with the target: its requests' k falls and speculation pauses,
    so far fewer tokens are proposed than k per generated token."""
    eng = _spec(models, "draft", 4, "draft")
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    eng.generate([_prompts()[0]], params)
    m = eng.metrics()
    assert m.spec_accepted_tokens < m.spec_proposed_tokens / 2  # (it really disagrees)
    assert m.spec_proposed_tokens < 120
    eng.close()


def test_refusals_name_the_culprit(models, tmp_path):
    from tests.llm.fixtures import build_gpt2
    from tests.llm.test_causal_lm import compile_llm

    target, _ = models
    with pytest.raises(UsageError, match="needs a draft artifact"):
        Engine.load(target, speculative=SpeculativeConfig(method="draft"))
    with pytest.raises(UsageError, match="unknown speculative method"):
        Engine.load(target, speculative=SpeculativeConfig(method="eagle", draft=target))
    with pytest.raises(UsageError, match="num_speculative_tokens"):
        Engine.load(target, speculative=SpeculativeConfig(method="ngram", num_tokens=0))
    # GPT-2's hand-written paged graph returns one logits row per request
    gpt2 = compile_llm(build_gpt2(tmp_path / "gpt2"), tmp_path / "gpt2-art").output
    with pytest.raises(UsageError, match="several logits rows"):
        Engine.load(gpt2, speculative=SpeculativeConfig(method="ngram"))
    # a draft with another tokenizer
    import json

    from tests.llm.fixtures import build_llama

    other = build_llama(tmp_path / "other-tok")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    other_art = compile_llm(other, tmp_path / "other-art").output
    with pytest.raises(UsageError, match="tokenizer differs"):
        Engine.load(target, speculative=SpeculativeConfig(draft=other_art))


# -- the sampling rule ------------------------------------------------------------------------------------
class _Req:
    """What verify() reads of a request."""

    def __init__(self, params, seed):
        self.params, self.rng = params, np.random.default_rng(seed)
        self.token_ids, self.prompt_ids = [1, 2], [1, 2]
        self.argmax = False


def _first_tokens(rule, draws: int, p_logits, q_probs) -> np.ndarray:
    """Counts of the first token a verified row yields, drafts drawn from q (k = 2), over many seeds."""
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(p_logits.shape[1], dtype=np.int64)
    for seed in range(draws):
        rng = np.random.default_rng(10_000 + seed)
        drafts = [int(rng.choice(len(q), p=q)) for q in q_probs]
        tokens = rule(_Req(params, seed), drafts, p_logits, q_probs, p_logits.shape[1])
        counts[tokens[0]] += 1
    return counts


def _wrong_rule(req, drafts, logits, q, vocab):
    """Keep a draft with probability p(d) regardless of q (a plausible bug): biased towards q."""
    from precast.runtime.llm.sampler import filtered_probs

    p = filtered_probs(logits[0, :vocab], req.params, req.token_ids, 2)
    if req.rng.random() < p[drafts[0]]:
        return [drafts[0]]
    return [int(req.rng.choice(vocab, p=p))]


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square of the first yielded token against the target's p (6 tokens, 4000 seeded draws): the
    rule passes (p > 0.01); the wrong rule, on the same draws, fails."""
    from scipy.stats import chisquare

    p_logits = np.log(np.array([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]] * 3))
    q = [np.array([0.05, 0.05, 0.10, 0.20, 0.30, 0.30])] * 2
    p = np.exp(p_logits[0])
    n = 4000
    good = _first_tokens(verify, n, p_logits, q)
    bad = _first_tokens(_wrong_rule, n, p_logits, q)
    assert chisquare(good, p * n).pvalue > 0.01
    assert chisquare(bad, p * n).pvalue < 1e-6


def test_sampling_engine_matches_plain_in_distribution(models):
    """End to end, temperature 1 with top-k 4 (a tiny effective vocabulary): the third generated token's
    distribution over 600 seeded requests, with the other-seed draft (real rejections) and without."""
    from scipy.stats import chi2_contingency

    target = models[0]
    prompt = _prompts()[1]
    n = 600

    def thirds(eng) -> list[int]:
        handles = [
            eng.submit(
                prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True)
            )
            for s in range(n)
        ]
        eng.run_until_done()
        return [h.result().token_ids[-1] for h in handles]

    base = thirds(Engine.load(target, threads=1))
    cfg = SpeculativeConfig(method="draft", draft=models[1], num_tokens=3, max_batch=n, adaptive=False)
    eng = Engine.load(target, threads=1, speculative=cfg, config=SchedulerConfig(max_num_seqs=n))
    spec = thirds(eng)
    assert eng.metrics().spec_proposed_tokens > 0
    keys = sorted(set(base) | set(spec))
    table = np.array([[base.count(t) for t in keys], [spec.count(t) for t in keys]]) + 1
    assert chi2_contingency(table).pvalue > 0.01
    eng.close()


def test_spec_state_adapts():
    st = SpecState(k=2, k_max=4)
    st.update(2, 2)
    assert st.k == 3
    st.update(3, 0)
    st.update(2, 0)
    st.update(1, 0)
    assert st.k == 1 and st.off > 0  # three misses: off for a while (counted in tokens)
    assert st.wanted(100) == 0 and st.off > 0
    assert st.wanted(100 + st.off) == 0 and st.off == 0  # (a burst decoded those tokens)
    assert st.k == 1 and st.wanted(117) == 1


@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    """A tiny Qwen3 (the generic paged graph) compiled for ort-cpu and, where OpenVINO is installed, openvino."""
    import importlib.util

    from precast.compiler.driver import CompileOptions, compile_model
    from tests.llm.fixtures import build_causal_lm

    root = tmp_path_factory.mktemp("spec-generic")
    targets = ("ort-cpu", "openvino") if importlib.util.find_spec("openvino") else ("ort-cpu",)
    folder = build_causal_lm(root / "qwen3", "qwen3")
    out = compile_model(str(folder), root / "art", CompileOptions(targets=targets, task="causal-lm")).output
    return {t: out / t for t in targets} if len(targets) > 1 else {"ort-cpu": out}


@pytest.mark.parametrize("target", ["ort-cpu", "openvino"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_equals_plain_on_the_generic_and_openvino_graphs(generic, target, method):
    if target not in generic:
        pytest.skip("openvino is not installed")
    art = generic[target]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [c.token_ids for c in Engine.load(art, threads=1).generate(_prompts(), params)]
    cfg = SpeculativeConfig(
        method=method, num_tokens=4, draft=str(art) if method == "draft" else None, max_batch=8
    )
    eng = _pinned(Engine.load(art, threads=1, speculative=cfg))
    assert [eng.generate([p], params)[0].token_ids for p in _prompts()] == want
    assert [c.token_ids for c in eng.generate(_prompts(), params)] == want
    assert eng.metrics().spec_accepted_tokens > 0
    eng.close()


def test_stop_strings_and_logprobs_match_plain(models):
    """Text requests: a stop string inside a kept run cuts the text where the plain engine cuts it, and each
    kept token's logprobs are the target's (from its verify row) as without speculation."""
    target = models[0]
    plain = Engine.load(target, threads=1)
    prompt = "def wrap(text, width=70):\n    return"
    free = plain.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    stop = free.text[12:15]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, stop=[stop], logprobs=2)
    want_h = plain.submit(prompt, params)
    want_ev = list(want_h)  # (iterating steps the engine to the end)
    eng = _spec(models, "draft", 5, "self")
    got_h = eng.submit(prompt, params)
    got_ev = list(got_h)
    want, got = want_h.result(), got_h.result()
    assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"
    assert got.token_ids == want.token_ids
    assert eng.metrics().spec_accepted_tokens > 0
    wl = [e.logprobs for e in want_ev]
    gl = [e.logprobs for e in got_ev]
    assert len(wl) == len(gl) == len(want.token_ids)
    for (lw, top_w), (lg, top_g) in zip(wl, gl):
        assert lg == pytest.approx(lw, abs=1e-4)
        assert [t for t, _ in top_g] == [t for t, _ in top_w]
    eng.close()


def test_a_draft_with_a_smaller_vocabulary_samples_and_penalized_greedy_keeps(models, tmp_path):
    """A target whose vocabulary is padded past its tokenizer's (640 vs the draft's 512) samples with the
    draft (q padded to the target's size); and greedy with a repetition penalty keeps the self-draft's
    tokens (the draft picks the penalized argmax, as verify does)."""
    from tests.llm.fixtures import build_llama
    from tests.llm.test_causal_lm import compile_llm

    padded = compile_llm(build_llama(tmp_path / "padded", vocab_size=640), tmp_path / "padded-art").output
    cfg = SpeculativeConfig(method="draft", draft=str(models[1]), num_tokens=3, adaptive=False)
    eng = Engine.load(padded, threads=1, speculative=cfg)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    assert len(eng.generate("def wrap(text, width=70):", p)[0].token_ids) == 16
    assert eng.metrics().spec_proposed_tokens > 0
    eng.close()
    penalized = SamplingParams(max_tokens=NEW, repetition_penalty=1.3, ignore_eos=True)
    want = Engine.load(models[0], threads=1).generate(_prompts()[:2], penalized)
    eng = _spec(models, "draft", 4, "self")
    assert [c.token_ids for c in eng.generate(_prompts()[:2], penalized)] == [c.token_ids for c in want]
    m = eng.metrics()
    assert m.spec_accepted_tokens == m.spec_proposed_tokens > 0
    eng.close()


def test_a_signed_target_needs_a_signed_draft_and_a_packed_draft_is_cleaned_up(models, tmp_path):
    """Under a signature key the draft is held to the target's rule (a signed pack): a directory or an unsigned
    pack is refused naming the draft; a packed draft's unpacked copy goes when the engine closes."""
    from precast.artifact.signing import generate_keypair
    from precast.compiler.pack import pack_artifact
    from precast.errors import PrecastError

    target, draft = models
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    signed_t, signed_d, unsigned_d = (tmp_path / f"{n}.precast" for n in ("t", "d", "u"))
    pack_artifact(target, signed_t, sign_key=tmp_path / "k.pem", name="t", version="1")
    pack_artifact(draft, signed_d, sign_key=tmp_path / "k.pem", name="d", version="1")
    pack_artifact(draft, unsigned_d)
    key = tmp_path / "k.pub"
    for bad in (draft, unsigned_d):
        with pytest.raises(PrecastError, match="^draft: "):
            Engine.load(signed_t, pubkey=key, speculative=SpeculativeConfig(draft=str(bad)))
    eng = Engine.load(signed_t, pubkey=key, speculative=SpeculativeConfig(draft=str(signed_d), num_tokens=3))
    assert len(eng.generate([_prompts()[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8
    temps = [Path(f.peek()[2][0]) for f in (eng._cleanup, eng._draft_cleanup)]  # (the finalizers' temp dirs)
    assert all(t.is_dir() for t in temps)
    eng.close()
    assert not any(t.exists() for t in temps)


def test_prompt_lookup_proposes_a_loop_periodically():
    """A loop shorter than k: the proposal repeats it (a period-2 loop with k = 5 proposes 5 tokens)."""
    from precast.runtime.llm.speculative import NgramProposer

    class R:
        token_ids = [9, 8, 7, 1, 2, 1, 2, 1, 2]
        spec = SpecState(k=5, k_max=5)

    assert NgramProposer(SpeculativeConfig(method="ngram")).propose([R()], [5]) == [[1, 2, 1, 2, 1]]


class _FakeClock:
    """Time that passes only in the target's steps: ``spec`` / ``plain`` seconds per step of each kind."""

    def __init__(self, engine, spec: float, plain: float):
        self.now = 0.0
        run = engine.runner.execute

        def execute(out):
            self.now += spec if out.logit_rows is not None else plain
            return run(out)

        engine.runner.execute = execute

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("spec_cost,pays", [(1.5, True), (9.0, False)])
def test_speculation_stays_on_only_while_it_pays(models, plain, spec_cost, pays):
    """The governor compares the measured seconds per token of speculative and plain decode steps (a clock
    the test controls: a verify step costs spec_cost, a plain one 1.0): the self-draft keeps ~4 tokens per
    verify step, so 1.5 pays and 9.0 does not; then speculation stops (bar a rare re-probe) and the batch-1
    burst runs the plain steps. Tokens are the plain engine's either way."""
    target = models[0]
    cfg = SpeculativeConfig(method="draft", draft=str(target), num_tokens=4)
    eng = Engine.load(target, threads=1, speculative=cfg)
    eng._governor.clock = _FakeClock(eng, spec_cost, 1.0)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    got = eng.generate([_prompts()[0]], params)[0].token_ids
    m = eng.metrics()
    rows = sum(m.spec_accepted_per_row)
    assert got[:NEW] == plain[0]
    gov = eng._governor
    if pays:
        assert rows > 20  # speculating all along (~4-5 tokens a verify row)
        assert not gov.plain_wins(1)
    else:  # the first measurements (8 steps) and at most one re-probe, then plain
        assert rows <= gov.MIN_STEPS[True] + gov.PROBE and gov.plain_wins(1)
    eng.close()
