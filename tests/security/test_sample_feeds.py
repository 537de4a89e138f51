"""Issue 14 (trust boundary), compile side: the sample data precast generates for a model.

A model (or an --input/--dim) may claim any static size; precast checks the bytes its generated sample
and export feeds would need before allocating them, and fails with one line naming the input. A rank-0
bool input is an ordinary input: it compiles, verifies and runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from precast.artifact.manifest import TensorSpec
from precast.errors import UsageError
from precast.ir.parity import make_sample_feeds
from precast.runtime import load
from tests.helpers import one_line_error


def _save(path: Path, op: str, dtype, in_shape, out_shape=None) -> Path:
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", dtype, in_shape)],
        [helper.make_tensor_value_info("y", dtype, in_shape if out_shape is None else out_shape)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 10
    onnx.save(proto, str(path))
    return path


_error = one_line_error


# --- item 5: huge static dims ---------------------------------------------------------------------------


def test_onnx_with_huge_static_dims_fails_with_one_line(cli, tmp_path):
    model = _save(tmp_path / "big.onnx", "Relu", TensorProto.FLOAT, [100000, 100000])
    line = _error(
        cli("compile", model, "-o", tmp_path / "art", "-q"),
        1,
        "input 'x'",
        "[100000, 100000] float32",
        "40.0 GB",
        "--sample-inputs",
    )
    assert "1.0 GiB" in line  # the cap is named
    assert not (tmp_path / "art").exists()


def test_huge_dim_value_fails_with_one_line(cli, tmp_path):
    model = _save(tmp_path / "m.onnx", "Relu", TensorProto.FLOAT, ["batch", 8])
    _error(
        cli("compile", model, "-o", tmp_path / "art", "-q", "--dim", "batch=1000000000"),
        1,
        "input 'x'",
        "[1000000000, 8] float32",
        "32.0 GB",
    )


def test_the_cap_counts_all_inputs_together():
    from precast.ir.parity import MAX_SAMPLE_BYTES

    half = MAX_SAMPLE_BYTES // 2 // 4 + 1024  # float32 elements: each input alone fits, both do not
    specs = [TensorSpec("a", "float32", (half,)), TensorSpec("b", "float32", (half,))]
    with pytest.raises(UsageError, match="input 'b'.*sample data"):
        make_sample_feeds(None, specs)
    small = make_sample_feeds(None, [TensorSpec("a", "float32", (2, 3))])
    assert small["a"].shape == (2, 3)


def test_torch_input_with_huge_static_dims_fails_before_export(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "bigmods.py").write_text("import torch\n\ndef build():\n    return torch.nn.ReLU()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _error(
        cli("compile", "bigmods:build", "-i", "x:float32[100000,100000]", "-o", tmp_path / "art", "-q"),
        1,
        "input 'x'",
        "[100000, 100000] float32",
        "40.0 GB",
    )
    assert not (tmp_path / "art").exists()


# --- item 6: rank-0 bool inputs ---------------------------------------------------------------------------


def test_rank0_bool_input_compiles_and_runs(cli, tmp_path):
    model = _save(tmp_path / "not.onnx", "Not", TensorProto.BOOL, [])
    art = tmp_path / "art"
    r = cli("compile", model, "-o", art, "-q")
    assert r.code == 0, r.err
    feeds = tmp_path / "feeds.json"
    feeds.write_text(json.dumps({"x": True}))
    r = cli("run", art, "-i", feeds, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out) == {"y": False}
    np.savez(tmp_path / "feeds.npz", x=np.array(False))
    r = cli("run", art, "-i", tmp_path / "feeds.npz", "--json")
    assert r.code == 0 and json.loads(r.out) == {"y": True}, r.err
    assert load(art).run({"x": np.array(True)})["y"].shape == ()
    assert cli("verify", art, "-q").code == 0


def test_json_bool_feeds_take_true_false_or_0_1_only(cli, tmp_path):
    model = _save(tmp_path / "not.onnx", "Not", TensorProto.BOOL, [2])
    art = tmp_path / "art"
    assert cli("compile", model, "-o", art, "-q").code == 0
    feeds = tmp_path / "feeds.json"
    feeds.write_text(json.dumps({"x": [1, 0]}))
    r = cli("run", art, "-i", feeds, "--json")
    assert r.code == 0 and json.loads(r.out) == {"y": [False, True]}, r.err
    feeds.write_text(json.dumps({"x": [2, 0]}))  # not a bool: astype(bool) would call it True, silently
    _error(cli("run", art, "-i", feeds), 1, "input 'x'", "bool")
