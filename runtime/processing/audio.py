"""Audio input: WAV files to float samples, and transformers' Wav2Vec2FeatureExtractor in numpy.

    waveforms (float, mono, the model's rate) -> [normalize each: (x - mean) / sqrt(var + 1e-7)]
      -> right-pad with padding_value -> {"input_values": float32 [N, T], "attention_mask": int64 [N, T]}

The statistics of a waveform are those of its own samples, never of the padding: each row equals what
transformers returns for that waveform alone. (transformers' batched call without an attention mask computes
them over the padded row, so a short waveform's values depend on its batch-mates; precast does not copy that.)
"""

from __future__ import annotations

import io
import os
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.errors import ArtifactError, InputError, first_line
from precast.runtime.processing.fields import CONFIG, bad, processor_type, read_bool, read_float, read_int

__all__ = ["AUDIO_TYPES", "MAX_WAV_BYTES", "AudioProcessing", "checked_waveform", "decode_wav", "read_wav"]

AUDIO_TYPES = ("Wav2Vec2FeatureExtractor",)  # HuBERT, WavLM and Data2Vec-Audio configs name this one too
MAX_WAV_BYTES = 256 * 2**20  # over two hours of 16 kHz 16-bit mono; bounds what one request may cost
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_STREAMED = 0xFFFFFFFF  # the data size a writer that cannot seek back leaves in the header


@dataclass(frozen=True)
class AudioProcessing:
    """A Wav2Vec2-style feature extractor: raw samples in, optionally normalized, padded to a batch."""

    sampling_rate: int
    do_normalize: bool
    padding_value: float
    return_attention_mask: bool

    @classmethod
    def from_config(cls, cfg: dict) -> AudioProcessing:
        name = processor_type(cfg)
        if name not in AUDIO_TYPES:
            raise ArtifactError(
                f"{CONFIG}: unknown feature extractor type '{name}'; precast reproduces {', '.join(AUDIO_TYPES)}"
            )
        read_int(cfg, "feature_size", 1, 1, 1)  # one value per time step: raw samples, not filter banks
        side = cfg.get("padding_side", "right")
        if side != "right":
            raise bad("padding_side", side, '"right"')
        return cls(
            sampling_rate=read_int(cfg, "sampling_rate", 16000, 1000, 192000),
            do_normalize=read_bool(cfg, "do_normalize", True),
            padding_value=read_float(cfg, "padding_value", 0.0, -1e6, 1e6),
            return_attention_mask=read_bool(cfg, "return_attention_mask", False),
        )

    def __call__(self, waveforms: Sequence[np.ndarray], sampling_rate: int) -> dict[str, np.ndarray]:
        """Mono float waveforms at ``sampling_rate`` -> input_values (+ attention_mask): one row each."""
        if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)):
            raise InputError(f"sampling_rate: expected an integer in Hz, got {sampling_rate!r}")
        if sampling_rate != self.sampling_rate:
            raise InputError(
                f"expected {self.sampling_rate} Hz, got {sampling_rate} Hz: resample the audio first "
                "(precast does not resample)"
            )
        if isinstance(waveforms, np.ndarray) or not isinstance(waveforms, Sequence) or not waveforms:
            raise InputError("expected a non-empty list of waveforms (1-D arrays)")
        rows = [self._row(i, w) for i, w in enumerate(waveforms)]
        length = max(len(r) for r in rows)
        values = np.full((len(rows), length), self.padding_value, np.float32)
        mask = np.zeros((len(rows), length), np.int64)
        for i, row in enumerate(rows):
            values[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return (
            {"input_values": values, "attention_mask": mask}
            if self.return_attention_mask
            else {"input_values": values}
        )

    def _row(self, index: int, waveform: object) -> np.ndarray:
        x = checked_waveform(index, waveform)
        return (x - x.mean()) / np.sqrt(x.var() + 1e-7) if self.do_normalize else x


def checked_waveform(index: int, waveform: object) -> np.ndarray:
    """One caller waveform as float32 mono samples, or an InputError naming it (its index) and what is wrong.
    float32 first, then transformers' float32 arithmetic: the same values, to the last bit."""
    if not isinstance(waveform, np.ndarray):
        raise InputError(f"waveform {index}: expected a numpy array, got {type(waveform).__name__}")
    if waveform.ndim == 2:
        raise InputError(
            f"waveform {index} has {waveform.shape[1]} channels (shape {waveform.shape}); the model takes mono "
            "audio: average the channels or pick one"
        )
    if waveform.ndim != 1:
        raise InputError(f"waveform {index}: expected 1-D mono samples, got shape {waveform.shape}")
    if waveform.dtype.kind != "f":
        raise InputError(f"waveform {index}: expected float samples in [-1, 1], got {waveform.dtype}")
    if waveform.size == 0:
        raise InputError(f"waveform {index} is empty")
    x = waveform.astype(np.float32)
    if not np.isfinite(x).all():
        raise InputError(f"waveform {index} holds NaN or infinite samples")
    return x


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """A WAV file -> (float32 samples in [-1, 1]: [T] for mono, [T, C] otherwise; the rate in Hz).

    PCM 8-bit (unsigned), 16, 24 and 32-bit (signed) through the stdlib ``wave``; IEEE float 32/64-bit and
    WAVE_FORMAT_EXTENSIBLE files (which ``wave`` refuses before Python 3.12) through a minimal chunk reader."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size <= MAX_WAV_BYTES:
            blob = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or first_line(e)})") from None
    if size > MAX_WAV_BYTES:
        raise InputError(f"{path}: {size:,} bytes; WAV files over {MAX_WAV_BYTES:,} bytes are refused")
    return decode_wav(blob, str(path))


def decode_wav(blob: bytes, name: str) -> tuple[np.ndarray, int]:
    """The bytes of a WAV file -> what ``read_wav`` returns for it; errors name the file ``name``. A data chunk
    shorter than its header says is a truncated file (unless the size is the 0xFFFFFFFF of a streamed one)."""
    if len(blob) > MAX_WAV_BYTES:
        raise InputError(f"{name}: {len(blob):,} bytes; WAV files over {MAX_WAV_BYTES:,} bytes are refused")
    try:
        with wave.open(io.BytesIO(blob), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            declared = w.getnframes() * channels * width
            tag, data = _PCM, w.readframes(w.getnframes())
    except wave.Error:
        tag, channels, rate, width, declared, data = _read_chunks(blob, name)
    except (EOFError, OSError) as e:
        raise InputError(f"{name}: not a readable WAV file ({first_line(e)})") from None
    if not 1 <= channels <= 64 or not 1 <= rate <= 1_000_000:
        raise InputError(f"{name}: implausible WAV header ({channels} channels at {rate} Hz)")
    if len(data) < declared <= _STREAMED - channels * width:
        raise InputError(
            f"{name}: truncated WAV file (data chunk declares {declared:,} bytes, holds {len(data):,})"
        )
    if tag == _PCM and width in (1, 2, 3, 4):
        samples = _pcm(data, width)
    elif tag == _FLOAT and width in (4, 8):
        samples = np.frombuffer(data[: len(data) // width * width], "<f4" if width == 4 else "<f8")
    else:
        raise InputError(
            f"{name}: unsupported WAV encoding (format {tag}, {8 * width}-bit); precast reads PCM 8/16/24/32-bit "
            "and IEEE float 32/64-bit"
        )
    samples = samples[: len(samples) // channels * channels].astype(np.float32).reshape(-1, channels)
    return (samples[:, 0].copy() if channels == 1 else samples), rate


def _pcm(data: bytes, width: int) -> np.ndarray:
    """Integer PCM -> float64 in [-1, 1): 8-bit is unsigned (128 is silence), the others signed little-endian."""
    data = data[: len(data) // width * width]
    if width == 1:
        return (np.frombuffer(data, np.uint8).astype(np.float64) - 128) / 128
    if width == 3:  # no numpy dtype: widen each sample to 4 bytes, the sign in the top one
        b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
        return ints / 2.0**23
    return np.frombuffer(data, "<i2" if width == 2 else "<i4") / 2.0 ** (8 * width - 1)


def _read_chunks(blob: bytes, name: str) -> tuple[int, int, int, int, int, bytes]:
    """(format tag, channels, rate, bytes per sample, declared data size, data) of a RIFF/WAVE file ``wave`` did
    not take; an EXTENSIBLE file's tag is its sub-format's (PCM or float)."""
    if len(blob) < 12 or blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise InputError(f"{name}: not a WAV file (no RIFF/WAVE header)")
    fmt = data = None
    declared = 0
    pos = 12
    while pos + 8 <= len(blob) and data is None:
        chunk, n = blob[pos : pos + 4], int.from_bytes(blob[pos + 4 : pos + 8], "little")
        body = blob[pos + 8 : pos + 8 + n]
        if chunk == b"fmt ":
            fmt = body
        elif chunk == b"data":
            data, declared = body, n
        pos += 8 + n + (n & 1)
    if fmt is None or len(fmt) < 16 or data is None:
        raise InputError(f"{name}: not a readable WAV file (no 'fmt ' or 'data' chunk)")
    tag, channels = int.from_bytes(fmt[0:2], "little"), int.from_bytes(fmt[2:4], "little")
    rate, block = int.from_bytes(fmt[4:8], "little"), int.from_bytes(fmt[12:14], "little")
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = int.from_bytes(fmt[24:26], "little")
    # the container's width, not bits_per_sample: 20-bit audio sits left-justified in 3 bytes
    return tag, channels, rate, block // channels if channels else 0, declared, data
