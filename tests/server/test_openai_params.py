"""OpenAI API coverage of `precast serve` over a real compiled tiny Llama: n, prompt lists, logprobs, seed,
presence / frequency penalties, refused parameters, max_tokens beyond the context; and the serve controls
(--api-key, the scheduler and KV-memory options)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "def wrap(text, width=70):"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(llm_artifact):
    with live_server(ServerConfig(llm_artifact, model_name="tiny", llm={"num_blocks": 64})) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


# -- n and prompt lists -------------------------------------------------------------------------------
def test_n_choices_greedy_are_identical_and_seeded_ones_reproducible(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, extra_body={**GREEDY})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1 and r.usage.completion_tokens == 24
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once

    def sampled(seed):
        r = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            n=3,
            temperature=1.5,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in r.choices]

    a, b = sampled(7), sampled(7)
    assert a == b  # same seed: same choices
    assert len(set(a)) > 1  # each choice has its own seed
    assert sampled(8) != a


def test_n_choices_stream_interleaved_with_index(client):
    msgs = [{"role": "user", "content": "hello"}]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=6,
            n=2,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]
    full = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert texts[0] == full.choices[0].message.content


def test_prompt_lists_give_one_choice_per_prompt_times_n(client, server):
    prompts = [PROMPT, "x = [", "import os"]
    singles = [
        client.completions.create(model="tiny", prompt=p, max_tokens=5, extra_body=GREEDY) for p in prompts
    ]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2, extra_body=GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 30
    # token-id prompts, one and several
    tok = server[1].host.current.llm.engine.tokenizer
    ids = [tok.encode(p) for p in prompts[:2]]
    r = _post(server, "completions", {"prompt": ids, "max_tokens": 5, **GREEDY}).json()
    assert [c["text"] for c in r["choices"]] == [singles[0].choices[0].text, singles[1].choices[0].text]
    r = _post(server, "completions", {"prompt": ids[0], "max_tokens": 5, **GREEDY}).json()
    assert r["choices"][0]["text"] == singles[0].choices[0].text
    for bad in ([], [""], ["a", 3], [[1, "x"]], [[]]):
        r = _post(server, "completions", {"prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


# -- logprobs -------------------------------------------------------------------------------------------
def test_completion_logprobs_are_the_models(server, llm_artifact):
    r = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3, **GREEDY}).json()
    lp = r["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 6
    )
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 3 <= len(top) <= 4 and top[token] == value
        assert value == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the values are the log-softmax of the model's logits at each step
    from precast.runtime.llm import Engine

    engine = Engine.load(llm_artifact, num_blocks=16)
    prompt = engine.tokenizer.encode(PROMPT)
    out = engine.generate(PROMPT, _params(max_tokens=6, ignore_eos=True))[0]
    ids = prompt + out.token_ids
    want = [
        _log_softmax(_last_logits(engine.runner, ids[: len(prompt) + i]))[t]
        for i, t in enumerate(out.token_ids)
    ]
    np.testing.assert_allclose(lp["token_logprobs"], want, atol=1e-4)
    engine.close()
    r = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 0, **GREEDY}).json()
    assert all(len(t) == 1 for t in r["choices"][0]["logprobs"]["top_logprobs"])
    r = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, **GREEDY}).json()
    assert r["choices"][0]["logprobs"] is None


def _params(**kw):
    from precast.runtime.llm import SamplingParams

    return SamplingParams(**kw)


def _last_logits(runner, ids: list[int]) -> np.ndarray:
    """The model's logits after ``ids``: one prefill from an empty cache (independent of the server)."""
    n, bs = len(ids), runner.spec.block_size
    table = np.arange(-(-n // bs))[None, :]
    out = runner.step(np.array([ids]), np.arange(n)[None, :], np.array([0]), np.array([n]), table)
    return out[0].astype(np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_chat_logprobs_with_the_openai_client(client):
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert entry.logprob == pytest.approx(tops[0]) and entry.token == entry.top_logprobs[0].token
        assert entry.bytes == list(entry.token.encode())
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs not asked: none
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, top_logprobs=3)


# -- seed and penalties -----------------------------------------------------------------------------
def test_seed_reproduces_a_sampled_completion(client):
    def run(seed):
        return (
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.2, seed=seed)
            .choices[0]
            .text
        )

    assert run(3) == run(3)
    assert len({run(s) for s in range(4)}) > 1


def test_presence_and_frequency_penalties_change_greedy_output(server):
    body = {"prompt": "the the the the the the", "max_tokens": 24, **GREEDY}
    plain = _post(server, "completions", body).json()["choices"][0]["text"]
    zero = _post(server, "completions", body | {"presence_penalty": 0, "frequency_penalty": 0.0}).json()
    assert zero["choices"][0]["text"] == plain
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert _post(server, "completions", body | extra).json()["choices"][0]["text"] != plain, extra
    r = _post(server, "completions", body | {"frequency_penalty": 2.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"


def test_penalty_formula_is_openais():
    from precast.runtime.llm.sampler import filtered_probs, sample

    logits = np.array([3.0, 2.9, 0.0, -1.0])
    p = _params(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25)
    history = [0, 1, 0, 0]  # prompt [0], generated [1, 0, 0]: counts {0: 2, 1: 1}
    want = logits - np.array([2 * 0.5 + 0.25, 0.5 + 0.25, 0, 0])
    want = np.exp(want - want.max())
    np.testing.assert_allclose(filtered_probs(logits, p, history, num_prompt=1), want / want.sum())
    greedy = _params(frequency_penalty=2.0)
    assert sample(logits, greedy, [0, 0], None, num_prompt=1) == 1  # only the generated 0 counts
    assert sample(logits, greedy, [0, 0], None, num_prompt=2) == 0  # nothing generated: no penalty


# -- refused parameters and limits ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("chat/completions", {"function_call": "auto"}, "function_call"),
        ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("chat/completions", {"temperature": 3}, "temperature"),
        ("chat/completions", {"min_p": 2}, "min_p"),
        ("chat/completions", {"not_a_parameter": 1}, "not_a_parameter"),
        ("chat/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("chat/completions", {"n": 9}, "n"),
        ("chat/completions", {"logprobs": 3}, "logprobs"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_unsupported_or_bad_parameters_are_400_naming_them(server, route, extra, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    r = _post(server, route, base | {"max_tokens": 2} | extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_defaults_of_refused_parameters_are_accepted(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "user": "someone",
        "n": 1,
    }
    assert _post(server, "chat/completions", body).status_code == 200
    body = {"prompt": "hi", "max_tokens": 2, "echo": False, "suffix": None, "best_of": 1}
    assert _post(server, "completions", body).status_code == 200


def test_max_tokens_beyond_the_context_is_400_naming_it(server):
    context = server[1].host.current.llm.max_context
    r = _post(server, "completions", {"prompt": "hello", "max_tokens": context})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens", r.text
    assert (
        f"max_tokens ({context}) + prompt tokens (" in err["message"]
        and f"context ({context})" in err["message"]
    )
    r = _post(
        server,
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": context},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    # the default max_tokens is capped to what fits, and usage says what ran
    long = "word " * (context - 8)
    r = _post(server, "completions", {"prompt": long, **GREEDY})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= context


# -- serve controls ---------------------------------------------------------------------------------------
def test_api_key_and_scheduler_options_reach_the_engine(llm_artifact):
    from precast.artifact.manifest import read_manifest
    from precast.runtime.llm.runners.gather import LLMSpec
    from precast.runtime.server.kv_memory import block_bytes

    per_block = block_bytes(LLMSpec.from_manifest(read_manifest(llm_artifact)))
    memory = 20 * per_block + per_block // 2
    llm = {"kv_cache_memory": memory, "max_num_seqs": 3, "max_num_batched_tokens": 96}
    with live_server(ServerConfig(llm_artifact, model_name="tiny", api_key="s3cret", llm=llm)) as (
        url,
        state,
    ):
        engine = state.host.current.llm.engine
        assert engine.pool.num_blocks == 20 and engine.runner.kv_bytes <= memory
        assert (engine.scheduler.config.max_num_seqs, engine.scheduler.config.max_num_batched_tokens) == (
            3,
            96,
        )
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(f"{url}/v1/models").status_code == 401
        r = httpx.post(f"{url}/v2/models/tiny/infer", json={"inputs": []})
        assert r.status_code == 401 and "API key" in r.json()["error"]
        for path in ("/health", "/ready", "/metrics", "/v2/health/ready"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.get(f"{url}/admin/status").status_code == 200  # admin: its own rules (loopback here)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        # 4 choices with room for 3 running: the scheduler queues the fourth
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=4, extra_body=GREEDY)
        assert len(r.choices) == 4 and len({c.text for c in r.choices}) == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def _serve(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from precast.cli.main import main; main()", "serve", *args, "--port", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--kv-cache-memory", "lots"], "not a memory size: 'lots'"),
        (["--kv-cache-memory", "2"], "not a memory size: '2'"),
        (["--kv-cache-memory", "-1GiB"], "not a memory size"),
        (["--kv-cache-memory", "1MiB", "--num-blocks", "8"], "give one of them"),
        (["--kv-cache-memory", "10B"], "holds no KV block"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_bad_serve_options_are_one_line_and_exit_1(llm_artifact, args, needle):
    r = _serve(str(llm_artifact), *args)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr[-2000:]


def test_llm_options_on_a_non_llm_artifact_are_refused(mlp_a):
    r = _serve(str(mlp_a), "--max-num-seqs", "4")
    assert r.returncode == 1 and "not an LLM artifact" in r.stderr and len(r.stderr.strip().splitlines()) == 1
