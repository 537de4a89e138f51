"""Per-request bounds that protect the other requests: what one request may ask for is capped (400 naming
the limit), and what it costs to check (parsing, a chat template, tokenizing) runs off the event loop and
outside the engine lock, so a neighbour's latency stays its own.

Latency bounds are relative to the neighbour's own baseline and generous (a noisy 2-core host): see
_bound for what was measured before and after.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server

NEIGHBOUR = {"prompt": "x = [", "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def _message(r) -> str:
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bound(baseline: float) -> float:
    """The slowest a neighbour may get during an attack. Measured before these bounds (2 cores):
    baseline 0.02-0.05 s, under attack 1.5-3.7 s; after: at most 2x its baseline."""
    return 5 * baseline + 0.25


def _neighbour_latencies(send, attack, max_requests: int = 100) -> tuple[list[float], object]:
    """Run ``attack`` in a thread and ``send`` in a loop (at most ``max_requests``) until it is done."""
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", attack()), daemon=True)
    t.start()
    latencies = []
    while t.is_alive() and len(latencies) < max_requests:
        latencies.append(_timed(send))
    t.join(timeout=60)
    assert not t.is_alive(), "the attack request never finished"
    return latencies, result.get("r")


# -- embeddings ---------------------------------------------------------------------------------------
def test_embedding_requests_are_capped(tiny_encoder):
    from fastapi.testclient import TestClient

    from precast.runtime.server.app import create_app

    app = create_app(ServerConfig(tiny_encoder, model_name="enc", max_queue_delay_ms=0))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/embeddings", json={"input": ["fox"] * 129})
        assert r.status_code == 400 and "129 texts" in _message(r) and "at most 128" in _message(r), r.text
        assert "--max-embedding-inputs" in _message(r)
        # 20 texts of 600 words: each truncated to the model's 512 tokens, 20 x 512 > 8192
        r = c.post("/v1/embeddings", json={"input": ["the quick brown fox " * 150] * 20})
        assert r.status_code == 400 and "10240 tokens" in _message(r) and "8192" in _message(r), r.text
        assert "--max-embedding-tokens" in _message(r)
        assert c.post("/v1/embeddings", json={"input": ["fox"] * 128}).status_code == 200
        r = c.post("/v1/embeddings", json={"input": ["fox " * 40_000, "dog " * 30_000]})
        assert r.status_code == 400 and "280000 characters" in _message(r) and "262144" in _message(r), r.text
        assert "--max-text-chars" in _message(r)
    small = ServerConfig(tiny_encoder, model_name="enc", max_embedding_inputs=2, max_embedding_tokens=6)
    with TestClient(create_app(small), raise_server_exceptions=False) as c:
        assert "at most 2" in _message(c.post("/v1/embeddings", json={"input": ["fox"] * 3}))
        assert "at most 6" in _message(c.post("/v1/embeddings", json={"input": ["the quick brown fox"] * 2}))
        assert c.post("/v1/embeddings", json={"input": ["the quick brown", "fox"]}).status_code == 200


def test_a_huge_embedding_request_does_not_stall_a_neighbour(tiny_encoder):
    cfg = ServerConfig(tiny_encoder, model_name="enc", max_queue_delay_ms=0)
    huge = {"input": ["the quick brown fox jumps over the lazy dog " * 80] * 2000}  # 7 MB, 1.4M words
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=60) as c:

        def send():
            assert c.post("/v1/embeddings", json={"input": "hello world"}).status_code == 200

        baseline = max(_timed(send) for _ in range(5))
        with httpx.Client(base_url=url, timeout=60) as attacker:
            latencies, rs = _neighbour_latencies(
                send, lambda: [attacker.post("/v1/embeddings", json=huge) for _ in range(3)]
            )
        assert max(latencies) < _bound(baseline), (baseline, sorted(latencies)[-5:])
        assert all(r.status_code == 400 and "2000 texts" in _message(r) for r in rs), rs[0].text


# -- LLM ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_server(llm_artifact):
    # max_text_chars raised so that test_a_long_prompt_... reaches the tokenizer (its default refuses first)
    cfg = ServerConfig(
        llm_artifact, model_name="tiny", request_timeout=60, llm={"num_blocks": 32}, max_text_chars=4 << 20
    )
    with live_server(cfg) as s:
        yield s


@pytest.mark.slow
def test_prompt_text_is_capped(llm_artifact):
    cfg = ServerConfig(llm_artifact, model_name="tiny", llm={"num_blocks": 16}, max_text_chars=1000)
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 1001, "max_tokens": 2})
        assert r.status_code == 400 and "1001 characters" in _message(r) and "at most 1000" in _message(r)
        assert "--max-text-chars" in _message(r)
        msgs = [{"role": "user", "content": "y" * 600}, {"role": "user", "content": "y" * 600}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 400 and "1200 characters" in _message(r), r.text
        assert c.post("/v1/completions", json={"prompt": "x = [", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_stop_strings_are_capped(llm_server):
    url, _ = llm_server
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={**NEIGHBOUR, "stop": [f"s{i}" for i in range(17)]})
        assert r.status_code == 400 and "17 strings" in _message(r) and "at most 16" in _message(r), r.text
        r = c.post("/v1/completions", json={**NEIGHBOUR, "stop": ["x" * 257]})
        assert r.status_code == 400 and "257 characters" in _message(r) and "at most 256" in _message(r), (
            r.text
        )
        r = c.post("/v1/completions", json={**NEIGHBOUR, "stop": [f"s{i}" for i in range(16)]})
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_many_stop_strings_do_not_slow_a_neighbour(llm_server):
    url, _ = llm_server
    attack = {
        "prompt": "def",
        "max_tokens": 200,
        "ignore_eos": True,
        "stop": [f"never{i}" for i in range(100_000)],
    }
    with httpx.Client(base_url=url, timeout=60) as c, httpx.Client(base_url=url, timeout=60) as attacker:

        def send():
            assert c.post("/v1/completions", json=NEIGHBOUR).status_code == 200

        baseline = max(_timed(send) for _ in range(3))

        def attacks():
            return [attacker.post("/v1/completions", json=attack) for _ in range(3)]

        latencies, rs = _neighbour_latencies(send, attacks)
        assert max(latencies) < _bound(baseline), (baseline, sorted(latencies)[-5:])
        assert all(r.status_code == 400 and "at most 16" in _message(r) for r in rs), rs[0].text


@pytest.mark.slow
def test_a_long_prompt_does_not_stall_a_neighbour(llm_server):
    url, _ = llm_server
    # ~2 MB of code: 1.3 s of tokenizing for the tiny BPE (measured), far past the 256-token context.
    prompt = "def wrap(text, width=70): return text.split()\n" * 44_000
    with httpx.Client(base_url=url, timeout=60) as c, httpx.Client(base_url=url, timeout=60) as attacker:

        def send():
            assert c.post("/v1/completions", json=NEIGHBOUR).status_code == 200

        baseline = max(_timed(send) for _ in range(3))
        t0 = time.perf_counter()
        latencies, r = _neighbour_latencies(
            send, lambda: attacker.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        )
        attack_seconds = time.perf_counter() - t0
    assert max(latencies) < _bound(baseline), (baseline, attack_seconds, sorted(latencies)[-5:])
    assert len(latencies) >= 3, f"only {len(latencies)} neighbour requests ran during {attack_seconds:.1f} s"
    assert r.status_code == 400 and "the model's context is 256" in _message(r), r.text


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, culprit",
    [
        ({"stream_options": "yes"}, "'stream_options' must be an object"),
        ({"stream_options": {"include_usage": "yes"}}, "include_usage"),
        ({"stream_options": [1]}, "'stream_options'"),
        ({"stream": "yes"}, "'stream' must be true or false"),
    ],
    ids=["options-str", "include_usage-str", "options-list", "stream-str"],
)
def test_bad_stream_options_are_a_400_before_streaming(llm_server, extra, culprit):
    url, _ = llm_server
    body = {"prompt": "def", "max_tokens": 4, "stream": True, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and culprit in _message(r), (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
