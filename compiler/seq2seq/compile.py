"""Compile an encoder-decoder folder: two verified part artifacts, then the whole checked token for token.

    export_parts (export.py)          the encoder graph and the decoder step graph, each with its torch reference
    compile_model(encoder) -> encoder/   the ordinary compile of each part: passes, targets, verification against
    compile_model(decoder) -> decoder/   its torch module, bisection naming a pass that broke it
    tokenizer/                        tokenizer.json, generation_config.json, preprocessor_config.json (Whisper)
    end-to-end check                  Seq2SeqEngine on the staged artifact vs transformers' generate() (greedy,
                                      sources of different lengths in one batch): any token differing is exit 2
    seq2seq.json                      the engine's contract + sha256 of every top-level file and part manifest

Everything is staged in a sibling temp dir and renamed into place at the end (a failure leaves nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np

from precast.artifact.seq2seq_spec import SEQ2SEQ_FILE, SEQ2SEQ_SCHEMA, Seq2SeqSpec
from precast.compiler.artifact import clean_stale_siblings, publish, staging_dir
from precast.compiler.report import CompileReport
from precast.errors import ModelLoadError, ParityError, UsageError
from precast.runtime.progress import reporter

__all__ = ["compile_seq2seq", "E2E_TOKENS"]

E2E_TOKENS = 16  # greedy tokens the end-to-end check compares per source
_SHIP = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "preprocessor_config.json",
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_seq2seq(folder: Path, task: str, output, opts, progress=None) -> CompileReport:
    from precast import __version__
    from precast.compiler.driver import compile_model
    from precast.compiler.frontends.hf_source import folder_hash_and_ship, read_config
    from precast.compiler.seq2seq.export import export_parts

    t0 = time.perf_counter()
    prog = reporter(progress)
    output = Path(output)
    for name in ("dims", "inputs"):
        if getattr(opts, name):
            raise UsageError(
                f"--{name[:-1] if name == 'dims' else 'input'} does not apply to task {task}: "
                "the encoder and decoder step graphs take any batch and length"
            )
    if opts.passes is not None and "split-stages" in opts.passes:
        raise UsageError(f"task {task}: splitting the step graphs into stages is not supported (--passes)")
    quantized = opts.passes is not None and "quantize" in opts.passes
    from precast.compiler.artifact import check_replaceable

    check_replaceable(output)  # (before the export: a wrong -o fails in milliseconds)
    for above in output.absolute().parents:
        if (above / "manifest.json").is_file() or (above / SEQ2SEQ_FILE).is_file():
            raise UsageError(f"-o {output}: inside the artifact {above}; writing there would break its integrity")
    config = read_config(folder)
    if not sorted(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder}: no *.safetensors weights (pickled checkpoints are refused)")
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"{folder}: no tokenizer.json (the artifact ships the tokenizer; save one with `tokenizers`)"
        )
    if task == "automatic-speech-recognition" and not (folder / "preprocessor_config.json").is_file():
        raise ModelLoadError(f"{folder}: no preprocessor_config.json (Whisper's feature extractor settings)")
    sha, ship = folder_hash_and_ship(folder, _SHIP)
    clean_stale_siblings(output)
    parts = export_parts(folder, config, task, sha, prog)
    part_opts = dataclasses.replace(
        opts, task=None, kv_layout=None, report_path=None, junit_path=None, sample_inputs=None, cache_dir=None
    )
    seconds = {"export": time.perf_counter() - t0}
    records, parity = {}, {}
    with staging_dir(output) as stage:
        for part, source in (("encoder", parts.encoder), ("decoder", parts.decoder)):
            prog.step(f"compiling the {part}")
            rep = compile_model(source, stage / part, part_opts, progress)
            records.update({f"{part}:{t}": r for t, r in rep.records.items()})
            seconds[part] = rep.seconds.get("total", 0.0)
            parity[part] = _parts_parity(rep.manifest)
        tok = stage / "tokenizer"
        tok.mkdir()
        for rel, src in sorted(ship.items()):
            shutil.copyfile(src, tok / Path(rel).name)
        block = dict(parts.block)
        prog.step("checking the whole against transformers' generate()")
        t1 = time.perf_counter()
        parity["generate"] = _end_to_end(stage, block, parts, folder, config, exact=not quantized)
        seconds["e2e"] = time.perf_counter() - t1
        files = {f"{p}/manifest.json": _sha(stage / p / "manifest.json") for p in ("encoder", "decoder")}
        files.update({f"tokenizer/{f.name}": _sha(f) for f in sorted(tok.iterdir())})
        spec = Seq2SeqSpec(
            schema=SEQ2SEQ_SCHEMA, precast_version=__version__, files=files, parity=parity, **block
        )
        (stage / SEQ2SEQ_FILE).write_text(json.dumps(spec.to_json(), indent=2, sort_keys=True) + "\n")
        publish(stage, output)
    seconds["total"] = time.perf_counter() - t0
    on_disk = [p for p in output.rglob("*") if p.is_file()]
    return CompileReport(
        output=output,
        manifest=spec.to_json(),
        records=records,
        seconds=seconds,
        bytes=sum(p.stat().st_size for p in on_disk),
        files=len(on_disk),
    )


def _parts_parity(manifest: dict) -> dict:
    """The part's parity summary (a multi-target index: each target's)."""
    if manifest.get("kind") == "multi-target":
        return {"targets": sorted((manifest.get("targets") or {}))}
    par = manifest.get("parity") or {}
    return {"ok": bool(par.get("ok")), "target": (manifest.get("target") or {}).get("name")}


def _sources(parts, config: dict) -> list:
    """The end-to-end check's inputs: three sources of different lengths (text) or two clips (speech)."""
    rng = np.random.default_rng(7)
    if parts.speech:
        sr = 16000
        t = np.arange(5 * sr) / sr
        return [
            (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32),
            (0.1 * rng.standard_normal(3 * sr)).astype(np.float32),
        ]
    vocab, pad = parts.shape.vocab, parts.block["pad_id"]
    eos = config.get("eos_token_id")
    bad = {pad, eos} if isinstance(eos, int) else {pad}
    out = []
    for n in (12, 5, 9):
        ids = [int(x) for x in rng.integers(4, min(vocab, 30000), n) if int(x) not in bad]
        out.append(ids + ([eos] if isinstance(eos, int) else []))
    return out


def _end_to_end(stage: Path, block: dict, parts, folder: Path, config: dict, exact: bool = True) -> dict:
    """Greedy tokens of the staged artifact (all sources in one batch) == transformers' generate(). ``exact``
    False (quantized weights: each part passed its accuracy budget): the agreement is measured and reported,
    the share of generated tokens before the first difference."""
    import torch

    from precast.artifact.seq2seq_spec import Seq2SeqSpec
    from precast.runtime.seq2seq.engine import Seq2SeqEngine
    from precast.runtime.seq2seq.runner import Seq2SeqRunner

    spec = Seq2SeqSpec(schema=SEQ2SEQ_SCHEMA, precast_version="", files={}, parity={}, **block)
    runner = Seq2SeqRunner(stage, spec, num_blocks=64)
    engine = Seq2SeqEngine(runner, stage)
    sources = _sources(parts, config)
    lang = {"language": "en"} if engine.whisper is not None and engine.whisper.multilingual else {}
    feats = [engine._source(s) for s in sources]
    got = engine.generate(feats, max_new_tokens=E2E_TOKENS, num_beams=1, do_sample=False, **lang)
    hf = parts.hf
    from precast.compiler.decoder.generic_decoder import set_attention

    set_attention(hf, "eager")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # (its notes on max_length vs max_new_tokens are not the user's business)
    worst, agree = [], []
    with torch.no_grad():
        for i, (src, res) in enumerate(zip(feats, got)):
            kw = dict(max_new_tokens=E2E_TOKENS, num_beams=1, do_sample=False)
            if parts.speech:  # (Whisper's generate() returns the tokens after the decoder prompt)
                prompt = res.sequences[0][: res.prompt_len]
                ref = hf.generate(
                    input_features=torch.from_numpy(src[None]), decoder_input_ids=torch.tensor([prompt]), **kw
                )[0].tolist()
                ref = ref if ref[: len(prompt)] == prompt else prompt + ref
            else:
                ref = hf.generate(input_ids=torch.tensor([src]), **kw)[0].tolist()
            mine = res.sequences[0]
            ref = _strip(ref, engine.settings)
            if not exact:
                same = next(
                    (j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref))
                )
                agree.append((same - res.prompt_len) / max(1, len(ref) - res.prompt_len))
            elif ref != mine[: len(ref)] or len(mine) != len(ref):
                raise ParityError(
                    f"{folder}: the compiled model's greedy tokens differ from transformers' generate() on "
                    f"source {i}: {mine[:12]}... vs {ref[:12]}..."
                )
            worst.append(len(mine) - res.prompt_len)
    if not exact:
        return {
            "ok": True,
            "sources": len(sources),
            "identical": min(agree) == 1.0,
            "prefix_agreement": round(sum(agree) / len(agree), 4),
        }
    return {"ok": True, "sources": len(sources), "tokens": sum(worst), "identical": True}


def _strip(seq: list[int], settings) -> list[int]:
    """HF pads a batch row after its EOS; a batch of one has none, but drop trailing pads all the same."""
    pad = settings.effective_pad_token_id
    eos = set(settings.eos_token_id)
    for j, t in enumerate(seq[1:], 1):
        if t in eos:
            return seq[: j + 1]
    while len(seq) > 1 and pad is not None and seq[-1] == pad and pad not in eos:
        seq = seq[:-1]
    return seq
