"""Pack/unpack: deterministic tar, safe reader (no escapes, links, devices, unlisted files, bombs), signatures."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

import numpy as np
import pytest

from precast.artifact.archive import ArchiveError, Limits, unpack_artifact
from precast.artifact.signing import SignatureError
from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.pack import pack_artifact
from precast.errors import EXIT_ARTIFACT, ArtifactError, IntegrityError
from precast.runtime import load
from tests.ci.archive_helpers import members_of, reg, special, tree, write_tar
from tests.ci.cli_helpers import run_cli
from tests.helpers import ort_run, save, tiny_mlp


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    model = save(tiny_mlp(), root / "mlp.onnx")
    art = compile_model(str(model), root / "art", CompileOptions()).output
    packed = root / "mlp.precast"
    pack_artifact(art, packed)
    return {"root": root, "model": model, "art": art, "packed": packed}


def test_pack_is_deterministic_across_builds(built, tmp_path):
    again = compile_model(str(built["model"]), tmp_path / "art2", CompileOptions()).output
    pack_artifact(again, tmp_path / "again.precast")
    assert (tmp_path / "again.precast").read_bytes() == built["packed"].read_bytes()
    names = [m.name for m, _ in members_of(built["packed"])]
    assert names[0] == "manifest.json" and names[1:] == sorted(names[1:]) and "build-info.json" not in names
    for m, _ in members_of(built["packed"]):
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)


def test_unpack_and_load_packed_file(built, tmp_path, rng):
    unpack_artifact(built["packed"], tmp_path / "un")
    assert tree(tmp_path / "un") == [p for p in tree(built["art"]) if p != "build-info.json"]
    feeds = {"x": rng.standard_normal((2, 8), dtype=np.float32)}
    np.testing.assert_allclose(
        load(built["packed"]).run(feeds)["y"], ort_run(tiny_mlp(), feeds)[0], rtol=1e-5, atol=1e-5
    )


def test_unpack_refuses_non_empty_target(built, tmp_path):
    (tmp_path / "un").mkdir()
    (tmp_path / "un" / "keep.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not empty"):
        unpack_artifact(built["packed"], tmp_path / "un")
    assert (tmp_path / "un" / "keep.txt").read_text() == "mine"


def _hostile(built, tmp_path, extra=(), replace=None, drop=()):
    members = [(m, d) for m, d in members_of(built["packed"]) if m.name not in drop]
    if replace:
        members = [replace(m, d) for m, d in members]
    return write_tar(tmp_path / "bad.precast", members + list(extra))


CASES = {
    "absolute": ([reg("/tmp/evil", b"x")], "absolute path"),
    "dotdot": ([reg("../evil", b"x")], "'..'"),
    "dotdot-inner": ([reg("parity/../../evil", b"x")], "'..'"),
    "symlink": ([special("link", tarfile.SYMTYPE, "/etc/passwd")], "symlink"),
    "hardlink": ([special("hard", tarfile.LNKTYPE, "model.onnx")], "hard link"),
    "chardev": ([special("dev", tarfile.CHRTYPE)], "character device"),
    "fifo": ([special("fifo", tarfile.FIFOTYPE)], "FIFO"),
    "directory": ([special("sub", tarfile.DIRTYPE)], "directory"),
    "duplicate": ([reg("model.onnx", b"evil")], "appears twice"),
    "duplicate-case": ([reg("MODEL.onnx", b"evil")], "appears twice"),
    "unlisted": ([reg("extra.py", b"import os")], "not listed in the manifest"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_members_are_rejected(built, tmp_path, case):
    extra, why = CASES[case]
    bad = _hostile(built, tmp_path, extra=extra)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    with pytest.raises(ArchiveError, match=why):
        unpack_artifact(bad, sandbox / "out")
    assert tree(sandbox) == []
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()


def test_tampered_file_fails_its_checksum(built, tmp_path):
    def flip(m, d):
        return (m, d[:-1] + bytes([d[-1] ^ 1])) if m.name == "model.onnx" else (m, d)

    bad = _hostile(built, tmp_path, replace=flip)
    with pytest.raises(IntegrityError, match="model.onnx"):
        unpack_artifact(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_file_is_rejected(built, tmp_path):
    bad = _hostile(built, tmp_path, drop=("model.onnx",))
    with pytest.raises(IntegrityError, match="missing"):
        unpack_artifact(bad, tmp_path / "out")


def test_size_bomb_is_rejected(built, tmp_path):
    zeros = b"\0" * (8 << 20)
    bomb = write_tar(
        tmp_path / "bomb.tar.gz", [m for m in members_of(built["packed"])] + [reg("zeros.bin", zeros)], "w:gz"
    )
    assert bomb.stat().st_size < 100_000
    with pytest.raises(ArchiveError, match="size bomb"):
        unpack_artifact(bomb, tmp_path / "out", limits=Limits(max_ratio=10, ratio_slack_bytes=1 << 20))
    with pytest.raises(ArchiveError, match="size bomb"):
        unpack_artifact(bomb, tmp_path / "out", limits=Limits(max_total_bytes=1 << 20))
    with pytest.raises(ArchiveError, match="members"):
        unpack_artifact(built["packed"], tmp_path / "out", limits=Limits(max_members=2))
    assert not (tmp_path / "out").exists()


def test_garbage_and_truncated_files(built, tmp_path):
    (tmp_path / "junk.precast").write_bytes(b"definitely not a tar" * 100)
    with pytest.raises(ArchiveError):
        unpack_artifact(tmp_path / "junk.precast", tmp_path / "out")
    data = built["packed"].read_bytes()
    (tmp_path / "cut.precast").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError):
        unpack_artifact(tmp_path / "cut.precast", tmp_path / "out")
    (tmp_path / "z.gz").write_bytes(gzip.compress(b"\1" * 5000))
    with pytest.raises(ArchiveError):
        unpack_artifact(tmp_path / "z.gz", tmp_path / "out")


def test_signature_roundtrip_and_rejections(built, keys, tmp_path):
    signed = tmp_path / "signed.precast"
    pack_artifact(built["art"], signed, sign_key=keys / "k.pem", version="1")
    names = [m.name for m, _ in members_of(signed)]
    assert names[:3] == ["manifest.json", "statement.json", "statement.sig"] and names[3:] == sorted(
        names[3:]
    )
    unpack_artifact(signed, tmp_path / "ok", pubkey=keys / "k.pub")
    load(signed, pubkey=keys / "k.pub")
    with pytest.raises(SignatureError, match="does not match"):
        unpack_artifact(signed, tmp_path / "a", pubkey=keys / "other.pub")
    with pytest.raises(SignatureError, match="not signed"):
        unpack_artifact(built["packed"], tmp_path / "b", pubkey=keys / "k.pub")

    # A valid signature does not bless a swapped model file: the signed manifest's sha256 catches it.
    def swap(m, d):
        return (m, d[:-4] + b"EVIL") if m.name == "model.onnx" else (m, d)

    with pytest.raises(IntegrityError):
        unpack_artifact(
            _hostile({"packed": signed}, tmp_path, replace=swap), tmp_path / "c", pubkey=keys / "k.pub"
        )
    assert not any((tmp_path / n).exists() for n in "abc")


def test_cli_pack_verify_unpack(built, keys, tmp_path, capsys):
    out = tmp_path / "m.precast"
    code, _, err = run_cli(capsys, "pack", built["art"], "-o", out, "--sign-key", keys / "k.pem")
    assert code == 1 and "--sign-key needs --version" in err and not out.exists()
    code, _, err = run_cli(
        capsys, "pack", built["art"], "-o", out, "--sign-key", keys / "k.pem", "--version", "2"
    )
    assert code == 0 and "signed as 'art' version 2" in err
    code, stdout, err = run_cli(capsys, "verify", out, "--pubkey", keys / "k.pub", "-q")
    assert (code, stdout, err) == (0, "", "")
    code, _, err = run_cli(capsys, "verify", out, "--pubkey", keys / "other.pub")
    assert code == EXIT_ARTIFACT and "signature does not match" in err
    code, _, _ = run_cli(capsys, "unpack", out, "-o", tmp_path / "un", "--pubkey", keys / "k.pub")
    assert code == 0 and (tmp_path / "un" / "manifest.json").is_file()
    code, _, err = run_cli(
        capsys, "run", _hostile(built, tmp_path, extra=[reg("../evil", b"x")]), "-i", tmp_path / "none.npz"
    )
    assert code in (1, EXIT_ARTIFACT) and "Traceback" not in err
    code, _, _ = run_cli(capsys, "keygen", "-o", tmp_path / "new.pem")
    assert (
        code == 0
        and (tmp_path / "new.pem.pub").is_file()
        and (tmp_path / "new.pem").stat().st_mode & 0o077 == 0
    )
