"""precast.runtime.processing against transformers' own processors (the slow, PIL ones: backend="pil").

Images of odd sizes (wide, tall, grey, RGBA) through the real preprocessor_config.json of seven models, audio
of two lengths through wav2vec2-base-960h's feature extractor, CTC logits through its tokenizer; then what an
untrusted config, vocab, WAV or image file may hold that must be refused.
"""

from __future__ import annotations

import json
import struct
import sys
import wave
import zlib

import numpy as np
import pytest

import precast.runtime.processing.audio as audio_module
from precast.errors import ArtifactError, InputError
from precast.runtime.processing import (
    AudioProcessing,
    CTCDecoder,
    ImageProcessing,
    label_scores,
    load_image,
    processing_from_config,
    read_wav,
)
from tests.runtime.processor_configs import (
    CONFIGS,
    IMAGE_MODELS,
    WAV2VEC2_TOKENIZER_CONFIG,
    WAV2VEC2_VOCAB,
)

WAV2VEC2 = CONFIGS["facebook/wav2vec2-base-960h"]


@pytest.fixture(scope="module")
def pil():
    """PIL.Image (precast's image processing needs pillow; the audio, CTC and config tests do not)."""
    return pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def hf(pil):
    """transformers, with its logging quiet (it warns about every legacy config)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_image_processor(hf, cfg: dict, tmp_path):
    folder = tmp_path / f"hf{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    return hf.AutoImageProcessor.from_pretrained(str(folder), backend="pil")


def scene(height: int, width: int, seed: int) -> np.ndarray:
    """A photo-like uint8 RGB image: smooth gradients, a disc, a box with a hard edge, a little noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    img = np.stack([255 * u, 255 * v, 127 + 120 * np.sin(6 * u + 4 * v + seed)], axis=-1)
    disc = (x - 0.6 * width) ** 2 + (y - 0.4 * height) ** 2 < (0.25 * min(height, width)) ** 2
    img[disc] = (230, 40, 60)
    img[height // 5 : height // 2, width // 6 : width // 3] = (20, 200, 90)
    img += np.random.default_rng(seed).normal(0, 4, img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    rgba = np.concatenate([scene(80, 64, 3), np.linspace(0, 255, 80 * 64).reshape(80, 64, 1)], axis=-1)
    return {
        "wide 300x200": scene(200, 300, 0),
        "tall 97x513": scene(513, 97, 1),
        "grey 111x150": scene(150, 111, 2)[:, :, 1],
        "rgba 64x80": rgba.astype(np.uint8),
    }


def as_rgb(image: np.ndarray) -> np.ndarray:
    """What transformers' own convert_to_rgb makes of a grey or RGBA array (precast always converts)."""
    from transformers.image_transforms import convert_to_rgb

    return convert_to_rgb(image[:, :, None] if image.ndim == 2 else image, return_numpy=True)


# --- images: the real configs --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_image_processing_matches_transformers(hf, model, images, tmp_path):
    cfg = CONFIGS[model]
    ours = processing_from_config(cfg)
    assert isinstance(ours, ImageProcessing) and ours.output_size() == (224, 224)
    reference = hf_image_processor(hf, cfg, tmp_path)
    batch = list(images.values())
    expected = reference([as_rgb(im) for im in batch], return_tensors="np")["pixel_values"]
    got = ours(batch)
    assert got.shape == (4, 3, 224, 224) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    if reference.do_convert_rgb:  # transformers converts grey / RGBA itself: the same pixels
        raw = [im[:, :, None] if im.ndim == 2 else im for im in batch]
        np.testing.assert_allclose(
            got, reference(raw, return_tensors="np")["pixel_values"], rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_each_config_reads_as_transformers_reads_it(hf, model, tmp_path):
    ours = processing_from_config(CONFIGS[model])
    ref = hf_image_processor(hf, CONFIGS[model], tmp_path)
    square = (ref.size.height, ref.size.width) if ref.size.height else None
    assert (ours.size, ours.shortest_edge, ours.resample) == (
        square,
        ref.size.shortest_edge,
        int(ref.resample),
    )
    assert ours.do_center_crop == bool(ref.do_center_crop)
    if ours.do_center_crop:
        assert ours.crop_size == (ref.crop_size.height, ref.crop_size.width)
    assert (ours.do_resize, ours.do_rescale, ours.do_normalize) == (
        ref.do_resize,
        ref.do_rescale,
        ref.do_normalize,
    )
    assert ours.rescale_factor == ref.rescale_factor
    assert (ours.image_mean, ours.image_std) == (tuple(ref.image_mean), tuple(ref.image_std))
    assert ours.do_convert_rgb == bool(ref.do_convert_rgb)
    assert ours.crop_pct == getattr(ref, "crop_pct", None)


def test_legacy_names_and_int_sizes():
    """Swin's and ResNet's configs still name ViT's and ConvNext's feature extractors, with ``size: 224``."""
    swin = processing_from_config(CONFIGS["microsoft/swin-tiny-patch4-window7-224"])
    assert (swin.processor_type, swin.size, swin.resample) == ("ViTImageProcessor", (224, 224), 3)
    resnet = processing_from_config(CONFIGS["microsoft/resnet-50"])
    assert resnet == processing_from_config(CONFIGS["facebook/convnext-tiny-224"])
    assert (resnet.processor_type, resnet.shortest_edge, resnet.crop_pct) == (
        "ConvNextImageProcessor",
        224,
        0.875,
    )
    clip = processing_from_config(CONFIGS["openai/clip-vit-base-patch32"])
    assert (clip.shortest_edge, clip.crop_size) == (
        224,
        (224, 224),
    )  # int size: shortest edge; int crop: square


# --- images: the branches the real configs do not take ------------------------------------------------------

VARIANTS = {
    "convnext at 384 warps to the square": {**CONFIGS["facebook/convnext-tiny-224"], "size": 384},
    "crop larger than the resize pads with zeros": {
        **CONFIGS["openai/clip-vit-base-patch32"],
        "size": {"shortest_edge": 40},
        "crop_size": {"height": 56, "width": 48},
    },
    "size as [h, w], not square, nearest": {
        "image_processor_type": "ViTImageProcessor",
        "size": [96, 160],
        "resample": 0,
    },
    "no rescale, no normalize": {
        "image_processor_type": "ViTImageProcessor",
        "do_rescale": False,
        "do_normalize": False,
        "size": {"height": 32, "width": 48},
    },
    "crop without resize, lanczos ignored": {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": False,
        "crop_size": 64,
        "resample": 1,
        "do_rescale": False,
    },
    "bit defaults (CLIP mean/std)": {"image_processor_type": "BitImageProcessor"},
    "fast processor name": {
        **CONFIGS["facebook/dinov2-small"],
        "image_processor_type": "BitImageProcessorFast",
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_image_variants_match_transformers(hf, variant, images, tmp_path):
    cfg = VARIANTS[variant]
    ours = ImageProcessing.from_config(cfg)
    hf_cfg = {k: v.removesuffix("Fast") if k == "image_processor_type" else v for k, v in cfg.items()}
    reference = hf_image_processor(hf, hf_cfg, tmp_path)
    batch = [images["wide 300x200"], images["tall 97x513"]]
    got = ours(batch)
    assert got.shape[2:] == ours.output_size()
    expected = reference(batch, return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * max(1, float(np.abs(expected).max())))


@pytest.mark.parametrize("model", ["google/vit-base-patch16-224", "openai/clip-vit-base-patch32"])
def test_a_float_image_is_read_as_already_rescaled(hf, model, images, tmp_path):
    """transformers would divide a [0, 1] image by 255 again; precast equals it called with do_rescale=False."""
    cfg = CONFIGS[model]
    floats = images["wide 300x200"].astype(np.float32) / 255
    expected = hf_image_processor(hf, cfg, tmp_path)(floats, do_rescale=False, return_tensors="np")[
        "pixel_values"
    ]
    np.testing.assert_allclose(processing_from_config(cfg)([floats]), expected, rtol=0, atol=1e-5)
    no_resize = {"image_processor_type": "CLIPImageProcessor", "do_resize": False, "crop_size": 50}
    expected = hf_image_processor(hf, no_resize, tmp_path)(floats, do_rescale=False, return_tensors="np")
    np.testing.assert_allclose(
        ImageProcessing.from_config(no_resize)([floats]), expected["pixel_values"], atol=1e-6
    )


@pytest.mark.parametrize(
    "image, needle",
    [
        (np.zeros((4, 5, 2), np.uint8), "got shape (4, 5, 2)"),
        (np.zeros((0, 8, 3), np.uint8), "empty"),
        (np.zeros((8, 8, 3), np.int32), "int32"),
        (np.full((8, 8, 3), 1.5, np.float32), "[0, 1]"),
        (np.full((8, 8, 3), np.nan, np.float32), "[0, 1]"),
        ([[0, 1], [2, 3]], "numpy array"),
    ],
)
def test_bad_images_are_input_errors(image, needle):
    with pytest.raises(InputError, match="image 0") as e:
        processing_from_config(CONFIGS["google/vit-base-patch16-224"])([image])
    assert needle in str(e.value)


def test_an_elongated_image_cannot_blow_up_the_resize():
    sliver = np.zeros((1, 300_000, 3), np.uint8)  # shortest edge 1 -> 224: a 224 x 67 million resize
    with pytest.raises(InputError, match="too elongated"):
        processing_from_config(CONFIGS["openai/clip-vit-base-patch32"])([sliver])


def test_without_pillow_an_image_artifact_says_what_to_install(monkeypatch, images):
    for name in ("PIL", "PIL.Image", "PIL.ImageOps"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ArtifactError, match=r"pip install 'precast\[vision\]'"):
        processing_from_config(VIT)([images["wide 300x200"]])


# --- images: hostile configs --------------------------------------------------------------------------------

VIT = CONFIGS["google/vit-base-patch16-224"]
CONVNEXT = CONFIGS["facebook/convnext-tiny-224"]
HOSTILE = [
    ({**VIT, "size": 10**9}, "'size'"),
    ({**VIT, "size": {"height": 0, "width": 224}}, "'size.height'"),
    ({**VIT, "size": {"shortest_edge": 800, "longest_edge": 1333}}, "'size'"),
    ({**VIT, "size": "224"}, "'size'"),
    ({**VIT, "size": [224, True]}, "'size[1]'"),
    ({**VIT, "image_std": [0.2, -0.1, 0.2]}, "'image_std[1]'"),
    ({**VIT, "image_std": 0}, "'image_std'"),
    ({**VIT, "image_mean": [0.5, 0.5]}, "'image_mean'"),
    ({**VIT, "image_mean": [0.5, float("nan"), 0.5]}, "'image_mean[1]'"),
    ({**VIT, "image_mean": "imagenet"}, "'image_mean'"),
    ({**VIT, "resample": 7}, "'resample'"),
    ({**VIT, "resample": True}, "'resample'"),
    ({**VIT, "do_resize": "yes"}, "'do_resize'"),
    ({**VIT, "rescale_factor": -1}, "'rescale_factor'"),
    ({**VIT, "rescale_factor": float("inf")}, "'rescale_factor'"),
    ({**VIT, "do_center_crop": True}, "'do_center_crop'"),
    ({**VIT, "do_center_crop": True, "crop_size": {"shortest_edge": 224}}, "'crop_size'"),
    ({**VIT, "do_center_crop": True, "crop_size": 5000}, "'crop_size'"),
    ({**VIT, "do_pad": True}, "'do_pad'"),
    ({**VIT, "do_resize": False}, "its own size"),
    ({**CONVNEXT, "crop_pct": 0}, "'crop_pct'"),
    ({**CONVNEXT, "crop_pct": 1.5}, "'crop_pct'"),
    ({**CONVNEXT, "size": {"height": 224, "width": 224}}, "'size'"),
    ({**VIT, "feature_extractor_type": 42}, "'feature_extractor_type'"),
    ({**VIT, "feature_extractor_type": "DetrFeatureExtractor"}, "'DetrFeatureExtractor'"),
    ({"image_processor_type": "../../etc/passwd"}, "'image_processor_type'"),
    ({"do_resize": True, "size": 224}, "names no image_processor_type or feature_extractor_type"),
    (["ViTImageProcessor"], "expected a JSON object"),
]


@pytest.mark.parametrize("cfg, needle", HOSTILE, ids=[needle for _, needle in HOSTILE])
def test_hostile_image_configs_are_artifact_errors(cfg, needle):
    with pytest.raises(ArtifactError) as e:
        processing_from_config(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_types_are_named_and_null_means_the_default():
    with pytest.raises(ArtifactError, match="unknown processor type 'WhisperFeatureExtractor'"):
        processing_from_config({"feature_extractor_type": "WhisperFeatureExtractor"})
    with pytest.raises(ArtifactError, match="unknown image processor type 'Wav2Vec2FeatureExtractor'"):
        ImageProcessing.from_config(WAV2VEC2)
    with pytest.raises(ArtifactError, match="unknown feature extractor type 'ViTImageProcessor'"):
        AudioProcessing.from_config({"image_processor_type": "ViTImageProcessor"})
    nulls = processing_from_config({**VIT, "resample": None, "do_convert_rgb": None, "unknown_key": [1, 2]})
    assert nulls.resample == 2 and nulls.do_convert_rgb is False


# --- audio --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def waveforms() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(16000) / 16000
    speechy = 0.3 * np.sin(2 * np.pi * 220 * t) * np.hanning(16000) + 0.01 * rng.standard_normal(16000)
    return [speechy.astype(np.float32), (0.2 * rng.standard_normal(9000) + 0.05).astype(np.float64)]


def test_wav2vec2_without_mask_matches_transformers_per_waveform(hf, waveforms):
    """wav2vec2-base-960h: no attention mask. Each row equals transformers on that waveform alone; the padding is
    padding_value (transformers' batched call would normalize the padded row as a whole)."""
    ours = processing_from_config(WAV2VEC2)
    assert ours == AudioProcessing(16000, do_normalize=True, padding_value=0.0, return_attention_mask=False)
    reference = hf.Wav2Vec2FeatureExtractor(**WAV2VEC2)
    out = ours(waveforms, sampling_rate=16000)
    assert list(out) == ["input_values"] and out["input_values"].shape == (2, 16000)
    for row, w in zip(out["input_values"], waveforms):
        alone = reference(w, sampling_rate=16000, return_tensors="np")["input_values"][0]
        np.testing.assert_allclose(row[: len(w)], alone, rtol=0, atol=1e-5)
        assert not row[len(w) :].any()
        assert abs(row[: len(w)].mean()) < 1e-5 and abs(row[: len(w)].std() - 1) < 1e-3


@pytest.mark.parametrize("normalize", [True, False])
def test_wav2vec2_with_mask_matches_transformers_batched(hf, waveforms, normalize):
    cfg = {**WAV2VEC2, "return_attention_mask": True, "do_normalize": normalize, "padding_value": 0.5}
    reference = hf.Wav2Vec2FeatureExtractor(**cfg)(
        waveforms, sampling_rate=16000, padding=True, return_tensors="np"
    )
    out = AudioProcessing.from_config(cfg)(waveforms, 16000)
    np.testing.assert_allclose(out["input_values"], reference["input_values"], rtol=0, atol=1e-5)
    assert out["attention_mask"].dtype == np.int64
    np.testing.assert_array_equal(out["attention_mask"], reference["attention_mask"])


@pytest.mark.parametrize(
    "waveforms, rate, needle",
    [
        ([np.zeros(100, np.float32)], 8000, "expected 16000 Hz, got 8000 Hz"),
        ([np.zeros((100, 2), np.float32)], 16000, "waveform 0 has 2 channels"),
        ([np.zeros(10, np.float32), np.zeros((2, 3, 4), np.float32)], 16000, "waveform 1: expected 1-D"),
        ([np.zeros(0, np.float32)], 16000, "waveform 0 is empty"),
        ([np.array([0.1, np.nan], np.float32)], 16000, "NaN or infinite"),
        ([np.array([1, 2], np.int16)], 16000, "int16"),
        (np.zeros(100, np.float32), 16000, "non-empty list"),
        ([], 16000, "non-empty list"),
        ([np.zeros(100, np.float32)], 16000.0, "sampling_rate"),
    ],
)
def test_bad_audio_is_an_input_error(waveforms, rate, needle):
    with pytest.raises(InputError) as e:
        processing_from_config(WAV2VEC2)(waveforms, rate)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"sampling_rate": 8}, "'sampling_rate'"),
        ({"sampling_rate": 16000.0}, "'sampling_rate'"),
        ({"padding_value": "0"}, "'padding_value'"),
        ({"feature_size": 80}, "'feature_size'"),
        ({"padding_side": "left"}, "'padding_side'"),
        ({"return_attention_mask": "no"}, "'return_attention_mask'"),
        ({"do_normalize": 1}, "'do_normalize'"),
    ],
)
def test_hostile_audio_configs_are_artifact_errors(change, needle):
    with pytest.raises(ArtifactError, match=needle):
        processing_from_config({**WAV2VEC2, **change})


# --- WAV files ----------------------------------------------------------------------------------------------


def write_wav(path, frames: np.ndarray, width: int, rate: int = 16000, channels: int = 1):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames.tobytes())
    return path


def riff(fmt_tag: int, channels: int, rate: int, bits: int, data: bytes, extensible: bool = False) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else fmt_tag, channels, rate, rate * block, block, bits)
    if extensible:  # cbSize, valid bits, channel mask, sub-format GUID (its first two bytes: the format tag)
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", fmt_tag) + bytes(14)
    body = (
        b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_read_wav_pcm_round_trips(tmp_path):
    ints = np.array([0, 1, -1, 32767, -32768, 1234, -20000], np.int16)
    samples, rate = read_wav(write_wav(tmp_path / "mono16.wav", ints, 2))
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == (7,)
    np.testing.assert_array_equal(samples, ints / 32768)

    stereo = np.stack([ints, -ints // 2], axis=1)  # interleaved L, R
    samples, rate = read_wav(write_wav(tmp_path / "stereo.wav", stereo, 2, rate=44100, channels=2))
    assert rate == 44100 and samples.shape == (7, 2)
    np.testing.assert_array_equal(samples, stereo / 32768)

    u8 = np.array([0, 128, 255, 64], np.uint8)  # 8-bit WAV is unsigned: 128 is silence
    samples, _ = read_wav(write_wav(tmp_path / "u8.wav", u8, 1, rate=8000))
    np.testing.assert_array_equal(samples, [-1.0, 0.0, 127 / 128, -0.5])

    values = np.array([0, 1, -1, 2**23 - 1, -(2**23), -123456])
    packed = b"".join(int(v).to_bytes(3, "little", signed=True) for v in values)
    samples, _ = read_wav(write_wav(tmp_path / "s24.wav", np.frombuffer(packed, np.uint8), 3))
    np.testing.assert_allclose(samples, values / 2**23, rtol=0, atol=1e-7)

    i32 = np.array([0, 2**31 - 1, -(2**31), 65536], np.int32)
    samples, _ = read_wav(write_wav(tmp_path / "s32.wav", i32, 4))
    np.testing.assert_allclose(samples, i32 / 2**31, rtol=0, atol=1e-7)


def test_read_wav_float_and_extensible(tmp_path):
    floats = np.array([0.0, 0.5, -0.25, 1.0, -1.0, 0.123], np.float32)
    (tmp_path / "f32.wav").write_bytes(riff(3, 1, 22050, 32, floats.tobytes()))
    samples, rate = read_wav(tmp_path / "f32.wav")
    assert rate == 22050
    np.testing.assert_array_equal(samples, floats)

    stereo = np.array([[0.1, -0.1], [0.2, -0.2], [0.3, -0.3]])
    (tmp_path / "f64.wav").write_bytes(riff(3, 2, 16000, 64, stereo.tobytes(), extensible=True))
    np.testing.assert_allclose(read_wav(tmp_path / "f64.wav")[0], stereo, rtol=1e-7)

    ints = np.array([100, -100, 32767], np.int16)
    (tmp_path / "ext16.wav").write_bytes(riff(1, 1, 16000, 16, ints.tobytes(), extensible=True))
    np.testing.assert_array_equal(read_wav(tmp_path / "ext16.wav")[0], ints / 32768)


def test_read_wav_refuses_what_it_cannot_read(tmp_path, monkeypatch):
    (tmp_path / "notes.wav").write_text("not audio at all")
    (tmp_path / "adpcm.wav").write_bytes(riff(2, 1, 16000, 4, bytes(10)))
    (tmp_path / "nofmt.wav").write_bytes(b"RIFF" + struct.pack("<I", 4) + b"WAVE")
    for name, needle in [
        ("notes.wav", "not a WAV file"),
        ("adpcm.wav", "unsupported WAV encoding (format 2"),
        ("nofmt.wav", "no 'fmt ' or 'data' chunk"),
        ("missing.wav", "cannot read"),
    ]:
        with pytest.raises(InputError) as e:
            read_wav(tmp_path / name)
        assert needle in str(e.value) and name in str(e.value)
    path = write_wav(tmp_path / "long.wav", np.zeros(1000, np.int16), 2)
    monkeypatch.setattr(audio_module, "MAX_WAV_BYTES", 1024)
    with pytest.raises(InputError, match="bytes are refused"):
        read_wav(path)


def test_a_wav_file_reaches_the_model_input(tmp_path, waveforms):
    ints = np.round(waveforms[0] * 32767).astype(np.int16)
    samples, rate = read_wav(write_wav(tmp_path / "speech.wav", ints, 2))
    out = processing_from_config(WAV2VEC2)([samples], rate)
    assert out["input_values"].shape == (1, 16000)


# --- image files --------------------------------------------------------------------------------------------


def test_load_image_matches_transformers_load_image(hf, pil, images, tmp_path):
    from transformers.image_utils import load_image as hf_load_image

    rgba = tmp_path / "rgba.png"
    pil.fromarray(images["rgba 64x80"]).save(rgba)
    grey = tmp_path / "grey.png"
    pil.fromarray(images["grey 111x150"]).save(grey)
    rotated = tmp_path / "rotated.jpg"
    exif = pil.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    pil.fromarray(images["wide 300x200"]).save(rotated, exif=exif, quality=95)
    for path in (rgba, grey, rotated):
        got = load_image(path)
        assert got.dtype == np.uint8 and got.ndim == 3 and got.shape[2] == 3
        np.testing.assert_array_equal(got, np.asarray(hf_load_image(str(path))))
    assert load_image(rotated).shape == (300, 200, 3)
    wide = tmp_path / "wide.png"
    pil.fromarray(images["wide 300x200"]).save(wide)
    np.testing.assert_array_equal(load_image(wide), images["wide 300x200"])


def test_a_file_through_clip_matches_transformers(hf, pil, images, tmp_path):
    path = tmp_path / "photo.png"
    pil.fromarray(images["tall 97x513"]).save(path)
    cfg = CONFIGS["openai/clip-vit-base-patch32"]
    from transformers.image_utils import load_image as hf_load_image

    expected = hf_image_processor(hf, cfg, tmp_path)(hf_load_image(str(path)), return_tensors="np")
    np.testing.assert_allclose(
        processing_from_config(cfg)([load_image(path)]), expected["pixel_values"], atol=1e-5
    )


def png_claiming(pil, width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (the CRC fixed up): a decompression bomb's header."""
    import io

    buf = io.BytesIO()
    pil.new("L", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


def test_load_image_refuses_bombs_and_non_images(pil, tmp_path):
    (tmp_path / "bomb.png").write_bytes(png_claiming(pil, 10_000, 10_000))
    (tmp_path / "huge.png").write_bytes(png_claiming(pil, 100_000, 100_000))  # past PIL's own bomb limit too
    (tmp_path / "notes.png").write_text("hello")
    (tmp_path / "cut.png").write_bytes(png_claiming(pil, 64, 64))  # header fine, pixels missing
    for name, needle in [
        ("bomb.png", "10000x10000 is over 50 megapixels"),
        ("huge.png", "over 50 megapixels"),
        ("notes.png", "not a readable image"),
        ("cut.png", "not a readable image"),
        ("missing.png", "no such file"),
    ]:
        with pytest.raises(InputError) as e:
            load_image(tmp_path / name)
        assert needle in str(e.value) and name in str(e.value)


# --- CTC decoding -------------------------------------------------------------------------------------------


def one_hot_logits(ids: list[list[int]], vocab: int, rng) -> np.ndarray:
    logits = rng.standard_normal((len(ids), len(ids[0]), vocab)).astype(np.float32)
    for b, row in enumerate(ids):
        logits[b, np.arange(len(row)), row] += 10
    return logits


def test_ctc_decode_matches_the_wav2vec2_tokenizer(hf, tmp_path, rng):
    (tmp_path / "vocab.json").write_text(json.dumps(WAV2VEC2_VOCAB))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(WAV2VEC2_TOKENIZER_CONFIG))
    tokenizer = hf.Wav2Vec2CTCTokenizer.from_pretrained(str(tmp_path))
    decoder = CTCDecoder.from_vocab(WAV2VEC2_VOCAB, WAV2VEC2_TOKENIZER_CONFIG)
    assert (decoder.blank_id, decoder.word_delimiter, len(decoder.tokens)) == (0, "|", 32)
    v = WAV2VEC2_VOCAB
    hello = [0, 0, v["H"], v["H"], v["E"], 0, v["L"], v["L"], 0, v["L"], v["O"], v["|"], v["|"], 0, v["|"]]
    world = [
        v["W"],
        v["O"],
        v["R"],
        v["L"],
        v["D"],
        v["<s>"],
        v["'"],
        v["S"],
        v["<unk>"],
        0,
        v["|"],
        0,
        0,
        0,
        0,
    ]
    spaced = [v["A"], v["|"], 0, v["|"], v["B"], *[0] * 10]
    logits = np.concatenate(
        [one_hot_logits([hello, world, spaced], 32, rng), rng.standard_normal((3, 15, 32))]
    )
    ids = logits.argmax(-1)
    expected = [tokenizer.decode(row) for row in ids]
    assert decoder.decode(logits) == expected
    assert expected[:3] == ["HELLO", "WORLD<s>'S<unk>", "A  B"]  # the ends stripped, two spaces kept
    lengths = [9, 15, 4, 0, 7, 15]
    assert decoder.decode(logits, lengths) == [tokenizer.decode(row[:n]) for row, n in zip(ids, lengths)]
    assert decoder.decode(logits[:1], [9]) == ["HEL"]


def test_ctc_decoder_reads_tokenizer_config_forms():
    vocab = {"[PAD]": 0, "a": 1, "b": 2, " ": 3}
    decoder = CTCDecoder.from_vocab(
        vocab,
        {
            "pad_token": {"content": "[PAD]", "lstrip": False},
            "word_delimiter_token": " ",
            "do_lower_case": True,
        },
    )
    assert (decoder.blank_id, decoder.word_delimiter, decoder.lower_case) == (0, " ", True)
    logits = np.eye(4)[[[1, 1, 0, 1, 3, 2, 2]]]
    assert decoder.decode(logits) == ["aa b"]
    upper = CTCDecoder.from_vocab({"<pad>": 0, "A": 1}, None)
    assert upper.word_delimiter is None and upper.decode(np.eye(2)[[[1, 0, 1]]]) == ["AA"]


@pytest.mark.parametrize(
    "vocab, config, needle",
    [
        ({"<pad>": 0, "a": 2}, None, "ids must be 0..1"),
        ({"<pad>": 0, "a": 0}, None, "ids must be 0..1"),
        ({"<pad>": 0, "a": True}, None, "ids must be 0..1"),
        ({"<pad>": 0, "a" * 100: 1}, None, "1..64 chars"),
        ({}, None, "1..1048576"),
        (["<pad>"], None, "token -> id"),
        ({"<pad>": 0, "a": 1}, {"pad_token": "[PAD]"}, "'[PAD]' (the CTC blank) is not in vocab.json"),
        ({"<pad>": 0, "a": 1}, {"pad_token": 7}, "'pad_token'"),
        ({"<pad>": 0, "a": 1}, {"do_lower_case": "yes"}, "'do_lower_case'"),
        ({"<pad>": 0, "a": 1}, "pad", "expected a JSON object"),
    ],
)
def test_bad_vocabularies_are_artifact_errors(vocab, config, needle):
    with pytest.raises(ArtifactError) as e:
        CTCDecoder.from_vocab(vocab, config)
    assert needle in str(e.value)


def test_ctc_decode_checks_shapes_and_lengths():
    decoder = CTCDecoder.from_vocab(WAV2VEC2_VOCAB, WAV2VEC2_TOKENIZER_CONFIG)
    with pytest.raises(ArtifactError, match=r"expected \[batch, frames, 32\]"):
        decoder.decode(np.zeros((1, 10, 33)))
    with pytest.raises(ArtifactError, match="NaN"):
        decoder.decode(np.full((1, 10, 32), np.nan))
    for lengths in ([11], [5, 5], [-1], [True]):
        with pytest.raises(InputError, match="lengths"):
            decoder.decode(np.zeros((1, 10, 32)), lengths)


# --- classification labels ----------------------------------------------------------------------------------


def test_label_scores_match_the_pipelines(hf, rng):
    from transformers.pipelines.image_classification import sigmoid, softmax

    logits = rng.standard_normal((3, 7)).astype(np.float32) * 4
    id2label = {str(i): f"class {i}" for i in range(7)}
    for multi, reference in [(False, softmax), (True, sigmoid)]:
        rows = label_scores(logits, id2label, top_k=3, multi_label=multi)
        expected = reference(logits.astype(np.float64))
        for row, probs in zip(rows, expected):
            assert [r["label"] for r in row] == [f"class {i}" for i in np.argsort(-probs)[:3]]
            np.testing.assert_allclose([r["score"] for r in row], np.sort(probs)[::-1][:3], rtol=1e-6)
            assert all(type(r["score"]) is float for r in row)


def test_label_scores_edges():
    id2label = {0: "no", 1: "yes"}  # int keys (a config object's), not only JSON's strings
    rows = label_scores(np.array([[0.0, 0.0], [1000.0, -1000.0]]), id2label, top_k=10)
    assert rows[0] == [{"label": "no", "score": 0.5}, {"label": "yes", "score": 0.5}]  # ties: lower id first
    assert rows[1][0] == {"label": "no", "score": 1.0} and len(rows[1]) == 2
    multi = label_scores(np.array([[1000.0, -1000.0]]), id2label, multi_label=True)
    assert [r["score"] for r in multi[0]] == [1.0, 0.0]
    with pytest.raises(ArtifactError, match="no label for class 2"):
        label_scores(np.zeros((1, 3)), id2label)
    with pytest.raises(ArtifactError, match="entry '5'"):
        label_scores(np.zeros((1, 2)), {"0": "a", "1": "b", "5": "c"})
    with pytest.raises(ArtifactError, match=r"expected \[batch, classes\]"):
        label_scores(np.zeros(2), id2label)
    with pytest.raises(ArtifactError, match="NaN"):
        label_scores(np.array([[np.nan, 0.0]]), id2label)
    with pytest.raises(InputError, match="top_k"):
        label_scores(np.zeros((1, 2)), id2label, top_k=0)
