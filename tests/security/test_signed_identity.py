"""A signature covers the artifact's identity, not only its bytes: the signed statement names the artifact, its
version, the manifest's sha256 and an optional expiry. A verifier (unpack, verify, load, serve) can require the
name and a least version and always refuses an expired statement, so an older signed pack cannot be replayed
for a newer one. `serve --pubkey` checks every pack it loads, at start and on each reload."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import numpy as np
import pytest

from precast.artifact.archive import unpack_artifact, unpack_checked
from precast.artifact.signing import SignatureError, SignaturePolicy, version_key
from precast.compiler.pack import pack_artifact
from precast.errors import EXIT_ARTIFACT, EXIT_USAGE, UsageError
from precast.runtime import load
from precast.runtime.server import ServerConfig
from tests.ci.archive_helpers import members_of, reg, write_tar
from tests.ci.cli_helpers import run_cli
from tests.helpers import ort_run, tiny_mlp
from tests.server.conftest import live_server, v2_body, v2_output

UTC = timezone.utc


@pytest.fixture(scope="module")
def packs(mlp_a, mlp_b, keys, tmp_path_factory):
    """mlp_a signed as 'mlp' versions 3 and 4, mlp_b as 5; one for another name, one expiring, one unsigned."""
    d = tmp_path_factory.mktemp("packs")
    k = keys / "k.pem"
    pack_artifact(mlp_a, d / "v3.precast", sign_key=k, name="mlp", version="3")
    pack_artifact(mlp_a, d / "v4.precast", sign_key=k, name="mlp", version="4")
    pack_artifact(mlp_b, d / "v5.precast", sign_key=k, name="mlp", version="5")
    pack_artifact(mlp_a, d / "other-name.precast", sign_key=k, name="encoder", version="9")
    pack_artifact(mlp_b, d / "other-key.precast", sign_key=keys / "other.pem", name="mlp", version="6")
    expires = datetime(2030, 1, 1, tzinfo=UTC)
    pack_artifact(mlp_a, d / "expiring.precast", sign_key=k, name="mlp", version="4", expires=expires)
    pack_artifact(mlp_a, d / "unsigned.precast")
    return d


def _policy(keys, **require) -> SignaturePolicy:
    return SignaturePolicy(keys / "k.pub", **require)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_versions_compare_numerically():
    assert version_key("1.10") > version_key("1.9") > version_key("1") == version_key("1.0.0")
    for bad in ("v1", "1.2.3-rc1", "01", "", "1..2", "1.2.3.4.5"):
        with pytest.raises(UsageError, match="dotted non-negative integers"):
            version_key(bad)


def test_a_replayed_older_pack_is_refused_with_min_version(packs, keys, tmp_path, capsys):
    policy = _policy(keys, min_version="4")
    with pytest.raises(SignatureError, match="signed version 3 is older than --min-version 4"):
        unpack_artifact(packs / "v3.precast", tmp_path / "old", policy=policy)
    assert not (tmp_path / "old").exists()
    done = unpack_checked(packs / "v4.precast", tmp_path / "new", policy=policy)
    assert (done.statement.name, done.statement.version) == ("mlp", "4")
    with pytest.raises(SignatureError, match="older than --min-version 4"):
        load(packs / "v3.precast", pubkey=keys / "k.pub", min_version="4")
    assert load(packs / "v4.precast", pubkey=keys / "k.pub", min_version="4.0").target == "ort-cpu"
    for cmd in (("unpack", "-o", tmp_path / "cli"), ("verify",)):
        code, _, err = run_cli(
            capsys, cmd[0], packs / "v3.precast", *cmd[1:], "--pubkey", keys / "k.pub", "--min-version", "4"
        )
        assert code == EXIT_ARTIFACT and "signed version 3 is older than --min-version 4" in _one_line(err)
    code, _, _ = run_cli(
        capsys, "verify", packs / "v4.precast", "--pubkey", keys / "k.pub", "--min-version", "4"
    )
    assert code == 0


def test_a_pack_signed_for_another_name_is_refused(packs, keys, tmp_path, capsys):
    with pytest.raises(SignatureError, match="signed for name 'encoder', not --expect-name 'mlp'"):
        unpack_artifact(packs / "other-name.precast", tmp_path / "x", policy=_policy(keys, expect_name="mlp"))
    code, _, err = run_cli(
        capsys, "verify", packs / "other-name.precast", "--pubkey", keys / "k.pub", "--expect-name", "mlp"
    )
    assert code == EXIT_ARTIFACT and "not --expect-name 'mlp'" in _one_line(err)
    code, _, _ = run_cli(
        capsys, "verify", packs / "v4.precast", "--pubkey", keys / "k.pub", "--expect-name", "mlp", "-q"
    )
    assert code == 0


def test_an_expired_statement_is_refused(packs, keys, tmp_path):
    before, after = datetime(2029, 12, 31, 23, 59, tzinfo=UTC), datetime(2030, 1, 1, tzinfo=UTC)
    done = unpack_checked(packs / "expiring.precast", tmp_path / "ok", policy=_policy(keys), now=before)
    assert done.statement.not_after == after
    with pytest.raises(SignatureError, match=r"expired at 2030-01-01T00:00:00Z \(now 2030-01-01T00:00:00Z\)"):
        unpack_artifact(packs / "expiring.precast", tmp_path / "late", pubkey=keys / "k.pub", now=after)
    with pytest.raises(SignatureError, match="expired"):
        load(packs / "expiring.precast", pubkey=keys / "k.pub", now=after)
    statement = json.loads(
        dict((m.name, d) for m, d in members_of(packs / "expiring.precast"))["statement.json"]
    )
    assert statement["not_after"] == "2030-01-01T00:00:00Z"


def test_pack_refuses_an_expiry_in_the_past_and_signing_without_a_version(mlp_a, keys, tmp_path, capsys):
    out = tmp_path / "m.precast"
    base = ("pack", mlp_a, "-o", out, "--sign-key", keys / "k.pem")
    for extra, why in (
        ((), "--sign-key needs --version"),
        (("--version", "v2"), "dotted non-negative integers"),
        (("--version", "2", "--expires", "2001-01-01"), "is not in the future"),
    ):
        code, _, err = run_cli(capsys, *base, *extra)
        assert code == EXIT_USAGE and why in _one_line(err) and not out.exists()
    code, _, err = run_cli(capsys, "pack", mlp_a, "-o", out, "--version", "2")
    assert code == EXIT_USAGE and "give --sign-key too" in err


def _rewrite(packed, out, change):
    return write_tar(out, [change(m, d) for m, d in members_of(packed)])


def test_a_statement_edited_after_signing_is_refused(packs, keys, tmp_path):
    def bump(m, d):  # version 3 -> 9, same length: only the signature can tell
        return (m, d.replace(b'"version":"3"', b'"version":"9"')) if m.name == "statement.json" else (m, d)

    edited = _rewrite(packs / "v3.precast", tmp_path / "edited.precast", bump)
    with pytest.raises(SignatureError, match="signature does not match statement.json"):
        unpack_artifact(edited, tmp_path / "a", policy=_policy(keys, min_version="4"))

    # A valid statement and signature moved onto another build: the statement names another manifest.
    v5 = dict((m.name, d) for m, d in members_of(packs / "v5.precast"))

    def transplant(m, d):
        return (m, v5[m.name]) if m.name in ("statement.json", "statement.sig") else (m, d)

    moved = _rewrite(packs / "v4.precast", tmp_path / "moved.precast", transplant)
    with pytest.raises(SignatureError, match="names manifest sha256"):
        unpack_artifact(moved, tmp_path / "b", pubkey=keys / "k.pub")

    # Format v1 (manifest.sig: the manifest only) is refused with a key, and still unpacks without one.
    legacy = [(m, d) for m, d in members_of(packs / "unsigned.precast")]
    legacy.insert(1, reg("manifest.sig", b"\0" * 64))
    v1 = write_tar(tmp_path / "v1.precast", legacy)
    with pytest.raises(SignatureError, match="signature format v1 .* is no longer accepted: re-sign it"):
        unpack_artifact(v1, tmp_path / "c", pubkey=keys / "k.pub")
    unpack_artifact(v1, tmp_path / "d")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_serve_pubkey_refuses_an_unsigned_pack_and_a_directory_at_start(packs, mlp_a, keys, capsys):
    base = ("serve", "--port", "0", "--pubkey", keys / "k.pub")
    code, _, err = run_cli(capsys, base[0], packs / "unsigned.precast", *base[1:])
    assert code == EXIT_ARTIFACT and "not signed (no statement.json)" in _one_line(err)
    code, _, err = run_cli(capsys, base[0], packs / "v3.precast", *base[1:], "--min-version", "4")
    assert code == EXIT_ARTIFACT and "signed version 3 is older than --min-version 4" in _one_line(err)
    code, _, err = run_cli(capsys, base[0], mlp_a, *base[1:])
    assert code == EXIT_USAGE and "is a directory, which carries no signature" in _one_line(err)
    code, _, err = run_cli(capsys, "serve", packs / "v4.precast", "--port", "0", "--min-version", "4")
    assert code == EXIT_USAGE and "give --pubkey too" in _one_line(err)


def test_serve_pubkey_refuses_a_bad_reload_and_keeps_the_old_model(packs, mlp_a, keys, rng):
    x = rng.standard_normal((2, 8), dtype=np.float32)
    expected = ort_run(tiny_mlp(seed=0), {"x": x})[0]  # mlp_a, signed as version 4
    cfg = ServerConfig(packs / "v4.precast", model_name="mlp", pubkey=keys / "k.pub", min_version="4")
    with live_server(cfg) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        for path, why in (
            ("unsigned.precast", "not signed (no statement.json)"),
            ("v3.precast", "signed version 3 is older than --min-version 4"),
            ("other-key.precast", "signature does not match statement.json"),
            ("other-name.precast", "it is signed as 'encoder', the served model as 'mlp'"),
            (None, "a directory carries no signature"),
        ):
            r = c.post("/admin/reload", json={"path": str(packs / path if path else mlp_a)})
            assert r.status_code == 422, r.text
            msg = r.json()["error"]
            assert "still serving version 1" in msg and why in msg and "\n" not in msg, msg
            r = c.post("/v2/models/mlp/infer", json=v2_body(x))
            assert r.status_code == 200 and r.json()["model_version"] == "1"
            np.testing.assert_allclose(v2_output(r.json()), expected, rtol=1e-5, atol=1e-5)
        assert c.post("/admin/reload", json={"path": str(packs / "v5.precast")}).json()["version"] == 2
        # Back to version 4 would be a rollback: refused, version 5 (mlp_b) keeps serving.
        r = c.post("/admin/reload", json={"path": str(packs / "v4.precast")})
        assert r.status_code == 422 and "older than the served signed version 5" in r.json()["error"]
        r = c.post("/v2/models/mlp/infer", json=v2_body(x))
        np.testing.assert_allclose(
            v2_output(r.json()), ort_run(tiny_mlp(seed=1), {"x": x})[0], rtol=1e-5, atol=1e-5
        )
        assert c.get("/admin/status").json()["version"] == 2
