"""Whisper (a tiny N(0, 0.1) folder with whisper-tiny's vocab, special tokens and generation config) compiles with
no --task; the artifact's numpy log-mel + encoder + paged decoder give transformers' tokens on 5 s and 45 s of
audio (sequential 30 s windows), with language detection, greedy and 4 beams."""

from __future__ import annotations

import json
import subprocess
import sys
import wave

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from precast.compiler.driver import CompileOptions, compile_model  # noqa: E402
from precast.runtime.seq2seq.engine import Seq2SeqEngine  # noqa: E402
from tests.seq2seq_models import make_folder  # noqa: E402

SR = 16000


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    root = tmp_path_factory.mktemp("whisper")
    folder = make_folder("whisper", root / "model", seed=3)
    compile_model(str(folder), str(root / "out"), CompileOptions())
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(
        str(folder), attn_implementation="eager"
    )
    fe = transformers.WhisperFeatureExtractor.from_pretrained(str(folder))
    transformers.utils.logging.set_verbosity_error()
    return root / "out", hf.eval(), fe


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    return (0.2 * np.sin(2 * np.pi * (200 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(
        np.float32
    )


def _hf_tokens(hf, fe, samples, **kw) -> list[int]:
    feats = fe(samples, sampling_rate=SR, return_tensors="pt").input_features
    with torch.no_grad():
        return hf.generate(feats, **kw)[0].tolist()


def test_compiles_as_speech_recognition(whisper):
    out, _hf, _fe = whisper
    spec = json.loads((out / "seq2seq.json").read_text())
    assert spec["task"] == "automatic-speech-recognition" and spec["input"] == "speech"
    assert spec["vocab"] == 51865 and spec["max_source"] == 3000
    assert spec["parity"]["generate"]["identical"]
    assert "tokenizer/preprocessor_config.json" in spec["files"]


def test_five_seconds_greedy_with_language_detection(whisper):
    out, hf, fe = whisper
    engine = Seq2SeqEngine.load(out)
    try:
        samples = _audio(5, 1)
        got = engine.transcribe(samples, max_new_tokens=32)
        ref = _hf_tokens(hf, fe, samples, max_new_tokens=32)  # HF detects the language too
        prompt = got.sequences[0][: got.prompt_len]
        assert prompt[0] == 50258 and prompt[2:] == [50359, 50363]
        assert got.tokens == [t for t in ref if t not in prompt][: len(got.tokens)]
        assert len(got.tokens) == len([t for t in ref if t not in prompt])
        assert got.language is not None
        en = engine.transcribe(samples, max_new_tokens=32, language="en", task="translate")
        ref_en = _hf_tokens(hf, fe, samples, max_new_tokens=32, language="en", task="translate")
        assert en.sequences[0][1:3] == [50259, 50358] and en.tokens == ref_en[-len(en.tokens) :]
    finally:
        engine.close()


def test_forty_five_seconds_in_sequential_windows(whisper):
    out, hf, fe = whisper
    engine = Seq2SeqEngine.load(out)
    try:
        samples = _audio(45, 2)
        got = engine.transcribe(samples, max_new_tokens=24, language="en")
        want = []
        for start in (0, 30 * SR):  # 30 s, then the last 15 s
            want += _hf_tokens(hf, fe, samples[start : start + 30 * SR], max_new_tokens=24, language="en")[
                -24:
            ]
        assert got.tokens == want
    finally:
        engine.close()


def test_beam_search_matches_generate(whisper):
    out, hf, fe = whisper
    engine = Seq2SeqEngine.load(out)
    try:
        samples = _audio(4, 4)
        got = engine.transcribe(samples, max_new_tokens=16, language="en", num_beams=4)
        ref = _hf_tokens(hf, fe, samples, max_new_tokens=16, language="en", num_beams=4)
        assert got.tokens == ref[-len(got.tokens) :] and len(got.tokens) == 16
    finally:
        engine.close()


def test_cli_transcribes_a_wav(whisper, tmp_path):
    out, _hf, _fe = whisper
    path = tmp_path / "a.wav"
    pcm = (_audio(3, 5) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(pcm.tobytes())
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from precast.cli.main import main; main()",
            "run",
            str(out),
            "--audio",
            str(path),
            "--language",
            "en",
            "--max-new-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    [row] = json.loads(run.stdout)
    assert row["language"] == "en" and len(row["tokens"]) == 6
    (tmp_path / "bad.wav").write_bytes(b"not audio at all")
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            "from precast.cli.main import main; main()",
            "run",
            str(out),
            "--audio",
            str(tmp_path / "bad.wav"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "bad.wav" in bad.stderr and "Traceback" not in bad.stderr
