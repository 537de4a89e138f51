"""Hugging Face frontend: a local folder (config.json + safetensors) -> exported ONNX.

Weights are read with safetensors (or ``weights_only`` torch checkpoints); never from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from precast.artifact.manifest import TensorSpec
from precast.compiler.frontends import hf_feeds, st_pooling
from precast.compiler.frontends.hf_tasks import (
    AUDIO,
    IMAGE,
    IMAGE_TEXT,
    TASKS,
    TEXT,
    modality_of,
    model_class,
    resolve_task,
)
from precast.compiler.frontends.source import Source, hash_files
from precast.compiler.frontends.torch_export import (
    export_module,
    import_torch,
    sample_dims,
    torch_reference,
)
from precast.errors import ExportError, ModelLoadError, UsageError
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "load_hf_folder",
    "TASK_LOADERS",
    "folder_hash_and_ship",
    "read_config",
]

# Other tasks (e.g. causal-lm) register a loader(folder, config, dims, progress, **options) -> Source here.
TASK_LOADERS: dict = {}


def _causal_lm(folder, config, dims, progress, kv_layout=None):
    from precast.compiler.decoder.causal_lm import load_causal_lm

    return load_causal_lm(folder, config, dims, kv_layout=kv_layout, progress=progress)


TASK_LOADERS["causal-lm"] = _causal_lm

# Text encoders take input_ids + attention_mask (+ token_type_ids where the model has two or more types);
# image ones pixel_values at the preprocessing's output size, audio ones a waveform (input_values).
_NO_TOKEN_TYPES = {"distilbert", "roberta", "xlm-roberta", "camembert", "mpnet"}  # type ids unused / all zero
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def folder_hash_and_ship(folder: Path, ship_names, extra_hashed=()) -> tuple[str, dict[str, Path]]:
    """A Hugging Face folder's source hash (its .json/.safetensors/.txt files) and the tokenizer files to ship.

    A file to ship must resolve inside the folder (or, for a hub-cache snapshot, the repo's blobs/): the
    artifact is handed to others, so a link to a file elsewhere (a key, a config) must not travel with it.
    """
    hashed = [
        p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in (".json", ".safetensors", ".txt")
    ] + list(extra_hashed)
    ship = {f"tokenizer/{n}": folder / n for n in ship_names if (folder / n).is_file()}
    for path in ship.values():
        _check_inside(folder, path)
    return hash_files(hashed, folder), ship


def _check_inside(folder: Path, path: Path) -> None:
    base, real = folder.resolve(), path.resolve()
    roots = [base]
    if base.parent.name == "snapshots":  # the hub cache: snapshots/<rev>/<file> -> ../../blobs/<sha>
        roots.append(base.parent.parent / "blobs")
    if not any(root in real.parents for root in roots):
        raise ModelLoadError(
            f"{folder}: '{path.name}' resolves to {real}, outside the model folder; "
            "precast ships it in the artifact, so copy the file into the folder instead of linking it"
        )


def read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{folder}/config.json is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder}/config.json must hold a JSON object, not a {type(config).__name__}")
    return config


def load_hf_folder(
    folder: Path,
    task: str | None = None,
    dims: dict[str, int] | None = None,
    kv_layout: str | None = None,
    progress: ProgressReporter = SILENT,
) -> Source:
    """A Hugging Face folder for ``task`` (None: inferred from config.architectures, hf_tasks.infer_task)."""
    config = read_config(folder)
    task, inferred = resolve_task(config, task, list(TASK_LOADERS))
    if task in TASK_LOADERS:
        options = {"kv_layout": kv_layout} if kv_layout else {}
        return TASK_LOADERS[task](folder, config, dims, progress, **options)
    _refuse_causal_lm(folder, config, inferred)
    archs = ", ".join(config.get("architectures") or []) or "none"
    progress.note(f"task {task}" + (f" (inferred from config.architectures: {archs})" if inferred else ""))
    transformers = _import_transformers(progress)
    class_name = model_class(folder, config, task)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (pickled checkpoints are refused)")
    spec = TASKS[task]
    processing = hf_feeds.read_processor(folder)
    ship_names = [*_TOKENIZER_FILES, *(("vocab.json",) if task == "automatic-speech-recognition" else ())]
    extra_hashed = st_pooling.pooling_files(folder) if task == "sentence-similarity" else []
    # a linked-in file is refused before any work
    sha, ship = folder_hash_and_ship(folder, ship_names, extra_hashed)
    if processing is not None:
        ship[f"processor/{hf_feeds.PROCESSOR_FILE}"] = folder / hf_feeds.PROCESSOR_FILE
    module = _load_module(folder, getattr(transformers, class_name), progress)
    modality = modality_of(type(module))
    model_type = config.get("model_type", "?")
    if processing is not None and modality in (IMAGE, AUDIO, IMAGE_TEXT):
        progress.step(f"checking precast's preprocessing against transformers' ({hf_feeds.PROCESSOR_FILE})")
        hf_feeds.check_against_transformers(folder, processing, transformers)
    inputs = _model_inputs(module, modality, config, processing)
    names = [s.name for s in inputs]
    info: dict = {}
    if task == "sentence-similarity":
        mode, normalize = st_pooling.read_pooling(folder)
        module = st_pooling.SentenceEmbedding(module, mode, normalize, "token_type_ids" in names)
        info["pooling"] = {"mode": mode, "normalize": normalize}
    if task == "zero-shot-image-classification":  # how transformers' pipeline scores it, and pads its text
        siglip = _text_max_length(config) is not None
        info.update(scores="sigmoid" if siglip else "softmax", text_length=_text_max_length(config))
    given_dims = dict(dims or {})  # --dim sizes the sample feeds
    dims = sample_dims(inputs, {**_EXPORT_DIMS, **given_dims})
    if task == "sentence-similarity":
        outputs = list(spec.outputs)
    else:
        outputs = _encoder_outputs(module, inputs, dims, spec.outputs)
        if spec.outputs is not None:  # a head's own outputs, nothing nested (CLIP's tower outputs)
            module, outputs = _select_outputs(module, spec.outputs), list(spec.outputs)
    model = export_module(module, inputs, outputs, dims, progress)
    if [v.name for v in model.graph.outputs] != outputs:
        raise ExportError(f"{folder}: exported outputs {[v.name for v in model.graph.outputs]} != {outputs}")
    labels = config.get("id2label") if spec.labels else None
    return Source(
        "hf",
        folder.name,
        model,
        sha,
        reference=torch_reference(module, names, outputs),
        reference_name="torch (transformers eager)",
        ship_files=ship,
        info={
            "model_type": model_type,
            "task": task,
            "modality": modality,
            "vocab_size": config.get("vocab_size"),
            "padding_mask": "attention_mask" if "attention_mask" in names else None,
            **({"id2label": {str(k): str(v) for k, v in labels.items()}} if isinstance(labels, dict) else {}),
            **info,
        },
        sample_feeds=_sample_feeds(folder, modality, names, processing, given_dims, _text_max_length(config)),
    )


# Export sizes of the symbolic dims that must be realistic for the model to trace (a conv stack needs more
# than a few samples); distinct from each other, as sample_dims' are.
_EXPORT_DIMS = {"samples": 6400, "texts": 3}


def _text_max_length(config: dict) -> int | None:
    """SigLIP's text tower was trained on text padded to its full length (transformers' zero-shot pipeline pads
    it so): its feeds are padded to max_position_embeddings."""
    if str(config.get("model_type", "")).startswith("siglip"):
        return int((config.get("text_config") or {}).get("max_position_embeddings", 64))
    return None


def _sample_feeds(
    folder: Path, modality: str, names: list[str], processing, dims: dict, max_length
) -> dict | None:
    """Verification feeds from the folder's own tokenizer and preprocessing (None: generated ones)."""
    if modality == TEXT:
        return hf_feeds.text_feeds(folder, names, dims)
    if modality == AUDIO and processing is None:  # no preprocessor_config.json: raw waveforms, 16 kHz
        return hf_feeds.raw_audio_feeds(names, dims)
    if processing is None:
        return None
    if modality == IMAGE:
        return hf_feeds.image_feeds(processing, dims)
    if modality == AUDIO:
        return hf_feeds.audio_feeds(processing, names, dims)
    text = hf_feeds.text_feeds(
        folder, [n for n in names if n != "pixel_values"], dims, hf_feeds.SAMPLE_LABELS, "texts", max_length
    )
    return None if text is None else {**text, **hf_feeds.image_feeds(processing, dims)}


def _refuse_causal_lm(folder: Path, config: dict, inferred: bool) -> None:
    """A causal LM loaded without --task: a hint to add it (its step graphs are another export)."""
    archs = config.get("architectures") or []
    if inferred and any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ModelLoadError(
            f"{folder}: model_type '{config.get('model_type', '?')}' is not a supported encoder for task "
            "feature-extraction; it is a causal LM: add --task causal-lm"
        )


def _import_transformers(progress: ProgressReporter):
    progress.step("importing torch and transformers")
    import_torch()
    try:
        import transformers
    except ImportError:
        raise UsageError("Hugging Face folders need transformers: pip install 'precast[export]'") from None
    transformers.utils.logging.disable_progress_bar()  # precast prints its own progress (or none: -q)
    return transformers


def _load_module(folder: Path, loader, progress: ProgressReporter):
    """The model as a transformers module in eval mode, eager attention (what the export traces)."""
    progress.step(f"loading {folder.name} with transformers ({loader.__name__})")
    try:
        return loader.from_pretrained(
            str(folder), local_files_only=True, use_safetensors=True, attn_implementation="eager"
        ).eval()
    except Exception as e:
        raise ModelLoadError(
            f"{folder}: transformers cannot load the model ({' '.join(str(e).split())[:300]})"
        ) from e


def _model_inputs(module, modality: str, config: dict, processing) -> list[TensorSpec]:
    import inspect

    if modality == AUDIO:
        names = ["input_values"] + (
            ["attention_mask"] if processing is not None and processing.return_attention_mask else []
        )
        return [TensorSpec("input_values", "float32", ("batch", "samples"))] + [
            TensorSpec(n, "int64", ("batch", "samples")) for n in names[1:]
        ]
    params = inspect.signature(module.forward).parameters
    if modality in (IMAGE, IMAGE_TEXT):
        height, width = _image_size(module.config, processing)
        channels = int(
            getattr(module.config, "num_channels", None)
            or getattr(getattr(module.config, "vision_config", None), "num_channels", 3)
        )
        pixels = TensorSpec("pixel_values", "float32", ("batch", channels, height, width))
        if modality == IMAGE:
            return [pixels]
        text = ["input_ids"] + (
            ["attention_mask"] if "attention_mask" in params and not _text_max_length(config) else []
        )
        return [TensorSpec(n, "int64", ("texts", "sequence")) for n in text] + [pixels]
    names = ["input_ids", "attention_mask"]
    model_type = config.get("model_type", "?")
    if (
        "token_type_ids" in params
        and model_type not in _NO_TOKEN_TYPES
        and config.get("type_vocab_size", 0) > 1
    ):
        names.append("token_type_ids")
    return [TensorSpec(n, "int64", ("batch", "sequence")) for n in names]


def _image_size(config, processing) -> tuple[int, int]:
    """(height, width) the model sees: the preprocessing's output, else the config's image_size, else 224."""
    if processing is not None:
        return processing.output_size()
    size = getattr(config, "image_size", None) or getattr(
        getattr(config, "vision_config", None), "image_size", 224
    )
    return (int(size[0]), int(size[1])) if isinstance(size, (list, tuple)) else (int(size), int(size))


def _select_outputs(module, names):
    """``module`` returning only ``names``, in order: CLIPModel's forward also returns each tower's whole
    output, which the exporter would flatten into extra graph outputs."""
    torch = import_torch()

    class _Select(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = module
            self.config = module.config

        def forward(
            self,
            input_ids=None,
            attention_mask=None,
            token_type_ids=None,
            pixel_values=None,
            input_values=None,
        ):
            given = dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                pixel_values=pixel_values,
                input_values=input_values,
            )
            out = self.model(**{k: v for k, v in given.items() if v is not None})
            return tuple(out[n] for n in names)

    _Select.__name__ = type(module).__name__  # what the progress line names
    return _Select().eval()


def _encoder_outputs(module, inputs: list[TensorSpec], dims: dict[str, int], want) -> list[str]:
    """The tensors the forward returns (last_hidden_state, pooler_output where it pools; a head's logits), from
    one eager run; ``want``: the task's outputs, which must all be there."""
    from precast.compiler.frontends.torch_export import example_array

    torch = import_torch()
    with torch.no_grad():
        out = module(**{s.name: torch.from_numpy(example_array(s, dims)) for s in inputs})
    names = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    if want is not None and not set(want) <= set(names):
        raise ExportError(f"{type(module).__name__} returned {names}, expected {list(want)}")
    return names
