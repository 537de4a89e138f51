"""Hugging Face frontend: a local folder (config.json + safetensors) -> exported ONNX.

Weights are read with safetensors (or ``weights_only`` torch checkpoints); never from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from precast.artifact.manifest import TensorSpec
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
    "ENCODER_TYPES",
    "TASK_LOADERS",
    "encoder_dims",
    "folder_hash_and_ship",
    "read_config",
]

# Other tasks (e.g. causal-lm) register a loader(folder, config, dims, progress, **options) -> Source here.
TASK_LOADERS: dict = {}


def _causal_lm(folder, config, dims, progress, kv_layout=None):
    from precast.compiler.decoder.causal_lm import load_causal_lm

    return load_causal_lm(folder, config, dims, kv_layout=kv_layout, progress=progress)


TASK_LOADERS["causal-lm"] = _causal_lm

# Encoders for task feature-extraction. Text ones take input_ids + attention_mask (+ token_type_ids where the
# model has a type vocabulary); vision ones take pixel_values at the config's image size.
ENCODER_TYPES = {
    "bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert", "mpnet",
    "deberta-v2", "albert", "t5", "vit", "clip_text_model",
}  # fmt: skip
_VISION_TYPES = {"vit"}
_NO_TOKEN_TYPES = {"distilbert", "roberta", "xlm-roberta", "camembert", "mpnet"}  # type ids unused / all zero
_ENCODER_CLASSES = {"t5": "T5EncoderModel"}  # AutoModel would build the encoder-decoder
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
    config = read_config(folder)
    model_type = config.get("model_type", "?")
    given = task is not None
    task = task or "feature-extraction"
    if task != "feature-extraction":
        if task not in TASK_LOADERS:
            known = ", ".join(["feature-extraction", *sorted(TASK_LOADERS)])
            raise UsageError(f"unknown task '{task}' (supported: {known})")
        options = {"kv_layout": kv_layout} if kv_layout else {}
        return TASK_LOADERS[task](folder, config, dims, progress, **options)
    _check_encoder(folder, config, given)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (pickled checkpoints are refused)")
    sha, ship = folder_hash_and_ship(folder, _TOKENIZER_FILES)  # a linked-in file is refused before any work
    module = _load_encoder_module(folder, model_type, progress)
    inputs = _encoder_inputs(module, model_type, config)
    names = [s.name for s in inputs]
    given_dims = dict(dims or {})  # --dim sizes the sample feeds
    dims = sample_dims(inputs, dims)
    outputs = _encoder_outputs(module, inputs, dims)
    model = export_module(module, inputs, outputs, dims, progress)
    if [v.name for v in model.graph.outputs] != outputs:
        raise ExportError(f"{folder}: exported outputs {[v.name for v in model.graph.outputs]} != {outputs}")
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
        },
        sample_feeds=_text_sample_feeds(folder, names, given_dims),
    )


def _check_encoder(folder: Path, config: dict, given: bool) -> None:
    """ModelLoadError unless the config is an encoder precast exports for feature-extraction; a causal LM
    loaded without --task gets a hint to add it."""
    model_type = config.get("model_type", "?")
    if model_type in ENCODER_TYPES:
        return
    archs = config.get("architectures") or []
    causal = not given and any(
        isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs
    )
    hint = "; it is a causal LM: add --task causal-lm" if causal else ""
    raise ModelLoadError(
        f"{folder}: model_type '{model_type}' is not a supported encoder for task feature-extraction "
        f"(supported: {', '.join(sorted(ENCODER_TYPES))}){hint}"
    )


def _load_encoder_module(folder: Path, model_type: str, progress: ProgressReporter):
    """The encoder as a transformers module in eval mode, eager attention (what the export traces)."""
    progress.step("importing torch and transformers")
    import_torch()
    try:
        import transformers
    except ImportError:
        raise UsageError("Hugging Face folders need transformers: pip install 'precast[export]'") from None
    transformers.utils.logging.disable_progress_bar()  # precast prints its own progress (or none: -q)
    progress.step(f"loading {folder.name} with transformers")
    try:
        loader = getattr(transformers, _ENCODER_CLASSES.get(model_type, "AutoModel"))
        return loader.from_pretrained(
            str(folder), local_files_only=True, use_safetensors=True, attn_implementation="eager"
        ).eval()
    except Exception as e:
        raise ModelLoadError(
            f"{folder}: transformers cannot load the model ({' '.join(str(e).split())[:300]})"
        ) from e


def encoder_dims(model_type: str) -> frozenset[str] | None:
    """The symbolic input dims a feature-extraction export of ``model_type`` has (None: not an encoder):
    what ``--dim`` may size, known from the config alone (see _encoder_inputs)."""
    if model_type not in ENCODER_TYPES:
        return None
    return frozenset({"batch"} if model_type in _VISION_TYPES else {"batch", "sequence"})


def _encoder_inputs(module, model_type: str, config: dict) -> list[TensorSpec]:
    if model_type in _VISION_TYPES:
        size = module.config.image_size
        return [TensorSpec("pixel_values", "float32", ("batch", module.config.num_channels, size, size))]
    import inspect

    names = ["input_ids", "attention_mask"]
    takes_types = "token_type_ids" in inspect.signature(module.forward).parameters
    if takes_types and model_type not in _NO_TOKEN_TYPES and config.get("type_vocab_size", 0):
        names.append("token_type_ids")
    return [TensorSpec(n, "int64", ("batch", "sequence")) for n in names]


def _encoder_outputs(module, inputs: list[TensorSpec], dims: dict[str, int]) -> list[str]:
    """The tensors the model returns (last_hidden_state, pooler_output where it pools), from one eager run."""
    from precast.compiler.frontends.torch_export import example_array

    torch = import_torch()
    with torch.no_grad():
        out = module(**{s.name: torch.from_numpy(example_array(s, dims)) for s in inputs})
    return [k for k, v in out.items() if isinstance(v, torch.Tensor)]
