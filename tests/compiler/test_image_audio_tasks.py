"""Image, audio and two-tower tasks: tiny random models of twelve families (tests/task_models.py), compiled from their
folders -- half with the task inferred from config.architectures, half with it given -- then run on inputs the
verification never saw, through the artifact's own preprocessing, and compared with transformers: the model's
forward on transformers' processor output, the labels, the CTC text, the zero-shot ranking.

Each family is compiled once per module (~8 s each on 2 cores).
"""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest

from tests.task_models import FAMILIES, LABELS

pytestmark = pytest.mark.slow
EXPLICIT = {
    "swin",
    "resnet",
    "clip_vision",
    "siglip",
    "wav2vec2_cls",
}  # compiled with --task; the rest inferred


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """family -> (transformers model, folder, artifact)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from precast.compiler.driver import CompileOptions, compile_model
    from tests.task_models import build

    root = tmp_path_factory.mktemp("tasks")
    out = {}
    for family, (*_, task) in FAMILIES.items():
        folder, artifact = root / family / "hf", root / family / "art"
        model = build(family, folder)
        compile_model(str(folder), artifact, CompileOptions(task=task if family in EXPLICIT else None))
        out[family] = (model, folder, artifact)
    return out


def fresh_images() -> list[np.ndarray]:
    """Images unlike the verification's: other sizes, a portrait, a greyscale one, an RGBA one."""
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (150, 410, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:333, 0:120]
    portrait = np.stack([xx * 2 % 256, yy % 256, (xx + yy) % 256], -1).astype(np.uint8)
    grey = (np.add.outer(np.arange(64), np.arange(90)) % 256).astype(np.uint8)
    rgba = rng.integers(0, 256, (77, 55, 4), dtype=np.uint8)
    return [rgb, portrait, grey, rgba]


def _hf_pixels(folder, images):
    import transformers

    proc = transformers.AutoImageProcessor.from_pretrained(str(folder), use_fast=False)
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    rgb = [np.asarray(convert_to_rgb(Image.fromarray(i))) for i in images]  # grey, RGBA (onto white) -> RGB
    return proc(rgb, return_tensors="np")["pixel_values"]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    err = float(np.abs(got - want).max())
    print(f"{what}: max abs error {err:.2e}")
    assert got.shape == want.shape and err < 1e-4 * max(float(np.abs(want).max()), 1.0), what


IMAGE_FAMILIES = [
    f for f, v in FAMILIES.items() if v[4] in ("image-classification", "image-feature-extraction")
]


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_image_task_matches_transformers_on_fresh_images(compiled, family):
    import torch

    from precast.artifact.manifest import read_manifest
    from precast.runtime import load
    from precast.runtime.processing import label_scores
    from precast.runtime.tasks import TaskRunner

    model, folder, artifact = compiled[family]
    task = FAMILIES[family][4]
    manifest = read_manifest(artifact)
    assert manifest.source["task"] == task and manifest.parity["ok"] is True
    assert (artifact / "processor" / "preprocessor_config.json").is_file()
    runner = TaskRunner.open(load(artifact))
    images = fresh_images()
    ours = np.concatenate([runner.image_feeds(i)["pixel_values"] for i in images])
    want_pixels = _hf_pixels(folder, images)
    _close(ours, want_pixels, f"{family} preprocessing")
    h, w = want_pixels.shape[-2:]
    assert (h, w) == (32, 32) and all(i.shape[:2] != (h, w) for i in images)  # every image was resized
    results = runner.run(images=images, top_k=len(LABELS))
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(want_pixels))
    if task == "image-classification":
        assert manifest.source["id2label"] == {str(k): v for k, v in LABELS.items()}
        logits = ref.logits.numpy()
        _close(
            np.concatenate([runner.model.run(runner.image_feeds(i))["logits"] for i in images]),
            logits,
            family,
        )
        names = {str(k): v for k, v in LABELS.items()}
        for got, want in zip(results, label_scores(logits, names, len(LABELS))):
            assert [r["label"] for r in got] == [r["label"] for r in want], (
                family
            )  # labels applied, same order
            np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], atol=1e-4)
        assert len({r[0]["label"] for r in results}) >= 1 and set(results[0][0]) == {"label", "score"}
    else:
        pooled = ref.pooler_output.numpy()
        _close(np.array([r["embedding"] for r in results]), pooled, family)


def _wav(path, samples: np.ndarray, rate: int, channels: int = 1) -> None:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.repeat(pcm, channels).tobytes())


def _speech(seconds: float, seed: int, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    tone = np.sin(2 * np.pi * (180 + 60 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.3 * tone + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("family", ["wav2vec2_ctc", "wav2vec2_masked", "wav2vec2_cls"])
def test_audio_task_matches_transformers_on_two_lengths(compiled, family):
    import torch
    import transformers

    from precast.runtime import load
    from precast.runtime.processing import label_scores
    from precast.runtime.tasks import TaskRunner

    model, folder, artifact = compiled[family]
    runner = TaskRunner.open(load(artifact))
    extractor = transformers.AutoFeatureExtractor.from_pretrained(str(folder))
    waves = [_speech(1.3, 1), _speech(0.45, 2)]  # neither of the verification's lengths
    results = runner.run(audio=[(w, 16000) for w in waves], top_k=len(LABELS))
    for wave_, result in zip(waves, results):
        values = extractor(wave_, sampling_rate=16000, return_tensors="np")["input_values"]
        with torch.no_grad():
            logits = model(input_values=torch.from_numpy(values)).logits.numpy()
        _close(runner.model.run(runner.audio_feeds(wave_, 16000))["logits"], logits, f"{family} {wave_.size}")
        if family != "wav2vec2_cls":
            tok = transformers.Wav2Vec2CTCTokenizer(str(folder / "vocab.json"))
            assert result == {"text": tok.batch_decode(logits.argmax(-1))[0]}
            assert len(result["text"]) > 3  # the random model emits characters, not only blanks
        else:
            want = label_scores(logits, {str(k): v for k, v in LABELS.items()}, len(LABELS))[0]
            assert [r["label"] for r in result] == [r["label"] for r in want]
    if family != "wav2vec2_cls":
        single = [runner.model.run(runner.audio_feeds(w, 16000))["logits"][0] for w in waves]
        assert single[0].shape[0] > 2 * single[1].shape[0]  # the two lengths really ran at their own lengths
    if family == "wav2vec2_masked":  # both in one padded batch: the mask keeps the padding out
        feeds = runner.processing(waves, 16000)
        assert set(feeds) == {"input_values", "attention_mask"} == {i.name for i in runner.model.inputs}
        batch = runner.model.run(feeds)["logits"]
        n = single[1].shape[0]
        _close(batch[1, :n], single[1], "masked batch, short row")
        _close(batch[0], single[0], "masked batch, long row")


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_zero_shot_ranks_labels_as_transformers(compiled, family):
    import torch
    from tokenizers import Tokenizer

    from precast.artifact.manifest import read_manifest
    from precast.runtime import load
    from precast.runtime.tasks import ZERO_SHOT_TEMPLATE, TaskRunner

    model, folder, artifact = compiled[family]
    manifest = read_manifest(artifact)
    assert manifest.source["task"] == "zero-shot-image-classification"
    assert manifest.source["scores"] == ("sigmoid" if family == "siglip" else "softmax")
    runner = TaskRunner.open(load(artifact))
    labels = ["cat", "dog", "fish", "circuit"]
    images = fresh_images()[:2]
    results = runner.run(images=images, labels=labels)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    length = manifest.source.get("text_length")
    tok.enable_padding(pad_id=0, **({"length": length} if length else {}))
    enc = tok.encode_batch([ZERO_SHOT_TEMPLATE.format(x) for x in labels])
    feeds = {"input_ids": torch.tensor([e.ids for e in enc])}
    if family == "clip":
        feeds["attention_mask"] = torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        logits = model(
            **feeds, pixel_values=torch.from_numpy(_hf_pixels(folder, images))
        ).logits_per_image.numpy()
    for row, result in zip(logits, results):
        if family == "siglip":
            probs = 1 / (1 + np.exp(-row.astype(np.float64)))
        else:
            probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        order = [labels[i] for i in np.argsort(-probs, kind="stable")]
        assert [r["label"] for r in result] == order, family
        np.testing.assert_allclose([r["score"] for r in result], np.sort(probs)[::-1], atol=1e-4)
        assert probs.max() - probs.min() > 1e-3  # the labels really score apart


def test_tasks_inferred_and_explicit_agree(compiled):
    """Every family's inferred task is the one FAMILIES names (so the explicit compiles test the same path)."""
    from precast.compiler.frontends.hf_tasks import infer_task

    for family, (*_, task) in FAMILIES.items():
        config = json.loads((compiled[family][1] / "config.json").read_text())
        assert infer_task(config) == task, family


def _precast(args, capsys) -> tuple[int, str, str]:
    from precast.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_precast_run_takes_files_and_names_wrong_inputs(compiled, tmp_path, capsys):
    from PIL import Image

    img = tmp_path / "photo.png"
    Image.fromarray(fresh_images()[0]).save(img)
    art_img, art_asr = compiled["vit"][2], compiled["wav2vec2_ctc"][2]
    code, out, err = _precast(["run", str(art_img), "--image", str(img), "--top-k", "2", "--json"], capsys)
    assert code == 0, err
    body = json.loads(out)
    assert body[0]["input"] == str(img) and len(body[0]["result"]) == 2
    assert body[0]["result"][0]["label"] in LABELS.values()
    speech = tmp_path / "speech.wav"
    _wav(speech, _speech(0.8, 3), 16000)
    code, out, err = _precast(["run", str(art_asr), "--audio", str(speech)], capsys)
    assert code == 0 and out.startswith(f"{speech}: "), err
    cases = [
        (["--audio", str(_at(tmp_path / "8k.wav", 8000))], "expected 16000 Hz, got 8000 Hz"),
        (["--audio", str(_at(tmp_path / "stereo.wav", 16000, 2))], "2 channels"),
        (["--image", str(img)], "task automatic-speech-recognition takes audio; got image"),
        (["--audio", str(img)], "photo.png"),
        ([], "nothing to run"),
    ]
    for args, why in cases:
        code, out, err = _precast(["run", str(art_asr), *args], capsys)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and why in lines[0], (args, code, err)


def _at(path, rate: int, channels: int = 1):
    _wav(path, _speech(0.3, 4, rate), rate, channels)
    return path


def test_unknown_task_and_missing_head_are_one_line(compiled):
    from precast.compiler.frontends.hf_source import load_hf_folder
    from precast.errors import UsageError

    folder = compiled["dinov2"][1]
    with pytest.raises(UsageError, match="unknown task 'image-segmentation' .*image-classification"):
        load_hf_folder(folder, task="image-segmentation")
    with pytest.raises(UsageError, match="has no CTC head; its task is 'audio-classification'"):
        load_hf_folder(compiled["wav2vec2_cls"][1], task="automatic-speech-recognition")


def test_kserve_takes_images_and_audio_and_answers_labels(compiled):
    """KServe v2 infer on task artifacts: an encoded image file (base64 BYTES) or a waveform with its sampling
    rate in, the model's logits plus labels and scores (or CTC text) out; a wrong input is a 400 naming it."""
    import base64
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from precast.runtime import load
    from precast.runtime.processing import label_scores
    from precast.runtime.server import ServerConfig, create_app
    from precast.runtime.tasks import TaskRunner

    images = fresh_images()[:2]
    blobs = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        blobs.append(base64.b64encode(buf.getvalue()).decode())
    art = compiled["resnet"][2]
    runner = TaskRunner.open(load(art))
    want = np.concatenate([runner.model.run(runner.image_feeds(i))["logits"] for i in images])
    names = {str(k): v for k, v in LABELS.items()}
    image_input = {"name": "image", "datatype": "BYTES", "shape": [2], "data": blobs}
    with TestClient(create_app(ServerConfig(art, model_name="cls", max_queue_delay_ms=0))) as c:
        meta = c.get("/v2/models/cls").json()["parameters"]
        assert meta["task"] == "image-classification" and meta["raw_inputs"][0]["name"] == "image"
        r = c.post("/v2/models/cls/infer", json={"inputs": [image_input], "parameters": {"top_k": 2}})
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        assert set(out) == {"logits", "label", "score"} and out["label"]["datatype"] == "BYTES"
        assert out["label"]["shape"] == [2, 2] and out["score"]["shape"] == [2, 2]
        np.testing.assert_allclose(np.array(out["logits"]["data"]).reshape(want.shape), want, atol=1e-5)
        rows = label_scores(want, names, 2)
        assert out["label"]["data"] == [r["label"] for row in rows for r in row]
        for body, why in [
            ({"inputs": [{**image_input, "data": ["not base64!"]}]}, "data[0] is not base64"),
            ({"inputs": [{**image_input, "data": [base64.b64encode(b"GIF89a junk").decode()]}]}, "data[0]"),
            (
                {"inputs": [{"name": "audio", "datatype": "FP32", "shape": [3], "data": [0, 0, 0]}]},
                "takes 'image'",
            ),
            ({"inputs": [image_input], "parameters": {"top_k": 0}}, "top_k"),
        ]:
            r = c.post("/v2/models/cls/infer", json=body)
            assert r.status_code == 400 and why in r.json()["error"], (why, r.text)
        r = c.post("/v2/models/cls/infer", json={"inputs": [image_input], "outputs": [{"name": "label"}]})
        assert [o["name"] for o in r.json()["outputs"]] == ["label"]

    art = compiled["wav2vec2_ctc"][2]
    runner = TaskRunner.open(load(art))
    wave_ = _speech(0.7, 5)
    audio = {"name": "audio", "datatype": "FP32", "shape": [1, wave_.size], "data": wave_.tolist()}
    with TestClient(create_app(ServerConfig(art, model_name="asr", max_queue_delay_ms=0))) as c:
        r = c.post(
            "/v2/models/asr/infer", json={"inputs": [{**audio, "parameters": {"sampling_rate": 16000}}]}
        )
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        assert out["text"]["data"] == [runner.run(audio=[(wave_, 16000)])[0]["text"]]
        for params, why in [
            ({"sampling_rate": 8000}, "expected 16000 Hz, got 8000 Hz"),
            ({}, "sampling_rate"),
        ]:
            r = c.post("/v2/models/asr/infer", json={"inputs": [{**audio, "parameters": params}]})
            assert r.status_code == 400 and why in r.json()["error"], (why, r.text)
