"""`precast serve` on encoder-decoder (seq2seq) artifacts: Whisper's /v1/audio/* and T5's /v1/completions, driven
by the official `openai` client against a real uvicorn server, compared with the answers of an engine of their own
(the offline path).

The tiny random-weight models generate ids past their small test tokenizer's vocabulary, so their texts are
mostly empty: the token counts (usage, the generated-tokens metric) and Whisper's detected language are what
show the server decoded exactly what the engine does.
"""

from __future__ import annotations

import io
import wave
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server, metric_value

openai = pytest.importorskip("openai")
pytest.importorskip("python_multipart")
pytestmark = pytest.mark.slow  # exports two models with torch

RATE = 16000
MAX_AUDIO = 150_000  # bytes: the 3 s WAV below (96 044 bytes) fits, a 6 s one does not


def _compile(kind: str, tmp_path_factory):
    from precast.compiler.driver import CompileOptions, compile_model
    from tests.seq2seq_models import make_folder

    root = tmp_path_factory.mktemp(kind)
    folder = make_folder(kind, root / "src")
    compile_model(str(folder), str(root / kind), CompileOptions())
    return root / kind


def _wav(seconds: float, freq: float = 440.0) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    art = _compile("whisper", tmp_path_factory)
    cfg = ServerConfig(art, model_name="whisper", request_timeout=60, max_audio_bytes=MAX_AUDIO)
    with live_server(cfg) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    art = _compile("t5", tmp_path_factory)
    with live_server(ServerConfig(art, model_name="t5", request_timeout=60)) as (url, state):
        yield url, state


def _reference(state):
    """The artifact in an engine of its own (the offline path: no serving thread), closed with the module."""
    from precast.runtime.seq2seq.engine import Seq2SeqEngine

    engine = Seq2SeqEngine.load(state.host.current.path)
    _ENGINES.append(engine)
    return engine


_ENGINES: list = []


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    """A 3 s 440 Hz WAV on disk, and its samples as the server decodes them."""
    from precast.runtime.processing.whisper import read_audio

    path = tmp_path_factory.mktemp("wav") / "a.wav"
    path.write_bytes(_wav(3.0))
    return path, read_audio(path.read_bytes(), "a.wav", RATE)


def _generated(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, "precast_llm_request_generation_tokens_sum")


def test_openai_client_transcribes_as_the_engine_does(whisper, audio):
    url, state = whisper
    path, samples = audio
    want = _reference(state).transcribe(samples)
    before = _generated(url)
    with path.open("rb") as f:
        got = _client(url).audio.transcriptions.create(model="whisper", file=f)
    assert got.text == want.text
    assert _generated(url) - before == len(want.tokens) > 0  # the same decoding, token for token in count

    with path.open("rb") as f:
        text = _client(url).audio.transcriptions.create(model="whisper", file=f, response_format="text")
    assert text == want.text
    with path.open("rb") as f:
        verbose = _client(url).audio.transcriptions.create(
            model="whisper", file=f, response_format="verbose_json", temperature=0, language=want.language
        )
    assert verbose.text == want.text and verbose.language == want.language
    assert verbose.duration == pytest.approx(3.0) and verbose.segments == []
    assert verbose.to_dict()["task"] == "transcribe"


def test_translations_use_the_translate_task(whisper, audio):
    url, state = whisper
    path, samples = audio
    want = _reference(state).transcribe(samples, task="translate")
    with path.open("rb") as f:
        got = _client(url).audio.translations.create(model="whisper", file=f, response_format="verbose_json")
    assert got.text == want.text and got.language == want.language
    assert got.to_dict()["task"] == "translate"


def test_bad_files_are_400s_naming_the_file_and_the_server_keeps_serving(whisper, audio):
    url, _ = whisper
    path, _ = audio
    endpoint = f"{url}/v1/audio/transcriptions"
    cases = {
        "pic.png": b"\x89PNG\r\n\x1a\n" + bytes(200),
        "notes.txt": b"just some text, not audio\n",
        "empty.wav": b"",
        "long.wav": _wav(6.0),  # over --max-audio-bytes
        "cut.wav": path.read_bytes()[:30],
    }
    for name, data in cases.items():
        r = httpx.post(endpoint, files={"file": (name, data)}, data={"model": "whisper"}, timeout=30)
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert name in err["message"] and err["param"] == "file" and err["type"] == "invalid_request_error"
    # no file, a prompt, an unsupported format: 400 naming the field
    for data, param in (({"model": "whisper"}, "file"), ({"prompt": "hi"}, "prompt"), ({"response_format": "srt"}, "response_format")):  # fmt: skip
        files = None if param == "file" else {"file": ("a.wav", path.read_bytes())}
        r = httpx.post(endpoint, data=data, files=files, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # a body past the route's limit (the file and 1 MiB of form) is a 413 before it is read
    r = httpx.post(endpoint, files={"file": ("huge.wav", bytes(MAX_AUDIO + (1 << 20)))}, timeout=30)
    assert r.status_code == 413 and "--max-audio-bytes" in r.json()["error"]["message"]
    with path.open("rb") as f:  # still serving
        assert _client(url).audio.transcriptions.create(model="whisper", file=f).text is not None
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_t5_completions_match_the_engine(t5):
    url, state = t5
    engine = _reference(state)
    source = "translate English to German: the house is wonderful"
    want = engine.generate([source], max_new_tokens=8)[0]
    client = _client(url)
    r = client.completions.create(model="t5", prompt=source, max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.tokens) > 0
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(source))
    assert r.choices[0].finish_reason == (
        "stop" if want.tokens[-1] in engine.settings.eos_token_id else "length"
    )
    # two prompts: two choices, decoded together; a beam search through the num_beams extension
    beams = engine.generate([source, "summarize: hello world"], max_new_tokens=6, num_beams=2)
    r = client.completions.create(
        model="t5", prompt=[source, "summarize: hello world"], max_tokens=6, extra_body={"num_beams": 2}
    )
    assert [c.text for c in r.choices] == [b.text for b in beams]
    assert r.usage.completion_tokens == sum(len(b.tokens) for b in beams)
    assert [m.id for m in client.models.list().data] == ["t5"]
    # concurrent requests (each waits in the server's threads, off the event loop): each gets its own answer
    with ThreadPoolExecutor(4) as pool:
        got = list(
            pool.map(lambda _: client.completions.create(model="t5", prompt=source, max_tokens=8), range(4))
        )
    assert all(g.choices[0].text == want.text and g.usage.completion_tokens == len(want.tokens) for g in got)


def test_t5_streams_server_sent_events(t5):
    url, state = t5
    engine = _reference(state)
    source = "translate English to German: the house is wonderful"
    want = engine.generate([source], max_new_tokens=8)[0]
    chunks = list(_client(url).completions.create(model="t5", prompt=source, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == (
        "stop" if want.tokens[-1] in engine.settings.eos_token_id else "length"
    )
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=60,
        json={"model": "t5", "prompt": source, "max_tokens": 4, "stream": True},
    ) as r:
        lines = [x for x in r.iter_lines() if x]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_t5_refuses_what_it_does_not_do(t5):
    url, _ = t5
    for body, param in (
        ({"stream": "yes"}, "stream"),
        ({"stream": True, "prompt": ["a", "b"]}, "stream"),
        ({"n": 2}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "[a-z]+"}, "guided_regex"),
        ({"min_p": 0.1}, "min_p"),
        ({"no_such_option": 1}, "no_such_option"),
    ):
        r = httpx.post(f"{url}/v1/completions", json={"model": "t5", "prompt": "hello", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "t5", "messages": []}, timeout=30)
    assert r.status_code == 404
    r = httpx.post(f"{url}/v2/models/t5/infer", json={"inputs": []}, timeout=30)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]


def test_metrics(whisper, t5):
    for url, endpoint in ((whisper[0], "/v1/audio/transcriptions"), (t5[0], "/v1/completions")):
        text = httpx.get(f"{url}/metrics").text
        assert metric_value(text, "precast_requests_total", endpoint=endpoint, status="200") >= 1
        assert metric_value(text, "precast_request_latency_seconds_count", endpoint=endpoint) >= 1
        assert metric_value(text, "precast_llm_request_generation_tokens_count") >= 1
        for gauge in ("precast_seq2seq_cross_attention_bytes", "precast_llm_kv_blocks_used", "precast_llm_kv_blocks_free"):  # fmt: skip
            assert f"\n{gauge} " in text, gauge
    assert metric_value(text, "precast_llm_kv_blocks_free") > 0
