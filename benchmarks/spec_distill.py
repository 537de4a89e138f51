"""Distil the speculative draft towards its target: the draft's next-token distribution is trained (KL) to the
target's on the same training text. Drafts are trained this way in practice (a draft is only as useful as its
agreement with its target); a draft trained on the text alone learns the text, not what the target predicts.

    python benchmarks/spec_distill.py --work .cache/bench-spec [--steps 300]

``distilled(work, target, draft)`` returns the distilled draft's Hugging Face folder, trained once from
``draft``'s weights (warm start) and cached under ``work`` keyed by this script and both models' weights. Only
the training split of tests/data's text is read (spec_pair.heldout_text()[0]); the held-out part stays unseen.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {"steps": 300, "batch": 16, "seq": 128, "lr": 1e-3, "seed": 0, "threads": 2, "temperature": 1.0}


def _key(target: Path, draft: Path, settings: dict) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for folder in (target, draft):
        h.update((folder / "model.safetensors").read_bytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def distilled(work: Path, target: Path, draft: Path, settings: dict = SETTINGS, log=print) -> Path:
    out = work / f"draft-distilled-{_key(target, draft, settings)}"
    if (out / "distill.json").is_file():
        return out
    with open(work / "distill.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "distill.json").is_file():
            _distil(target, draft, out, settings, log)
    return out


def _distil(target: Path, draft: Path, out: Path, s: dict, log) -> None:
    import numpy as np
    import torch
    import transformers
    from spec_pair import heldout_text
    from tokenizers import Tokenizer

    torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    ids = np.array(tok.encode(heldout_text()[0]).ids, dtype=np.int64)  # the training split only
    teacher = transformers.AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True).eval()
    student = transformers.AutoModelForCausalLM.from_pretrained(str(draft), local_files_only=True)
    opt = torch.optim.AdamW(student.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(s["seed"])
    t0 = time.perf_counter()
    student.train()
    agree = []
    for step in range(s["steps"]):
        starts = rng.integers(0, len(ids) - s["seq"] - 1, size=s["batch"])
        batch = torch.from_numpy(np.stack([ids[i : i + s["seq"]] for i in starts]))
        with torch.no_grad():
            p = torch.softmax(teacher(input_ids=batch).logits / s["temperature"], dim=-1)
        logq = torch.log_softmax(student(input_ids=batch).logits / s["temperature"], dim=-1)
        loss = -(p * logq).sum(-1).mean()  # cross-entropy to the teacher (KL up to its entropy)
        for g in opt.param_groups:
            g["lr"] = s["lr"] * min(1.0, (step + 1) / 20)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        agree.append(float((logq.argmax(-1) == p.argmax(-1)).float().mean()))
        if step % 50 == 0 or step == s["steps"] - 1:
            log(
                f"distil step {step:4d}  loss {float(loss):.3f}  argmax agreement {np.mean(agree[-50:]):.3f}"
                f"  ({time.perf_counter() - t0:.0f} s)"
            )
    student.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    student.save_pretrained(str(tmp), safe_serialization=True)
    for name in ("tokenizer.json", "generation_config.json"):
        if (draft / name).is_file():
            shutil.copy(draft / name, tmp / name)
    summary = {
        "settings": s,
        "teacher": str(target),
        "from": str(draft),
        "agreement_last50": float(np.mean(agree[-50:])),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / "distill.json").write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    import sys

    sys.path.insert(0, str(HERE))
    from spec_pair import spec_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=HERE.parent / ".cache" / "bench-spec")
    ap.add_argument("--steps", type=int, default=SETTINGS["steps"])
    a = ap.parse_args()
    target, draft = spec_pair(a.work)
    print(distilled(a.work, target, draft, {**SETTINGS, "steps": a.steps}))


if __name__ == "__main__":
    main()
