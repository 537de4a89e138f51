"""The foundation's CLI end to end on a tiny ONNX model, and every bad input with its one-line error."""

import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.helpers import make_model, save, tiny_mlp


@pytest.fixture
def mlp_path(tmp_path):
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


def _one_line_error(r, *needles):
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert lines, "no error printed"
    last = lines[-1]
    assert last.startswith("error: "), r.err
    assert "Traceback" not in r.err
    for n in needles:
        assert n in last, f"{n!r} not in {last!r}"
    return last


def test_compile_inspect_verify_run(cli, mlp_path, tmp_path, rng):
    out = tmp_path / "art"
    r = cli("compile", mlp_path, "-o", out, "--report", tmp_path / "rep.json")
    assert r.code == 0, r.err
    manifest = json.loads((out / "manifest.json").read_text())
    from precast.ir.pipeline import format_pipeline, parse_pipeline
    from precast.targets.ort_cpu import OrtCpu

    assert manifest["pipeline"] == format_pipeline(parse_pipeline(OrtCpu.default_pipeline))
    assert manifest["io"]["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}]
    assert manifest["parity"]["ok"] and manifest["parity"]["outputs"]["y"]["cosine"] > 0.9999
    assert {"model.onnx"} <= set(manifest["files"])
    assert json.loads((tmp_path / "rep.json").read_text())["ok"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art.")], "staging dir left behind"

    r = cli("inspect", out)
    assert r.code == 0 and "IO signature" in r.out and "fold-constants" in r.out
    r = cli("inspect", out, "--json")
    assert json.loads(r.out)["schema_version"] == 1
    r = cli("verify", out)
    assert r.code == 0 and "verified" in r.out

    x = rng.standard_normal((3, 8)).astype(np.float32)
    np.savez(tmp_path / "feeds.npz", x=x)
    r = cli("run", out, "--input", tmp_path / "feeds.npz", "--output", tmp_path / "y.npz")
    assert r.code == 0, r.err
    y = np.load(tmp_path / "y.npz")["y"]
    from tests.helpers import ort_run

    np.testing.assert_allclose(y, ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5)
    (tmp_path / "feeds.json").write_text(json.dumps({"x": x.tolist()}))
    r = cli("run", out, "--input", tmp_path / "feeds.json", "--json")
    assert r.code == 0 and np.allclose(np.array(json.loads(r.out)["y"]), y, atol=1e-5)


def test_compile_is_byte_identical(cli, mlp_path, tmp_path):
    for name in ("a", "b"):
        assert cli("compile", mlp_path, "-o", tmp_path / name, "-q").code == 0
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        if rel.name != "build-info.json":  # wall times: the one unhashed, non-reproducible file
            assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_recompile_replaces_artifact_atomically(cli, mlp_path, tmp_path):
    out = tmp_path / "art"
    assert cli("compile", mlp_path, "-o", out, "-q").code == 0
    # A failing recompile leaves the old artifact in place.
    r = cli("compile", mlp_path, "-o", out, "-q", "--passes", "no-such-pass")
    assert r.code == 1
    assert (out / "manifest.json").is_file() and cli("verify", out).code == 0


def test_passes_and_targets_list(cli):
    r = cli("passes")
    assert r.code == 0 and "fold-constants" in r.out and "eliminate-dead-code" in r.out
    r = cli("targets", "--json")
    rows = json.loads(r.out)
    assert rows["ort-cpu"]["build"] is True and rows["ort-cpu"]["run"] is True


# ---------------------------------------------------------------- bad input, one line each


def test_missing_file(cli, tmp_path):
    r = cli("compile", tmp_path / "nope.onnx", "-o", tmp_path / "o")
    assert r.code == 1
    _one_line_error(r, "nope.onnx")
    assert not (tmp_path / "o").exists()


def test_not_onnx_and_truncated(cli, tmp_path, mlp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_text("this is not a protobuf at all, just text\n" * 10)
    r = cli("compile", junk, "-o", tmp_path / "o")
    assert r.code == 1
    _one_line_error(r, "junk.onnx")
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(mlp_path.read_bytes()[:300])
    r = cli("compile", trunc, "-o", tmp_path / "o")
    assert r.code == 1
    _one_line_error(r, "trunc.onnx")
    assert not (tmp_path / "o").exists()


def test_op_onnxruntime_cannot_run(cli, tmp_path):
    m = make_model(
        [
            helper.make_node("Relu", ["x"], ["h"], name="ok"),
            helper.make_node("FrobnicateOp", ["h"], ["y"], name="weird_node"),
        ],
        [("x", TensorProto.FLOAT, [2])],
        [("y", TensorProto.FLOAT, [2])],
    )
    path = save(m, tmp_path / "weird.onnx")
    r = cli("compile", path, "-o", tmp_path / "o")
    assert r.code == 5
    _one_line_error(r, "weird_node", "FrobnicateOp")
    assert not (tmp_path / "o").exists()


def test_unknown_pass_and_bad_syntax(cli, mlp_path, tmp_path):
    r = cli("compile", mlp_path, "-o", tmp_path / "o", "--passes", "fold-constans")
    assert r.code == 1
    _one_line_error(r, "unknown pass 'fold-constans'", "did you mean 'fold-constants'")
    r = cli("compile", mlp_path, "-o", tmp_path / "o", "--passes", "fold-constants{input_size_limit=3")
    assert r.code == 1
    _one_line_error(r, "column 34")
    assert not (tmp_path / "o").exists()


def test_unknown_target(cli, mlp_path, tmp_path):
    r = cli("compile", mlp_path, "-o", tmp_path / "o", "--target", "ort-cpux")
    assert r.code == 4
    _one_line_error(r, "unknown target 'ort-cpux'", "did you mean 'ort-cpu'")


def test_bad_target_option(cli, mlp_path, tmp_path):
    r = cli("compile", mlp_path, "-o", tmp_path / "o", "--target-option", "ort_levl=basic")
    assert r.code == 1
    _one_line_error(r, "ort_levl")


@pytest.fixture
def artifact(cli, mlp_path, tmp_path):
    out = tmp_path / "art"
    assert cli("compile", mlp_path, "-o", out, "-q").code == 0
    return out


def test_tampered_file_is_named(cli, artifact, tmp_path):
    model = artifact / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0xFF
    model.write_bytes(bytes(data))
    r = cli("verify", artifact)
    assert r.code == 3
    _one_line_error(r, "model.onnx", "modified")
    np.savez(tmp_path / "f.npz", x=np.zeros((1, 8), np.float32))
    r = cli("run", artifact, "--input", tmp_path / "f.npz")
    assert r.code == 3
    _one_line_error(r, "model.onnx")


def test_extra_and_missing_files(cli, artifact):
    (artifact / "smuggled.sh").write_text("echo hi")
    _one_line_error(cli("verify", artifact), "smuggled.sh")
    os.remove(artifact / "smuggled.sh")
    os.remove(next((artifact / "parity" / "inputs").iterdir()))
    r = cli("verify", artifact)
    assert r.code == 3
    _one_line_error(r, "missing")


def test_newer_schema(cli, artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    m["schema_version"] = 99
    (artifact / "manifest.json").write_text(json.dumps(m))
    r = cli("inspect", artifact)
    assert r.code == 3
    _one_line_error(r, "schema version 99", "upgrade precast")


@pytest.mark.parametrize(
    "feeds, needles",
    [
        ({}, ["missing input 'x'"]),
        ({"x": np.zeros((2, 8), np.float64)}, ["input 'x'", "float32", "float64"]),
        ({"x": np.zeros((2, 8, 1), np.float32)}, ["input 'x'", "rank 2", "rank 3"]),
        ({"x": np.zeros((2, 7), np.float32)}, ["input 'x'", "dim 1 must be 8", "got 7"]),
        ({"x": np.zeros((2, 8), np.float32), "z": np.zeros(1)}, ["unknown input 'z'"]),
    ],
)
def test_run_with_bad_feeds(cli, artifact, tmp_path, feeds, needles):
    np.savez(tmp_path / "bad.npz", **feeds)
    r = cli("run", artifact, "--input", tmp_path / "bad.npz")
    assert r.code == 1
    _one_line_error(r, *needles)


def test_parity_failure_writes_nothing(cli, mlp_path, tmp_path):
    # fp16 weights under an exact tolerance: parity is reported, nothing is written.
    r = cli(
        "compile",
        mlp_path,
        "-o",
        tmp_path / "o",
        "--passes",
        "convert-fp16",
        "--atol",
        "0",
        "--rtol",
        "0",
        "--report",
        tmp_path / "r.json",
    )
    assert r.code == 2
    _one_line_error(r, "parity failed", "output 'y'")
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] is False and rep["exit_code"] == 2


def test_debug_shows_traceback(cli, tmp_path):
    r = cli("--debug", "compile", tmp_path / "nope.onnx", "-o", tmp_path / "o")
    assert r.code == 1 and "Traceback" in r.err


def test_unknown_command_suggests(cli):
    r = cli("complie")
    assert r.code == 1
    _one_line_error(r, "did you mean 'compile'")


def test_feeds_file_that_is_neither_npz_nor_json(cli, artifact, tmp_path):
    text = tmp_path / "feeds.txt"
    text.write_text("x = 1, 2, 3\n")
    r = cli("run", artifact, "--input", text)
    assert r.code == 1
    _one_line_error(r, "feeds.txt", "not an .npz")
    assert "pickle" not in r.err
