"""``--task causal-lm`` on a local Hugging Face folder -> the paged decoder step graph (see paged_decoder.py).

Registered in hf_source.TASK_LOADERS. The Source carries:
  - the exported step graph (dynamic B, S, NB, MAXB),
  - the torch paged decoder as the parity reference, with a mixed prefill + decode sample step,
  - ``info["llm"]``: the manifest's ``llm`` block (the contract between compiler and runtime engine),
  - tokenizer files to ship under ``tokenizer/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np

from precast.compiler.decoder.context import (
    ROPE_TYPES,
    freeze_rotary,
    layer_windows,
    max_positions,
    rope_kind,
    windowed,
)
from precast.compiler.frontends.source import Source
from precast.compiler.frontends.torch_export import dynamo_export
from precast.errors import ExportError, ModelLoadError, UsageError
from precast.runtime.llm.runners.base import last_indices
from precast.runtime.llm.runners.mapped import MAPPED_STEP_INPUTS, gqa_lengths
from precast.runtime.llm.runners.mapped_kv import page_block_size
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "BLOCK_SIZE",
    "SUPPORTED",
    "build_paged_decoder",
    "decode_step",
    "export_step",
    "llm_block",
    "load_causal_lm",
    "sample_step",
]

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
# Through the generic path (generic_decoder.py: the model's own forward, precast's paged attention), each
# one tested token for token against transformers. Other architectures may try it: a wrong one fails the
# pre-export check against the model's own forward (exit 2).
GENERIC = (
    "qwen3",
    "phi3",
    "gemma",
    "granite",
    "gemma2",
    "olmo",
    "olmo2",
    "stablelm",
    "gpt_neox",
    "gptj",
    "phi",
    "starcoder2",
    "opt",
    "gemma3_text",
    "mixtral",  # mixtures of experts: every expert evaluated, weighted by the in-graph routing
    "qwen2_moe",
    "qwen3_moe",
    "falcon",  # own attention code, swapped for precast's (attention_swaps.py)
    "bloom",  # + ALiBi in precast's paged attention
    "mpt",  # ALiBi, own attention code (swapped)
    "xglm",  # own attention code (swapped)
    "llama4_text",  # complex rotary swapped for a real one; chunked attention masked in-graph
)
SUPPORTED = (*LLAMA_FAMILY, "gpt2", *GENERIC)
BLOCK_SIZE = 16
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _seq2seq_task(config: dict) -> str:
    """Hugging Face's task name for an encoder-decoder config: speech (a mel-feature encoder), image or text."""
    if "num_mel_bins" in config or config.get("model_type") in ("speech-encoder-decoder", "speech_to_text"):
        return "automatic-speech-recognition"
    if config.get("model_type") == "vision-encoder-decoder":
        return "image-to-text"
    return "text2text-generation"


def _check_architecture(folder: Path, config: dict) -> str:
    model_type = config.get("model_type", "?")
    if model_type == "?":
        raise ModelLoadError(
            f"{folder}: architecture '?' is not supported for task causal-lm "
            f"(no model_type in config.json; supported: {', '.join(SUPPORTED)})"
        )
    if config.get("is_encoder_decoder"):
        raise UsageError(
            f"{folder}: '{model_type}' is an encoder-decoder model, not a causal LM: its task is "
            f"{_seq2seq_task(config)} (compile it without --task, or with --task {_seq2seq_task(config)})"
        )
    if model_type == "falcon" and config.get("alibi"):
        raise ModelLoadError(
            f"{folder}: falcon with alibi=true is not supported for task causal-lm (transformers' own eager "
            "and sdpa attention disagree for it, so there is no reference to match); rotary falcon is"
        )
    kind = rope_kind(config)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"{folder}: rope type '{kind}' is not supported for task causal-lm (supported: {', '.join(ROPE_TYPES)})"
        )
    return model_type


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def llm_block(folder: Path, config: dict, module) -> dict:
    """The manifest's ``llm`` block (see the LLM contract)."""
    gen = {}
    if (folder / "generation_config.json").is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            gen = json.loads((folder / "generation_config.json").read_text())
    bos = gen.get("bos_token_id", config.get("bos_token_id"))
    eos = _ids(gen.get("eos_token_id", config.get("eos_token_id")))
    pad = gen.get("pad_token_id", config.get("pad_token_id"))
    pad = int(pad) if pad is not None else (eos[0] if eos else 0)
    ctx = getattr(module, "max_context", None) or max_positions(config)
    layers = len(module.layers) if hasattr(module, "layers") else len(module.blocks)
    mapped = module.kv_layout == "mapped"
    arch = (
        "generic" if hasattr(module, "shape") else "gpt2" if config.get("model_type") == "gpt2" else "llama"
    )
    return {
        "architecture": arch,
        "model_type": config.get("model_type"),
        "layers": layers,
        "heads": module.heads,
        "kv_heads": module.kv_heads,
        "head_size": module.head_dim,
        "hidden": int(config.get("hidden_size") or config.get("n_embd") or config.get("d_model")),
        "vocab": int(config["vocab_size"]),
        "max_context": ctx,
        "block_size": page_block_size(module.head_dim) if mapped else BLOCK_SIZE,
        "kv_layout": module.kv_layout,
        "kv_inputs": [list(_kv_input_names(i, mapped)) for i in range(layers)],
        "kv_outputs": [list(_kv_output_names(i, mapped)) for i in range(layers)],
        "bos_id": int(bos) if bos is not None else None,
        "eos_ids": eos,
        "pad_id": pad,
        "tokenizer": "tokenizer/tokenizer.json",
        # False: the graph's fused attention (GroupQueryAttention) takes S > 1 only for one request at a
        # time; ModelRunner runs such steps request by request.
        "batched_prefill": not mapped,
        # True: the graph takes last_index [B,Q] and returns logits [B*Q,V] (speculative verification)
        "multi_logits": bool(getattr(module, "multi_logits", False)),
        # multi-head latent attention: the pool's one K head is the latent, no V pool
        **({"value_size": 0} if getattr(getattr(module, "shape", None), "value_size", None) == 0 else {}),
        # recurrent states (hybrid and state-space models): a slot per request, not blocks per token
        **({"states": [_state_entry(st) for st in _states(module)]} if _states(module) else {}),
    }


def _states(module) -> tuple:
    """The step module's recurrent states (recurrent.StateLayer), () for a pure K/V decoder."""
    shape = getattr(module, "shape", None)
    return tuple(getattr(shape, "states", ()) or ())


def _state_entry(st) -> dict:
    return {"name": st.name, "layer": st.layer, "kind": st.kind, "shape": list(st.shape)}


KV_LAYOUTS = ("mapped", "paged")


def build_paged_decoder(
    folder: Path, model_type: str, kv_layout: str | None = None, progress: ProgressReporter = SILENT
):
    """Load the HF model (local files, safetensors, fp32, eager) and wrap it in its paged decoder.

    ``kv_layout``: 'mapped' (GroupQueryAttention over per-request views of the pool; Llama family, head size a
    multiple of 16, Linux runtime), 'paged' (the graph gathers blocks itself; any model), None: mapped when
    the model allows it."""
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise UsageError(f"unknown KV layout '{kv_layout}' (choose from: {', '.join(KV_LAYOUTS)})")
    progress.step("importing torch and transformers")
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        raise UsageError(
            "causal-lm export needs torch and transformers: pip install 'precast[export]'"
        ) from None
    from precast.compiler.decoder.paged_decoder import (
        MappedLlama,
        PagedGPT2,
        PagedLlama,
    )
    from precast.compiler.decoder.paged_ops import supports_gqa

    transformers.utils.logging.disable_progress_bar()  # precast prints its own progress (or none: -q)
    # (recurrent layers' "falling back to its reference PyTorch implementation" notes: the reference is what
    # precast compares against and replaces, never what it ships)
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    progress.step(f"loading {folder.name} with transformers")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder),
            local_files_only=True,
            use_safetensors=True,
            attn_implementation="eager",
            dtype="float32",
        ).eval()
    except Exception as e:
        raise ModelLoadError(
            f"{folder}: transformers cannot load the model ({' '.join(str(e).split())[:300]})"
        ) from e
    config = json.loads((folder / "config.json").read_text())
    freeze_rotary(hf)
    if max_positions(config) < int(config.get("max_position_embeddings") or 0):
        progress.step(f"longrope: context capped at original_max_position_embeddings={max_positions(config)}")
    if model_type not in (*LLAMA_FAMILY, "gpt2"):
        if kv_layout == "mapped":
            raise UsageError(
                f"{folder}: --kv-layout mapped needs a Llama-family model; '{model_type}' takes 'paged'"
            )
        return hf, _generic(folder, hf, config, progress)
    if model_type == "gpt2":
        if kv_layout == "mapped":
            raise UsageError(f"{folder}: --kv-layout mapped needs a Llama-family model; GPT-2 takes 'paged'")
        return hf, PagedGPT2(hf).eval()
    head = hf.model.layers[0].self_attn.head_dim
    if kv_layout == "mapped" and not supports_gqa(head):
        raise UsageError(
            f"{folder}: --kv-layout mapped needs a head size that is a multiple of 16 (GroupQueryAttention); "
            f"this model's is {head}"
        )
    sliding = windowed(config)
    if kv_layout != "paged" and supports_gqa(head):  # one GroupQueryAttention per layer, in place
        windows = layer_windows(hf) if sliding else None  # local_window_size: exact, the full context
        return hf, MappedLlama(hf, max_context=max_positions(config), windows=windows).eval()
    if sliding:  # the gather layout masks windows on the generic path (PagedLlama does not)
        return hf, _generic(folder, hf, config, progress)
    return hf, PagedLlama(hf).eval()


def _generic(folder: Path, hf, config: dict, progress: ProgressReporter):
    """The generic decoder over the model's own forward, checked against that forward before export."""
    from precast.compiler.decoder.generic_decoder import (
        GenericDecoder,
        check_against_hf,
        probe,
    )

    progress.step("probing the model's attention layers")
    shape = probe(hf, str(folder))
    module = GenericDecoder(hf, shape, max_context=max_positions(config)).eval()
    progress.step("checking the paged decoder against the model's own forward")
    check_against_hf(module, "eager", str(folder), BLOCK_SIZE)
    return module


def _kv_input_names(i: int, mapped: bool) -> tuple[str, str]:
    return (f"past_key.{i}", f"past_value.{i}") if mapped else (f"key_cache.{i}", f"value_cache.{i}")


def _kv_output_names(i: int, mapped: bool) -> tuple[str, str]:
    return (f"present_key.{i}", f"present_value.{i}") if mapped else (f"new_key.{i}", f"new_value.{i}")


def _input_names(layers: int, mapped: bool = False, multi: bool = False, states: tuple = ()) -> list[str]:
    """The step graph's inputs in order (``multi``: a paged graph's last_index [B,Q] after the pools, then
    the recurrent ``states``' names)."""
    names = ["input_ids", "positions"] + (
        list(MAPPED_STEP_INPUTS) if mapped else ["past_lens", "new_lens", "block_tables"]
    )
    pairs = [_kv_input_names(i, mapped) for i in range(layers)]
    tail = ["last_index"] if multi and not mapped else []
    return names + [k for k, _ in pairs] + [v for _, v in pairs] + tail + list(states)


def _output_names(layers: int, mapped: bool = False, states: tuple = ()) -> list[str]:
    kv = [n for i in range(layers) for n in _kv_output_names(i, mapped)]
    return ["logits", *kv, *(f"new_{name}" for name in states)]


def _state_names(spec: dict) -> tuple[str, ...]:
    return tuple(st["name"] for st in spec.get("states", ()))


def kv_valid_rule(spec: dict) -> dict | None:
    """Parity masking for the mapped layout: present rows from seqlens_k + 1 (= past + new) on are unspecified."""
    if spec["kv_layout"] != "mapped":
        return None
    return {
        "lengths": ["seqlens_k"],
        "offset": 1,
        "axis": 2,
        "outputs": [n for p in spec["kv_outputs"] for n in p],
    }


def sample_step(
    spec: dict,
    seed: int = 0,
    batch: int = 2,
    new: int = 5,
    past: int = 20,
    pasts: tuple[int, ...] | None = None,
    logit_rows: int = 1,
) -> dict[str, np.ndarray]:
    """One step's feeds: request 0 decodes 1 token after ``past`` cached ones, the others prefill ``new``
    tokens; or, with ``pasts``, a batched decode (one new token per request after ``pasts[b]`` cached).
    ``logit_rows``: Q, the logits rows per request (a graph with ``multi_logits``: each row's last Q tokens).

    The KV inputs hold random K/V (as if earlier steps wrote them); block tables point at shuffled blocks.
    """
    rng = np.random.default_rng(seed)
    bs, kv, d = spec["block_size"], spec["kv_heads"], spec["head_size"]
    if pasts is not None:
        batch, new, past = len(pasts), 1, max(pasts)
        past_lens, new_lens = np.array(pasts, dtype=np.int64), np.ones(batch, dtype=np.int64)
    else:
        past_lens = np.array([past] + [0] * (batch - 1), dtype=np.int64)
        new_lens = np.array([1] + [new] * (batch - 1), dtype=np.int64)
    maxb = -(-(past + new) // bs)
    nb = batch * maxb + 3
    tables = rng.permutation(nb)[: batch * maxb].reshape(batch, maxb).astype(np.int64)
    ids = rng.integers(0, spec["vocab"], size=(batch, new)).astype(np.int64)
    pos = past_lens[:, None] + np.arange(new, dtype=np.int64)[None, :]
    pad = np.arange(new)[None, :] >= new_lens[:, None]
    ids[pad], pos[pad] = spec["pad_id"], 0
    feeds = {"input_ids": ids, "positions": pos}
    mapped = spec["kv_layout"] == "mapped"
    multi = bool(spec.get("multi_logits"))
    if mapped:  # each request's view [B,KV,C,D]: C a little past the longest request, as a real view would be
        feeds.update(gqa_lengths(past_lens, new_lens, new))
        shape = (batch, kv, past + new + 3, d)
    else:
        feeds.update(past_lens=past_lens, new_lens=new_lens, block_tables=tables)
        shape = (nb, kv, bs, d)
    if multi:  # each row's last logit_rows tokens (a row with fewer new tokens: its last one, repeated)
        feeds["last_index"] = last_indices(new_lens, np.minimum(new_lens, logit_rows), logit_rows)
    v_shape = (*shape[:-1], spec.get("value_size", d))  # (latent attention: no V, size 0)
    for i in range(spec["layers"]):
        for name, dims in zip(_kv_input_names(i, mapped), (shape, v_shape)):
            feeds[name] = rng.standard_normal(dims).astype(np.float32)
    for st in spec.get("states", ()):  # a request's recurrent state as earlier steps left it (row 0's only:
        state = rng.standard_normal((batch, *st["shape"])).astype(np.float32)  # the others start at 0)
        state[past_lens == 0] = 0.0
        feeds[st["name"]] = state
    order = _input_names(spec["layers"], mapped, multi, _state_names(spec))
    return dict(sorted(feeds.items(), key=lambda kv_: order.index(kv_[0])))


def decode_step(spec: dict, seed: int = 0, pasts: tuple[int, ...] = (20, 3, 37)) -> dict[str, np.ndarray]:
    """A batched decode step (one new token per request after ``pasts`` cached ones), for graphs whose
    prefill runs one request at a time (``batched_prefill`` false): what their batches look like."""
    return sample_step(spec, seed, pasts=pasts)


def _call(module, feeds: dict, layers: int):
    import torch

    with torch.no_grad():
        return module(
            *_module_args(
                module, {k: torch.from_numpy(np.asarray(v, order="C")) for k, v in feeds.items()}, layers
            )
        )


def _module_args(module, t: dict, layers: int) -> tuple:
    """Feeds (torch tensors by graph input name) -> the decoder module's positional arguments."""
    mapped = module.kv_layout == "mapped"
    pairs = [_kv_input_names(i, mapped) for i in range(layers)]
    keys, values = [t[k] for k, _ in pairs], [t[v] for _, v in pairs]
    if mapped:
        return (t["input_ids"], t["positions"], *(t[n] for n in MAPPED_STEP_INPUTS), keys, values)
    head = (t["input_ids"], t["positions"], t["past_lens"], t["new_lens"])
    tail = (t["last_index"],) if getattr(module, "multi_logits", False) else ()
    states = [t[st.name] for st in _states(module)]
    return (*head, t["block_tables"], keys, values, *tail, *((states,) if states else ()))


def step_reference(module, layers: int):
    """The torch paged decoder as a feeds -> outputs callable (the compile driver's parity reference)."""
    names = _output_names(layers, module.kv_layout == "mapped", tuple(st.name for st in _states(module)))

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: o.numpy() for n, o in zip(names, _call(module, feeds, layers))}

    return run


def export_step(module, spec: dict, progress: ProgressReporter = SILENT):
    """torch.onnx (dynamo) export of the step with dynamic B, S, NB, MAXB -> onnx_ir.Model."""
    import torch
    from torch.export import Dim

    layers = spec["layers"]
    # distinct sizes: B=3, S=5, C=45 or MAXB=3, NB=12, Q=2
    feeds = sample_step(spec, batch=3, new=5, past=37, logit_rows=2)
    mapped = module.kv_layout == "mapped"
    multi = bool(spec.get("multi_logits"))
    from precast.compiler.decoder.generic_decoder import export_moe_op
    from precast.compiler.decoder.paged_ops import MOE_TRANSLATIONS, TRANSLATIONS

    translations = TRANSLATIONS if mapped else MOE_TRANSLATIONS
    args = _module_args(module, {k: torch.from_numpy(v) for k, v in feeds.items()}, layers)
    b, s, q = Dim("batch"), Dim("sequence"), Dim("logit_rows")
    last = {0: b, 1: q} if multi else {0: b}
    if mapped:  # seqlens_k [B], total_sequence_length [] (a scalar), last_index [B, Q]
        view = {0: b, 2: Dim("context")}
        dynamic = ({0: b, 1: s}, {0: b, 1: s}, {0: b}, None, last, [view] * layers, [view] * layers)
    else:
        nb = {0: Dim("num_blocks")}
        head = ({0: b, 1: s}, {0: b, 1: s}, {0: b}, {0: b})
        tail = (last,) if multi else ()
        states = _state_names(spec)
        tail = (*tail, [{0: b}] * len(states)) if states else tail
        dynamic = (*head, {0: b, 1: Dim("max_blocks")}, [nb] * layers, [nb] * layers, *tail)
    with export_moe_op():
        return dynamo_export(
            module,
            args,
            input_names=_input_names(layers, mapped, multi, _state_names(spec)),
            output_names=_output_names(layers, mapped, _state_names(spec)),
            dynamic_shapes=dynamic,
            custom_translation_table=translations,
            progress=progress,
        )


def _check_tokenizer(path: Path, vocab_size: int) -> None:
    """The shipped tokenizer must load, and its ids must fit the model's vocabulary: a broken one would only
    show on the deployment host."""
    from precast.errors import ArtifactError
    from precast.runtime.llm.tokenizer import TextTokenizer

    try:
        tok = TextTokenizer.from_file(path)
    except ArtifactError as e:
        raise ModelLoadError(str(e)) from e
    if vocab_size and tok.vocab_size > vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}"
        )


def load_causal_lm(
    folder: Path,
    config: dict,
    dims: dict[str, int] | None = None,
    kv_layout: str | None = None,
    progress: ProgressReporter = SILENT,
) -> Source:
    if dims:  # refused, not ignored: the step graph's shapes are the engine's, not sample sizes
        raise UsageError(
            f"--dim {next(iter(dims))}=... does not apply to --task causal-lm: the step graph takes any batch "
            "of tokens and its context length comes from the model's config; drop --dim"
        )
    model_type = _check_architecture(folder, config)
    if not sorted(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder}: no *.safetensors weights (pickled checkpoints are refused)")
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"{folder}: no tokenizer.json (the artifact ships the tokenizer; save one with `tokenizers`)"
        )
    from precast.compiler.frontends.hf_source import folder_hash_and_ship

    sha, ship = folder_hash_and_ship(folder, _TOKENIZER_FILES)  # a linked-in file is refused before any work
    _check_tokenizer(folder / "tokenizer.json", int(config.get("vocab_size") or 0))
    _hf, module = build_paged_decoder(folder, model_type, kv_layout, progress)
    spec = llm_block(folder, config, module)
    model = export_step(module, spec, progress)
    got = [v.name for v in model.graph.outputs]
    if got != _output_names(spec["layers"], spec["kv_layout"] == "mapped", _state_names(spec)):
        raise ExportError(f"{folder}: exported outputs {got[:3]}... do not match the step contract")
    kv_rule = kv_valid_rule(spec)
    from precast.compiler.decoder.ov_decoder import (
        ov_lowering,  # (torch is loaded by now)
    )

    return Source(
        "hf",
        folder.name,
        model,
        sha,
        reference=step_reference(module, spec["layers"]),
        reference_name="torch (paged decoder over the transformers model)",
        ship_files=ship,
        info={
            "model_type": model_type,
            "task": "causal-lm",
            "vocab_size": spec["vocab"],
            "llm": spec,
            **({"kv_valid": kv_rule} if kv_rule else {}),
        },
        # (Q = 2 on a multi-logits graph: verification compares a speculative row's logits too)
        sample_feeds=sample_step(spec, logit_rows=2) if spec["batched_prefill"] else decode_step(spec),
        lowerings={"openvino": ov_lowering(folder, _hf, spec, spec["max_context"])},
    )
