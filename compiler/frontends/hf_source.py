"""Hugging Face frontend: a local folder (config.json + safetensors) -> exported ONNX.

Weights are read with safetensors (or ``weights_only`` torch checkpoints); never from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from precast.artifact.manifest import TensorSpec
from precast.compiler.frontends.hf_tasks import TEXT_TASKS, VISION_TYPES, model_class, resolve_task
from precast.compiler.frontends.source import Source, hash_files
from precast.compiler.frontends.torch_export import (
    export_module,
    import_torch,
    sample_dims,
    torch_reference,
)
from precast.errors import ExportError, ModelLoadError, UsageError, first_line
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

# Text encoders take input_ids + attention_mask (+ token_type_ids where the model has a type vocabulary);
# vision ones (hf_tasks.VISION_TYPES) take pixel_values at the config's image size.
_NO_TOKEN_TYPES = {"distilbert", "roberta", "xlm-roberta", "camembert", "mpnet"}  # type ids unused / all zero
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def folder_hash_and_ship(folder: Path, ship_names) -> tuple[str, dict[str, Path]]:
    """A Hugging Face folder's source hash (its .json/.safetensors/.txt files) and the tokenizer files to ship.

    A file to ship must resolve inside the folder (or, for a hub-cache snapshot, the repo's blobs/): the
    artifact is handed to others, so a link to a file elsewhere (a key, a config) must not travel with it.
    """
    hashed = [
        p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in (".json", ".safetensors", ".txt")
    ]
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


# Verification text for encoders with a tokenizer: random token ids are far from what the model sees in
# use, and they exaggerate the error of quantized artifacts (cosine 0.986 on random ids vs 0.993 on text).
SAMPLE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on a small stage while the audience sings along.",
    "Interest rates were raised again to fight inflation.",
    "How do I reset my password if I no longer have access to my email account?",
)


def _text_sample_feeds(folder: Path, names: list[str], dims: dict[str, int] | None = None) -> dict | None:
    """Tokenized sample sentences (padded batch) when the folder ships a tokenizer.json, else None. With
    ``dims`` (--dim batch / sequence) the batch is exactly that size: sentences repeated to ``batch`` rows,
    padded (or truncated) to ``sequence`` tokens -- real text at the compile's shapes, not random ids."""
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        import numpy as np
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises plain Exception on a malformed file
        raise ModelLoadError(f"cannot read tokenizer {folder / 'tokenizer.json'}: {first_line(e)}") from e
    dims = dims or {}
    seq = dims.get("sequence")
    tok.enable_padding(**({"length": seq} if seq else {}))
    tok.enable_truncation(max_length=seq or 128)
    rows = dims.get("batch", len(SAMPLE_SENTENCES))
    enc = tok.encode_batch([SAMPLE_SENTENCES[i % len(SAMPLE_SENTENCES)] for i in range(rows)])
    arrays = {
        "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
    }
    return {n: arrays[n] for n in names}


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
    sha, ship = folder_hash_and_ship(folder, _TOKENIZER_FILES)  # a linked-in file is refused before any work
    module = _load_module(folder, getattr(transformers, class_name), progress)
    model_type = config.get("model_type", "?")
    inputs = _encoder_inputs(module, model_type, config)
    names = [s.name for s in inputs]
    given_dims = dict(dims or {})  # --dim sizes the sample feeds
    dims = sample_dims(inputs, dims)
    outputs = _encoder_outputs(module, inputs, dims, TEXT_TASKS[task].outputs)
    model = export_module(module, inputs, outputs, dims, progress)
    if [v.name for v in model.graph.outputs] != outputs:
        raise ExportError(f"{folder}: exported outputs {[v.name for v in model.graph.outputs]} != {outputs}")
    labels = config.get("id2label") if TEXT_TASKS[task].labels else None
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
            "vocab_size": config.get("vocab_size"),
            "padding_mask": "attention_mask" if "attention_mask" in names else None,
            **({"id2label": {str(k): str(v) for k, v in labels.items()}} if isinstance(labels, dict) else {}),
        },
        sample_feeds=_text_sample_feeds(folder, names, given_dims),
    )


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


def _encoder_inputs(module, model_type: str, config: dict) -> list[TensorSpec]:
    if model_type in VISION_TYPES:
        size = module.config.image_size
        return [TensorSpec("pixel_values", "float32", ("batch", module.config.num_channels, size, size))]
    import inspect

    names = ["input_ids", "attention_mask"]
    takes_types = "token_type_ids" in inspect.signature(module.forward).parameters
    if takes_types and model_type not in _NO_TOKEN_TYPES and config.get("type_vocab_size", 0):
        names.append("token_type_ids")
    return [TensorSpec(n, "int64", ("batch", "sequence")) for n in names]


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
