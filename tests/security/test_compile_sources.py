"""Issue 14 (trust boundary), compile side: what a source may make precast read.

Every file precast reads on a model's behalf resolves inside the model's folder (after symlinks): external
data of initializers *and* of Constant-node attributes (relative to the model file, never the working
directory), and every file precast copies out of a Hugging Face folder into the artifact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from precast.compiler.frontends.hf_source import folder_hash_and_ship
from precast.errors import ModelLoadError
from precast.runtime import load
from tests.helpers import one_line_error

CONST = np.arange(8, dtype=np.float32).reshape(2, 4)


def _external(arr: np.ndarray, name: str, location: str) -> TensorProto:
    t = numpy_helper.from_array(arr, name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(arr.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _save(nodes, path: Path) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 10
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return path


def _constant_add(path: Path, location: str) -> Path:
    """y = x + Constant(value=<external tensor at ``location``>)."""
    const = helper.make_node("Constant", [], ["c"], name="c", value=_external(CONST, "c", location))
    return _save([const, helper.make_node("Add", ["x", "c"], ["y"])], path)


def _error(r, *needles: str) -> str:
    return one_line_error(r, 1, *needles)


# --- item 3: Constant-attribute external data ---------------------------------------------------------


def test_constant_external_data_is_read_from_the_model_folder_not_the_cwd(cli, tmp_path, monkeypatch):
    model = _constant_add(tmp_path / "model" / "m.onnx", "w.bin")
    (tmp_path / "model" / "w.bin").write_bytes(CONST.tobytes())
    work = tmp_path / "work"
    work.mkdir()
    (work / "w.bin").write_bytes((CONST * 100).tobytes())  # a decoy of the same name in the cwd
    monkeypatch.chdir(work)
    r = cli("compile", model, "-o", tmp_path / "art", "-q")
    assert r.code == 0, r.err
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(load(tmp_path / "art").run({"x": x})["y"], x + CONST)
    # the data is in the artifact: it runs from anywhere, without w.bin
    monkeypatch.chdir(tmp_path)
    np.testing.assert_array_equal(load(tmp_path / "art").run({"x": x})["y"], x + CONST)


def test_constant_external_data_inside_a_subgraph_is_loaded(cli, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(CONST.tobytes())
    const = helper.make_node("Constant", [], ["c"], value=_external(CONST, "c", "w.bin"))
    then = helper.make_graph(
        [const, helper.make_node("Add", ["x", "c"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 4])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 4])],
    )
    cond = helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True)))
    model = _save(
        [cond, helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        tmp_path / "model" / "m.onnx",
    )
    assert cli("compile", model, "-o", tmp_path / "art", "-q").code == 0
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(load(tmp_path / "art").run({"x": x})["y"], x + CONST)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_constant_external_data_outside_the_model_folder_is_refused(cli, tmp_path, how):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(CONST.tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    location = {"dotdot": "../secret.bin", "absolute": str(secret), "symlink": "w.bin"}[how]
    if how == "symlink":
        (folder / "w.bin").symlink_to(secret)
    model = _constant_add(folder / "m.onnx", location)
    _error(cli("compile", model, "-o", tmp_path / "art", "-q"), str(model), "outside the model folder")
    assert not (tmp_path / "art").exists()


def test_missing_constant_external_data_is_named(cli, tmp_path):
    model = _constant_add(tmp_path / "model" / "m.onnx", "gone.bin")
    _error(cli("compile", model, "-o", tmp_path / "art", "-q"), "gone.bin", "missing")


# --- item 2: files copied out of a Hugging Face folder ------------------------------------------------


def test_symlinked_tokenizer_file_outside_the_folder_is_refused(tmp_path):
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (folder / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(ModelLoadError, match="tokenizer_config.json.*outside the model folder"):
        folder_hash_and_ship(folder, ("tokenizer.json", "tokenizer_config.json"))


def test_symlinks_that_stay_inside_the_folder_or_the_hub_cache_are_fine(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "real_tokenizer.json").write_text("{}")
    (folder / "tokenizer.json").symlink_to("real_tokenizer.json")
    _sha, ship = folder_hash_and_ship(folder, ("tokenizer.json",))
    assert ship == {"tokenizer/tokenizer.json": folder / "tokenizer.json"}
    # the Hugging Face hub cache: snapshots/<rev>/<file> -> ../../blobs/<sha>
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text("{}")
    snap = repo / "snapshots" / "0123"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").symlink_to("../../blobs/abc123")
    _sha, ship = folder_hash_and_ship(snap, ("tokenizer.json",))
    assert list(ship) == ["tokenizer/tokenizer.json"]


@pytest.fixture
def tiny_bert_folder(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = transformers.BertConfig(
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        num_hidden_layers=1,
        vocab_size=50,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    folder = tmp_path / "bert"
    transformers.BertModel(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_compile_refuses_a_symlinked_vocab_before_exporting(cli, tiny_bert_folder, tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2\n")
    (tiny_bert_folder / "vocab.txt").symlink_to(secret)

    def no_export(*_a, **_k):
        raise AssertionError("exported before checking the files to ship")

    monkeypatch.setattr("precast.compiler.frontends.hf_source.export_module", no_export)
    out = tmp_path / "art"
    _error(cli("compile", tiny_bert_folder, "-o", out, "-q"), "vocab.txt", "outside the model folder")
    assert not out.exists()
