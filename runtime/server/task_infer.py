"""KServe v2 infer for Hugging Face task artifacts: what users have in, labels and text out.

    inputs "image" (BYTES: base64 of encoded image files, one per row) or "audio" (FP32 [samples] or
    [1, samples], parameters.sampling_rate) ──the artifact's preprocessing──> the model's own feeds
    inputs "text" (BYTES: strings, one per row; text classifiers, tokenized in the server's sandbox)
    logits ──> outputs "label" (BYTES [rows, k]) and "score" (FP32 [rows, k]) for classifiers ([rows, tokens]:
    each token's best label, for token classification), "text" (BYTES [rows]) for speech recognition, beside
    the model's own outputs

A request may also send the model's own tensors (pixel_values, input_values, ...) as before; the labels are
added all the same. ``parameters.top_k`` (default 5) picks k.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from precast.errors import InputError

__all__ = [
    "RAW_INPUTS",
    "split_raw",
    "raw_feeds",
    "raw_texts",
    "task_metadata",
    "task_outputs",
    "task_output_names",
]

RAW_INPUTS = {"image": "BYTES", "audio": "FP32", "text": "BYTES"}
MAX_IMAGES = 64  # images in one request
_CLASSIFIERS = {"text-classification", "image-classification", "audio-classification", "token-classification"}
MAX_TEXTS = 128  # texts in one request


def split_raw(body: dict, task) -> tuple[dict, dict]:
    """(raw inputs by name, the body with them taken out) -- raw inputs only for a task artifact that takes them."""
    inputs = body.get("inputs")
    if task is None or not isinstance(inputs, list):
        return {}, body
    raw = {t["name"]: t for t in inputs if isinstance(t, dict) and t.get("name") in RAW_INPUTS}
    if not raw:
        return {}, body
    rest = [t for t in inputs if not (isinstance(t, dict) and t.get("name") in RAW_INPUTS)]
    return raw, {**body, "inputs": rest or None}


def _parameter(obj: dict, key: str, default=None):
    params = obj.get("parameters")
    return params.get(key, default) if isinstance(params, dict) else default


def raw_texts(body: object, task, encoder) -> list[str] | None:
    """The strings of a 'text' input for a text task artifact (tokenized by the server's sandbox), else None."""
    if not isinstance(body, dict):
        return None
    raw, _ = split_raw(body, task)
    if "text" not in raw:
        return None
    if encoder is None or task.spec.modality != "text":
        raise InputError(f"input 'text': this {task.spec.task} model takes no text through KServe v2")
    if len(raw) != 1:
        raise InputError(f"give one raw input, not {', '.join(sorted(raw))}")
    t = raw["text"]
    data = t.get("data")
    if t.get("datatype") != "BYTES" or not isinstance(data, list) or not data:
        raise InputError("input 'text': datatype must be BYTES with a non-empty list of strings")
    if len(data) > MAX_TEXTS or not all(isinstance(d, str) and d for d in data):
        raise InputError(f"input 'text': 1 to {MAX_TEXTS} non-empty strings")
    return data


def raw_feeds(task, raw: dict) -> dict[str, np.ndarray]:
    """The model's feeds from raw inputs, through the artifact's preprocessing; InputError names the input."""
    if len(raw) != 1:
        raise InputError(f"give one raw input ('image' or 'audio'), not {', '.join(sorted(raw))}")
    ((name, t),) = raw.items()
    if name == "text":
        raise InputError(f"input 'text': this {task.spec.task} model takes {task.spec.modality}")
    want = "image" if task.spec.modality == "image" else "audio" if task.spec.modality == "audio" else None
    if name != want:
        takes = f"'{want}'" if want else "its own tensors"
        raise InputError(f"input '{name}': this {task.spec.task} model takes {takes}")
    if t.get("datatype") != RAW_INPUTS[name]:
        raise InputError(f"input '{name}': datatype must be {RAW_INPUTS[name]}, got {t.get('datatype')!r}")
    data = t.get("data")
    if name == "image":
        return _images(task, data)
    return _audio(task, t, data)


def _images(task, data) -> dict[str, np.ndarray]:
    from precast.runtime.processing import load_image

    if not isinstance(data, list) or not data or not all(isinstance(d, str) for d in data):
        raise InputError("input 'image': data must be a list of base64 strings (encoded image files)")
    if len(data) > MAX_IMAGES:
        raise InputError(f"input 'image': {len(data)} images; at most {MAX_IMAGES} per request")
    images = []
    for i, d in enumerate(data):
        try:
            blob = base64.b64decode(d, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"input 'image': data[{i}] is not base64") from None
        images.append(load_image(blob, f"input 'image' data[{i}]"))
    rows = [task.image_feeds(img)["pixel_values"] for img in images]
    return {"pixel_values": np.concatenate(rows)}


def _audio(task, t: dict, data) -> dict[str, np.ndarray]:
    shape = t.get("shape")
    if not isinstance(shape, list) or not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
        raise InputError(
            f"input 'audio': shape must be [samples] or [1, samples] (one mono waveform), got {shape!r}"
        )
    rate = _parameter(t, "sampling_rate")
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise InputError("input 'audio': parameters.sampling_rate (an integer, in Hz) is required")
    try:
        wave = np.asarray(data, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise InputError(f"input 'audio': data is not FP32 ({e})") from None
    if wave.size != shape[-1]:
        raise InputError(f"input 'audio': shape {shape} needs {shape[-1]} values, got {wave.size}")
    return task.audio_feeds(wave, rate)


def task_output_names(task) -> list[str]:
    if task is None:
        return []
    if task.spec.task in _CLASSIFIERS:
        return ["label", "score"]
    if task.spec.task == "automatic-speech-recognition" and task.ctc is not None:
        return ["text"]
    return []


def task_outputs(task, body: dict, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The labels (top k, best first) or decoded text of a task artifact's outputs; {} for other artifacts."""
    from precast.runtime.processing import label_scores

    names = task_output_names(task)
    if not names:
        return {}
    if names == ["text"]:
        return {"text": np.array(task.ctc.decode(outputs["logits"]), dtype=object)}
    top_k = _parameter(body, "top_k", 5)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InputError(f"parameters.top_k must be a positive integer, got {top_k!r}")
    logits = outputs["logits"]
    if logits.ndim == 3:  # token-classification: each position's best label
        from precast.runtime.tasks import softmax

        probs = softmax(logits)
        best = probs.argmax(-1)
        names = task.labels(logits.shape[-1])
        return {
            "label": np.array([[names[str(k)] for k in row] for row in best], dtype=object),
            "score": np.take_along_axis(probs, best[..., None], -1)[..., 0].astype(np.float32),
        }
    rows = label_scores(logits, task.labels(logits.shape[-1]), min(top_k, logits.shape[-1]))
    return {
        "label": np.array([[r["label"] for r in row] for row in rows], dtype=object),
        "score": np.array([[r["score"] for r in row] for row in rows], dtype=np.float32),
    }


def task_metadata(task, encoder) -> dict:
    """What model metadata adds for a task artifact: its task, the raw input it takes and the outputs it adds."""
    if task is None:
        return {}
    raw = {"image": "image", "audio": "audio"}.get(task.spec.modality)
    if raw is None and task.spec.modality == "text" and encoder is not None:
        raw = "text"
    shape = {"image": [-1], "audio": [1, -1], "text": [-1]}
    extra = {"parameters": {"task": task.spec.task}}
    if raw is not None:
        extra["parameters"]["raw_inputs"] = [{"name": raw, "datatype": RAW_INPUTS[raw], "shape": shape[raw]}]
    added = task_output_names(task)
    if added:
        types = {"label": "BYTES", "score": "FP32", "text": "BYTES"}
        extra["parameters"]["task_outputs"] = [{"name": n, "datatype": types[n]} for n in added]
    return extra
