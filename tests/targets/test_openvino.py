"""openvino: ONNX -> OpenVINO IR via the openvino package, run on CPU with fp32 parity and a per-host cache."""

import json

import numpy as np
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from precast.runtime import load
from tests.helpers import ort_run, tiny_mlp

pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def ov_art(mlp_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ov") / "art"
    compile_model(str(mlp_path), out, CompileOptions(targets=["openvino"]))
    return out


def test_ir_artifact_runs_dynamic_batch_at_fp32(ov_art, rng, tmp_path, monkeypatch):
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path / "cache"))
    manifest = json.loads((ov_art / "manifest.json").read_text())
    assert manifest["target"]["backend"] == "openvino" and manifest["parity"]["ok"]
    assert {"model.xml", "model.bin"} <= set(manifest["files"])
    model = load(ov_art)
    assert model.providers == ["OpenVINO:CPU"]
    for batch in (1, 5):  # symbolic batch stays dynamic in the IR
        x = rng.standard_normal((batch, 8)).astype(np.float32)
        np.testing.assert_allclose(
            model.run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-4, atol=1e-4
        )
    assert any(
        (tmp_path / "cache" / "openvino").iterdir()
    )  # compiled blob cached per host, not in the artifact


def test_bad_option(mlp_path, tmp_path):
    with pytest.raises(UsageError, match="inference_precision"):
        compile_model(
            str(mlp_path),
            tmp_path / "a",
            CompileOptions(targets=["openvino"], target_options={"inference_precision": "f64"}),
        )


def test_edited_ir_is_refused(ov_art, tmp_path):
    import shutil

    from precast.errors import IntegrityError

    copy = tmp_path / "copy"
    shutil.copytree(ov_art, copy)
    (copy / "model.xml").write_text((copy / "model.xml").read_text().replace("MatMul", "MatMul "))
    with pytest.raises(IntegrityError, match="model.xml"):
        load(copy)
