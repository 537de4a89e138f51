"""Bad request values on the LLM paths: one line from precast, nothing from ONNX Runtime's own log.

A prompt's token id beyond the vocabulary is refused before any step runs (engine and server); where ids
reach a session anyway (`precast run` on raw feeds), the session logs nothing and precast's one-line error
is all stderr holds. temperature is refused
outside OpenAI's [0, 2] by SamplingParams.validate, so the engine, the CLI and the server (a 400 naming
``temperature``) agree."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from precast.errors import LLMRequestError
from precast.runtime.llm.sampler import SamplingParams


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "onnxruntime:" not in err and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def engine(llm_artifact):
    from precast.runtime.llm import Engine

    return Engine.load(llm_artifact, num_blocks=32, threads=1)


@pytest.mark.parametrize("bad", [512, 9999, -1])
def test_prompt_ids_beyond_the_vocab_are_refused_before_running(engine, capfd, bad):
    capfd.readouterr()
    with pytest.raises(LLMRequestError, match=rf"^unknown token id {bad} in prompt \(vocab size 512\)$"):
        engine.generate([[1, 2, bad]], SamplingParams(max_tokens=2))
    assert capfd.readouterr().err == ""
    assert engine.counters.requests_submitted == 0  # (refused before it reached the scheduler)


def test_server_refuses_an_out_of_vocab_prompt_with_a_400(llm_artifact, capfd):
    from fastapi.testclient import TestClient

    from precast.runtime.server import ServerConfig
    from precast.runtime.server.app import create_app

    with TestClient(create_app(ServerConfig(llm_artifact, model_name="m"))) as c:
        capfd.readouterr()
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1, 9999], "max_tokens": 2})
        assert r.status_code == 400 and "unknown token id 9999" in r.text and "vocab size 512" in r.text
        r = c.post("/v1/completions", json={"model": "m", "prompt": "def", "temperature": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        assert "onnxruntime" not in capfd.readouterr().err


def test_precast_run_on_a_bad_id_prints_one_line(llm_artifact, tmp_path):
    """Raw feeds reach ORT's Gather: its own error log line stays off stderr (session log level fatal)."""
    from precast.artifact.manifest import read_manifest
    from precast.runtime.llm.runners.gather import LLMSpec

    spec = LLMSpec.from_manifest(read_manifest(llm_artifact), str(llm_artifact))
    feeds = {
        "input_ids": np.array([[1, 9999]], np.int64),
        "positions": np.array([[0, 1]], np.int64),
        "seqlens_k": np.array([1], np.int32),
        "total_sequence_length": np.array(2, np.int32),
        "last_index": np.array([[1]], np.int64),
    }
    for pair in spec.kv_inputs:
        for name in pair:
            feeds[name] = np.zeros((1, spec.kv_heads, spec.max_context, spec.head_size), np.float32)
    np.savez(tmp_path / "bad.npz", **feeds)
    r = subprocess.run(
        [sys.executable, "-m", "precast", "run", str(llm_artifact), "-i", str(tmp_path / "bad.npz")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    line = _one_error_line(r.stderr)
    assert "idx=9999" in line and "Gather" in line


@pytest.mark.parametrize("t", [5.0, 2.0001, -0.5, math.nan, math.inf])
def test_temperature_outside_0_to_2_is_refused(t):
    with pytest.raises(LLMRequestError, match=r"^temperature must be a number in \[0, 2\]"):
        SamplingParams(temperature=t).validate()


@pytest.mark.parametrize("t", [0.0, 0.7, 2.0, 2])
def test_temperature_in_0_to_2_is_accepted(t):
    SamplingParams(temperature=t).validate()


def test_cli_generate_refuses_temperature_5_in_one_line(cli, tmp_path):
    # (checked before the artifact loads: tmp_path holds none)
    r = cli("generate", tmp_path, "def", "--temperature", "5")
    assert r.code == 1
    line = _one_error_line(r.err)
    assert "temperature" in line and "[0, 2]" in line and "5.0" in line
