"""A tiny Llama-style LM trained on the shipped public-domain text (tests/data/), built on demand and cached.

``trained_lm_dir()`` runs scripts/train_tiny_lm.py once (a fixed number of steps, seeded, 2 threads) and
caches the Hugging Face folder under tests/.cache/ (gitignored), keyed by a hash of the script, the text
and the training settings: edit any of them and the next run retrains. A file lock keeps two test
processes from training at once. Benchmarks use it too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["FIXTURE_TRAINING", "REPO", "TEXT", "texts", "trained_lm_dir"]

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "web_genesis_exodus.txt"
SCRIPT = REPO / "scripts" / "train_tiny_lm.py"
CACHE = REPO / "tests" / ".cache"
# Small enough for CI (about a minute on 2 idle cores), long enough to learn: held-out perplexity ~40-45
# with a 1024-token vocabulary.
FIXTURE_TRAINING = {"steps": 200, "seq": 64, "batch": 16, "lr": 0.004, "seed": 0, "threads": 2}


def _key() -> str:
    h = hashlib.sha256()
    for blob in (
        SCRIPT.read_bytes(),
        TEXT.read_bytes(),
        json.dumps(FIXTURE_TRAINING, sort_keys=True).encode(),
    ):
        h.update(hashlib.sha256(blob).digest())
    return h.hexdigest()[:16]


def trained_lm_dir() -> Path:
    """The cached trained model folder (config.json, model.safetensors, tokenizer.json, training.json)."""
    out = CACHE / f"tiny-lm-{_key()}"
    if (out / "training.json").is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "tiny-lm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "training.json").is_file():  # another process trained it while we waited
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        args = [f"--{k.replace('_', '-')}={v}" for k, v in FIXTURE_TRAINING.items()]
        env = {**os.environ, "OMP_NUM_THREADS": str(FIXTURE_TRAINING["threads"])}
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--text", str(TEXT), "--out", str(tmp), *args],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0:
            raise RuntimeError(f"training the tiny LM failed:\n{done.stderr[-3000:]}")
        tmp.rename(out)
        for stale in CACHE.glob("tiny-lm-*"):  # models of older scripts/texts/settings
            if stale != out and stale.is_dir() and ".tmp" not in stale.name:
                shutil.rmtree(stale, ignore_errors=True)
    return out


def texts() -> tuple[str, str]:
    """(training text, held-out text) of the shipped text, split as the training script splits it."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from train_tiny_lm import TinyLMConfig, split_text
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return split_text(TEXT.read_text(encoding="utf-8"), TinyLMConfig().holdout)
