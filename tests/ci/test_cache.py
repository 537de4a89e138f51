"""Compile cache and reproducibility: same input + options + toolchain => same bytes; a hit is a checked copy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from precast.artifact.manifest import BUILD_INFO_NAME, sha256_file
from precast.compiler.cache import ARTIFACT_NAME, cache_key, check_artifact_tree
from precast.compiler.driver import CompileOptions, compile_model
from precast.runtime import load
from tests.ci.cli_helpers import run_cli
from tests.helpers import ort_run, save, tiny_mlp


@pytest.fixture
def model_file(tmp_path) -> Path:
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != BUILD_INFO_NAME
    }


def test_two_builds_are_byte_identical(model_file, tmp_path):
    a = compile_model(str(model_file), tmp_path / "a", CompileOptions())
    b = compile_model(str(model_file), tmp_path / "b", CompileOptions())
    assert _hashes(a.output) == _hashes(b.output) and len(_hashes(a.output)) >= 4


def test_miss_then_hit_copies_the_same_artifact(model_file, tmp_path, rng):
    cache = tmp_path / "cache"
    first = compile_model(str(model_file), tmp_path / "a", CompileOptions(cache_dir=str(cache)))
    assert first.cache == "miss" and first.records["ort-cpu"]
    said = []
    second = compile_model(
        str(model_file), tmp_path / "b", CompileOptions(cache_dir=str(cache)), progress=said.append
    )
    assert second.cache == "hit" and second.records == {}
    assert any(m.startswith("cache hit") for m in said)
    assert _hashes(first.output) == _hashes(second.output)
    feeds = {"x": rng.standard_normal((3, 8), dtype=np.float32)}
    np.testing.assert_allclose(
        load(second.output).run(feeds)["y"], ort_run(tiny_mlp(), feeds)[0], rtol=1e-5, atol=1e-5
    )


def test_options_and_model_are_part_of_the_key(model_file, tmp_path):
    cache = str(tmp_path / "cache")
    compile_model(str(model_file), tmp_path / "a", CompileOptions(cache_dir=cache))
    assert (
        compile_model(str(model_file), tmp_path / "b", CompileOptions(cache_dir=cache, atol=1e-3)).cache
        == "miss"
    )
    assert (
        compile_model(
            str(model_file), tmp_path / "c", CompileOptions(cache_dir=cache, passes="fold-constants")
        ).cache
        == "miss"
    )
    assert (
        compile_model(str(model_file), tmp_path / "d", CompileOptions(cache_dir=cache, seed=1)).cache
        == "miss"
    )
    other = save(tiny_mlp(seed=1), tmp_path / "mlp.onnx")  # same name, new weights
    assert compile_model(str(other), tmp_path / "e", CompileOptions(cache_dir=cache)).cache == "miss"
    assert compile_model(str(other), tmp_path / "f", CompileOptions(cache_dir=cache)).cache == "hit"
    save(tiny_mlp(), other)  # the original weights again: the very first entry
    assert compile_model(str(other), tmp_path / "g", CompileOptions(cache_dir=cache)).cache == "hit"
    assert cache_key({"a": 1}) != cache_key({"a": 2})


def test_corrupt_entry_is_detected_and_rebuilt(model_file, tmp_path):
    cache = tmp_path / "cache"
    compile_model(str(model_file), tmp_path / "a", CompileOptions(cache_dir=str(cache)))
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    model = entry / ARTIFACT_NAME / "model.onnx"
    model.write_bytes(model.read_bytes()[:-8] + b"\0" * 8)
    said = []
    result = compile_model(
        str(model_file), tmp_path / "b", CompileOptions(cache_dir=str(cache)), progress=said.append
    )
    assert result.cache.startswith("corrupt") and "model.onnx" in result.cache
    assert any("rebuilding" in m for m in said)
    check_artifact_tree(result.output)
    check_artifact_tree(entry / ARTIFACT_NAME)  # the rebuilt entry replaced the corrupt one
    assert compile_model(str(model_file), tmp_path / "c", CompileOptions(cache_dir=str(cache))).cache == "hit"


def test_cli_cache_dir_and_env_var(model_file, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    code, _, err = run_cli(capsys, "compile", model_file, "-o", tmp_path / "a", "--cache-dir", cache)
    assert code == 0 and "cache store" in err
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(cache))
    report = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "compile", model_file, "-o", tmp_path / "b", "--report", report)
    assert code == 0 and "cache hit" in err
    assert json.loads(report.read_text())["cache"] == "hit"
    code, _, err = run_cli(capsys, "compile", model_file, "-o", tmp_path / "c", "--quiet")
    assert code == 0 and err == ""


def test_precast_code_is_part_of_the_key(model_file, tmp_path, monkeypatch):
    # The version string does not move between releases: a change to precast's own code must miss.
    import precast.compiler.cache as cache_mod
    from precast.compiler.cache import hash_sources

    cache = str(tmp_path / "cache")
    assert compile_model(str(model_file), tmp_path / "a", CompileOptions(cache_dir=cache)).cache == "miss"
    assert compile_model(str(model_file), tmp_path / "b", CompileOptions(cache_dir=cache)).cache == "hit"
    monkeypatch.setattr(cache_mod, "code_hash", lambda: "0" * 64)  # as if a pass had been edited
    assert compile_model(str(model_file), tmp_path / "c", CompileOptions(cache_dir=cache)).cache == "miss"

    pkg = tmp_path / "passes"
    pkg.mkdir()
    (pkg / "fuse.py").write_text("X = 1\n")
    before = hash_sources([pkg])
    (pkg / "fuse.py").write_text("X = 2\n")
    assert hash_sources([pkg]) != before
    (pkg / "fuse.py").write_text("X = 1\n")
    assert hash_sources([pkg]) == before


def test_the_code_hash_covers_every_package_that_builds_artifacts():
    """Every package setup.py installs but the CLI, and every module of the top package, is in the code hash:
    a package left out (as precast.ir and precast.artifact were when the layout moved) would let the cache hand
    out artifacts that code built before it changed."""
    import ast
    import importlib
    from pathlib import Path

    import precast.compiler.cache as cache_mod

    root = Path(__file__).resolve().parent.parent.parent
    setup = ast.parse((root / "setup.py").read_text())
    (folders,) = [
        ast.literal_eval(n.value) for n in ast.walk(setup) if isinstance(n, ast.Assign) and n.targets[0].id == "FOLDERS"
    ]
    assert set(cache_mod._CODE_PACKAGES) == set(folders) - {"precast", "precast.cli"}
    top = Path(importlib.import_module("precast").__file__).parent
    modules = {f"precast.{f.stem}" for f in top.glob("*.py") if f.stem not in ("__init__", "__main__")}
    assert set(cache_mod._CODE_MODULES) == modules
    pkg = root / "ir"
    assert pkg.is_dir()
    before = cache_mod.hash_sources([pkg], [top / "options.py"])
    assert before != cache_mod.hash_sources([pkg], [top / "errors.py"])
