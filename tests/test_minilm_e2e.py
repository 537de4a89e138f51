"""End to end: all-MiniLM-L6-v2 folder -> artifact -> sentence embeddings through the runtime alone.

One compile per module (~25 s on 2 cores); every test below reuses it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "minilm_quickstart.py"

# Different lengths on purpose: the batch is padded, so pooling must honour the attention mask.
SENTENCES = [
    "Hello!",
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog.",
    "Central banks raised interest rates again this quarter to slow inflation.",
    "Ahead-of-time compilation turns a trained model into an artifact that a small runtime can load.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "¿Dónde está la biblioteca? Ich weiß es nicht — 図書館はどこですか。",
    " ".join(
        ["The committee reviewed the proposal, asked for revisions to the budget and the timeline,"]
        + ["and then approved the project after a long discussion about risks and staffing."] * 5
    ),
]


@pytest.fixture(scope="module")
def artifact(minilm_dir, tmp_path_factory) -> Path:
    from precast.compiler.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("minilm") / "minilm"
    compile_model(str(minilm_dir), out, CompileOptions())
    return out


def _mean_pool_normalize(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[:, :, None].astype(np.float64)
    pooled = (hidden.astype(np.float64) * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def _torch_embeddings(folder: Path, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """sentence-transformers' recipe for this model; transformers' own tokenizer, default attention."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    batch = tok(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state.numpy()
    mask = batch["attention_mask"].numpy()
    return _mean_pool_normalize(hidden, mask), batch["input_ids"].numpy()


def _runtime_embeddings(artifact: Path, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Only precast.runtime + tokenizers, reading the tokenizer shipped inside the artifact."""
    from tokenizers import Tokenizer

    from precast.runtime import load

    tok = Tokenizer.from_file(str(artifact / "tokenizer" / "tokenizer.json"))
    tok.enable_truncation(256)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], dtype=np.int64)
    mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
    types = np.array([e.type_ids for e in enc], dtype=np.int64)
    model = load(artifact)
    hidden = model.run({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[
        "last_hidden_state"
    ]
    return _mean_pool_normalize(hidden, mask), ids


def test_embeddings_match_pytorch(artifact, minilm_dir):
    ours, our_ids = _runtime_embeddings(artifact, SENTENCES)
    ref, ref_ids = _torch_embeddings(minilm_dir, SENTENCES)
    lengths = (our_ids != 0).sum(axis=1)
    assert lengths.min() < 8 and lengths.max() > 64, "the batch must mix short and long sentences"
    np.testing.assert_array_equal(our_ids, ref_ids)  # shipped tokenizer == transformers' tokenizer
    cosines = (ours * ref).sum(axis=1)
    assert cosines.min() >= 0.9999, f"per-sentence cosine to PyTorch: {np.round(cosines, 6).tolist()}"
    # Real sentences, real semantics: the embeddings are not all alike.
    sim = ours @ ours.T
    assert sim[np.triu_indices(len(SENTENCES), 1)].min() < 0.5


def test_padding_does_not_change_an_embedding(artifact):
    alone, _ = _runtime_embeddings(artifact, SENTENCES[1:2])
    batched, _ = _runtime_embeddings(artifact, SENTENCES)
    assert float(alone[0] @ batched[1]) >= 0.99999


def test_manifest_records_tokenizer_and_parity(artifact):
    from precast.artifact.manifest import read_manifest

    m = read_manifest(artifact)
    tokenizer_files = {
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/vocab.txt",
        "tokenizer/special_tokens_map.json",
    }
    assert tokenizer_files <= set(m.extra_files)
    assert tokenizer_files <= set(m.files)  # hashed, so `precast verify` covers them
    assert m.source["kind"] == "hf" and m.source["model_type"] == "bert"
    parity = m.parity
    assert parity["ok"] is True
    assert parity["reference"].startswith("torch")
    assert set(parity["outputs"]) == {"last_hidden_state", "pooler_output"}
    assert all(
        r["ok"] and r["cosine"] >= parity["tolerance"]["min_cosine"] for r in parity["outputs"].values()
    )
    assert parity["tolerance"]["min_cosine"] >= 0.9999
    for rel in [*parity["inputs"].values(), *parity["expected"].values()]:
        assert rel in m["files"] and (artifact / rel).is_file()


def _load_quickstart():
    spec = importlib.util.spec_from_file_location("minilm_quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_reuses_a_verified_artifact(artifact, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART), "--output", str(artifact)],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "existing artifact verified" in proc.stdout
    assert "compiling" not in proc.stdout
    assert "cosine similarity" in proc.stdout and "most similar pair" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_quickstart_refuses_a_tampered_artifact(artifact, tmp_path):
    copy = tmp_path / "minilm"
    shutil.copytree(artifact, copy)
    assert _load_quickstart().artifact_is_usable(copy)[0]
    (copy / "tokenizer" / "vocab.txt").write_text("[PAD]\n")
    ok, why = _load_quickstart().artifact_is_usable(copy)
    assert not ok and "tokenizer/vocab.txt" in why
