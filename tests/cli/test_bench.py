"""`precast bench`: tables, JSON, plots, --dim, errors; an LLM artifact; a real `precast serve` over loopback.

Short windows (0.3 s per level) keep the file near 20 s; the tiny LLM artifact is the session's llm_artifact
(tests/conftest.py), compiled once for every file that serves or benches it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import one_line_error, save, tiny_mlp

SHORT = ("--duration", "0.3s", "--warmup", "0.1s")


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    from precast.compiler.driver import CompileOptions, compile_model

    tmp = tmp_path_factory.mktemp("bench")
    compile_model(str(save(tiny_mlp(), tmp / "mlp.onnx")), tmp / "mlp", CompileOptions())
    return tmp / "mlp"


_one_line_error = one_line_error


def test_bench_prints_a_table_and_writes_a_plot(cli, mlp, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    r = cli("bench", mlp, "--concurrency", "1,2", *SHORT, "--plot", plot, "--threads", "1")
    assert r.code == 0, r.err
    assert "precast bench: mlp (ort-cpu), in-process, intra-op threads: 1" in r.out
    for col in ("concurrency", "req/s", "p50 ms", "p90 ms", "p99 ms", "mean ms"):
        assert col in r.out
    assert "x float32[1, 8]: standard normal" in r.out
    assert "dims not given, defaulted: batch=1" in r.out
    data = plot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000  # a drawn figure, not an empty canvas
    assert f"wrote the plot to {plot}" in r.err.replace("\n", "")


def test_bench_json_has_sane_numbers(cli, mlp):
    r = cli("bench", mlp, "--concurrency", "1,2", *SHORT, "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    assert rep["kind"] == "model" and rep["mode"] == "in-process" and rep["target"] == "ort-cpu"
    assert rep["dims"] == {"batch": 1} and rep["defaulted_dims"] == ["batch"]
    assert [lv["concurrency"] for lv in rep["levels"]] == [1, 2]
    for lv in rep["levels"]:
        lat = lv["latency"]
        assert lv["errors"] == 0 and lv["requests"] == lat["count"] > 10
        assert 0 < lat["min_ms"] <= lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"] <= lat["max_ms"]
        assert 0.3 <= lv["wall_s"] < 60  # (at least the duration; no upper bound a busy host could break)
        assert lv["requests_per_s"] == pytest.approx(lv["requests"] / lv["wall_s"])
        assert lv["items_per_s"] == pytest.approx(lv["requests_per_s"])
    assert rep["host"]["cpus"] == os.cpu_count()


def test_bench_dims_and_requests(cli, mlp, tmp_path):
    r = cli(
        "bench", mlp, "--dim", "batch=4", "--concurrency", "2", "--requests", "25", "--warmup", "0", "--json"
    )
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    assert rep["dims"] == {"batch": 4} and rep["defaulted_dims"] == [] and rep["inputs"][0]["shape"] == [4, 8]
    (lv,) = rep["levels"]
    assert rep["items_per_request"] == 4 and lv["requests"] == 25 and rep["duration_s"] is None
    assert lv["items_per_s"] == pytest.approx(4 * lv["requests_per_s"])

    import numpy as np

    np.savez(tmp_path / "feeds.npz", x=np.ones((3, 8), np.float32))
    r = cli("bench", mlp, "--input", tmp_path / "feeds.npz", "--requests", "5", "--warmup", "0", "--json")
    rep = json.loads(r.out)
    assert (
        rep["dims"] == {"batch": 3}
        and rep["items_per_request"] == 3
        and rep["inputs"][0]["values"] == "given (--input)"
    )
    np.savez(tmp_path / "bad.npz", x=np.ones((3, 7), np.float32))
    _one_line_error(cli("bench", mlp, "--input", tmp_path / "bad.npz"), 1, "input 'x': dim 1 must be 8")

    r = cli("bench", mlp, "--dim", "seq=4", *SHORT)
    _one_line_error(r, 1, "unknown --dim 'seq'", "symbolic dims are: batch")
    r = cli("bench", mlp, "--dim", "batch=0", *SHORT)
    _one_line_error(r, 1, "bad --dim 'batch=0'")


def test_bench_errors_are_one_line(cli, mlp, tmp_path, monkeypatch):
    _one_line_error(cli("bench", mlp, "--concurrency", "1,x"), 1, "bad --concurrency '1,x'")
    _one_line_error(cli("bench", mlp, "--concurrency", "0"), 1, "bad --concurrency")
    _one_line_error(cli("bench", mlp, "--duration", "5 parsecs"), 1, "bad --duration '5 parsecs'")
    _one_line_error(cli("bench", mlp, "--duration", "1s", "--requests", "3"), 1, "not both")
    _one_line_error(cli("bench", mlp, "--plot", tmp_path / "bench.gif"), 1, ".png")
    _one_line_error(cli("bench", tmp_path, *SHORT), 3)  # not an artifact
    _one_line_error(cli("bench", tmp_path / "nope", *SHORT), 3)
    _one_line_error(cli("bench", mlp, "--url", "http://10.1.2.3:8000"), 1, "not a loopback address")
    _one_line_error(cli("bench", mlp, "--url", "http://127.0.0.1:9", "--threads", "2"), 1, "serve --threads")
    _one_line_error(cli("bench", mlp, "--endpoint", "v2"), 1, "need --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there (bound, not listening)
        _one_line_error(cli("bench", mlp, "--url", f"http://127.0.0.1:{port}", *SHORT), 1, "cannot reach")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    _one_line_error(
        cli("bench", mlp, "--plot", tmp_path / "b.png", *SHORT), 1, "pip install 'precast[bench]'"
    )
    assert not (tmp_path / "b.png").exists()


def test_bench_llm_artifact(cli, llm_artifact, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "llm.png"
    args = ("--concurrency", "1,2", *SHORT, "--prompt-len", "16", "--output-len", "8")
    r = cli("bench", llm_artifact, *args, "--json", "--plot", plot)
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    assert rep["kind"] == "llm" and rep["llm"]["prompt_len"] == 16 and rep["llm"]["output_len"] == 8
    assert rep["llm"]["prefix_hit_tokens"] == 0  # fresh prompts
    for lv in rep["levels"]:
        assert lv["errors"] == 0 and lv["requests"] > 0
        assert lv["output_tokens"] == 8 * lv["requests"]  # EOS ignored: exactly --output-len each
        assert lv["tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"])
        assert 0 < lv["ttft"]["p50_ms"] <= lv["ttft"]["p99_ms"] <= lv["latency"]["max_ms"]
        assert lv["itl"]["count"] == 7 * lv["requests"] and lv["itl"]["p50_ms"] <= lv["itl"]["p99_ms"]
        assert lv["request_tokens_per_s"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size > 20_000

    r = cli(
        "bench",
        llm_artifact,
        "--concurrency",
        "2",
        *SHORT,
        "--prompt-len",
        "16",
        "--output-len",
        "8",
        "--shared-prefix",
    )
    assert r.code == 0, r.err
    assert "tokens/s per request" in r.out and "TTFT p50 ms" in r.out and "one shared prompt" in r.out

    _one_line_error(
        cli("bench", llm_artifact, "--prompt-len", "200", "--output-len", "100"), 1, "context is 256"
    )
    _one_line_error(cli("bench", llm_artifact, "--dim", "batch=2"), 1, "causal-lm artifact")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(*artifacts: Path):
    """`precast serve` subprocesses on 127.0.0.1 (started together: each takes seconds to import and load)."""
    import httpx

    procs, urls = [], []
    try:
        for art in artifacts:
            port = _free_port()
            cmd = [sys.executable, "-c", "from precast.cli.main import main; main()", "serve", str(art)]
            cmd += ["--port", str(port), "--log-level", "warning"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        for proc, url in zip(procs, urls):
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "server did not become ready"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200:
                        break
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_bench_url_drives_precast_serve(cli, mlp, llm_artifact, tmp_path):
    for mod in ("httpx", "uvicorn", "matplotlib"):
        pytest.importorskip(mod)
    with _serving(mlp, llm_artifact) as (mlp_url, llm_url):
        r = cli("bench", mlp, "--url", mlp_url, "--concurrency", "1,2", *SHORT, "--json")
        assert r.code == 0, r.err
        rep = json.loads(r.out)
        assert rep["mode"] == "http" and rep["endpoint"] == "v2" and rep["model_name"] == "mlp"
        for lv in rep["levels"]:
            assert (
                lv["errors"] == 0
                and lv["requests"] > 0
                and lv["latency"]["p50_ms"] <= lv["latency"]["p99_ms"]
            )

        _one_line_error(cli("bench", mlp, "--url", llm_url, *SHORT), 1, "inputs")  # not the artifact served

        plot = tmp_path / "url.png"
        args = ("--url", llm_url, "--concurrency", "1,2", *SHORT, "--prompt-len", "16", "--output-len", "8")
        r = cli("bench", llm_artifact, *args, "--json", "--plot", plot)
        assert r.code == 0, r.err
        rep = json.loads(r.out)
        assert rep["mode"] == "http" and rep["endpoint"] == "completions"
        for lv in rep["levels"]:
            assert lv["errors"] == 0 and lv["output_tokens"] == 8 * lv["requests"] > 0
            assert 0 < lv["ttft"]["p50_ms"] <= lv["latency"]["max_ms"]
        assert plot.stat().st_size > 20_000
