"""Train a tiny Llama-style causal LM on a text file and save it as a Hugging Face folder.

    python scripts/train_tiny_lm.py --text tests/data/web_genesis_exodus.txt --out /tmp/tiny-lm --steps 600

Writes config.json, model.safetensors, tokenizer.json (byte-level BPE trained on the same text) and
generation_config.json. The last ``--holdout`` fraction of the text is never trained on: it is the
held-out split for perplexity (``split_text()``). Deterministic for a given seed, torch version and
thread count. Random weights cannot show whether a quantizer (GPTQ vs RTN) keeps what a model learned;
this model has learned something (held-out perplexity far below its vocabulary size) in a few minutes
of CPU.

``--tokenizer FILE`` reuses a tokenizer.json instead of training one, so that two models (a speculative
decoding target and its draft) share a tokenizer byte for byte: it is copied as is, and its vocabulary
size must equal ``--vocab``. It should itself have been trained on the training split only (a
tokenizer.json this script wrote from the same text and ``--holdout`` is).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TinyLMConfig", "bpe_tokenizer", "load_tokenizer", "split_text", "train", "train_tokenizer"]

SPECIALS = ["<|endoftext|>", "<s>", "</s>"]


@dataclass(frozen=True)
class TinyLMConfig:
    vocab: int = 1024
    hidden: int = 128
    intermediate: int = 384
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 256
    seq: int = 128  # training sequence length
    batch: int = 16
    steps: int = 600
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    holdout: float = 0.1  # last fraction of the text kept out of training (tokenizer and model)
    threads: int = 2


def split_text(text: str, holdout: float = 0.1) -> tuple[str, str]:
    """(train, held-out): the held-out part is the last ``holdout`` of the text, cut at a line break."""
    cut = int(len(text) * (1 - holdout))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return text[:cut], text[cut:]


def bpe_tokenizer(texts, vocab: int, specials=SPECIALS):
    """A byte-level BPE tokenizer trained on ``texts`` (also used by the test fixtures' tiny models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def train_tokenizer(text: str, vocab: int):
    return bpe_tokenizer([p for p in text.split("\n\n") if p.strip()], vocab)


def load_tokenizer(path: Path, vocab: int):
    """A saved tokenizer.json, checked against the vocabulary size the model is configured for."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"tokenizer {path}: vocabulary of {tok.get_vocab_size()} tokens, --vocab is {vocab}")
    return tok


def train(
    text: str, out: Path, cfg: TinyLMConfig = TinyLMConfig(), log=print, tokenizer: Path | None = None
) -> dict:
    """Train and save; returns a summary (final train loss, held-out perplexity, seconds).

    ``tokenizer``: a tokenizer.json to reuse (copied byte for byte) instead of training one.
    """
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    train_text, held = split_text(text, cfg.holdout)
    if tokenizer is None:
        tok = train_tokenizer(train_text, cfg.vocab)
    else:
        tok = load_tokenizer(tokenizer, cfg.vocab)
    ids = np.array(tok.encode(train_text).ids, dtype=np.int64)
    held_ids = np.array(tok.encode(held).ids, dtype=np.int64)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        initializer_range=0.02,
    )
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.05)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    model.train()
    loss_val = float("nan")
    for step in range(cfg.steps):
        starts = rng.integers(0, len(ids) - cfg.seq - 1, size=cfg.batch)
        batch = torch.from_numpy(np.stack([ids[s : s + cfg.seq] for s in starts]))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss)
        if step % 100 == 0 or step == cfg.steps - 1:
            log(f"step {step:5d}  loss {loss_val:.3f}  ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    held_ppl = _heldout_ppl(model, held_ids, cfg.seq)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is None:
        tok.save(str(out / "tokenizer.json"))
    else:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    summary = {
        "config": asdict(cfg),
        "train_loss": round(loss_val, 4),
        "heldout_ppl": round(held_ppl, 3),
        "heldout_tokens": len(held_ids),
        "seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
    }
    if tokenizer is not None:
        summary["tokenizer"] = str(tokenizer)
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"held-out perplexity {held_ppl:.2f} over {len(held_ids)} tokens")
    return summary


def _heldout_ppl(model, ids, seq: int) -> float:
    """Non-overlapping windows of ``seq`` tokens (the reference for `precast eval --perplexity --stride seq`)."""
    import torch

    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq):
            w = torch.from_numpy(ids[s : s + seq][None])
            if w.shape[1] < 2:
                break
            loss = model(input_ids=w, labels=w).loss
            nll += float(loss) * (w.shape[1] - 1)
            n += w.shape[1] - 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json instead of training one")
    for f in TinyLMConfig.__dataclass_fields__.values():
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    a = ap.parse_args()
    cfg = TinyLMConfig(**{k: getattr(a, k) for k in TinyLMConfig.__dataclass_fields__})
    print(json.dumps(train(a.text.read_text(encoding="utf-8"), a.out, cfg, tokenizer=a.tokenizer)))


if __name__ == "__main__":
    main()
