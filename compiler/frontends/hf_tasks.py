"""Hugging Face tasks for single-forward text models: which Auto class loads the folder, what its forward
returns, how ``config.architectures`` names the head, and whether the labels travel in the artifact.

    config.json ──> resolve_task (given or inferred; pure, no transformers) ──> model_class (transformers'
    mapping for the task; refuses what cannot be a text encoder before the weights are read)

A task here is one row of ``TEXT_TASKS``, not a code path: hf_source.py loads, exports and verifies them alike.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from precast.errors import ModelLoadError, UsageError

__all__ = [
    "HFTask",
    "TEXT_TASKS",
    "TESTED_ENCODERS",
    "VISION_TYPES",
    "infer_task",
    "resolve_task",
    "task_dims",
    "model_class",
]


@dataclass(frozen=True)
class HFTask:
    name: str
    auto_class: str  # transformers' Auto class the folder is loaded with
    mapping: str  # its table in transformers.models.auto.modeling_auto (model_type -> class name)
    outputs: tuple[str, ...] | None  # what the forward returns (None: whatever the base model returns)
    heads: tuple[str, ...]  # config.architectures suffixes that carry this task's head
    labels: bool = False  # id2label travels in the manifest


TEXT_TASKS: dict[str, HFTask] = {
    t.name: t
    for t in (
        HFTask("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", None, ("Model",)),
        HFTask(
            "fill-mask", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", ("logits",), ("ForMaskedLM",)
        ),
        HFTask(
            "text-classification",
            "AutoModelForSequenceClassification",
            "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            ("logits",),
            ("ForSequenceClassification",),
            labels=True,
        ),
        HFTask(
            "token-classification",
            "AutoModelForTokenClassification",
            "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
            ("logits",),
            ("ForTokenClassification",),
            labels=True,
        ),
        HFTask(
            "question-answering",
            "AutoModelForQuestionAnswering",
            "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
            ("start_logits", "end_logits"),
            ("ForQuestionAnswering",),
        ),
    )
}  # fmt: skip

# Families the test suite compiles (tests/compiler/test_encoder_families.py): named in refusals, not a gate.
TESTED_ENCODERS = (
    "albert", "bert", "camembert", "clip_text_model", "deberta-v2", "distilbert", "electra", "mpnet",
    "roberta", "t5", "vit", "xlm-roberta",
)  # fmt: skip
VISION_TYPES = {"vit"}  # image encoders this frontend feeds pixel_values (image tasks: issue 39's next part)
_CAUSAL = ("ForCausalLM", "LMHeadModel")


def _archs(config: dict) -> list[str]:
    return [a for a in config.get("architectures") or [] if isinstance(a, str)]


def infer_task(config: dict) -> str:
    """The task ``config.architectures`` names: a head's task, else feature-extraction (a bare ``...Model``,
    or no architectures; a causal LM is refused with a hint by the loader)."""
    for arch in _archs(config):
        for task in TEXT_TASKS.values():
            if task.outputs is not None and arch.endswith(task.heads):
                return task.name
    return "feature-extraction"


def resolve_task(config: dict, task: str | None, others: list[str]) -> tuple[str, bool]:
    """(task, inferred). UsageError for an unknown task, or a head task the folder's architectures lack.
    ``others``: the tasks registered elsewhere (causal-lm), passed through unchecked."""
    if task is None:
        return infer_task(config), True
    if task in others:
        return task, False
    if task not in TEXT_TASKS:
        raise UsageError(f"unknown task '{task}' (supported: {', '.join(known_tasks(others))})")
    spec, archs = TEXT_TASKS[task], _archs(config)
    if spec.outputs is not None and archs and not any(a.endswith(spec.heads) for a in archs):
        raise UsageError(
            f"task '{task}': the folder's model ({', '.join(archs)}) has no {spec.heads[0][3:]} head; "
            f"its task is '{infer_task(config)}' (known tasks: {', '.join(known_tasks(others))})"
        )
    return task, False


def known_tasks(others: list[str]) -> list[str]:
    return [*TEXT_TASKS, *sorted(others)]


def task_dims(config: dict, task: str) -> frozenset[str] | None:
    """The symbolic input dims the export of ``task`` has, from the config alone (what ``--dim`` may size)."""
    if task not in TEXT_TASKS:
        return None
    vision = config.get("model_type") in VISION_TYPES
    return frozenset({"batch"} if vision else {"batch", "sequence"})


def model_class(folder: Path, config: dict, task: str) -> str:
    """The transformers class name that loads ``folder`` for ``task``: the Auto class, or an encoder-decoder's
    encoder class (T5EncoderModel) for feature-extraction. ModelLoadError, naming why, for a model that takes
    no token ids (audio, images other than ViT) or is an encoder-decoder without an encoder class."""
    import transformers
    from transformers.models.auto import modeling_auto

    model_type, spec = config.get("model_type", "?"), TEXT_TASKS[task]

    def refuse(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{folder}: model_type '{model_type}' is not a supported encoder for task {task}: {why} "
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
        raise refuse("it is an encoder-decoder (text2text is not a task here yet)")
    params = inspect.signature(getattr(transformers, name).forward).parameters
    if "input_ids" not in params and not (model_type in VISION_TYPES and "pixel_values" in params):
        takes = ", ".join(p for p in params if p != "self")
        raise refuse(f"its forward takes ({takes}), not input_ids")
    return spec.auto_class
