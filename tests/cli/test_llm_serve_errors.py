"""User mistakes on the LLM and serve commands: one line naming the culprit, exit 1, never a traceback."""

from __future__ import annotations

import socket

import pytest

from precast.errors import LLMRequestError
from precast.runtime.llm import Engine, SamplingParams
from tests.fake_llm import fake_engine


def _usage_error(r, *needles) -> str:
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == 1, (r.code, r.err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.err, r.err
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def test_negative_seed_is_a_sampling_error_everywhere(cli, tmp_path):
    with pytest.raises(LLMRequestError, match="seed must be a non-negative integer, got -1"):
        SamplingParams(seed=-1).validate()
    with pytest.raises(LLMRequestError, match="seed"):
        fake_engine().submit([1, 2], SamplingParams(seed=-1, temperature=1.0))
    SamplingParams(seed=0).validate()
    _usage_error(cli("generate", tmp_path, "def", "--seed", "-1", "--temperature", "1"), "seed", "-1")


@pytest.mark.parametrize("threads", ["0", "-3", "100000"])
def test_threads_out_of_range(cli, tmp_path, threads):
    for cmd in (
        ["generate", tmp_path, "def"],
        ["eval", tmp_path, "--perplexity", tmp_path],
        ["serve", tmp_path],
    ):
        _usage_error(cli(*cmd, "--threads", threads), "--threads", "1<=x<=256")


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_serve_port_out_of_range(cli, tmp_path, port):
    _usage_error(cli("serve", tmp_path, "--port", port), "--port", "0<=x<=65535")


@pytest.mark.parametrize(
    "option, value, why",
    [
        ("--timeout", "nan", "not a finite number"),
        ("--timeout", "inf", "not a finite number"),
        ("--drain-timeout", "nan", "not a finite number"),
        ("--max-queue-delay-ms", "nan", "not a finite number"),
        ("--model-name", "", "must not be empty"),
        ("--model-name", "  ", "must not be empty"),
    ],
)
def test_serve_refuses_nan_times_and_an_empty_name(cli, tmp_path, option, value, why):
    # nan passed FloatRange (every comparison with nan is false): a request timeout of nan, and a model
    # served under the name '', were accepted
    _usage_error(cli("serve", tmp_path, option, value), option, why)


def test_serve_port_in_use_is_one_line_before_loading(cli, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # tmp_path is no artifact: the port is checked before anything loads
        _usage_error(cli("serve", tmp_path, "--port", port), f"port {port} is already in use")


def test_eval_rejects_a_binary_file(cli, tmp_path):
    blob = tmp_path / "model.onnx"
    blob.write_bytes(b"\x08\x07\x12\x07pytorch\x80\xff\xfe" * 10)
    _usage_error(cli("eval", tmp_path / "art", "--perplexity", blob), str(blob), "not UTF-8")


def test_generate_notes_max_tokens_capped_at_the_context(cli, monkeypatch, tmp_path):
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: fake_engine(max_context=32)))
    r = cli("generate", tmp_path, "def", "--max-tokens", "100000")
    assert r.code == 0, r.err
    note = [ln for ln in r.err.splitlines() if ln.startswith("note:")]
    assert note == [
        "note: --max-tokens 100000 capped at 29: the context length is 32 tokens and the prompt has 3"
    ], r.err
    assert "29 tokens, finish: length" in r.err
    r = cli("generate", tmp_path, "def", "--max-tokens", "5")
    assert r.code == 0 and "note:" not in r.err, r.err
