"""A packed artifact is unpacked into a temp dir; whoever loaded it owns that copy and removes it: Model and
Engine on close() (or when garbage-collected), the server on every swap and on every way it exits."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server, metric_value


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """tempfile's directory for this test only, so its unpacked copies can be counted."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def _copies(tmp) -> list:
    return sorted(p.name for p in tmp.glob("precast-*"))


def test_model_close_removes_its_unpacked_copy(packed_mlp, private_tmp):
    from precast.runtime import load

    model = load(packed_mlp)
    assert model.path.is_dir() and len(_copies(private_tmp)) == 1
    model.close()
    model.close()  # idempotent
    assert _copies(private_tmp) == []
    dropped = load(packed_mlp).path
    gc.collect()  # a Model nobody holds takes its copy with it
    assert not dropped.exists() and _copies(private_tmp) == []


@pytest.mark.slow
def test_engine_close_removes_its_unpacked_copy(llm_artifact, private_tmp, tmp_path):
    from precast.compiler.pack import pack_artifact
    from precast.runtime.llm import Engine, SamplingParams

    packed = tmp_path / "llama.precast"
    pack_artifact(llm_artifact, packed)
    engine = Engine.load(packed, num_blocks=8)
    assert len(_copies(private_tmp)) == 1
    assert engine.generate("hi", SamplingParams(max_tokens=2))[0].token_ids
    engine.close()
    engine.close()
    assert _copies(private_tmp) == []


def test_reloading_a_packed_artifact_keeps_one_copy(packed_mlp, tiny_encoder, private_tmp):
    with live_server(ServerConfig(packed_mlp, model_name="mlp")) as (url, _), httpx.Client(base_url=url) as c:
        for version in range(2, 7):
            r = c.post("/admin/reload")
            assert r.status_code == 200 and r.json()["version"] == version, r.text
            assert len(_copies(private_tmp)) == 1, _copies(private_tmp)
        # A reload that fails after unpacking (another kind of artifact) leaves no copy behind either.
        from precast.compiler.pack import pack_artifact

        packed_encoder = private_tmp.parent / "encoder.precast"
        pack_artifact(tiny_encoder, packed_encoder)
        assert c.post("/admin/reload", json={"path": str(packed_encoder)}).status_code == 409
        assert len(_copies(private_tmp)) == 1
        body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [1.0] * 8}]}
        assert c.post("/v2/models/mlp/infer", json=body).json()["model_version"] == "6"
    assert _copies(private_tmp) == [], "the lifespan shutdown left the unpacked copy"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_removes_its_copies_on_signals(packed_mlp, tmp_path, sig):
    import os
    import socket

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from precast.cli.main import main; main()", "serve", str(packed_mlp)]
        + ["--port", str(port), "--model-name", "mlp", "--log-level", "warning"],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert len(_copies(tmp)) == 1
        assert httpx.post(f"{url}/admin/reload", timeout=30).status_code == 200  # the old copy's swap
        assert metric_value(httpx.get(f"{url}/metrics").text, "precast_reloads_total", result="ok") == 1
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert "Traceback" not in out, out[-2000:]
        assert _copies(tmp) == [], f"{sig.name} left {_copies(tmp)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
