"""An encoder-decoder Hugging Face folder -> two Sources (encoder graph, decoder step graph) + the seq2seq block.

Each Source carries its torch module as the parity reference and verification feeds shaped as the engine
feeds it (a batch of requests of different lengths; mixed prefill + decode rows over shuffled blocks), so
the ordinary compile (passes, target build, verification, bisection) runs on each part unchanged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.compiler.decoder.causal_lm import _output_names, sample_step
from precast.compiler.frontends.source import Source
from precast.compiler.frontends.torch_export import dynamo_export
from precast.compiler.seq2seq.step_modules import DecoderStep, EncoderStep, Seq2SeqShape, prepare
from precast.errors import ModelLoadError, UsageError
from precast.runtime.progress import SILENT, ProgressReporter
from precast.runtime.seq2seq.runner import decoder_inputs

__all__ = ["BLOCK_SIZE", "SEQ2SEQ_TASKS", "Seq2SeqParts", "cross_names", "export_parts", "seq2seq_task"]

BLOCK_SIZE = 16
# transformers' task names; translation / summarization are text2text-generation's aliases
SEQ2SEQ_TASKS = {
    "text2text-generation": "text2text-generation",
    "translation": "text2text-generation",
    "summarization": "text2text-generation",
    "automatic-speech-recognition": "automatic-speech-recognition",
}
SUPPORTED = ("bart", "mbart", "marian", "pegasus", "t5", "mt5", "whisper")


def seq2seq_task(config: dict, task: str | None) -> str | None:
    """The seq2seq task of a folder (None: not an encoder-decoder, or a task that is not a generation)."""
    if not config.get("is_encoder_decoder"):
        if task in SEQ2SEQ_TASKS and task != "automatic-speech-recognition":  # (ASR is also CTC models')
            raise UsageError(
                f"task '{task}' generates with an encoder-decoder; this folder's model "
                f"({config.get('model_type', '?')}) is not one (is_encoder_decoder is not set in config.json)"
            )
        return None
    speech = "num_mel_bins" in config
    if task is None:
        return "automatic-speech-recognition" if speech else "text2text-generation"
    canon = SEQ2SEQ_TASKS.get(task)
    want = "automatic-speech-recognition" if speech else "text2text-generation"
    if canon is None:
        archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
        if archs and all(a.endswith(("ForConditionalGeneration", "MTModel")) for a in archs):
            raise UsageError(
                f"task '{task}': the folder's model ({', '.join(archs)}) is an encoder-decoder; its task is {want} "
                "(compile it without --task)"
            )
        return None
    if canon != want:
        raise UsageError(
            f"task '{task}' does not fit this {config.get('model_type')} model: its task is '{want}'"
        )
    return canon


def cross_names(i: int) -> tuple[str, str]:
    return f"cross_key.{i}", f"cross_value.{i}"


@dataclass
class Seq2SeqParts:
    encoder: Source
    decoder: Source
    shape: Seq2SeqShape
    speech: bool
    block: dict  # the seq2seq.json block (without files / parity): the engine's contract
    hf: object  # the transformers model (the end-to-end check's reference)


def _load(folder: Path, speech: bool, progress: ProgressReporter):
    import torch
    import transformers

    progress.step(f"loading {folder.name} with transformers")
    cls = transformers.AutoModelForSpeechSeq2Seq if speech else transformers.AutoModelForSeq2SeqLM
    try:
        hf = cls.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{folder}: transformers could not load it as {cls.__name__}: {e}") from e
    return hf.eval()


def _text_encoder_feeds(vocab: int, pad: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = [11, 4, 7]
    ids = np.full((3, max(lens)), pad, dtype=np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, :n] = rng.integers(4, vocab - 1, n)
        mask[b, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _speech_encoder_feeds(mels: int, frames: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # log-mel-like values: (log10 power clamped, shifted) lie in about [-1, 1.5]
    return {"input_features": rng.uniform(-0.8, 1.2, (2, mels, frames)).astype(np.float32)}


def _decoder_feeds(spec: dict, enc_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    feeds = sample_step(spec, seed=seed, batch=3, new=5, past=20)
    rng = np.random.default_rng(seed + 1)
    b = feeds["input_ids"].shape[0]
    for i in range(spec["layers"]):
        for name in cross_names(i):
            feeds[name] = (rng.standard_normal((b, spec["kv_heads"], enc_len, spec["head_size"])) * 2).astype(
                np.float32
            )
    mask = np.ones((b, enc_len), dtype=np.int64)
    mask[1, enc_len // 2 :] = 0  # a shorter source: its padded positions must not be attended
    feeds["encoder_mask"] = mask
    return feeds


def _reference(module, names_in: list[str], names_out: list[str], layers: int, decoder: bool):
    import torch

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}
        with torch.no_grad():
            out = module(*(_decoder_args(t, layers) if decoder else [t[n] for n in names_in]))
        return {n: o.numpy() for n, o in zip(names_out, out)}

    return run


def _decoder_args(t: dict, layers: int) -> tuple:
    head = [t[n] for n in ("input_ids", "positions", "past_lens", "new_lens", "block_tables")]
    kc = [t[f"key_cache.{i}"] for i in range(layers)]
    vc = [t[f"value_cache.{i}"] for i in range(layers)]
    ck = [t[cross_names(i)[0]] for i in range(layers)]
    cv = [t[cross_names(i)[1]] for i in range(layers)]
    return (*head, kc, vc, ck, cv, t["encoder_mask"])


def export_parts(
    folder: Path, config: dict, task: str, sha: str, progress: ProgressReporter = SILENT
) -> Seq2SeqParts:
    import torch
    from torch.export import Dim

    speech = task == "automatic-speech-recognition"
    model_type = str(config.get("model_type"))
    if model_type not in SUPPORTED:
        progress.note(
            f"{model_type} is not among the tested encoder-decoders ({', '.join(SUPPORTED)}); trying it"
        )
    hf = _load(folder, speech, progress)
    where = str(folder)
    shape = prepare(hf, where)
    layers, heads, d = shape.layers, shape.heads, shape.head_size
    pad = int(getattr(hf.config, "pad_token_id", None) or 0)
    spec = {  # what causal_lm.sample_step reads
        "layers": layers,
        "kv_heads": heads,
        "head_size": d,
        "block_size": BLOCK_SIZE,
        "vocab": shape.vocab,
        "pad_id": pad,
        "kv_layout": "paged",
    }
    enc_names_out = [n for i in range(layers) for n in cross_names(i)]
    encoder = EncoderStep(hf, shape, speech)
    if speech:
        mels = int(config["num_mel_bins"])
        frames = 2 * int(hf.config.max_source_positions)
        enc_feeds = _speech_encoder_feeds(mels, frames)
        enc_names_in = ["input_features"]
        enc_dynamic = ({0: Dim("batch")},)
        enc_len = frames // 2
    else:
        enc_feeds = _text_encoder_feeds(shape.vocab, pad)
        enc_names_in = ["input_ids", "attention_mask"]
        b, e = Dim("batch"), Dim("source")
        enc_dynamic = ({0: b, 1: e}, {0: b, 1: e})
        enc_len = 9
    enc_args = tuple(torch.from_numpy(enc_feeds[n]) for n in enc_names_in)
    enc_model = dynamo_export(
        encoder,
        enc_args,
        input_names=enc_names_in,
        output_names=enc_names_out,
        dynamic_shapes=enc_dynamic,
        progress=progress,
    )
    decoder = DecoderStep(hf, shape, where)
    dec_feeds = _decoder_feeds(spec, enc_len)
    dec_in, dec_out = decoder_inputs(layers), _output_names(layers)  # (the runner's contract)
    t = {k: torch.from_numpy(v) for k, v in dec_feeds.items()}
    b, s, e = Dim("batch"), Dim("sequence"), Dim("encoder")
    nb = {0: Dim("num_blocks")}
    cross = {0: b, 2: e}
    dynamic = (
        {0: b, 1: s},
        {0: b, 1: s},
        {0: b},
        {0: b},
        {0: b, 1: Dim("max_blocks")},
        [nb] * layers,
        [nb] * layers,
        [cross] * layers,
        [cross] * layers,
        {0: b, 1: e},
    )
    dec_model = dynamo_export(
        decoder,
        _decoder_args(t, layers),
        input_names=dec_in,
        output_names=dec_out,
        dynamic_shapes=dynamic,
        progress=progress,
    )
    got = [v.name for v in dec_model.graph.outputs]
    if got != dec_out:
        raise ModelLoadError(
            f"{folder}: exported decoder outputs {got[:3]}... do not match the step contract"
        )
    name = folder.name
    part_sha = lambda part: hashlib.sha256(f"{sha}:{part}".encode()).hexdigest()  # noqa: E731
    enc_src = Source(
        "hf",
        f"{name}-encoder",
        enc_model,
        part_sha("encoder"),
        reference=_reference(encoder, enc_names_in, enc_names_out, layers, False),
        reference_name="torch (the transformers encoder + cross-attention projections)",
        info={"model_type": model_type, "task": task, "part": "encoder"},
        sample_feeds=enc_feeds,
    )
    dec_src = Source(
        "hf",
        f"{name}-decoder",
        dec_model,
        part_sha("decoder"),
        reference=_reference(decoder, dec_in, dec_out, layers, True),
        reference_name="torch (the transformers decoder over the paged pool)",
        info={"model_type": model_type, "task": task, "part": "decoder"},
        sample_feeds=dec_feeds,
    )
    block = {
        "task": task,
        "model_type": model_type,
        "input": "speech" if speech else "text",
        "layers": layers,
        "heads": heads,
        "head_size": d,
        "vocab": shape.vocab,
        "block_size": BLOCK_SIZE,
        "pad_id": pad,
        "max_target": _max_target(hf.config),
        "max_source": _max_source(hf.config, speech),
    }
    return Seq2SeqParts(enc_src, dec_src, shape, speech, block, hf)


def _max_target(cfg) -> int:
    for key in ("max_target_positions", "max_position_embeddings", "n_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 512  # T5: relative positions, no table; its usual generation bound


def _max_source(cfg, speech: bool) -> int:
    if speech:
        return 2 * int(cfg.max_source_positions)  # mel frames (30 s)
    v = getattr(cfg, "max_position_embeddings", None)
    return int(v) if isinstance(v, int) and v > 0 else 512
