"""A memory-bound INT4 target with the trained target's function: Net2Net widening (Chen et al., 2016).

    python benchmarks/spec_widen.py --work .cache/bench-spec [--hidden-factor 2] [--mlp-factor 6]

Why: the trained target (spec_pair.py, 27M parameters) is 14 MB in INT4, so its weights decode from the
CPU's cache and a verify step of K+1 rows costs what K+1 decode steps' arithmetic costs: speculation cannot
pay there (measured 1.01x). Speculation exists for targets whose weight read dominates a step, as it does
for every LLM served in INT4. Training a several-hundred-MB target on 2 cores takes many hours, so this
widens the trained one instead, exactly preserving what it computes (its greedy tokens, and so the draft's
acceptance, are the trained target's):

- hidden x h: every hidden unit is repeated h times (the embedding rows, the norm weights and the outputs
  of o_proj / down_proj tiled), so each RMSNorm sees the same mean square; the projections that read the
  hidden state (q, k, v, gate, up, lm_head) are tiled along their input and divided by h;
- MLP intermediate x m: every gate / up neuron repeated m times, down_proj's input tiled and divided by m.

The attention heads are unchanged. Every weight is a real trained value (no zero blocks for a kernel to
skip), so INT4 quantization and the weight read are those of a model of this size. Cached under ``work``
keyed by the target folder's weights and the factors; ``widened(work, target)`` returns the folder.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import sys
from pathlib import Path

__all__ = ["widened"]

HERE = Path(__file__).resolve().parent
HIDDEN_FACTOR, MLP_FACTOR = 2, 6  # 512 -> 1024 hidden, 1536 -> 9216 intermediate: ~240M parameters


def _key(target: Path, h: int, m: int) -> str:
    d = hashlib.sha256((target / "model.safetensors").read_bytes()).digest()
    return hashlib.sha256(d + f"{h},{m}".encode() + Path(__file__).read_bytes()).hexdigest()[:16]


def widened(work: Path, target: Path, h: int = HIDDEN_FACTOR, m: int = MLP_FACTOR, log=print) -> Path:
    out = work / f"target-wide-{_key(target, h, m)}"
    with open(work / "widen.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            log(f"widening {target.name} (hidden x{h}, MLP x{m}) into {out.name}")
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _widen(target, tmp, h, m, log)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


def _widen(src: Path, out: Path, h: int, m: int, log) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    cfg = AutoConfig.from_pretrained(src)
    if cfg.model_type != "llama" or getattr(cfg, "mlp_bias", False) or cfg.attention_bias:
        raise SystemExit(f"spec_widen: a bias-free Llama target is expected, got {cfg.model_type}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.head_dim = head_dim  # (the heads stay: q/k/v keep their output sizes)
    cfg.hidden_size *= h
    cfg.intermediate_size *= m
    cfg.tie_word_embeddings = False
    wide = AutoModelForCausalLM.from_config(cfg).eval()
    sd = small.state_dict()
    new = {}
    for name, w in sd.items():
        if name.endswith("embed_tokens.weight"):
            new[name] = w.repeat(1, h)
        elif name.endswith("norm.weight"):
            new[name] = w.repeat(h)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "lm_head.weight")):
            new[name] = w.repeat(1, h) / h
        elif name.endswith("o_proj.weight"):
            new[name] = w.repeat(h, 1)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            new[name] = w.repeat(m, 1).repeat(1, h) / h
        elif name.endswith("down_proj.weight"):
            new[name] = w.repeat(h, 1).repeat(1, m) / m
        elif name.endswith("rotary_emb.inv_freq"):
            new[name] = w
        else:
            raise SystemExit(f"spec_widen: no rule for {name}")
    missing, unexpected = wide.load_state_dict(new, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise SystemExit(f"spec_widen: missing {missing[:3]}, unexpected {unexpected[:3]}")
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    with torch.no_grad():
        a, b = small(ids).logits, wide(ids).logits
    err = float((a - b).abs().max() / a.abs().max())
    n = sum(p.numel() for p in wide.parameters())
    log(f"widened: {n / 1e6:.0f}M parameters, logits max rel. error vs the trained target {err:.1e}")
    if err > 1e-4:
        raise SystemExit(f"spec_widen: the widened model's logits differ (rel. error {err:.1e})")
    wide.save_pretrained(out)
    for f in ("tokenizer.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    meta = {"from": src.name, "hidden_factor": h, "mlp_factor": m, "parameters": n, "logits_rel_err": err}
    (out / "widening.json").write_text(json.dumps(meta, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=HERE.parent / ".cache" / "bench-spec")
    ap.add_argument("--hidden-factor", type=int, default=HIDDEN_FACTOR)
    ap.add_argument("--mlp-factor", type=int, default=MLP_FACTOR)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from spec_pair import spec_pair

    target, _ = spec_pair(a.work)
    print(widened(a.work, target, a.hidden_factor, a.mlp_factor))


if __name__ == "__main__":
    main()
