"""Whisper's log-mel features in numpy, and audio files (WAV, FLAC) to the model's mono waveform.

    waveform (float, mono, the model's rate) -> pad/truncate to chunk_length s with padding_value
      -> |STFT|^2 (centered, reflect-padded, periodic Hann, n_fft, hop_length) -> slaney mel filters
      -> log10(max(., 1e-10)) -> drop the last frame -> max(x, x.max() - 8) -> (x + 4) / 4
      -> input_features float32 [N, feature_size, frames] (3000 frames for 30 s at 16 kHz, hop 160)

Each row equals transformers' WhisperFeatureExtractor's numpy path (``_np_extract_fbank_features``, the one it
takes without torch) for that waveform alone; tests/runtime/test_whisper_features.py compares them. Audio longer
than one chunk is the caller's to split (``split_windows``): the extractor keeps the first chunk, as transformers
does. ``read_audio`` decodes WAV (audio.py's reader) and FLAC (the optional ``soundfile`` package), averages the
channels and resamples with ``resample``: scipy.signal.resample_poly's polyphase windowed-sinc filter in numpy.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from precast.errors import ArtifactError, InputError, first_line
from precast.runtime.processing import audio
from precast.runtime.processing.fields import CONFIG, bad, processor_type, read_float, read_int

__all__ = [
    "WHISPER_TYPES",
    "WhisperFeatures",
    "mel_filter_bank",
    "read_audio",
    "resample",
    "split_windows",
]

WHISPER_TYPES = ("WhisperFeatureExtractor",)
_MAX_FRAMES = 2**20  # bounds the [frames, n_fft] STFT a config may ask for (30 s at hop 160: 3000)
_BLOCK = 8192  # STFT frames computed at a time: bounds the float64 temporaries, not the result


@dataclass(frozen=True)
class WhisperFeatures:
    """WhisperFeatureExtractor: waveforms at ``sampling_rate`` -> log-mel input_features, one chunk each."""

    feature_size: int
    sampling_rate: int
    hop_length: int
    chunk_length: int
    n_fft: int
    padding_value: float
    mel_filters: np.ndarray = field(repr=False, compare=False)  # float64 [1 + n_fft // 2, feature_size]

    @property
    def n_samples(self) -> int:
        """Samples in one chunk: each waveform is padded or truncated to this many."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """Frames per row of the output (n_samples // hop_length for an even n_fft)."""
        return (self.n_samples + 2 * (self.n_fft // 2) - self.n_fft) // self.hop_length

    @classmethod
    def from_config(cls, cfg: dict) -> WhisperFeatures:
        name = processor_type(cfg)
        if name not in WHISPER_TYPES:
            raise ArtifactError(
                f"{CONFIG}: unknown feature extractor type '{name}'; precast reproduces {', '.join(WHISPER_TYPES)}"
            )
        feature_size = read_int(cfg, "feature_size", 80, 1, 512)
        sampling_rate = read_int(cfg, "sampling_rate", 16000, 1000, 192000)
        n_fft = read_int(cfg, "n_fft", 400, 2, 16384)
        hop_length = read_int(cfg, "hop_length", 160, 1, 16384)
        chunk_length = read_int(cfg, "chunk_length", 30, 1, 600)
        padding_value = read_float(cfg, "padding_value", 0.0, -1e6, 1e6)
        dither = cfg.get("dither")
        if dither is not None and (type(dither) not in (int, float) or dither != 0):
            raise bad("dither", dither, "0.0 (precast does not dither: dithered features are random)")
        side = cfg.get("padding_side", "right")
        if side != "right":
            raise bad("padding_side", side, '"right"')
        n_samples = chunk_length * sampling_rate
        if n_fft > n_samples:
            raise bad("n_fft", n_fft, f"at most chunk_length × sampling_rate = {n_samples} samples")
        if n_samples // hop_length > _MAX_FRAMES:
            raise bad(
                "hop_length",
                hop_length,
                f"at least {n_samples // _MAX_FRAMES + 1} (at most {_MAX_FRAMES:,} frames)",
            )
        # transformers recomputes these (and mel_filters, which older files store transposed) and ignores the
        # stored values; a stored value that disagrees is a hand-edited file, refused rather than half-obeyed
        derived = {"n_samples": n_samples, "nb_max_frames": n_samples // hop_length}
        for key, value in derived.items():
            if cfg.get(key) is not None and cfg[key] != value:
                raise bad(key, cfg[key], f"{value} (what chunk_length, sampling_rate and hop_length give)")
        return cls(
            feature_size=feature_size,
            sampling_rate=sampling_rate,
            hop_length=hop_length,
            chunk_length=chunk_length,
            n_fft=n_fft,
            padding_value=padding_value,
            mel_filters=mel_filter_bank(1 + n_fft // 2, feature_size, sampling_rate),
        )

    def __call__(self, waveforms: Sequence[np.ndarray]) -> np.ndarray:
        """Mono float waveforms at ``sampling_rate`` -> input_features float32 [N, feature_size, frames]."""
        if isinstance(waveforms, np.ndarray) or not isinstance(waveforms, Sequence) or not waveforms:
            raise InputError("expected a non-empty list of waveforms (1-D arrays)")
        rows = [audio.checked_waveform(i, w) for i, w in enumerate(waveforms)]  # every waveform checked before any work
        out = np.empty((len(rows), self.feature_size, self.nb_max_frames), np.float32)
        for row, features in zip(rows, out):
            self._log_mel(row, features)
        return out

    def _log_mel(self, waveform: np.ndarray, out: np.ndarray) -> None:
        # transformers pads the float32 waveform with padding_value (so rounded to float32), then works in float64
        padded = np.full(self.n_samples, self.padding_value, np.float32)
        kept = waveform[: self.n_samples]
        padded[: len(kept)] = kept
        half = self.n_fft // 2
        signal = np.pad(padded.astype(np.float64), (half, half), mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(signal, self.n_fft)[:: self.hop_length]
        window = np.hanning(self.n_fft + 1)[:-1]  # periodic Hann
        # out has one frame fewer than the STFT gives: transformers drops the last
        for start in range(0, out.shape[1], _BLOCK):
            block = frames[start : min(start + _BLOCK, out.shape[1])]
            spectrum = np.fft.rfft(block * window, axis=-1)
            power = spectrum.real**2 + spectrum.imag**2
            mel = power @ self.mel_filters
            out[:, start : start + len(block)] = np.log10(np.maximum(mel, 1e-10)).T
        np.maximum(out, out.max() - np.float32(8.0), out=out)
        out += np.float32(4.0)
        out /= np.float32(4.0)


def mel_filter_bank(
    num_frequency_bins: int,
    num_mel_filters: int,
    sampling_rate: int,
    min_frequency: float = 0.0,
    max_frequency: float = 8000.0,
) -> np.ndarray:
    """transformers' ``mel_filter_bank(..., norm="slaney", mel_scale="slaney")``: float64 [bins, filters] of
    triangles between slaney-mel-spaced edges over the bins of ``np.linspace(0, sampling_rate // 2, bins)``,
    each scaled to 2 / (its width in Hz)."""
    mels = np.linspace(_hz_to_mel(min_frequency), _hz_to_mel(max_frequency), num_mel_filters + 2)
    edges = _mel_to_hz(mels)
    bins = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    slopes = edges[None, :] - bins[:, None]
    widths = np.diff(edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


# Slaney's mel scale (librosa's default): linear below 1 kHz (3 mels per 200 Hz), logarithmic above
_LOG_HZ, _LOG_MEL, _LOG_STEP = 1000.0, 15.0, math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    return _LOG_MEL + math.log(hz / _LOG_HZ) / _LOG_STEP if hz >= _LOG_HZ else 3.0 * hz / 200.0


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = 200.0 * mels / 3.0
    log = mels >= _LOG_MEL
    hz[log] = _LOG_HZ * np.exp(_LOG_STEP * (mels[log] - _LOG_MEL))
    return hz


def split_windows(samples: np.ndarray, sampling_rate: int, chunk_length: int) -> list[np.ndarray]:
    """Consecutive, non-overlapping windows of ``chunk_length`` seconds (views of ``samples``); the last may be
    shorter, and there is always at least one (empty audio gives one empty window)."""
    if not isinstance(samples, np.ndarray) or samples.ndim != 1:
        raise InputError(
            f"expected 1-D mono samples, got {getattr(samples, 'shape', type(samples).__name__)}"
        )
    for key, value in (("sampling_rate", sampling_rate), ("chunk_length", chunk_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{key}: expected a positive integer, got {value!r}")
    size = int(chunk_length) * int(sampling_rate)
    return [samples[i : i + size] for i in range(0, len(samples), size)] or [samples]


def read_audio(data: bytes, name: str, target_rate: int) -> np.ndarray:
    """The bytes of a WAV or FLAC file -> float32 mono samples at ``target_rate`` (channels averaged, resampled
    when the file's rate differs). WAV through audio.py's reader; FLAC needs the ``soundfile`` package. Files over
    audio.MAX_WAV_BYTES are refused; errors are InputErrors naming ``name``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InputError(f"{name}: expected the file's bytes, got {type(data).__name__}")
    if isinstance(target_rate, bool) or not isinstance(target_rate, (int, np.integer)):
        raise InputError(f"target_rate: expected an integer in Hz, got {target_rate!r}")
    if not 1 <= target_rate <= 1_000_000:
        raise InputError(f"target_rate: expected 1..1000000 Hz, got {target_rate}")
    data = bytes(data)
    if not data:
        raise InputError(f"{name}: empty file")
    if len(data) > audio.MAX_WAV_BYTES:
        raise InputError(
            f"{name}: {len(data):,} bytes; audio files over {audio.MAX_WAV_BYTES:,} bytes are refused"
        )
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        samples, rate = audio.decode_wav(data, name)
    elif data[:4] == b"fLaC":
        samples, rate = _read_flac(data, name)
    else:
        raise InputError(
            f"{name}: unknown audio format (neither RIFF/WAVE nor fLaC header); precast reads WAV, FLAC"
        )
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float64).astype(np.float32)
    if samples.size == 0:
        raise InputError(f"{name}: holds no audio samples")
    if not np.isfinite(samples).all():
        raise InputError(f"{name}: holds NaN or infinite samples")
    if rate != target_rate:
        samples = resample(samples, rate, int(target_rate))
    return np.ascontiguousarray(samples, np.float32)


def _read_flac(data: bytes, name: str) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except (ImportError, OSError):  # OSError: the package without its libsndfile
        raise InputError(f"{name}: FLAC needs the soundfile package (pip install soundfile)") from None
    limit = audio.MAX_WAV_BYTES // 2  # samples: as many as the largest 16-bit WAV precast takes
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            declared, channels, rate = f.frames, f.channels, f.samplerate
            if declared * channels > limit:
                raise InputError(
                    f"{name}: {declared * channels:,} samples; FLAC files over {limit:,} are refused"
                )
            samples = f.read(dtype="float32", always_2d=True)
    except InputError:
        raise
    except (
        RuntimeError,
        ValueError,
        TypeError,
        OSError,
        EOFError,
    ) as e:  # soundfile's errors are RuntimeErrors
        why = getattr(e, "error_string", None) or first_line(
            e
        )  # libsndfile's own words, not the BytesIO repr
        raise InputError(f"{name}: not a readable FLAC file ({why})") from None
    if len(samples) < declared:
        raise InputError(
            f"{name}: truncated FLAC file (declares {declared:,} frames, holds {len(samples):,})"
        )
    return (samples[:, 0] if channels == 1 else samples), rate


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """1-D float samples at ``from_rate`` -> float32 at ``to_rate``: ``scipy.signal.resample_poly(x, up, down)``
    with up/down = to_rate/from_rate in lowest terms, in numpy: the same FIR (a windowed sinc, Kaiser beta 5,
    10 * max(up, down) taps each side of the centre, cutoff at the lower Nyquist), zeros outside the signal, and
    ceil(len * up / down) output samples. Computed polyphase: output m = q * up + r takes phase r of the filter
    over a window of the input starting at q * down, so the cost is one filter phase per output sample."""
    g = math.gcd(from_rate, to_rate)
    up, down = to_rate // g, from_rate // g
    x = np.asarray(samples, np.float32)
    if up == down:
        return x.copy()
    n_out = -(-len(x) * up // down)
    half = 10 * max(up, down)
    cutoff = 1.0 / max(up, down)  # of the Nyquist frequency at the upsampled rate
    taps = np.arange(-half, half + 1, dtype=np.float64)
    fir = np.sinc(cutoff * taps) * np.kaiser(2 * half + 1, 5.0)
    fir *= up / fir.sum()  # unit gain at DC, times up for the zeros upsampling inserts
    per_phase = -(-(2 * half + 1) // up)
    phases = np.zeros(per_phase * up)
    phases[: 2 * half + 1] = fir
    # y[m] = sum_j x[j] fir[m * down + half - j * up]; for m = q * up + r that is
    # sum_i phases[p_r + i * up] * x[q * down + b_r - i], with p_r, b_r = divmod's remainder and quotient below
    offsets = np.arange(up) * down + half
    starts, firsts = offsets // up, offsets % up
    blocks = -(-n_out // up)
    need = (blocks - 1) * down + int(starts.max()) + per_phase
    padded = np.zeros(max(need, len(x) + per_phase - 1), np.float32)
    padded[per_phase - 1 : per_phase - 1 + len(x)] = x
    windows = np.lib.stride_tricks.sliding_window_view(padded, per_phase)
    out = np.empty(blocks * up, np.float32)
    for r in range(up):
        kernel = phases[firsts[r] :: up][::-1].astype(np.float32)
        out[r::up] = windows[starts[r] :: down][:blocks] @ kernel
    return out[:n_out]
