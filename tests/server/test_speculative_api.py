"""`precast serve --draft / --speculative ngram` over a real compiled tiny Llama, driven by the `openai`
client: greedy answers (plain, streamed, n > 1, stop strings, logprobs) are the ones served without
speculation, and /metrics shows the speculation counters."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server, metric_value

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "def wrap(text, width=70):"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
SPECULATING = ("draft", "self", "ngram")


@pytest.fixture(scope="module")
def servers(llm_artifact, llm_draft_artifact):
    """One server without speculation and one per way of speculating: a draft with other weights (K = 3),
    the target as its own draft (every greedy proposal kept), prompt lookup."""
    llm = {
        "plain": {},
        "draft": {"draft": str(llm_draft_artifact), "num_speculative_tokens": 3},
        "self": {"draft": str(llm_artifact)},
        "ngram": {"speculative": "ngram"},
    }
    out = {}
    contexts = []
    try:
        for name, options in llm.items():
            config = ServerConfig(
                llm_artifact, model_name="tiny", request_timeout=60, llm={"num_blocks": 32, **options}
            )
            ctx = live_server(config)
            out[name] = ctx.__enter__()
            contexts.append(ctx)
            _pinned(out[name][1])  # (see _engine)
        yield out
    finally:
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)


def _client(servers, name):
    return openai.OpenAI(base_url=f"{servers[name][0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _engine(servers, name):
    """The server's engine, its speculation governor pinned on: these tests are about the API, and whether
    speculating pays on this host (measured with the real clock) must not decide what they see."""
    return _pinned(servers[name][1])


def _pinned(state):
    engine = state.host.current.llm.engine
    engine._governor.speculate = lambda batch: True
    engine._governor.plain_wins = lambda batch: False
    return engine


def test_the_flags_reach_the_engine(servers, llm_artifact, llm_draft_artifact):
    assert _engine(servers, "plain").speculative is None
    draft = _engine(servers, "draft").speculative
    assert (draft.method, draft.draft, draft.num_tokens) == ("draft", str(llm_draft_artifact), 3)
    assert _engine(servers, "self").speculative.num_tokens == 4  # the default K
    ngram = _engine(servers, "ngram").speculative
    assert (ngram.method, ngram.draft) == ("ngram", None)


@pytest.mark.parametrize("name", SPECULATING)
def test_completions_plain_and_streamed_are_the_unspeculated_text(servers, name):
    want = _client(servers, "plain").completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY)
    client = _client(servers, name)
    before = _engine(servers, name).metrics().spec_proposed_tokens
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY)
    assert _engine(servers, name).metrics().spec_proposed_tokens > before  # (it did speculate)
    assert r.choices[0].text == want.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 == want.usage.completion_tokens
    chunks = list(
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == want.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("name", SPECULATING)
def test_chat_streamed_and_n_choices(servers, name):
    msgs = [{"role": "user", "content": "hello"}]
    plain, client = _client(servers, "plain"), _client(servers, name)
    want = plain.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content and chunks[-1].usage.completion_tokens == 16
    want = plain.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, n=2, **GREEDY)
    # (the mapped KV layout speculates while one request decodes: the two choices in part, as they interleave)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, n=2, **GREEDY)
    assert [c.text for c in r.choices] == [c.text for c in want.choices]
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 32


@pytest.mark.parametrize("name", SPECULATING)
def test_stop_strings_end_inside_a_verified_step(servers, name):
    """The target as its own draft yields 5 tokens per step: a stop string ends the answer inside one."""
    plain, client = _client(servers, "plain"), _client(servers, name)
    full = plain.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    want = plain.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop], **GREEDY)
    assert want.choices[0].finish_reason == "stop" and len(want.choices[0].text) < len(full)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop], **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.choices[0].text, "stop")
    assert r.usage.completion_tokens == want.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop], stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("name", SPECULATING)
def test_logprobs_are_the_unspeculated_ones(servers, name):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "logprobs": 3, "temperature": 0}
    body["ignore_eos"] = True
    want = httpx.post(f"{servers['plain'][0]}/v1/completions", json=body, timeout=60).json()
    got = httpx.post(f"{servers[name][0]}/v1/completions", json=body, timeout=60).json()
    w, g = want["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
    assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"]
    # (a verified step's logits come from one forward over 1 + k positions: equal up to float rounding)
    np.testing.assert_allclose(g["token_logprobs"], w["token_logprobs"], atol=1e-4)
    for gt, wt in zip(g["top_logprobs"], w["top_logprobs"]):
        assert gt.keys() == wt.keys()
        np.testing.assert_allclose([gt[k] for k in wt], list(wt.values()), atol=1e-4)
    msgs = [{"role": "user", "content": "hello"}]
    chat = dict(model="tiny", messages=msgs, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    want = _client(servers, "plain").chat.completions.create(**chat).choices[0].logprobs.content
    chunks = list(_client(servers, name).chat.completions.create(stream=True, **chat))
    got = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in got] == [e.token for e in want]
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=1e-4)


def test_seeded_sampling_with_a_draft_is_reproducible(servers):
    """Sampling verifies by rejection (the draft's own distribution kept per token): the same seed gives
    the same answer."""
    client = _client(servers, "draft")

    def sampled():
        r = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=1.0,
            seed=11,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    before = _engine(servers, "draft").metrics().spec_proposed_tokens
    assert sampled() == sampled()
    assert _engine(servers, "draft").metrics().spec_proposed_tokens > before


def _scrape(servers, name) -> str:
    r = httpx.get(f"{servers[name][0]}/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def test_metrics_count_proposed_and_accepted_tokens(servers):
    for name in ("plain", "self", "draft"):  # (every server has served greedy requests by now, or does here)
        _client(servers, name).completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY)
    text = _scrape(servers, "self")
    proposed = metric_value(text, "precast_llm_spec_proposed_tokens_total")
    accepted = metric_value(text, "precast_llm_spec_accepted_tokens_total")
    rows = metric_value(text, "precast_llm_spec_accepted_tokens_per_step_count")
    kept = metric_value(text, "precast_llm_spec_accepted_tokens_per_step_sum")
    m = _engine(servers, "self").metrics()
    assert proposed == m.spec_proposed_tokens > 0 and accepted == m.spec_accepted_tokens > 0
    assert rows == sum(m.spec_accepted_per_row) > 0 and kept == accepted
    # the target as its own draft keeps every greedy proposal: the rows that kept 4 (K) are in le="4.0" only
    le3 = metric_value(text, "precast_llm_spec_accepted_tokens_per_step_bucket", le="3.0")
    le4 = metric_value(text, "precast_llm_spec_accepted_tokens_per_step_bucket", le="4.0")
    assert le4 - le3 == m.spec_accepted_per_row[4] > 0
    # a second scrape adds nothing new (what grew since the last one only)
    assert metric_value(_scrape(servers, "self"), "precast_llm_spec_proposed_tokens_total") == proposed
    text = _scrape(servers, "draft")
    assert metric_value(text, "precast_llm_spec_proposed_tokens_total") > 0
    assert metric_value(text, "precast_llm_spec_accepted_tokens_per_step_count") > 0
    text = _scrape(servers, "plain")
    assert metric_value(text, "precast_llm_spec_proposed_tokens_total") == 0
    assert metric_value(text, "precast_llm_spec_accepted_tokens_per_step_count") == 0


def test_a_reload_keeps_speculating(servers):
    url, state = servers["ngram"]
    r = httpx.post(f"{url}/admin/reload", json={}, timeout=120)
    assert r.status_code == 200, r.text
    engine = _pinned(state)
    assert engine.speculative is not None and engine.speculative.method == "ngram"
    want = _client(servers, "plain").completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **GREEDY)
    r = _client(servers, "ngram").completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **GREEDY)
    assert r.choices[0].text == want.choices[0].text
