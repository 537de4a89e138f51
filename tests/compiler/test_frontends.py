"""Frontends: ONNX with external data, a PyTorch module:callable, and Hugging Face folder checks."""

import json
import textwrap

import numpy as np
import onnx_ir as ir
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.frontends.source import load_source, parse_input_spec
from precast.errors import ModelLoadError, UsageError
from precast.runtime import load
from tests.helpers import ort_run, tiny_mlp


def test_parse_input_spec():
    s = parse_input_spec("input_ids:int64[batch, seq]")
    assert (s.name, s.dtype, s.shape) == ("input_ids", "int64", ("batch", "seq"))
    assert parse_input_spec("x:float32[4,16]").shape == (4, 16)
    with pytest.raises(UsageError, match="expected NAME:DTYPE"):
        parse_input_spec("x[4]")
    with pytest.raises(UsageError, match="unknown dtype 'float99'"):
        parse_input_spec("x:float99[4]")


def test_onnx_with_external_data(tmp_path, rng):
    model = tiny_mlp(hidden=64)
    path = tmp_path / "ext" / "m.onnx"
    path.parent.mkdir()
    ir.save(model, path, external_data="m.weights", size_threshold_bytes=0)
    assert (path.parent / "m.weights").is_file()
    src = load_source(str(path))
    assert src.kind == "onnx"
    compile_model(str(path), tmp_path / "art", CompileOptions())
    x = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(
        load(tmp_path / "art").run({"x": x})["y"],
        ort_run(tiny_mlp(hidden=64), {"x": x})[0],
        rtol=1e-5,
        atol=1e-5,
    )
    # The source hash covers the external data: change the weights, the hash changes.
    data = bytearray((path.parent / "m.weights").read_bytes())
    data[10] ^= 1
    (path.parent / "m.weights").write_bytes(bytes(data))
    assert load_source(str(path)).sha256 != src.sha256
    (path.parent / "m.weights").unlink()
    with pytest.raises(ModelLoadError, match="external data file 'm.weights' is missing"):
        load_source(str(path))


TORCH_MODULE = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, input_ids, scale):
        h = self.emb(input_ids) * scale.unsqueeze(-1)
        return torch.nn.functional.gelu(self.proj(h)).mean(dim=1)

def build():
    return Net()

def not_a_module():
    return 42
"""


@pytest.mark.slow
def test_torch_callable(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(TORCH_MODULE))
    monkeypatch.chdir(tmp_path)
    specs = [parse_input_spec("input_ids:int64[batch,seq]"), parse_input_spec("scale:float32[batch,seq]")]
    result = compile_model("mymodels:build", tmp_path / "art", CompileOptions(inputs=specs))
    m = result.manifest
    assert m["source"]["kind"] == "torch" and m["parity"]["reference"] == "torch (eager)"
    assert m["io"]["inputs"][0]["shape"] == ["batch", "seq"]
    # Run at sizes other than the export's samples (dynamic batch and sequence).
    ids = np.random.default_rng(1).integers(0, 50, size=(3, 11)).astype(np.int64)
    scale = np.random.default_rng(2).random((3, 11)).astype(np.float32)
    got = load(tmp_path / "art").run({"input_ids": ids, "scale": scale})
    import importlib

    net = importlib.import_module("mymodels").build().eval()
    with torch.no_grad():
        want = net(torch.from_numpy(ids), torch.from_numpy(scale)).numpy()
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-4, atol=1e-5)

    with pytest.raises(ModelLoadError, match="returned int, expected a torch.nn.Module"):
        load_source("mymodels:not_a_module", inputs=specs)
    with pytest.raises(ModelLoadError, match="no attribute 'nothing'"):
        load_source("mymodels:nothing", inputs=specs)
    with pytest.raises(UsageError, match="needs --input"):
        load_source("mymodels:build")


def test_hf_folder_errors(tmp_path):
    folder = tmp_path / "weird"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    # an image task on a text model: its forward takes token ids, not pixels
    with pytest.raises(
        ModelLoadError,
        match="model_type 'bert' is not a supported model for task "
        "image-feature-extraction: its forward takes \\(input_ids.*not pixel_values.*vit",
    ):
        load_source(str(folder), task="image-feature-extraction")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (folder / "pytorch_model.bin").write_bytes(b"pickle bytes")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_source(str(folder))
    (folder / "config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_source(str(folder))
    with pytest.raises(UsageError, match="unknown task 'translate'"):
        (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
        load_source(str(folder), task="translate")


def test_torch_export_holds_no_source_paths(tmp_path):
    """The exporter's per-node stack traces name absolute source paths (this file, where precast and torch are
    installed): an artifact compiled from two installs differed in bytes. None may be left in the graph."""
    torch = pytest.importorskip("torch")
    from precast.compiler.frontends.torch_export import dynamo_export

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 2

    model = dynamo_export(Net().eval(), (torch.ones(2, 4),))
    values = [
        v for node in ir.traversal.RecursiveGraphIterator(model.graph) for v in node.metadata_props.values()
    ]
    assert values, "the exporter's other node metadata (names, scopes) is kept"
    here = str(__import__("pathlib").Path(__file__).resolve().parent)
    assert not [v for v in values if here in v or "site-packages" in v]
