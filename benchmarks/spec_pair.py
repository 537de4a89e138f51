"""A trained target LM and a much smaller trained draft LM sharing one tokenizer, for speculative decoding.

    python benchmarks/spec_pair.py --work .cache/bench-spec

Random weights measure nothing for acceptance, so ``spec_pair(work)`` trains both with
scripts/train_tiny_lm.py on tests/data/web_genesis_exodus.txt (public domain) and caches the Hugging
Face folders under ``work``, keyed by a hash of the script, the text and the settings (as
tests/llm/trained_lm.py does). The target is trained first; the draft reuses its tokenizer.json byte for
byte. Neither the tokenizer nor either model sees the held-out split (the last 10% of the text,
``split_text``); ``heldout_prompts`` cuts benchmark prompts from it.

The CLI measures, in plain torch, how often the draft's greedy token equals the target's greedy token
given the target's prefix (the per-token acceptance ``a`` of greedy speculation), the expected tokens
per verify step E(K) = (1 - a^(K+1)) / (1 - a), the same simulated on the sequences, and each model's
perplexity on the held-out split and on the end of the training split (memorisation check).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["DRAFT", "TARGET", "TEXT", "acceptance_runs", "heldout_prompts", "heldout_text", "spec_pair"]

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "tests" / "data" / "web_genesis_exodus.txt"
SCRIPT = REPO / "scripts" / "train_tiny_lm.py"
THREADS = 2

# Sized on 2 idle cores (torch 2.13 CPU): the target ~5 s a step (about 17 minutes), the draft ~0.35 s a
# step (under 3 minutes); twice that on busy cores. The ~93k-token training split is seen ~9 times by
# the target, ~18 by the draft.
_SHAPE = {"vocab": 2048, "max_positions": 512, "seq": 256, "batch": 16, "seed": 0, "threads": THREADS}
TARGET = {
    **_SHAPE,
    **{"hidden": 512, "intermediate": 1536, "layers": 8, "heads": 8, "kv_heads": 4},
    **{"steps": 200, "lr": 0.002, "warmup": 20},
}
DRAFT = {
    **_SHAPE,
    **{"hidden": 192, "intermediate": 576, "layers": 2, "heads": 4, "kv_heads": 2},
    **{"steps": 400, "lr": 0.003, "warmup": 30},
}


def _key(settings: dict, *parents: str) -> str:
    h = hashlib.sha256()
    for blob in (SCRIPT.read_bytes(), TEXT.read_bytes(), json.dumps(settings, sort_keys=True).encode()):
        h.update(hashlib.sha256(blob).digest())
    for parent in parents:  # the draft's key covers the target whose tokenizer it reuses
        h.update(parent.encode())
    return h.hexdigest()[:16]


def _train(out: Path, settings: dict, tokenizer: Path | None = None, log=print) -> None:
    """Run the training script into a temporary folder, then rename it to ``out`` (the cache entry)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    if tokenizer is not None:
        args.append(f"--tokenizer={tokenizer}")
    env = {**os.environ, "OMP_NUM_THREADS": str(settings["threads"])}
    logfile = out.with_name(out.name + ".log")
    log(f"training {out.name} (log: {logfile})")
    t0 = time.perf_counter()
    with open(logfile, "w") as f:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--text", str(TEXT), "--out", str(tmp), *args],
            check=False,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if done.returncode != 0:
        raise RuntimeError(f"training {out.name} failed:\n{logfile.read_text()[-3000:]}")
    tmp.rename(out)
    log(f"trained {out.name} in {time.perf_counter() - t0:.0f} s")


def spec_pair(work: Path, log=print) -> tuple[Path, Path]:
    """(target_dir, draft_dir): cached trained Hugging Face folders (config.json, model.safetensors,
    tokenizer.json, training.json), trained on first use. A lock keeps two processes from training at once.
    """
    work = Path(work).resolve()
    tkey = _key(TARGET)
    target, draft = work / f"target-{tkey}", work / f"draft-{_key(DRAFT, tkey)}"
    if (target / "training.json").is_file() and (draft / "training.json").is_file():
        return target, draft
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "spec-pair.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "training.json").is_file():  # re-checked: another process may have trained it
            _train(target, TARGET, log=log)
        if not (draft / "training.json").is_file():
            _train(draft, DRAFT, tokenizer=target / "tokenizer.json", log=log)
    return target, draft


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_tiny_lm
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return train_tiny_lm


def heldout_text() -> tuple[str, str]:
    """(training text, held-out text), split exactly as the training script splits it."""
    script = _script()
    return script.split_text(TEXT.read_text(encoding="utf-8"), script.TinyLMConfig().holdout)


def heldout_prompts(n: int, prompt_tokens: int, tokenizer) -> list[list[int]]:
    """``n`` prompts of ``prompt_tokens`` token ids cut from the held-out text at distinct, non-overlapping
    offsets spread over it. ``tokenizer``: a ``tokenizers.Tokenizer`` (the pair's tokenizer.json)."""
    ids = tokenizer.encode(heldout_text()[1]).ids
    if n * prompt_tokens > len(ids):
        raise ValueError(f"{n} prompts of {prompt_tokens} tokens do not fit the {len(ids)} held-out tokens")
    stride = (len(ids) - prompt_tokens) // max(1, n - 1) if n > 1 else 0
    return [ids[i * stride : i * stride + prompt_tokens] for i in range(n)]


def acceptance_runs(match: list[bool], k: int) -> tuple[int, int]:
    """Simulate greedy speculation with ``k`` draft tokens a step over one sequence, where ``match[i]``
    says whether the draft's greedy token at position i (given the target's prefix) is the target's.

    Returns (verify steps, draft tokens accepted); each step also emits the target's own token (the
    correction, or the bonus after k accepted), so tokens emitted = accepted + steps. Only steps whose
    k + 1 positions all lie in the sequence count: a step cut short by its end would bias the mean down.
    """
    i, steps, accepted = 0, 0, 0
    while i + k < len(match):
        run = 0
        while run < k and match[i + run]:
            run += 1
        steps, accepted, i = steps + 1, accepted + run, i + run + 1
    return steps, accepted


def _greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's greedy continuation (KV cache, no stop token: the text has none)."""
    import torch

    out, cache = [], None
    x = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            r = model(input_ids=x, cache=cache, use_cache=True)
            cache, nxt = r.cache, int(r.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


def _argmax_after(model, seq: list[int], start: int):
    """The model's greedy next token at each position from ``start`` on, given ``seq``'s prefix."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([seq[:-1]])).logits[0, start - 1 :].argmax(-1).tolist()


def _ppl(model, ids: list[int], seq: int) -> float:
    import numpy as np

    return _script()._heldout_ppl(model, np.array(ids, dtype=np.int64), seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-spec")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

    import torch
    import transformers
    from tokenizers import Tokenizer

    torch.set_num_threads(THREADS)
    target_dir, draft_dir = spec_pair(a.work, log=lambda m: print(m, file=sys.stderr))
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    if (target_dir / "tokenizer.json").read_bytes() != (draft_dir / "tokenizer.json").read_bytes():
        raise RuntimeError(f"{draft_dir}: tokenizer.json differs from the target's {target_dir}")
    target = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    draft = transformers.AutoModelForCausalLM.from_pretrained(str(draft_dir)).eval()

    train_text, held = heldout_text()
    held_ids = tok.encode(held).ids
    train_tail = tok.encode(train_text).ids[-len(held_ids) :]  # as many training tokens as held-out ones
    models = {}
    for name, model, d in (("target", target, target_dir), ("draft", draft, draft_dir)):
        info = json.loads((d / "training.json").read_text())
        models[name] = {
            "dir": str(d),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "train_seconds": info["seconds"],
            "steps": info["config"]["steps"],
            "last_batch_loss": info["train_loss"],
            "train_tail_ppl": round(_ppl(model, train_tail, info["config"]["seq"]), 2),
            "heldout_ppl": round(_ppl(model, held_ids, info["config"]["seq"]), 2),
        }

    prompts = heldout_prompts(a.prompts, a.prompt_tokens, tok)
    matches, self_consistent, t0 = [], 0, time.perf_counter()
    for p in prompts:
        cont = _greedy(target, p, a.new_tokens)
        seq = p + cont
        # the target's full-sequence argmax should reproduce its cached decode (near-ties may flip)
        self_consistent += sum(x == y for x, y in zip(_argmax_after(target, seq, len(p)), cont))
        matches.append([x == y for x, y in zip(_argmax_after(draft, seq, len(p)), cont)])
    gen_s = time.perf_counter() - t0
    total = sum(len(m) for m in matches)
    acc = sum(map(sum, matches)) / total
    per_k = {}
    for k in (2, 4, 6, 8):
        steps, accepted = map(sum, zip(*(acceptance_runs(m, k) for m in matches)))
        expected = (1 - acc ** (k + 1)) / (1 - acc) if acc < 1 else k + 1.0
        per_k[k] = {
            "expected_tokens_per_step": round(expected, 3),
            "sim_accepted_per_step": round(accepted / steps, 3),
            "sim_tokens_per_step": round((accepted + steps) / steps, 3),
        }
    result = {
        "models": models,
        "prompts": len(prompts),
        "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new_tokens,
        "acceptance": round(acc, 4),
        "acceptance_per_prompt": [round(sum(m) / len(m), 3) for m in matches],
        "target_self_consistency": round(self_consistent / total, 4),
        "per_k": per_k,
        "measure_seconds": round(gen_s, 1),
    }
    if a.json:
        print(json.dumps(result))
        return
    print(
        f"{'model':8} {'params':>8} {'steps':>6} {'train s':>8} {'last loss':>9} {'train ppl':>9} {'held ppl':>9}"
    )
    for name, m in models.items():
        print(
            f"{name:8} {m['params_m']:7.2f}M {m['steps']:6d} {m['train_seconds']:8.0f} "
            f"{m['last_batch_loss']:9.3f} {m['train_tail_ppl']:9.2f} {m['heldout_ppl']:9.2f}"
        )
    print(
        f"\n{len(prompts)} held-out prompts x {a.prompt_tokens} tokens, target greedy {a.new_tokens} tokens: "
        f"acceptance a = {acc:.3f} (per prompt {min(result['acceptance_per_prompt']):.2f}-"
        f"{max(result['acceptance_per_prompt']):.2f}), target self-consistency "
        f"{result['target_self_consistency']:.3f}"
    )
    print(f"\n{'K':>2} {'E tokens/step':>14} {'sim tokens/step':>16} {'sim accepted/step':>18}")
    for k, r in per_k.items():
        print(
            f"{k:2d} {r['expected_tokens_per_step']:14.3f} {r['sim_tokens_per_step']:16.3f} "
            f"{r['sim_accepted_per_step']:18.3f}"
        )
    print(f"\ntarget: {target_dir}\ndraft:  {draft_dir}")


if __name__ == "__main__":
    main()
