"""Whisper's log-mel features (precast.runtime.processing.whisper) against transformers' WhisperFeatureExtractor,
and read_audio / split_windows / resample on WAV and FLAC files built in memory."""

from __future__ import annotations

import io
import math
import struct
import subprocess
import sys
import wave

import numpy as np
import pytest

import precast.runtime.processing.audio as audio_module
from precast.errors import ArtifactError, InputError
from precast.runtime.processing import WhisperFeatures, read_audio, read_wav, split_windows
from precast.runtime.processing.whisper import mel_filter_bank, resample

# openai/whisper-tiny's preprocessor_config.json as the hub holds it, less its 80 x 201 mel_filters
WHISPER_TINY = {
    "chunk_length": 30,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 80,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "processor_class": "WhisperProcessor",
    "return_attention_mask": False,
    "sampling_rate": 16000,
}
LARGE_V3 = {**WHISPER_TINY, "feature_size": 128}


@pytest.fixture(scope="module")
def hf_whisper():
    """WhisperFeatureExtractor on its numpy path (the one transformers takes without torch)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from transformers.models.whisper import feature_extraction_whisper

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(feature_extraction_whisper, "is_torch_available", lambda: False)
        yield feature_extraction_whisper.WhisperFeatureExtractor


def noise_and_sine(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.05 * noise + 0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


# --- features -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [WHISPER_TINY, LARGE_V3], ids=["80-mels", "128-mels"])
def test_features_match_transformers(hf_whisper, cfg):
    hf = hf_whisper(feature_size=cfg["feature_size"])
    ours = WhisperFeatures.from_config(cfg)
    np.testing.assert_allclose(ours.mel_filters, hf.mel_filters, rtol=0, atol=1e-12)
    waveforms = [noise_and_sine(s, seed=i) for i, s in enumerate([1, 5, 30, 37])]  # 37 s: truncated to 30
    got = ours(waveforms)
    assert got.dtype == np.float32 and got.shape == (4, cfg["feature_size"], 3000)
    for w, row in zip(waveforms, got):
        want = hf(w, sampling_rate=16000, return_tensors="np").input_features[0]
        np.testing.assert_allclose(row, want, rtol=0, atol=1e-4)


def test_padding_value_and_silence_match_transformers(hf_whisper):
    hf = hf_whisper(padding_value=0.25)
    ours = WhisperFeatures.from_config({**WHISPER_TINY, "padding_value": 0.25})
    for w in [noise_and_sine(2.5), np.zeros(1600, np.float64)]:  # float64 input: cast to float32 first, as hf
        want = hf(w, sampling_rate=16000, return_tensors="np").input_features
        np.testing.assert_allclose(ours([w]), want, rtol=0, atol=1e-4)


def test_mel_filter_bank_other_sizes(hf_whisper):
    from transformers.audio_utils import mel_filter_bank as hf_mel

    for bins, mels, rate in [(201, 80, 16000), (257, 40, 16000), (513, 128, 22050)]:
        want = hf_mel(bins, mels, 0.0, 8000.0, rate, norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(mel_filter_bank(bins, mels, rate), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"feature_extractor_type": "Wav2Vec2FeatureExtractor"}, "unknown feature extractor type"),
        ({"dither": 1e-4}, "'dither'"),
        ({"dither": "0"}, "'dither'"),
        ({"dither": True}, "'dither'"),
        ({"feature_size": 0}, "'feature_size'"),
        ({"feature_size": 80.0}, "'feature_size'"),
        ({"sampling_rate": 16000.5}, "'sampling_rate'"),
        ({"hop_length": -1}, "'hop_length'"),
        ({"chunk_length": "30"}, "'chunk_length'"),
        ({"n_fft": 1}, "'n_fft'"),
        ({"chunk_length": 1, "sampling_rate": 1000, "n_fft": 2048}, "'n_fft'"),
        ({"padding_value": float("nan")}, "'padding_value'"),
        ({"padding_side": "left"}, "'padding_side'"),
        ({"n_samples": 160000}, "'n_samples'"),
        ({"nb_max_frames": 1500}, "'nb_max_frames'"),
    ],
)
def test_hostile_whisper_configs_are_artifact_errors(change, needle):
    with pytest.raises(ArtifactError, match=needle) as e:
        WhisperFeatures.from_config({**WHISPER_TINY, **change})
    assert "\n" not in str(e.value)


def test_config_defaults_and_ignored_keys():
    bare = WhisperFeatures.from_config({"feature_extractor_type": "WhisperFeatureExtractor", "dither": 0.0})
    assert (bare.feature_size, bare.sampling_rate, bare.hop_length, bare.n_fft) == (80, 16000, 160, 400)
    assert (bare.n_samples, bare.nb_max_frames, bare.mel_filters.shape) == (480000, 3000, (201, 80))
    # older files store mel_filters transposed (80 x 201); transformers recomputes them, and so does precast
    stored = WhisperFeatures.from_config({**WHISPER_TINY, "mel_filters": [[0.0] * 201] * 80})
    np.testing.assert_array_equal(stored.mel_filters, bare.mel_filters)


@pytest.mark.parametrize(
    "waveforms, needle",
    [
        ([], "non-empty list"),
        (np.zeros((1, 16000), np.float32), "non-empty list"),
        ([[0.0, 0.1]], "waveform 0: expected a numpy array"),
        ([np.zeros((16000, 2), np.float32)], "waveform 0 has 2 channels"),
        ([np.zeros(10, np.int16)], "expected float samples"),
        ([np.zeros(10, np.float32), np.zeros(0, np.float32)], "waveform 1 is empty"),
        ([np.array([0.0, np.nan], np.float32)], "NaN or infinite"),
    ],
)
def test_bad_waveforms_are_input_errors(waveforms, needle):
    with pytest.raises(InputError, match=needle):
        WhisperFeatures.from_config(WHISPER_TINY)(waveforms)


def test_split_windows():
    samples = np.arange(65 * 100, dtype=np.float32)
    windows = split_windows(samples, 100, 30)
    assert [len(w) for w in windows] == [3000, 3000, 500]
    np.testing.assert_array_equal(np.concatenate(windows), samples)
    assert [len(w) for w in split_windows(samples[:6000], 100, 30)] == [3000, 3000]
    assert [len(w) for w in split_windows(samples[:1], 100, 30)] == [1]
    assert [len(w) for w in split_windows(samples[:0], 100, 30)] == [0]
    for args, needle in [
        ((samples.reshape(-1, 5), 100, 30), "1-D"),
        ((samples, 0, 30), "sampling_rate"),
        ((samples, 100, 2.5), "chunk_length"),
    ]:
        with pytest.raises(InputError, match=needle):
            split_windows(*args)


# --- audio files --------------------------------------------------------------------------------------------


def wav_bytes(frames: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(frames.dtype.itemsize)
        w.setframerate(rate)
        w.writeframes(frames.tobytes())
    return buffer.getvalue()


def float_wav_bytes(frames: np.ndarray, rate: int) -> bytes:
    """A mono IEEE-float WAV (format 3: the stdlib's wave cannot write one)."""
    data = frames.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def pcm16(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    return np.round(noise_and_sine(seconds, rate, seed) * 32767).astype(np.int16)


def resample_poly_or_skip(x: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    signal = pytest.importorskip("scipy.signal")
    g = math.gcd(from_rate, to_rate)
    return signal.resample_poly(x.astype(np.float64), to_rate // g, from_rate // g)


def test_read_audio_wav_16k_mono_round_trips():
    ints = pcm16(1.5, 16000)
    samples = read_audio(wav_bytes(ints), "a.wav", 16000)
    assert samples.dtype == np.float32 and samples.shape == (24000,)
    np.testing.assert_array_equal(samples, ints / 32768)
    assert read_audio(bytearray(wav_bytes(ints)), "a.wav", 16000).shape == (24000,)


def test_read_audio_wav_8k_stereo_is_averaged_and_resampled():
    left, right = pcm16(2, 8000, seed=1), pcm16(2, 8000, seed=2)
    samples = read_audio(wav_bytes(np.stack([left, right], axis=1), 8000, channels=2), "b.wav", 16000)
    assert samples.dtype == np.float32 and samples.shape == (32000,)
    mono = (left / 32768 + right / 32768) / 2
    np.testing.assert_allclose(samples[::2], mono, atol=0.05)  # up by 2: every other sample near the original
    np.testing.assert_allclose(samples, resample_poly_or_skip(mono, 8000, 16000), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rate", [44100, 48000, 22050, 11025])
def test_resample_matches_scipy_resample_poly(rate):
    x = noise_and_sine(0.75, rate)
    got = read_audio(float_wav_bytes(x, rate), "c.wav", 16000)
    want = resample_poly_or_skip(x, rate, 16000)
    assert got.shape == want.shape == (math.ceil(len(x) * 16000 / rate),)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_resample_keeps_a_tone():
    x = noise_and_sine(1, 44100)
    y = resample(x, 44100, 16000)
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(int(spectrum.argmax()) - 440) <= 1  # 1 s at 16 kHz: 1 Hz per bin
    np.testing.assert_array_equal(resample(x, 16000, 16000), x)


def test_read_audio_flac():
    soundfile = pytest.importorskip("soundfile")
    ints = pcm16(1, 16000)
    buffer = io.BytesIO()
    soundfile.write(buffer, ints, 16000, format="FLAC", subtype="PCM_16")
    np.testing.assert_array_equal(read_audio(buffer.getvalue(), "d.flac", 16000), ints / 32768)

    stereo = np.stack([pcm16(1, 48000, seed=3), pcm16(1, 48000, seed=4)], axis=1)
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo, 48000, format="FLAC", subtype="PCM_16")
    samples = read_audio(buffer.getvalue(), "e.flac", 16000)
    mono = stereo.astype(np.float64).mean(axis=1) / 32768
    assert samples.shape == (16000,)
    np.testing.assert_allclose(samples, resample_poly_or_skip(mono, 48000, 16000), rtol=0, atol=1e-5)

    with pytest.raises(InputError, match=r"f\.flac: (truncated|not a readable) FLAC file"):
        read_audio(buffer.getvalue()[: len(buffer.getvalue()) // 2], "f.flac", 16000)
    with pytest.raises(InputError, match=r"g\.flac: not a readable FLAC file"):
        read_audio(b"fLaC" + bytes(100), "g.flac", 16000)


def test_flac_without_soundfile_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile -> ImportError
    with pytest.raises(InputError, match=r"h\.flac: FLAC needs .*pip install soundfile"):
        read_audio(b"fLaC" + bytes(100), "h.flac", 16000)


def test_streamed_wav_size_is_not_truncation():
    ints = pcm16(0.5, 16000)
    blob = bytearray(wav_bytes(ints))
    at = blob.index(b"data") + 4
    blob[at : at + 4] = b"\xff\xff\xff\xff"  # a writer that could not seek back to fill the size in
    np.testing.assert_array_equal(read_audio(bytes(blob), "s.wav", 16000), ints / 32768)


def test_bad_audio_files_are_input_errors(monkeypatch, tmp_path):
    good = wav_bytes(pcm16(0.5, 16000))
    cases = [
        (b"", "empty file"),
        (b"ID3\x04" + bytes(200), "unknown audio format"),
        (b"OggS" + bytes(200), "unknown audio format"),
        (good[:30], "not a readable WAV file"),
        (good[:-100], "truncated WAV file"),
        (float_wav_bytes(np.zeros(100), 16000)[:-10], "truncated WAV file"),
        (wav_bytes(np.zeros(0, np.int16)), "holds no audio samples"),
        (float_wav_bytes(np.array([0.0, np.inf]), 16000), "NaN or infinite"),
    ]
    for blob, needle in cases:
        with pytest.raises(InputError) as e:
            read_audio(blob, "clip.wav", 16000)
        assert needle in str(e.value) and "clip.wav" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError, match="expected the file's bytes"):
        read_audio("clip.wav", "clip.wav", 16000)
    with pytest.raises(InputError, match="target_rate"):
        read_audio(good, "clip.wav", 16000.0)
    (tmp_path / "cut.wav").write_bytes(good[:-100])  # read_wav shares the reader
    with pytest.raises(InputError, match="cut.wav: truncated WAV file"):
        read_wav(tmp_path / "cut.wav")
    monkeypatch.setattr(audio_module, "MAX_WAV_BYTES", 1024)
    with pytest.raises(InputError, match=r"clip\.wav: .* bytes are refused"):
        read_audio(good, "clip.wav", 16000)


def test_a_long_file_becomes_windows_of_features():
    samples = read_audio(wav_bytes(pcm16(40, 8000), 8000), "long.wav", 16000)
    extractor = WhisperFeatures.from_config(WHISPER_TINY)
    windows = split_windows(samples, extractor.sampling_rate, extractor.chunk_length)
    assert [len(w) for w in windows] == [480000, 160000]
    assert extractor(windows).shape == (2, 80, 3000)


def test_the_module_imports_no_heavy_packages():
    code = (
        "import sys, precast.runtime.processing.whisper\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'scipy', 'soundfile'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
