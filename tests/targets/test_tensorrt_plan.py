"""tensorrt without a GPU: a build plan (prepared ONNX, profiles, precision, build script), said plainly."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from precast.runtime import TargetUnavailableError, load
from precast.runtime.backends import tensorrt as tensorrt_backend
from precast.targets.tensorrt_target import parse_profile
from tests.helpers import ort_run, tiny_mlp

no_gpu = pytest.mark.skipif(
    tensorrt_backend.gpu_info()[0], reason="this host has a GPU: the engine path runs instead"
)


@pytest.fixture(scope="module")
def plan(mlp_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "plan"
    notes = []
    compile_model(
        str(mlp_path),
        out,
        CompileOptions(targets=["tensorrt"], target_options={"profile": "batch=1::16"}),
        progress=notes.append,
    )
    return out, notes


@no_gpu
def test_plan_contents_and_plain_note(plan, rng):
    out, notes = plan
    block = json.loads((out / "manifest.json").read_text())["target"]
    assert (
        block["backend"] == "tensorrt-plan"
        and block["engine_built"] is False
        and "libcuda" in block["why_plan"]
    )
    assert any("build plan only, no engine" in n for n in notes)
    plan_json = json.loads((out / "plan.json").read_text())
    assert plan_json["profiles"] == {"x": {"min": [1, 8], "opt": [2, 8], "max": [16, 8]}}
    assert plan_json["precision"] == "fp16" and plan_json["engine_tolerance"]["atol"] == 1e-2
    assert block["prepared_with"].startswith("onnx-graphsurgeon")
    # The prepared graph is what the engine gets: constants folded, same numbers as the source.
    prepared = onnx.load(str(out / "model.onnx"))
    assert "Mul" not in [n.op_type for n in prepared.graph.node]
    x = rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(
        ort_run(prepared, {"x": x})[0], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5
    )


@no_gpu
def test_runtime_refuses_plan_and_script_refuses_without_gpu(plan, tmp_path):
    out, _ = plan
    with pytest.raises(TargetUnavailableError, match="build plan, not an engine: run .*build_engine.py"):
        load(out)
    r = subprocess.run(
        [sys.executable, str(out / "build_engine.py"), str(out), str(tmp_path / "eng")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "no NVIDIA GPU" in r.stderr and not (tmp_path / "eng").exists()


def _fake_engine(tmp_path, **lock):
    from precast.artifact.manifest import sha256_file

    art = tmp_path / "eng"
    art.mkdir()
    (art / "model.engine").write_bytes(b"not really an engine")
    io = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}], "outputs": []}
    manifest = {
        "schema_version": 1,
        "files": {"model.engine": sha256_file(art / "model.engine")},
        "io": io,
        "target": {"name": "tensorrt", "backend": "tensorrt", "model": "model.engine", **lock},
    }
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def test_runtime_checks_gpu_before_tensorrt(tmp_path, monkeypatch):
    art = _fake_engine(tmp_path, tensorrt_version="10.9.0", compute_capability="9.0")
    monkeypatch.setattr(
        tensorrt_backend, "gpu_info", lambda: (False, "no NVIDIA driver (libcuda.so.1 not found)", None)
    )
    monkeypatch.setitem(
        sys.modules, "tensorrt", None
    )  # importing it would fail loudly: it must not be reached
    with pytest.raises(TargetUnavailableError, match="needs an NVIDIA GPU: no NVIDIA driver"):
        load(art)


def test_runtime_refuses_other_gpu_and_other_tensorrt(tmp_path, monkeypatch):
    import types

    art = _fake_engine(tmp_path, tensorrt_version="10.9.0", compute_capability="9.0")
    monkeypatch.setattr(tensorrt_backend, "gpu_info", lambda: (True, "", "8.6"))
    with pytest.raises(TargetUnavailableError, match="built for GPU compute capability 9.0, this GPU is 8.6"):
        load(art)
    monkeypatch.setattr(tensorrt_backend, "gpu_info", lambda: (True, "", "9.0"))
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    with pytest.raises(TargetUnavailableError, match="built with TensorRT 10.9.0, this host has 10.3.0"):
        load(art)


@pytest.mark.parametrize("text, msg", [("batch=1:8", "DIM=MIN:OPT:MAX"), ("batch=a:b:c", "DIM=MIN:OPT:MAX")])
def test_profile_syntax(text, msg):
    with pytest.raises(UsageError, match=msg):
        parse_profile(text)


@pytest.mark.parametrize(
    "opt, msg",
    [
        ({"profile": "seq=1:2:3"}, "names dim 'seq'"),
        ({"profile": "batch=8:2:16"}, "MIN <= OPT <= MAX"),
        ({"precision": "fp4"}, "option .precision. must be one of fp32|fp16"),
    ],
)
def test_bad_options(mlp_path, tmp_path, opt, msg):
    with pytest.raises(UsageError, match=msg):
        compile_model(str(mlp_path), tmp_path / "a", CompileOptions(targets=["tensorrt"], target_options=opt))


@pytest.mark.gpu
def test_engine_build_and_parity_on_gpu(mlp_path, tmp_path, rng):
    if not tensorrt_backend.tensorrt_available()[0]:
        pytest.skip(tensorrt_backend.tensorrt_available()[1])
    out = tmp_path / "eng"
    result = compile_model(
        str(mlp_path), out, CompileOptions(targets=["tensorrt"], target_options={"profile": "batch=1::16"})
    )
    block = result.manifest["target"]
    assert block["backend"] == "tensorrt" and block["compute_capability"] == tensorrt_backend.gpu_info()[2]
    x = rng.standard_normal((7, 8)).astype(np.float32)
    got = load(out).run({"x": x})["y"]
    np.testing.assert_allclose(got, ort_run(tiny_mlp(), {"x": x})[0], rtol=2e-2, atol=2e-2)
