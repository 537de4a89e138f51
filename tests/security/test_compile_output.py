"""Issue 14 (trust boundary), compile side: what `precast compile -o DIR` may replace, and what it cleans.

An existing output is replaced only when it is provably a precast artifact (a manifest precast reads, and
nothing in the folder that the manifest does not list) or an empty folder; anything else is refused with
one line before any work, and again right before the publish rename. Leftovers of a killed compile
(staging dirs, cache temp entries) are cleaned on the next compile: only precast's own names, only dead
owners (or old enough), never through a symlink.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from precast.artifact.manifest import read_manifest
from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from tests.helpers import one_line_error, save, tiny_mlp

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def mlp(tmp_path) -> Path:
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


_one_line_error = one_line_error


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _browser_extension(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"manifest_version": 3, "name": "my extension"}))
    (folder / "background.js").write_text("chrome.runtime.onInstalled.addListener(() => {});\n")
    (folder / "icons").mkdir()
    (folder / "icons" / "icon.png").write_bytes(b"\x89PNG...")
    return _snapshot(folder)


# --- item 1: never replace what is not provably a precast artifact --------------------------------------


def test_compile_refuses_a_folder_with_a_foreign_manifest(cli, mlp, tmp_path):
    ext = tmp_path / "extension"
    before = _browser_extension(ext)
    line = _one_line_error(cli("compile", mlp, "-o", ext, "-q"), 1, str(ext), "not a precast artifact")
    assert "refusing" in line
    assert _snapshot(ext) == before  # not one file touched
    assert _leftovers(tmp_path) == []  # and no staging dir left beside it


def test_compile_refuses_an_artifact_holding_an_unlisted_file(cli, mlp, tmp_path):
    out = tmp_path / "art"
    assert cli("compile", mlp, "-o", out, "-q").code == 0
    (out / "notes.txt").write_text("my notes, not precast's")
    (out / "parity" / "mine.npy").write_bytes(b"mine")
    before = _snapshot(out)
    _one_line_error(cli("compile", mlp, "-o", out, "-q"), 1, str(out), "notes.txt")
    assert _snapshot(out) == before


def test_compile_refuses_an_output_that_is_a_symlink(cli, mlp, tmp_path):
    real = tmp_path / "real"
    assert cli("compile", mlp, "-o", real, "-q").code == 0
    before = _snapshot(real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    _one_line_error(cli("compile", mlp, "-o", link, "-q"), 1, str(link), "symlink")
    assert link.is_symlink() and _snapshot(real) == before


def test_refusal_comes_before_any_export_work(mlp, tmp_path, monkeypatch):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"jpeg")

    def no_work(*_a, **_k):
        raise AssertionError("the source was loaded before the output was checked")

    monkeypatch.setattr("precast.compiler.driver.load_source", no_work)
    with pytest.raises(UsageError, match="photos.*not a precast artifact"):
        compile_model(str(mlp), photos, CompileOptions())
    assert (photos / "cat.jpg").read_bytes() == b"jpeg"


def test_precast_artifacts_and_empty_folders_are_still_replaced(cli, mlp, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("compile", mlp, "-o", empty, "-q").code == 0
    assert cli("compile", mlp, "-o", empty, "-q", "--atol", "1e-3").code == 0  # an artifact: replaced whole
    assert read_manifest(empty).parity["tolerance"]["atol"] == 1e-3
    multi = tmp_path / "multi"
    for _ in range(2):  # a multi-target artifact (sub-artifact dirs) is replaceable too
        assert cli("compile", mlp, "-o", multi, "-t", "ort-cpu", "-t", "triton", "-q").code == 0
    assert read_manifest(multi).is_multi_target
    assert _leftovers(tmp_path) == []


def test_an_unlisted_file_in_a_sub_artifact_is_refused(cli, mlp, tmp_path):
    multi = tmp_path / "multi"
    assert cli("compile", mlp, "-o", multi, "-t", "ort-cpu", "-t", "triton", "-q").code == 0
    (multi / "triton" / "model_repository" / "extra.txt").write_text("mine")
    before = _snapshot(multi)
    _one_line_error(cli("compile", mlp, "-o", multi, "-t", "ort-cpu", "-t", "triton", "-q"), 1, "extra.txt")
    assert _snapshot(multi) == before


def test_publish_checks_again_right_before_the_rename(mlp, tmp_path):
    """TOCTOU: the output did not exist when the compile started; a user folder appears while it runs."""
    out = tmp_path / "out"
    state = {}

    def progress(msg: str) -> None:
        if "verifying" in msg and not out.exists():
            state["before"] = _browser_extension(out)

    with pytest.raises(UsageError, match="not a precast artifact"):
        compile_model(str(mlp), out, CompileOptions(), progress=progress)
    assert state and _snapshot(out) == state["before"]
    assert _leftovers(tmp_path) == []


def test_cache_never_deletes_a_foreign_folder_under_an_entry_name(mlp, tmp_path):
    cache = tmp_path / "cache"
    compile_model(str(mlp), tmp_path / "a", CompileOptions(cache_dir=str(cache)))
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for p in sorted(entry.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    before = _browser_extension_in(entry)
    with pytest.raises(UsageError, match="not a precast artifact"):
        compile_model(str(mlp), tmp_path / "b", CompileOptions(cache_dir=str(cache)))
    assert _snapshot(entry) == before and not (tmp_path / "b").exists()


def _browser_extension_in(folder: Path) -> dict[str, bytes]:
    (folder / "manifest.json").write_text(json.dumps({"manifest_version": 3, "name": "my extension"}))
    (folder / "background.js").write_text("// mine\n")
    return _snapshot(folder)


def test_unpack_refuses_a_non_empty_folder(cli, mlp, tmp_path):
    art, packed, ext = tmp_path / "art", tmp_path / "m.precast", tmp_path / "ext"
    assert cli("compile", mlp, "-o", art, "-q").code == 0
    assert cli("pack", art, "-o", packed, "-q").code == 0
    before = _browser_extension(ext)
    r = cli("unpack", packed, "-o", ext, "-q")
    assert r.code != 0 and "Traceback" not in r.err and _snapshot(ext) == before


# --- item 4: leftovers of a killed compile are cleaned, safely ---------------------------------------------

_KILL_DURING = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import importlib
    m = importlib.import_module({module!r}.split(":")[0])
    for part in {module!r}.split(":")[1:]:
        m = getattr(m, part)  # a class in the module: "pkg.mod:Class"
    real = getattr(m, {func!r})
    def killed(*a, **k):
        hit = {when!r} in str(a[-1] if a else "")
        if hit and not {after!r}:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*a, **k)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    setattr(m, {func!r}, killed)
    from precast.compiler.driver import CompileOptions, compile_model
    compile_model({model!r}, {out!r}, CompileOptions(cache_dir={cache!r}))
    """
)


def _killed_compile(model: Path, out: Path, module: str, func: str, *, after: bool, when="", cache=None):
    """Run a compile in a child that SIGKILLs itself in ``module.func`` (before or after it ran; only when the
    call's last argument contains ``when``): nothing of precast's own cleanup runs."""
    code = _KILL_DURING.format(
        repo=str(REPO),
        module=module,
        func=func,
        after=after,
        when=when,
        model=str(model),
        out=str(out),
        cache=cache,
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr


def test_staging_dir_of_a_killed_compile_is_cleaned_on_the_next_compile(mlp, tmp_path):
    out = tmp_path / "out"
    # killed while building in the stage
    _killed_compile(mlp, out, "precast.compiler.driver:_Build", "all_targets", after=False)
    stale = _leftovers(tmp_path)
    assert len(stale) == 1 and stale[0].startswith(".out."), stale

    # What must survive the cleanup: anything not named like precast's temp dirs, a symlink named like
    # one (and what it points at), a live compile's stage, and a legacy-named stage that is still fresh.
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("mine")
    (tmp_path / ".out.tmp-notprecast").mkdir()
    (tmp_path / "notes.tmp-12345678").write_text("mine")
    link = tmp_path / (stale[0][: stale[0].rindex("-")] + "-00000000")
    link.symlink_to(keep, target_is_directory=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / stale[0].replace(stale[0].split("-")[1], str(sleeper.pid), 1)
        live.mkdir()
        fresh_legacy = tmp_path / ".out.tmp-0123abcd"
        fresh_legacy.mkdir()
        old_legacy = tmp_path / ".out.tmp-89abcdef"
        old_legacy.mkdir()
        (old_legacy / "model.onnx").write_bytes(b"half")
        two_days_ago = time.time() - 2 * 86400
        os.utime(old_legacy, (two_days_ago, two_days_ago))

        compile_model(str(mlp), out, CompileOptions())

        left = set(_leftovers(tmp_path))
        assert stale[0] not in left and old_legacy.name not in left
        assert {link.name, live.name, fresh_legacy.name, ".out.tmp-notprecast"} <= left
        assert (keep / "precious.txt").read_text() == "mine" and (tmp_path / "notes.tmp-12345678").exists()
        assert read_manifest(out).files
    finally:
        sleeper.kill()
        sleeper.wait()


def test_cache_temp_entry_of_a_killed_store_is_cleaned(mlp, tmp_path):
    cache = tmp_path / "cache"
    _killed_compile(mlp, tmp_path / "a", "shutil", "copytree", after=True, when=str(cache), cache=str(cache))
    stale = [p.name for p in cache.iterdir() if ".tmp-" in p.name]
    assert stale, sorted(p.name for p in cache.iterdir())
    compile_model(str(mlp), tmp_path / "b", CompileOptions(cache_dir=str(cache)))
    assert not [p.name for p in cache.iterdir() if ".tmp-" in p.name]


def test_half_written_pack_of_a_killed_run_is_cleaned(cli, mlp, tmp_path):
    from precast.artifact.staging import host_id

    art, packed = tmp_path / "art", tmp_path / "m.precast"
    assert cli("compile", mlp, "-o", art, "-q").code == 0
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".m.precast.tmp-{int(gone.stdout)}-{host_id()}-0badf00d"  # its owner has exited
    stale.write_bytes(b"half a tar")
    other_host = tmp_path / f".m.precast.tmp-{int(gone.stdout)}-00000000-0badf00d"  # a fresh one elsewhere
    other_host.write_bytes(b"being written on another host")
    assert cli("pack", art, "-o", packed, "-q").code == 0
    assert not stale.exists() and other_host.exists() and packed.is_file()


def test_an_output_moved_aside_is_cleaned_only_while_it_is_a_precast_artifact(mlp, tmp_path):
    from precast.artifact.staging import host_id

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    aside = f".out.old-{int(gone.stdout)}-{host_id()}"
    artifact = tmp_path / f"{aside}-00000001"  # a killed publish's old artifact: precast's to delete
    compile_model(str(mlp), artifact, CompileOptions())
    foreign = tmp_path / f"{aside}-00000002"  # a folder a failed publish could not put back: the user's
    before = _browser_extension(foreign)
    compile_model(str(mlp), tmp_path / "out", CompileOptions())
    assert not artifact.exists() and _snapshot(foreign) == before
