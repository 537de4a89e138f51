"""Hugging Face tasks for single-forward models: which Auto class loads the folder, what its forward takes and
returns, how ``config.architectures`` names the head, and whether the labels travel in the artifact.

    config.json ──> resolve_task (given or inferred; pure, no transformers) ──> model_class (transformers'
    mapping for the task) ──> modality (what the class's forward takes: text, image, audio, image+text)

A task here is one row of ``TASKS``, not a code path: hf_source.py loads, exports and verifies them alike, and
which model types a task takes is transformers' own mapping, guarded by parity -- not a list kept here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from precast.errors import ModelLoadError, UsageError

__all__ = [
    "HFTask",
    "TASKS",
    "TESTED_ENCODERS",
    "infer_task",
    "resolve_task",
    "task_dims",
    "model_class",
    "modality_of",
]

TEXT, IMAGE, AUDIO, IMAGE_TEXT = "text", "image", "audio", "image-text"


@dataclass(frozen=True)
class HFTask:
    name: str
    auto_class: str  # transformers' Auto class the folder is loaded with
    mapping: str  # its table in transformers.models.auto.modeling_auto (model_type -> class name)
    outputs: tuple[str, ...] | None  # what the forward returns (None: whatever the base model returns)
    heads: tuple[str, ...]  # config.architectures suffixes that carry this task's head
    modalities: tuple[str, ...]  # what the model's forward may take (modality_of)
    labels: bool = False  # id2label travels in the manifest


_BARE = ("Model",)
TASKS: dict[str, HFTask] = {
    t.name: t
    for t in (
        HFTask("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", None, _BARE, (TEXT, IMAGE, AUDIO)),
        # feature-extraction + the folder's sentence-transformers pooling and normalisation, in the graph
        HFTask("sentence-similarity", "AutoModel", "MODEL_MAPPING_NAMES", ("sentence_embedding",), _BARE, (TEXT,)),
        HFTask("fill-mask", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", ("logits",),
               ("ForMaskedLM",), (TEXT,)),
        HFTask("text-classification", "AutoModelForSequenceClassification",
               "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", ("logits",), ("ForSequenceClassification",),
               (TEXT,), labels=True),
        HFTask("token-classification", "AutoModelForTokenClassification",
               "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", ("logits",), ("ForTokenClassification",),
               (TEXT,), labels=True),
        HFTask("question-answering", "AutoModelForQuestionAnswering",
               "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", ("start_logits", "end_logits"),
               ("ForQuestionAnswering",), (TEXT,)),
        HFTask("image-classification", "AutoModelForImageClassification",
               "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", ("logits",),
               ("ForImageClassification", "ForImageClassificationWithTeacher"), (IMAGE,), labels=True),
        HFTask("image-feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", None, _BARE, (IMAGE,)),
        HFTask("zero-shot-image-classification", "AutoModelForZeroShotImageClassification",
               "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
               ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"), _BARE, (IMAGE_TEXT,)),
        HFTask("audio-classification", "AutoModelForAudioClassification",
               "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", ("logits",),
               ("ForSequenceClassification", "ForAudioClassification"), (AUDIO,), labels=True),
        HFTask("automatic-speech-recognition", "AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES", ("logits",),
               ("ForCTC",), (AUDIO,)),
    )
}  # fmt: skip

# Families the test suite compiles (tests/compiler/test_*tasks.py, test_encoder_families.py): named in
# refusals as a hint, not a gate.
TESTED_ENCODERS = (
    "albert", "bert", "camembert", "clip", "clip_text_model", "clip_vision_model", "convnext", "deberta-v2",
    "dinov2", "distilbert", "electra", "modernbert", "mpnet", "resnet", "roberta", "siglip", "swin", "t5",
    "vit", "wav2vec2", "xlm-roberta",
)  # fmt: skip
_AUDIO_KEYS = ("num_feat_extract_layers", "num_mel_bins", "conv_dim")  # audio encoders' configs carry these


def _archs(config: dict) -> list[str]:
    return [a for a in config.get("architectures") or [] if isinstance(a, str)]


def _is_audio(config: dict) -> bool:
    return any(k in config for k in _AUDIO_KEYS)


def _is_image(config: dict) -> bool:
    return "num_channels" in config and "vocab_size" not in config


def infer_task(config: dict) -> str:
    """The task ``config.architectures`` names: a head's task (a ...ForSequenceClassification of an audio model
    is audio-classification), else by what a bare ``...Model`` takes: both towers -> zero-shot image
    classification, an image encoder -> image-feature-extraction, else feature-extraction. A causal LM is
    refused with a hint by the loader."""
    audio = _is_audio(config)
    for arch in _archs(config):
        for task in TASKS.values():
            if task.outputs is None or task.heads == _BARE or not arch.endswith(task.heads):
                continue
            if (AUDIO in task.modalities) == audio:
                return task.name
    if "text_config" in config and "vision_config" in config:
        return "zero-shot-image-classification"
    if _is_image(config):
        return "image-feature-extraction"
    return "feature-extraction"


def resolve_task(config: dict, task: str | None, others: list[str]) -> tuple[str, bool]:
    """(task, inferred). UsageError for an unknown task, or a head task the folder's architectures lack.
    ``others``: the tasks registered elsewhere (causal-lm), passed through unchecked."""
    if task is None:
        return infer_task(config), True
    if task in others:
        return task, False
    if task not in TASKS:
        raise UsageError(f"unknown task '{task}' (supported: {', '.join(known_tasks(others))})")
    spec, archs = TASKS[task], _archs(config)
    if spec.heads != _BARE and archs and not any(a.endswith(spec.heads) for a in archs):
        raise UsageError(
            f"task '{task}': the folder's model ({', '.join(archs)}) has no {spec.heads[0][3:]} head; "
            f"its task is '{infer_task(config)}' (known tasks: {', '.join(known_tasks(others))})"
        )
    return task, False


# generation tasks of encoder-decoders (compiler/seq2seq/export.py SEQ2SEQ_TASKS; automatic-speech-recognition
# is in TASKS already: the CTC models'), compiled before this module is asked
SEQ2SEQ_NAMES = ("text2text-generation", "translation", "summarization")


def known_tasks(others: list[str]) -> list[str]:
    return [*TASKS, *sorted({*others, *SEQ2SEQ_NAMES})]


def task_dims(config: dict, task: str) -> frozenset[str] | None:
    """The symbolic input dims the export of ``task`` has, from the config alone (what ``--dim`` may size)."""
    if task not in TASKS:
        return None
    if task == "zero-shot-image-classification":
        return frozenset({"batch", "texts", "sequence"})
    if _is_audio(config):
        return frozenset({"batch", "samples"})
    if _is_image(config) or "image_size" in config and "vocab_size" not in config:
        return frozenset({"batch"})
    return frozenset({"batch", "sequence"})


def modality_of(model_cls) -> str:
    """What a transformers class's forward takes: token ids, pixels, a waveform, or pixels and token ids."""
    params = inspect.signature(model_cls.forward).parameters
    if "input_values" in params:
        return AUDIO
    if "pixel_values" in params:
        return IMAGE_TEXT if "input_ids" in params else IMAGE
    return TEXT if "input_ids" in params else "?"


def model_class(folder: Path, config: dict, task: str) -> str:
    """The transformers class name that loads ``folder`` for ``task``: the Auto class, an encoder-decoder's
    encoder class (T5EncoderModel) for feature-extraction, or a dual-tower model's vision class
    (CLIPVisionModel) for image-feature-extraction. ModelLoadError, naming why, for a model whose forward
    takes what the task does not feed (token ids for an image task, a waveform for a text task)."""
    import transformers
    from transformers.models.auto import modeling_auto

    model_type, spec = config.get("model_type", "?"), TASKS[task]

    def refuse(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{folder}: model_type '{model_type}' is not a supported model for task {task}: {why} "
            f"(tested: {', '.join(TESTED_ENCODERS)})"
        )

    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises ValueError / KeyError / OSError on foreign configs
        raise refuse(f"transformers cannot read its config ({' '.join(str(e).split())[:200]})") from e
    name = getattr(modeling_auto, spec.mapping).get(model_type)
    name = name[0] if isinstance(name, tuple) else name  # a few types list (base, variant) classes
    if name is None:
        raise UsageError(
            f"task '{task}': transformers has no {spec.auto_class} for model_type '{model_type}' "
            f"(its task is '{infer_task(config)}')"
        )
    # An encoder-decoder's embeddings are its encoder's (T5Model -> T5EncoderModel; AutoModel builds both halves).
    encoder = name.removesuffix("Model") + "EncoderModel" if task == "feature-extraction" else ""
    if encoder and hasattr(transformers, encoder):
        return encoder
    if getattr(hf_config, "is_encoder_decoder", False):
        raise refuse("it is an encoder-decoder (text2text and speech-to-text are not tasks here yet)")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise refuse(f"transformers {transformers.__version__} names {name} but does not export it")
    modality = modality_of(cls)
    if task == "image-feature-extraction" and modality == IMAGE_TEXT:  # CLIPModel -> CLIPVisionModel
        vision = name.removesuffix("Model") + "VisionModel"
        if hasattr(transformers, vision):
            return vision
    if modality not in spec.modalities:
        takes = ", ".join(p for p in inspect.signature(cls.forward).parameters if p != "self")
        feeds = {TEXT: "token ids", IMAGE: "pixel_values", AUDIO: "a waveform", IMAGE_TEXT: "images and text"}
        wanted = " or ".join(feeds[m] for m in spec.modalities)
        raise refuse(f"its forward takes ({takes}), not {wanted}")
    return spec.auto_class
