"""A compile-cache entry is data from whoever can write the cache dir: one that is not provably this compile's
(another model's entry copied over this key's, a record forged to name this key, a complete forgery without
the secret that signs entries) is never published.

tests/conftest.py points $XDG_CONFIG_HOME at a temporary dir: the key file these compiles make is not the
user's."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

import precast.compiler.cache as cache_mod
from precast.artifact.manifest import MANIFEST_NAME, read_manifest, sha256_file
from precast.compiler.cache import ARTIFACT_NAME, RECORD_NAME, EntryKey, cache_secret
from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import ArtifactError
from precast.runtime import load
from tests.ci.cli_helpers import run_cli
from tests.helpers import ort_run, save, tiny_mlp


@pytest.fixture
def poisoned(tmp_path):
    """Models A and B compiled into one cache; A's entry replaced, as a whole folder, by B's."""
    a, b = save(tiny_mlp(seed=0), tmp_path / "a.onnx"), save(tiny_mlp(seed=1), tmp_path / "b.onnx")
    cache = tmp_path / "cache"
    built_a = compile_model(str(a), tmp_path / "built-a", CompileOptions(cache_dir=str(cache)))
    (entry_a,) = _entries(cache)
    built_b = compile_model(str(b), tmp_path / "built-b", CompileOptions(cache_dir=str(cache)))
    (entry_b,) = set(_entries(cache)) - {entry_a}
    record_a = json.loads((entry_a / RECORD_NAME).read_text())
    shutil.rmtree(entry_a)
    shutil.copytree(entry_b, entry_a)
    return {
        "a": a,
        "cache": cache,
        "entry_a": entry_a,
        "entry_b": entry_b,
        "record_a": record_a,
        "source_a": built_a.manifest["source"],
        "sha_a": built_a.manifest["source"]["sha256"],
        "sha_b": built_b.manifest["source"]["sha256"],
    }


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _copy_over_keeping_record(src: Path, dest: Path) -> None:
    """Entry ``src`` copied over ``dest``, with ``dest``'s record (its key, key inputs, MAC) naming the copied
    manifest's sha256: a forgery that only the other checks can catch."""
    record = json.loads((dest / RECORD_NAME).read_text())
    record["manifest_sha256"] = sha256_file(src / ARTIFACT_NAME / MANIFEST_NAME)
    shutil.rmtree(dest)
    shutil.copytree(src, dest)
    (dest / RECORD_NAME).write_text(json.dumps(record))


def _assert_is_model_a(out: Path, sha_a: str, rng) -> None:
    assert read_manifest(out).source["sha256"] == sha_a
    feeds = {"x": rng.standard_normal((3, 8), dtype=np.float32)}
    np.testing.assert_allclose(
        load(out).run(feeds)["y"], ort_run(tiny_mlp(seed=0), feeds)[0], rtol=1e-5, atol=1e-5
    )


def test_another_models_entry_copied_over_this_key_is_a_miss(poisoned, tmp_path, capsys, rng):
    p = poisoned
    assert p["sha_a"] != p["sha_b"]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "compile", p["a"], "-o", out, "--cache-dir", p["cache"])
    assert code == 0, err
    assert f"cache entry {p['entry_a']} is not this compile's" in err and "rebuilding" in err
    assert "cache hit" not in err and "cache rebuilt" in err
    _assert_is_model_a(out, p["sha_a"], rng)
    assert run_cli(capsys, "verify", out)[0] == 0
    # The entry was overwritten with A's own: the next compile hits, and publishes A
    again = compile_model(str(p["a"]), tmp_path / "again", CompileOptions(cache_dir=str(p["cache"])))
    assert again.cache == "hit"
    _assert_is_model_a(again.output, p["sha_a"], rng)


def test_a_record_forged_to_this_key_is_caught_by_the_source_hash(poisoned, tmp_path, rng):
    # Self-consistent forgery of the record only: A's key and key inputs, B's manifest hash.
    p = poisoned
    record = dict(p["record_a"], manifest_sha256=sha256_file(p["entry_a"] / ARTIFACT_NAME / MANIFEST_NAME))
    (p["entry_a"] / RECORD_NAME).write_text(json.dumps(record))
    said = []
    result = compile_model(
        str(p["a"]), tmp_path / "out", CompileOptions(cache_dir=str(p["cache"])), progress=said.append
    )
    assert result.cache.startswith("mismatch") and p["sha_b"][:12] in result.cache
    assert any(str(p["entry_a"]) in m and "source sha256" in m for m in said)
    _assert_is_model_a(result.output, p["sha_a"], rng)


def test_the_recorded_key_alone_is_not_enough(poisoned, tmp_path, rng):
    # B's record with only its key edited to A's: its key inputs still name B's source.
    p = poisoned
    path = p["entry_a"] / RECORD_NAME
    path.write_text(json.dumps(dict(json.loads(path.read_text()), key=p["entry_a"].name)))
    result = compile_model(str(p["a"]), tmp_path / "out", CompileOptions(cache_dir=str(p["cache"])))
    assert result.cache == "mismatch: its recorded key inputs are not this compile's"
    _assert_is_model_a(result.output, p["sha_a"], rng)


def test_an_entry_of_another_pipeline_forged_to_this_key_is_a_miss(tmp_path):
    a = save(tiny_mlp(), tmp_path / "a.onnx")
    cache = tmp_path / "cache"
    compile_model(str(a), tmp_path / "x", CompileOptions(cache_dir=str(cache)))
    (default,) = _entries(cache)
    compile_model(str(a), tmp_path / "y", CompileOptions(cache_dir=str(cache), passes="fold-constants"))
    (folded,) = set(_entries(cache)) - {default}
    _copy_over_keeping_record(folded, default)
    result = compile_model(str(a), tmp_path / "z", CompileOptions(cache_dir=str(cache)))
    assert result.cache.startswith("mismatch") and "pipeline 'fold-constants'" in result.cache
    assert read_manifest(result.output).pipeline != "fold-constants"


def test_an_entry_without_a_record_is_a_miss(tmp_path):
    # An artifact stored directly under the key (as precast stored entries before records): nothing binds it.
    a = save(tiny_mlp(), tmp_path / "a.onnx")
    cache = tmp_path / "cache"
    compile_model(str(a), tmp_path / "x", CompileOptions(cache_dir=str(cache)))
    (entry,) = _entries(cache)
    shutil.rmtree(entry)
    shutil.copytree(tmp_path / "x", entry)
    result = compile_model(str(a), tmp_path / "y", CompileOptions(cache_dir=str(cache)))
    assert result.cache.startswith("mismatch") and RECORD_NAME in result.cache
    assert compile_model(str(a), tmp_path / "z", CompileOptions(cache_dir=str(cache))).cache == "hit"


def test_an_entry_swapped_while_it_is_copied_is_not_published(tmp_path, monkeypatch):
    a, b = save(tiny_mlp(seed=0), tmp_path / "a.onnx"), save(tiny_mlp(seed=1), tmp_path / "b.onnx")
    cache = tmp_path / "cache"
    compile_model(str(a), tmp_path / "x", CompileOptions(cache_dir=str(cache)))
    (entry_a,) = _entries(cache)
    compile_model(str(b), tmp_path / "y", CompileOptions(cache_dir=str(cache)))
    (entry_b,) = set(_entries(cache)) - {entry_a}
    real = cache_mod.copy_entry
    monkeypatch.setattr(cache_mod, "copy_entry", lambda _entry, dest: real(entry_b / ARTIFACT_NAME, dest))
    out = tmp_path / "out"
    with pytest.raises(ArtifactError, match=f"cache entry {entry_a} changed while it was copied"):
        compile_model(str(a), out, CompileOptions(cache_dir=str(cache)))
    assert not out.exists()


def test_a_multi_target_entry_of_another_model_forged_to_this_key_is_a_miss(tmp_path, rng):
    a, b = save(tiny_mlp(seed=0), tmp_path / "a.onnx"), save(tiny_mlp(seed=1), tmp_path / "b.onnx")
    cache = tmp_path / "cache"
    opts = CompileOptions(cache_dir=str(cache), targets=("ort-cpu", "openvino"))
    sha_a = compile_model(str(a), tmp_path / "x", opts).manifest["source"]["sha256"]
    (entry_a,) = _entries(cache)
    compile_model(str(b), tmp_path / "y", opts)
    (entry_b,) = set(_entries(cache)) - {entry_a}
    _copy_over_keeping_record(entry_b, entry_a)
    result = compile_model(str(a), tmp_path / "out", opts)
    assert result.cache.startswith("mismatch") and "source sha256" in result.cache
    for target in ("ort-cpu", "openvino"):
        _assert_is_model_a(result.output / target, sha_a, rng)
    assert compile_model(str(a), tmp_path / "again", opts).cache == "hit"


# The secret: a complete forgery needs no other knowledge, so only the MAC stops it.

NOT_SIGNED = "not signed with this cache's secret ($PRECAST_CACHE_SECRET or ~/.config/precast/cache-secret)"


def _forge_as_a(p: dict, mac: str | None) -> None:
    """B's entry under A's key, its manifest and record rewritten to claim A and every hash recomputed: all
    that a writer of the cache dir can do without the secret. ``mac``: what the forger puts in the record."""
    artifact = p["entry_a"] / ARTIFACT_NAME
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    manifest["source"] = p["source_a"]
    (artifact / MANIFEST_NAME).write_text(json.dumps(manifest))
    record = dict(p["record_a"], manifest_sha256=sha256_file(artifact / MANIFEST_NAME))
    if mac is None:
        del record["mac"]
    elif mac != "a's":
        record["mac"] = mac
    (p["entry_a"] / RECORD_NAME).write_text(json.dumps(record))


@pytest.mark.parametrize(
    "mac", ["a's", None, "0" * 64, "\u00e9"], ids=["a-s-mac", "none", "zeros", "non-ascii"]
)
def test_a_complete_forgery_without_the_secret_is_a_miss(poisoned, tmp_path, capsys, rng, mac):
    p = poisoned
    _forge_as_a(p, mac)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "compile", p["a"], "-o", out, "--cache-dir", p["cache"])
    assert code == 0, err
    assert f"cache entry {p['entry_a']} is not this compile's: {NOT_SIGNED}; rebuilding\n" in err
    assert "cache hit" not in err and "cache rebuilt" in err
    _assert_is_model_a(out, p["sha_a"], rng)
    again = compile_model(str(p["a"]), tmp_path / "again", CompileOptions(cache_dir=str(p["cache"])))
    assert again.cache == "hit"
    _assert_is_model_a(again.output, p["sha_a"], rng)


def test_the_forgery_passes_every_check_but_the_mac(poisoned, tmp_path, rng):
    # What the test above relies on: signed with the secret (which the forger lacks), the forgery is a hit.
    # Whoever holds the secret can make an entry of their choosing; SECURITY.md says so.
    p = poisoned
    _forge_as_a(p, mac=None)
    path = p["entry_a"] / RECORD_NAME
    record = json.loads(path.read_text())
    key = EntryKey(record["key"], cache_mod._canonical(record["key_parts"]), p["sha_a"], {})
    record["mac"] = cache_mod._mac(cache_secret(), key, record["manifest_sha256"])
    path.write_text(json.dumps(record))
    result = compile_model(str(p["a"]), tmp_path / "out", CompileOptions(cache_dir=str(p["cache"])))
    assert result.cache == "hit"
    with pytest.raises(AssertionError):
        _assert_is_model_a(result.output, p["sha_a"], rng)  # B's numbers under A's name


def test_an_entry_of_another_secret_is_a_miss_and_each_secret_hits_its_own(tmp_path, monkeypatch, rng):
    a = save(tiny_mlp(), tmp_path / "a.onnx")
    cache = tmp_path / "cache"

    def compile_with(secret: str, out: str) -> tuple[str, list[str]]:
        monkeypatch.setenv("PRECAST_CACHE_SECRET", secret)
        said: list[str] = []
        result = compile_model(
            str(a), tmp_path / out, CompileOptions(cache_dir=str(cache)), progress=said.append
        )
        _assert_is_model_a(result.output, result.manifest["source"]["sha256"], rng)
        return result.cache, said

    assert compile_with("s1", "a")[0] == "miss"
    (entry,) = _entries(cache)
    assert compile_with("s1", "b")[0] == "hit"
    status, said = compile_with("s2", "c")
    assert status == f"mismatch: {NOT_SIGNED}"
    assert f"cache entry {entry} is not this compile's: {NOT_SIGNED}; rebuilding" in said
    assert compile_with("s2", "d")[0] == "hit"  # s2 stored its own in place of s1's ...
    assert compile_with("s1", "e")[0] == f"mismatch: {NOT_SIGNED}"  # ... which s1 does not accept either
    assert compile_with("s1", "f")[0] == "hit"


def test_the_key_file_is_made_0600_and_an_unsafe_one_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    key_file = tmp_path / "config" / "precast" / "cache-secret"
    a, cache = save(tiny_mlp(), tmp_path / "a.onnx"), tmp_path / "cache"

    def compile_cached(out: str) -> str:
        code, _, err = run_cli(capsys, "compile", a, "-o", tmp_path / out, "--cache-dir", cache)
        assert code == 0, err
        return err

    assert "cache store" in compile_cached("a")
    st = key_file.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 32 and st.st_uid == os.geteuid()
    assert not [f for f in key_file.parent.iterdir() if f != key_file]  # no temp file left behind
    assert "cache hit" in compile_cached("b")

    key_file.chmod(0o640)
    err = compile_cached("c")
    (note,) = [line for line in err.splitlines() if "cache-secret" in line]
    assert note.endswith(
        f"cache not used: the key file {key_file} is group/world readable or writable (-rw-r-----); "
        "it must be a file of yours, mode 0600 (or set $PRECAST_CACHE_SECRET)"
    )
    assert "cache hit" not in err and "cache store" not in err
    assert len(_entries(cache)) == 1  # neither read nor written, nor removed

    key_file.chmod(0o600)
    elsewhere = key_file.with_name("elsewhere")
    key_file.rename(elsewhere)
    key_file.symlink_to(elsewhere)
    err = compile_cached("d")
    assert f"cache not used: the key file {key_file} is a symlink; it must be" in err
    assert "cache hit" not in err and "cache store" not in err


def test_an_empty_cache_secret_is_a_usage_error(tmp_path, monkeypatch, capsys):
    a, cache, out = save(tiny_mlp(), tmp_path / "a.onnx"), tmp_path / "cache", tmp_path / "out"
    monkeypatch.setenv("PRECAST_CACHE_SECRET", "")
    code, _, err = run_cli(capsys, "compile", a, "-o", out, "--cache-dir", cache)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "$PRECAST_CACHE_SECRET is set but empty" in err
    assert not out.exists() and not cache.exists()
