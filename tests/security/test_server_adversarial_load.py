"""Oversized and malformed requests interleaved with normal traffic against a real `precast serve` process
(loopback, about 15 s, stops by itself): every normal request succeeds, /health answers within a second
throughout, nothing is a 500, and the server's memory (VmRSS) comes back to within 20% of where it began."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.security.raw_http import head_only, reset_mid_upload, stream_chunks
from tests.server.conftest import metric_value

MiB = 1 << 20
WARM_UP = 2.0
SECONDS = 10.0


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _post_raw(url: str, path: str, raw: str | bytes) -> int:
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=raw, headers=headers, timeout=30).status_code


def _attacks(url: str):
    """(name, callable returning a status or None for a reset, statuses allowed)."""
    words = "the quick brown fox jumps over the lazy dog "
    return [
        ("announced 100 MiB", lambda: head_only(url, "/v1/embeddings", 100 * MiB)[0], {413}),
        ("streamed 24 MiB", lambda: stream_chunks(url, "/v1/embeddings", b" " * (64 << 10), 24 * MiB)[0], {413}),
        ("nested 400k deep", lambda: _post_raw(url, "/v1/embeddings", "[" * 400_000 + "]" * 400_000), {400}),
        ("5000-digit int", lambda: _post_raw(url, "/v2/models/enc/infer", '{"id": ' + "7" * 5000 + "}"), {400}),
        ("lone surrogate", lambda: _post_raw(url, "/v1/embeddings", '{"input": "\\udc00"}'), {400}),
        ("malformed", lambda: _post_raw(url, "/v1/embeddings", b'{"input": ["fox",'), {400}),
        ("not UTF-8", lambda: _post_raw(url, "/v1/embeddings", b'{"input": "\xff\xfe"}'), {400}),
        ("129 inputs", lambda: _post_raw(url, "/v1/embeddings", '{"input": ' + '["fox"' + ', "fox"' * 128 + "]}"), {400}),
        ("too many tokens", lambda: httpx.post(f"{url}/v1/embeddings", json={"input": [words * 70] * 20}, timeout=30).status_code, {400}),
        ("reset mid-upload", lambda: reset_mid_upload(url, "/v1/embeddings"), {None}),
        ("7 MB text", lambda: httpx.post(f"{url}/v1/embeddings", json={"input": words * 160_000}, timeout=60).status_code, {400}),
        ("250k chars", lambda: httpx.post(f"{url}/v1/embeddings", json={"input": words * 5_600}, timeout=60).status_code, {200}),
        ("bad tensor", lambda: httpx.post(f"{url}/v2/models/enc/infer", json={"inputs": [{"name": "input_ids", "shape": [10**6, 10**6], "datatype": "INT64", "data": [1]}]}, timeout=30).status_code, {400}),
    ]  # fmt: skip


def _traffic(url: str, one_normal, seconds: float) -> tuple[list[str], dict, list[float]]:
    """2 normal clients, 2 attackers cycling through _attacks, and a /health prober, for ``seconds``."""
    stop = time.monotonic() + seconds
    failures: list[str] = []
    counts = {"normal": 0, "attacks": 0}
    health: list[float] = []

    def normal_client():
        while time.monotonic() < stop:
            err = one_normal()
            counts["normal"] += 1
            if err:
                failures.append(err)

    def attacker(offset: int):
        cycle = itertools.islice(itertools.cycle(_attacks(url)), offset, None)
        while time.monotonic() < stop:
            name, attack, allowed = next(cycle)
            try:
                status = attack()
            except (OSError, httpx.HTTPError) as e:
                status = f"{type(e).__name__}: {e}"
            counts["attacks"] += 1
            if status not in allowed:
                failures.append(f"{name}: {status}, expected {allowed}")

    def prober():
        with httpx.Client(base_url=url, timeout=10) as c:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                c.get("/health")
                health.append(time.perf_counter() - t0)
                time.sleep(0.05)

    threads = [threading.Thread(target=normal_client, daemon=True) for _ in range(2)]
    threads += [threading.Thread(target=attacker, args=(k * 6,), daemon=True) for k in range(2)]
    threads.append(threading.Thread(target=prober, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 90)
    assert not any(t.is_alive() for t in threads), "a client thread is stuck"
    return failures, counts, health


def test_adversarial_load_leaves_normal_traffic_and_memory_alone(tiny_encoder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from precast.cli.main import main; main()", "serve", str(tiny_encoder)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--model-name", "enc", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "precast serve did not start"
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        normal = httpx.Client(base_url=url, timeout=30)
        infer = {"inputs": [{"name": n, "shape": [1, 3], "datatype": "INT64", "data": [2, 3, 4]} for n in ("input_ids", "attention_mask", "token_type_ids")]}  # fmt: skip

        def one_normal() -> str | None:
            r = normal.post("/v1/embeddings", json={"input": ["hello world", "the lazy dog"]})
            if r.status_code != 200 or len(r.json()["data"]) != 2:
                return f"embeddings {r.status_code}: {r.text[:200]}"
            r = normal.post("/v2/models/enc/infer", json=infer)
            return None if r.status_code == 200 else f"infer {r.status_code}: {r.text[:200]}"

        for _ in range(20):
            assert one_normal() is None
        # Warm up with the same traffic: what the server sets up once (its thread pools, their malloc
        # arenas, ORT's buffers for the shapes seen) is not growth; what a further round keeps would be.
        _traffic(url, one_normal, WARM_UP)
        rss_start = _rss_kib(proc.pid)
        failures, counts, health = _traffic(url, one_normal, SECONDS)
        normal.close()

        assert not failures, failures[:5]
        assert counts["normal"] >= 20 and counts["attacks"] >= 12, counts
        assert max(health) < 1.0, f"/health took {max(health):.2f} s under attack"
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert metric_value(metrics, "precast_requests_total", status="500") == 0
        rss_end = _rss_kib(proc.pid)
        for _ in range(20):  # freed memory goes back to the OS a little after the last request
            if rss_end <= 1.2 * rss_start:
                break
            time.sleep(0.25)
            rss_end = _rss_kib(proc.pid)
        print(f"VmRSS {rss_start} -> {rss_end} KiB; /health at most {max(health):.3f} s; {counts}")
        assert rss_end <= 1.2 * rss_start, f"VmRSS grew from {rss_start} to {rss_end} KiB"

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert "Traceback" not in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


if not sys.platform.startswith("linux") or not os.path.exists("/proc/self/status"):
    pytestmark = pytest.mark.skip(reason="reads VmRSS from /proc")
