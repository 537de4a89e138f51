"""The runtime alone: load, integrity, IO checks, and the dependency rule (numpy + onnxruntime only)."""

import json

import numpy as np
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from precast.runtime import (
    ArtifactError,
    InputError,
    IntegrityError,
    SchemaVersionError,
    load,
)
from tests.helpers import make_model, ort_run, run_with_imports_blocked, save, tiny_mlp


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt")
    src = save(tiny_mlp(), tmp / "mlp.onnx")
    compile_model(str(src), tmp / "art", CompileOptions())
    return tmp / "art"


def test_load_and_run(artifact, rng):
    model = load(artifact)
    assert [s.name for s in model.inputs] == ["x"] and model.inputs[0].shape == ("batch", 8)
    assert [s.name for s in model.outputs] == ["y"]
    assert model.target == "ort-cpu" and "CPUExecutionProvider" in model.providers
    x = rng.standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_allclose(
        model.run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5
    )
    with pytest.raises(InputError, match="unknown output 'z'"):
        model.run({"x": x}, outputs=["z"])
    assert list(model.run({"x": x}, outputs="y")) == ["y"]  # one name as a string
    with pytest.raises(InputError, match="outputs is empty"):
        model.run({"x": x}, outputs=[])
    big = x.astype(">f4")  # other byte order, same dtype name
    np.testing.assert_array_equal(model.run({"x": big})["y"], model.run({"x": x})["y"])
    with pytest.raises(InputError, match="not a rectangular array"):
        model.run({"x": [[1.0] * 8, [1.0] * 7]})
    assert model.run({"x": np.zeros((0, 8), np.float32)})["y"].shape == (0, 4)  # zero-size is valid ONNX
    for bad in ("2", 1.5, 0, -1, 10**4, True):
        with pytest.raises(UsageError, match="threads must be an integer in 1..256"):
            load(artifact, threads=bad)


def test_input_errors_name_the_input(artifact):
    model = load(artifact)
    with pytest.raises(InputError, match="input 'x': expected dtype float32, got int64"):
        model.run({"x": np.zeros((1, 8), np.int64)})
    with pytest.raises(InputError, match="missing input 'x'"):
        model.run({})
    with pytest.raises(InputError, match="dim 1 must be 8"):
        model.run({"x": np.zeros((1, 9), np.float32)})


def test_symbolic_dims_must_agree():
    from precast.artifact.manifest import TensorSpec
    from precast.runtime.feeds import check_feeds

    specs = [TensorSpec("a", "int64", ("batch", "seq")), TensorSpec("b", "int64", ("batch", "seq"))]
    check_feeds({"a": np.zeros((2, 3), np.int64), "b": np.zeros((2, 3), np.int64)}, specs)
    with pytest.raises(InputError, match="input 'b': dim 1 \\('seq'\\) is 4 but input 'a' has 'seq'=3"):
        check_feeds({"a": np.zeros((2, 3), np.int64), "b": np.zeros((2, 4), np.int64)}, specs)


def test_integrity_and_schema(artifact, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    (copy / "model.onnx").write_bytes((copy / "model.onnx").read_bytes() + b"\0")
    with pytest.raises(IntegrityError, match="'model.onnx' was modified"):
        load(copy)
    shutil.rmtree(copy)
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SchemaVersionError, match="schema version 2 is newer"):
        load(copy)
    manifest["schema_version"] = 1
    manifest["files"]["../escape"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="unsafe file entry"):
        load(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load(copy)
    with pytest.raises(ArtifactError, match="not found"):
        load(tmp_path / "nothing-here")


def test_runtime_imports_only_numpy_and_onnxruntime(artifact):
    """Import and run the runtime in a process where the compiler's dependencies cannot be imported."""
    r = run_with_imports_blocked(
        f"""
        import numpy as np
        import precast.runtime as rt
        from precast.runtime.verify import verify_artifact
        m = rt.load({str(artifact)!r})
        y = m.run({{"x": np.ones((2, 8), np.float32)}})["y"]
        assert y.shape == (2, 4)
        assert verify_artifact({str(artifact)!r})["ok"]
        bad = [k for k in sys.modules if k.split(".")[0] in ("torch", "onnx_ir", "onnxscript", "onnx")]
        assert not bad, bad
        print("RUNTIME-OK")
        """
    )
    assert "RUNTIME-OK" in r.stdout, r.stderr


def test_mask_padding_ignores_padded_positions_only():
    from precast.runtime.verify import Tolerance, compare_outputs, mask_padding

    mask = np.array([[1, 1, 0], [1, 1, 1]], np.int64)
    ref = np.ones((2, 3, 4), np.float32)
    got = ref.copy()
    got[0, 2] = 100.0  # garbage at a padded position: a don't-care
    pooled = np.ones((2, 4), np.float32)  # not [batch, seq, ...]: left alone
    feeds = {"attention_mask": mask}
    tol = Tolerance(1e-6, 0, 0.9999)
    assert not compare_outputs({"h": ref}, {"h": got}, tol)["h"]["ok"]
    masked = compare_outputs(
        mask_padding({"h": ref}, feeds, "attention_mask"),
        mask_padding({"h": got}, feeds, "attention_mask"),
        tol,
    )
    assert masked["h"]["ok"] and masked["h"]["max_abs"] == 0
    got[1, 2] = 100.0  # a real token that differs still fails
    masked = compare_outputs(
        mask_padding({"h": ref}, feeds, "attention_mask"),
        mask_padding({"h": got}, feeds, "attention_mask"),
        tol,
    )
    assert not masked["h"]["ok"]
    assert mask_padding({"p": pooled}, feeds, "attention_mask")["p"] is not None
    np.testing.assert_array_equal(mask_padding({"p": pooled}, feeds, "attention_mask")["p"], pooled)


def test_values_the_backend_rejects_are_an_input_error(tmp_path):
    from onnx import TensorProto, helper

    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    model = make_model(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        [("ids", TensorProto.INT64, ["n"])],
        [("y", TensorProto.FLOAT, ["n", 2])],
        {"table": table},
    )
    out = tmp_path / "gather"
    compile_model(str(save(model, tmp_path / "g.onnx")), out, CompileOptions())
    m = load(out)
    np.testing.assert_array_equal(m.run({"ids": np.array([3, 0])})["y"], table[[3, 0]])
    with pytest.raises(InputError, match="the model rejected these feeds: .*indices"):
        m.run({"ids": np.array([7])})


def test_a_manifest_with_a_malformed_target_block(artifact, tmp_path):
    import shutil

    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target"] = "ort-cpu"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="'target' must be a JSON object, got str"):
        load(copy)
