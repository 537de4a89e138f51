"""Verification feeds for Hugging Face tasks from the folder's own preprocessing, on realistic inputs.

Random tensors are far from what a model sees in use (random token ids, white-noise pixels): the compile is
verified on text tokenized by the folder's tokenizer, on images and waveforms run through the folder's
preprocessor_config.json by precast's runtime preprocessing (runtime/processing.py) -- which is first checked
equal to transformers' own processor on the same inputs, so the artifact preprocesses as the folder does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from precast.errors import ExportError, ModelLoadError, first_line

__all__ = [
    "SAMPLE_SENTENCES",
    "SAMPLE_LABELS",
    "read_processor",
    "sample_images",
    "sample_waveforms",
    "text_feeds",
    "image_feeds",
    "audio_feeds",
    "check_against_transformers",
]

# Verification text for encoders with a tokenizer: random token ids exaggerate the error of quantized
# artifacts (cosine 0.986 on random ids vs 0.993 on text).
SAMPLE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on a small stage while the audience sings along.",
    "Interest rates were raised again to fight inflation.",
    "How do I reset my password if I no longer have access to my email account?",
)
SAMPLE_LABELS = ("a photo of a cat", "a photo of a dog", "a diagram of a circuit")
PROCESSOR_FILE = "preprocessor_config.json"


def read_processor(folder: Path):
    """The folder's preprocessor_config.json as precast's runtime preprocessing (ImageProcessing or
    AudioProcessing), or None when the folder has none. ModelLoadError naming what precast cannot reproduce."""
    path = folder / PROCESSOR_FILE
    if not path.is_file():
        return None
    from precast.errors import ArtifactError
    from precast.runtime.processing import processing_from_config

    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e})") from e
    try:
        return processing_from_config(cfg)
    except ArtifactError as e:  # the runtime's words for a shipped file; here it is the user's folder
        raise ModelLoadError(f"{path}: {e}") from e


def sample_images(n: int = 3) -> list[np.ndarray]:
    """Deterministic uint8 RGB images of odd sizes (none square, none at a model's size): gradients, a disc and
    stripes, plus a little noise -- the resize, crop and normalisation all act on them."""
    rng = np.random.default_rng(7)
    sizes = [(200, 300), (361, 271), (97, 513), (640, 480)]
    out = []
    for i in range(n):
        h, w = sizes[i % len(sizes)]
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        r = 127 + 120 * np.sin(xx / w * np.pi * (i + 2))
        g = 255 * yy / h
        disc = (yy - h * 0.4) ** 2 + (xx - w * 0.6) ** 2 < (min(h, w) * 0.25) ** 2
        b = np.where(disc, 230.0, 30.0) + 40 * ((xx // 16 + yy // 16) % 2)
        img = np.stack([r, g, b], -1) + rng.normal(0, 6, (h, w, 3))
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def sample_waveforms(rate: int, seconds=(1.0, 0.55)) -> list[np.ndarray]:
    """Deterministic speech-like float32 waveforms of different lengths: a gliding harmonic tone under a
    syllable-rate envelope, plus noise."""
    rng = np.random.default_rng(11)
    out = []
    for k, sec in enumerate(seconds):
        t = np.arange(int(rate * sec), dtype=np.float64) / rate
        f0 = 120 + 40 * k + 30 * np.sin(2 * np.pi * 1.5 * t)
        phase = 2 * np.pi * np.cumsum(f0) / rate
        voice = sum(np.sin(h * phase) / h for h in range(1, 6))
        env = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2
        out.append((0.2 * voice * env + 0.01 * rng.standard_normal(t.size)).astype(np.float32))
    return out


def _rows(arrays: dict[str, np.ndarray], dims: dict[str, int], dim: str, names) -> dict[str, np.ndarray]:
    """``names``' arrays repeated (or cut) to ``dims[dim]`` rows, when --dim sized that axis."""
    rows = dims.get(dim)
    if not rows:
        return arrays
    return {k: (np.resize(v, (rows, *v.shape[1:])) if k in names else v) for k, v in arrays.items()}


def text_feeds(
    folder: Path,
    names: list[str],
    dims: dict[str, int] | None = None,
    texts=None,
    rows_dim="batch",
    max_length: int | None = None,
) -> dict | None:
    """Tokenized ``texts`` (default SAMPLE_SENTENCES; padded batch) when the folder ships a tokenizer.json,
    else None. With ``dims`` (--dim batch / sequence) the batch is exactly that size: sentences repeated to
    the batch's rows, padded (or truncated) to ``sequence`` tokens. ``max_length``: pad every row to it (SigLIP)."""
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises plain Exception on a malformed file
        raise ModelLoadError(f"cannot read tokenizer {folder / 'tokenizer.json'}: {first_line(e)}") from e
    dims = dims or {}
    seq = dims.get("sequence") or max_length
    tok.enable_padding(**({"length": seq} if seq else {}))
    tok.enable_truncation(max_length=seq or 128)
    texts = list(texts or SAMPLE_SENTENCES)
    rows = dims.get(rows_dim, len(texts))
    enc = tok.encode_batch([texts[i % len(texts)] for i in range(rows)])
    arrays = {
        "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
    }
    return {n: arrays[n] for n in names if n in arrays}


def image_feeds(processing, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    return _rows({"pixel_values": processing(sample_images())}, dims or {}, "batch", {"pixel_values"})


def audio_feeds(processing, names: list[str], dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    feeds = processing(sample_waveforms(processing.sampling_rate), processing.sampling_rate)
    feeds = _rows(feeds, dims or {}, "batch", set(feeds))
    return {n: feeds[n] for n in names}


def raw_audio_feeds(names: list[str], dims: dict[str, int] | None = None, rate: int = 16000) -> dict:
    """sample_waveforms right-padded with zeros (attention_mask marks them), for a folder without a
    preprocessor_config.json."""
    waves = sample_waveforms(rate)
    values = np.zeros((len(waves), max(w.size for w in waves)), np.float32)
    mask = np.zeros(values.shape, np.int64)
    for i, w in enumerate(waves):
        values[i, : w.size], mask[i, : w.size] = w, 1
    feeds = _rows(
        {"input_values": values, "attention_mask": mask},
        dims or {},
        "batch",
        {"input_values", "attention_mask"},
    )
    return {n: feeds[n] for n in names}


def check_against_transformers(folder: Path, processing, transformers) -> float:
    """The largest difference between precast's preprocessing and transformers' own processor for the folder,
    on sample_images / sample_waveforms; ExportError when over 1e-4 (the artifact would preprocess otherwise)."""
    from precast.runtime.processing import ImageProcessing

    try:
        if isinstance(processing, ImageProcessing):
            hf = transformers.AutoImageProcessor.from_pretrained(str(folder), use_fast=False)
            images = sample_images()
            want = np.asarray(hf(images, return_tensors="np")["pixel_values"])
            got = processing(images)
        else:
            hf = transformers.AutoFeatureExtractor.from_pretrained(str(folder))
            rate = processing.sampling_rate
            # one waveform a call: without an attention mask transformers normalises a padded row's zeros too,
            # which its speech pipelines never do (they run one input at a time)
            waves = sample_waveforms(rate)
            want = np.concatenate(
                [np.asarray(hf([w], sampling_rate=rate, return_tensors="np")["input_values"]) for w in waves],
                1,
            )
            got = np.concatenate([processing([w], rate)["input_values"] for w in waves], 1)
    except Exception as e:  # transformers' processors raise many types on configs they cannot use
        raise ModelLoadError(
            f"{folder}/{PROCESSOR_FILE}: transformers cannot run it ({first_line(e)})"
        ) from e
    if want.shape != got.shape:
        raise ExportError(
            f"{folder}/{PROCESSOR_FILE}: precast's preprocessing gives shape {list(got.shape)}, transformers' "
            f"{type(hf).__name__} {list(want.shape)}"
        )
    err = float(np.abs(want.astype(np.float64) - got).max())
    if err > 1e-4:
        raise ExportError(
            f"{folder}/{PROCESSOR_FILE}: precast's preprocessing differs from transformers' "
            f"{type(hf).__name__} by {err:.2e} (max abs); the artifact would not see what the model expects"
        )
    return err
