"""No unpickling anywhere in the load path; JUnit reports, exit codes, --quiet, profiling."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from precast import errors
from precast.cli import main as cli_main
from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import EXIT_ARTIFACT, EXIT_PARITY, EXIT_USAGE
from tests.ci.cli_helpers import run_cli
from tests.helpers import save, tiny_mlp

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    model = save(tiny_mlp(), root / "mlp.onnx")
    art = compile_model(str(model), root / "art", CompileOptions()).output
    return {"root": root, "model": model, "art": art}


def _pickled_npz(path: Path) -> Path:
    np.savez(
        path, x=np.array([{"boom": 1}, None], dtype=object)
    )  # an object array is a pickle inside the zip
    return path


def test_pickle_bearing_npz_is_refused(built, tmp_path, capsys, monkeypatch):
    import pickle

    def no_unpickling(*_a, **_k):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    bad = _pickled_npz(tmp_path / "evil.npz")
    code, _, err = run_cli(capsys, "compile", built["model"], "-o", tmp_path / "a", "--sample-inputs", bad)
    assert code == EXIT_USAGE and "evil.npz" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()
    code, _, err = run_cli(capsys, "run", built["art"], "-i", bad)
    assert code == EXIT_USAGE and "evil.npz" in err


def test_hf_folder_with_only_a_pickled_checkpoint_is_refused(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle stream
    code, _, err = run_cli(capsys, "compile", folder, "-o", tmp_path / "out")
    assert code == EXIT_USAGE and "safetensors" in err and "pickled checkpoints are refused" in err


def _calls(text: str, func: str):
    """The argument text of every ``func(...)`` call (balanced parentheses)."""
    for m in re.finditer(re.escape(func) + r"\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text[m.end() : i - 1]


def test_no_pickle_in_source():
    """Every np.load passes allow_pickle=False, every torch.load weights_only=True; the runtime never imports pickle."""
    offenders = []
    for path in sorted(REPO.glob("*/**/*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("tests/", ".")) or "/." in rel:
            continue
        text = path.read_text()
        offenders += [
            f"{rel}: np.load({a})" for a in _calls(text, "np.load") if "allow_pickle=False" not in a
        ]
        offenders += [
            f"{rel}: torch.load({a})" for a in _calls(text, "torch.load") if "weights_only=True" not in a
        ]
        if "allow_pickle=True" in text:
            offenders.append(f"{rel}: allow_pickle=True")
        if rel.startswith("runtime/") and re.search(
            r"^\s*(import pickle|from pickle|import dill|import joblib)", text, re.MULTILINE
        ):
            offenders.append(f"{rel}: imports a pickle module")
    assert offenders == []


def test_exit_codes_are_stable_and_documented():
    assert (
        errors.EXIT_OK,
        errors.EXIT_USAGE,
        errors.EXIT_PARITY,
        errors.EXIT_ARTIFACT,
        errors.EXIT_TARGET,
        errors.EXIT_COMPILE,
        errors.EXIT_INTERNAL,
    ) == (0, 1, 2, 3, 4, 5, 70)
    doc = " ".join(cli_main.cli.help.split())
    for code in sorted(set(errors.EXIT_CODES.values()) - {0}):
        assert f"{code} " in doc


def test_verify_junit_and_quiet(built, tmp_path, capsys):
    junit = tmp_path / "verify.xml"
    code, out, err = run_cli(capsys, "verify", built["art"], "--junit", junit, "-q")
    assert (code, out, err) == (0, "", "")
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["parity:y"] and suite.get("failures") == "0"
    # Tamper with the stored expected output: parity fails, one failing testcase, exit 2.
    import shutil

    art = tmp_path / "art"
    shutil.copytree(built["art"], art)
    manifest = json.loads((art / "manifest.json").read_text())
    rel = manifest["parity"]["expected"]["y"]
    y = np.load(art / rel, allow_pickle=False)
    np.save(art / rel, y + 1.0, allow_pickle=False)
    from precast.artifact.manifest import dump_json, sha256_file

    manifest["files"][rel] = sha256_file(art / rel)
    dump_json(manifest, art / "manifest.json")
    code, _, err = run_cli(capsys, "verify", art, "--junit", junit)
    assert code == EXIT_PARITY and "output 'y'" in err
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "1" and "out of tolerance" in suite.find("testcase/failure").get(
        "message"
    )
    (art / "model.onnx").write_bytes(b"tampered")
    code, _, err = run_cli(capsys, "verify", art, "--junit", junit)
    assert code == EXIT_ARTIFACT
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("errors") == "1" and "model.onnx" in suite.find("testcase/error").get("message")


def test_compile_junit_success(built, tmp_path, capsys):
    junit = tmp_path / "c.xml"
    code, _, _ = run_cli(capsys, "compile", built["model"], "-o", tmp_path / "a", "--junit", junit, "-q")
    assert code == 0
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("failures") == "0" and suite.get("errors") == "0"


def test_profile_prints_top_ops_and_saves_trace(built, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    code, out, err = run_cli(capsys, "profile", built["art"], "--runs", "3", "--trace", trace)
    assert code == 0 and "top operators" in out and ("MatMul" in out or "Gemm" in out)
    events = json.loads(trace.read_text())
    assert any(e.get("cat") == "Node" for e in events)
    code, out, _ = run_cli(capsys, "profile", built["art"], "--runs", "2", "--json")
    result = json.loads(out)
    assert result["ops"] and abs(sum(r["share"] for r in result["ops"]) - 1.0) < 0.01
    assert result["ops"] == sorted(result["ops"], key=lambda r: -r["total_us"])
    code, _, err = run_cli(capsys, "profile", built["art"], "--runs", "0")
    assert code == EXIT_USAGE and "--runs" in err
