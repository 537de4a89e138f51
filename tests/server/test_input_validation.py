"""Bad OpenAI-style requests get a 400 with a JSON body naming the field, never a 500 (fake engine, no torch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from precast.runtime.server import ServerConfig
from tests.fake_llm import InProcessText, fake_engine

fastapi_testclient = pytest.importorskip("fastapi.testclient")


class _Host:
    """What ServerState needs from a ModelHost: the served LLM, ready() and close()."""

    def __init__(self, llm):
        self.current = SimpleNamespace(model=None, llm=llm, encoder=None, version=1)
        self.last_reload = {}

    def ready(self):
        return self.current.llm.healthy()

    def close(self, drain=0.0):
        self.current.llm.close(drain)


@pytest.fixture
def llm_client(tmp_path):
    from precast.runtime.server.app import ServerState, create_app
    from precast.runtime.server.llm_service import LLMService

    config = ServerConfig(tmp_path, model_name="tiny")
    engine = fake_engine(max_context=128)
    state = ServerState(
        config,
        host=_Host(
            LLMService(
                engine, tmp_path, SimpleNamespace(llm=None, files={}), text=InProcessText(engine.tokenizer)
            )
        ),
    )
    with fastapi_testclient.TestClient(create_app(config, state), raise_server_exceptions=False) as c:
        yield c


def _bad(r, culprit: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert culprit in err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("stream", [False, True])
def test_negative_seed(llm_client, stream):
    body = {"prompt": "def", "seed": -1, "max_tokens": 4, "stream": stream}
    _bad(llm_client.post("/v1/completions", json=body), "seed")
    body["seed"] = 7
    assert llm_client.post("/v1/completions", json=body).status_code == 200


def test_empty_stop_string(llm_client):
    for stop in ("", ["x", ""]):
        _bad(llm_client.post("/v1/completions", json={"prompt": "def", "stop": stop}), "stop")
    r = llm_client.post("/v1/completions", json={"prompt": "def", "stop": [], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_unknown_chat_role(llm_client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "bogus", "content": "hi"}]
    r = llm_client.post("/v1/chat/completions", json={"messages": msgs})
    _bad(r, "messages[1].role")
    assert "'bogus'" in r.json()["error"]["message"]
    msgs[1]["role"] = "assistant"
    r = llm_client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_max_tokens_beyond_the_context_is_400_as_openai_does(llm_client):
    # (the generate CLI caps instead, and says so; the API follows OpenAI)
    r = llm_client.post("/v1/completions", json={"prompt": "def", "max_tokens": 100000, "ignore_eos": True})
    _bad(r, "max_tokens (100000) + prompt tokens (3) exceed the model's context (128)")
    assert r.json()["error"]["param"] == "max_tokens"
    r = llm_client.post("/v1/completions", json={"prompt": "def", "max_tokens": 125, "ignore_eos": True})
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 125, "total_tokens": 128}


def test_embeddings_dimensions_must_be_the_model_size(tiny_encoder):
    from precast.runtime.server.app import create_app

    config = ServerConfig(tiny_encoder, model_name="enc", max_queue_delay_ms=0)
    with fastapi_testclient.TestClient(create_app(config), raise_server_exceptions=False) as c:
        for dims in (5, 0, "6", True):
            _bad(c.post("/v1/embeddings", json={"input": "fox", "dimensions": dims}), "'dimensions'")
        r = c.post("/v1/embeddings", json={"input": "fox", "dimensions": 6})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 6, r.text


def test_llm_options_on_a_non_llm_artifact_are_refused(mlp_a):
    from precast.errors import UsageError
    from precast.runtime.server.host import ModelHost

    with pytest.raises(UsageError, match="num_blocks.*not an LLM artifact"):
        ModelHost(mlp_a, llm_options={"num_blocks": 5})
    assert ModelHost(mlp_a).current.llm is None


def test_a_field_of_the_wrong_type_is_a_400_naming_it(llm_client, tiny_encoder):
    """protocol.py's request models: the message and OpenAI's error.param name the field."""
    from fastapi.testclient import TestClient

    from precast.runtime.server.app import create_app

    r = llm_client.post("/v1/completions", json={"prompt": "def", "model": 5})
    _bad(r, "'model'")
    assert r.json()["error"]["param"] == "model"
    _bad(llm_client.post("/v1/chat/completions", json=["hi"]), "must be a JSON object")
    with TestClient(create_app(ServerConfig(tiny_encoder, max_queue_delay_ms=0))) as c:
        for field, value in (("dimensions", "6"), ("encoding_format", "int8"), ("user", 3)):
            r = c.post("/v1/embeddings", json={"input": "fox", field: value})
            _bad(r, f"'{field}'")
            assert r.json()["error"]["param"] == field, r.json()
        r = c.post("/v2/models/nosuch/infer", json={"inputs": []})  # KServe's shape outside /v1/
        assert r.status_code == 404 and r.json() == {
            "error": f"unknown model 'nosuch'; this server serves '{tiny_encoder.name}'"
        }
