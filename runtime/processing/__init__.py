"""Hugging Face processors in numpy (+ PIL for images), so an artifact preprocesses its inputs and postprocesses
its outputs at run time without torch or transformers.

    preprocessor_config.json --processing_from_config--> ImageProcessing | AudioProcessing
    images / waveforms --processing--> pixel_values / input_values --model--> logits
    WAV / FLAC bytes --read_audio--> waveform --split_windows, WhisperFeatures--> input_features (Whisper)
    logits --CTCDecoder.decode / label_scores--> text / labels

The config is the model folder's file as the artifact ships it: untrusted data, read strictly (fields.py).
Each processor matches transformers' own slow (PIL) one; tests/runtime/test_processing.py compares them.
"""

from __future__ import annotations

from precast.errors import ArtifactError
from precast.runtime.processing.audio import AUDIO_TYPES, AudioProcessing, read_wav
from precast.runtime.processing.fields import CONFIG, processor_type
from precast.runtime.processing.image import IMAGE_ALIASES, IMAGE_TYPES, ImageProcessing, load_image
from precast.runtime.processing.postprocess import CTCDecoder, label_scores
from precast.runtime.processing.whisper import WhisperFeatures, read_audio, split_windows

__all__ = [
    "AudioProcessing",
    "CTCDecoder",
    "ImageProcessing",
    "WhisperFeatures",
    "label_scores",
    "load_image",
    "processing_from_config",
    "read_audio",
    "read_wav",
    "split_windows",
]


def processing_from_config(cfg: dict) -> ImageProcessing | AudioProcessing:
    """The processor a preprocessor_config.json names (image_processor_type / feature_extractor_type);
    ArtifactError naming the type if precast does not reproduce it."""
    name = processor_type(cfg)
    if name in AUDIO_TYPES:
        return AudioProcessing.from_config(cfg)
    if IMAGE_ALIASES.get(name, name) in IMAGE_TYPES:
        return ImageProcessing.from_config(cfg)
    known = ", ".join([*IMAGE_TYPES, *AUDIO_TYPES])
    raise ArtifactError(f"{CONFIG}: unknown processor type '{name}'; precast reproduces {known}")
