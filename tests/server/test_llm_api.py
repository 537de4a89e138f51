"""OpenAI-compatible LLM endpoints over a real compiled tiny Llama, driven by the official `openai` client."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server, metric_value

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "def wrap(text, width=70):"


@pytest.fixture(scope="module")
def server(llm_artifact):
    with live_server(
        ServerConfig(llm_artifact, model_name="tiny", request_timeout=60, llm={"num_blocks": 32})
    ) as s:
        yield s


@pytest.fixture
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_match_the_engine(server, client, llm_artifact):
    from precast.runtime.llm import Engine, SamplingParams

    want = Engine.load(llm_artifact, num_blocks=16).generate(
        PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)
    )[0]
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(want.prompt_ids)
    # streamed: the same text, piece by piece, then finish_reason on the last chunk
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) >= 2
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completions_stream_and_not(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_priority_header_and_field(client, server):
    url, _ = server
    r = client.completions.create(model="tiny", prompt="x = [", max_tokens=2, extra_body={"priority": "high"})
    assert r.usage.completion_tokens >= 1
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Priority": "low"}
    )
    assert r.status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "priority": "urgent"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


def test_bad_requests_are_4xx_and_the_server_keeps_serving(client, server):
    url, _ = server
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 400, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-4'"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    for body, culprit in [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": ""}, "'prompt'"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "n": 9}, "'n'"),
    ]:
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 400 and culprit in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    url, state = server
    engine = state.host.current.llm.engine
    cancelled_before = engine.metrics().requests_cancelled
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True, "temperature": 0}
    # The tiny model can write 200 tokens before the client reads its first line (then nothing is left to
    # cancel): the engine loop's steps after the first two wait (outside the engine lock) until the server has
    # cancelled the request, so it is surely mid-stream at the disconnect, however busy the host. (The loop
    # calls _step, not step: patching step slowed nothing, and a busy host let the request finish first.)
    gate, steps, step = threading.Event(), [0], engine._step

    def gated_step(burst):
        if steps[0] >= 2:
            gate.wait(30)
        steps[0] += 1
        return step(burst)

    engine._step = gated_step
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert '"text"' in first
            assert engine.metrics().kv_blocks_used > 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and engine.metrics().requests_cancelled == cancelled_before:
            time.sleep(0.05)
    finally:
        gate.set()
        del engine._step  # back to the class's method
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.metrics().kv_blocks_used or engine.has_unfinished()):
        time.sleep(0.05)
    m = engine.metrics()
    assert m.kv_blocks_used == 0 and m.requests_cancelled == cancelled_before + 1
    text = httpx.get(f"{url}/metrics").text
    assert metric_value(text, "precast_llm_kv_blocks_used") == 0
    assert metric_value(text, "precast_llm_kv_blocks_free") == m.kv_blocks_total
    # the pool grew on demand: the blocks this server's requests touched hold memory, the rest only address space
    resident, reserved = (metric_value(text, f"precast_llm_kv_bytes_{k}") for k in ("resident", "reserved"))
    assert resident == m.kv_bytes_resident > 0 and reserved == m.kv_bytes_reserved
    assert resident < reserved and m.kv_blocks_touched < m.kv_blocks_total
    assert metric_value(text, "precast_llm_time_to_first_token_seconds_count") > 0
    assert metric_value(text, "precast_llm_tokens_total", kind="completion") > 0
