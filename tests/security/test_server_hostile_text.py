"""An artifact's chat template and tokenizer are its author's code: per request they run in a sandbox process
with a deadline and a memory limit (runtime/server/text_sandbox.py), never in the server's threads.

Attacks, each from a real artifact served by a real `precast serve` process:
- a template with a 10^10-iteration nested loop when a message is BOOM: 504, once and 45 at a time, while an
  ordinary client keeps being served; afterwards no sandbox child is left, the server's threads and CPU are
  back to idle, and SIGTERM stops the server within its drain time;
- a template that doubles a string: a 400 naming the memory limit; the server's RSS does not grow;
- a pre-tokenizer regex with catastrophic backtracking: a JSON 4xx/504, no traceback in the server's log;
- a decoder regex (it would run on every generated token, in the engine's loop): refused at load, exit 3.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from precast.artifact.manifest import sha256_file

pytestmark = pytest.mark.slow

BOOM = (
    "{% for m in messages %}{% if m['content'] == 'BOOM' %}"
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
DOUBLING = (
    "{% set ns = namespace(s='0123456789abcdef') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
)
TEXT_TIMEOUT = 1.0


def _hostile(llm_artifact: Path, dest: Path, template: str | None = None, tokenizer_edit=None) -> Path:
    """A copy of the tiny Llama artifact with a chat template / an edited tokenizer.json, hashes updated (the
    author of a hostile artifact signs and hashes it as they like)."""
    shutil.copytree(llm_artifact, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    if template is not None:
        cfg = dest / "tokenizer" / "tokenizer_config.json"
        cfg.parent.mkdir(exist_ok=True)
        data = json.loads(cfg.read_text()) if cfg.is_file() else {}
        cfg.write_text(json.dumps({**data, "chat_template": template}))
        manifest["files"]["tokenizer/tokenizer_config.json"] = sha256_file(cfg)
    if tokenizer_edit is not None:
        rel = manifest["llm"]["tokenizer"]
        tok = json.loads((dest / rel).read_text())
        tokenizer_edit(tok)
        (dest / rel).write_text(json.dumps(tok))
        manifest["files"][rel] = sha256_file(dest / rel)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


class _Server:
    """`precast serve ARTIFACT` in a child process on a free loopback port."""

    def __init__(self, artifact: Path, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-c", "from precast.cli.main import main; main()", "serve", str(artifact)]
        cmd += ["--port", str(port), "--model-name", "tiny", "--num-blocks", "64", "--log-level", "warning"]
        self.proc = subprocess.Popen(
            cmd + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=30)[0]


def _serve_refused(artifact: Path) -> subprocess.CompletedProcess:
    """`precast serve ARTIFACT` run to its end (an artifact refused at load ends it at once)."""
    return subprocess.run(
        [sys.executable, "-m", "precast", "serve", str(artifact), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _sandbox_children(server_pid: int) -> list[int]:
    """The sandbox zygotes' live children (one per call in flight)."""
    return [c for z in _children(server_pid) for c in _children(z)]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def _thread_names(pid: int) -> list[str]:
    return sorted((t / "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir())


def _rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _chat(client: httpx.Client, content: str, timeout: float = 60) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": True}
    return client.post("/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def boom_server(llm_artifact, tmp_path_factory):
    art = _hostile(llm_artifact, tmp_path_factory.mktemp("boom") / "boom", template=BOOM)
    server = _Server(art, "--text-timeout", str(TEXT_TIMEOUT), "--timeout", "20", "--drain-timeout", "5")
    yield server
    server.stop()


def test_a_slow_chat_template_is_a_504_and_others_are_served(boom_server):
    url, pid = boom_server.url, boom_server.proc.pid
    with httpx.Client(base_url=url) as c:
        assert _chat(c, "hello").status_code == 200
        idle_threads = _threads(pid)
        t0 = time.monotonic()
        r = _chat(c, "BOOM")
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["type"] == "timeout" and "--text-timeout" in err["message"], err
        assert took < TEXT_TIMEOUT + 10, f"one BOOM took {took:.1f} s"

        # 45 attackers at once, each giving up after 5 s, while an ordinary client keeps chatting.
        def attack(_):
            try:
                with httpx.Client(base_url=url) as a:
                    return _chat(a, "BOOM", timeout=5).status_code
            except httpx.TimeoutException:
                return "gave up"

        with concurrent.futures.ThreadPoolExecutor(45) as pool:
            attacks = [pool.submit(attack, i) for i in range(45)]
            latencies, statuses = [], []
            while not all(f.done() for f in attacks) or len(latencies) < 5:
                t = time.monotonic()
                ordinary = _chat(c, "what is 2+2?")
                statuses.append(ordinary.status_code)
                assert ordinary.status_code in (200, 504), ordinary.text
                if ordinary.status_code == 200:
                    latencies.append(time.monotonic() - t)
            codes = [f.result() for f in attacks]
        assert set(codes) <= {504, "gave up"} and codes.count(504) >= 1, codes
        # Served: an ordinary request can still meet a full sandbox (32 live children, the rest wait in order
        # within their own 1 s deadline) and time out like the attackers; CI saw 1 such of the ordinary ones.
        assert statuses.count(200) >= 0.75 * len(statuses), statuses
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        # Measured on a quiet 2-core host: p99 0.1-0.3 s. The bound only rules out waiting for the attackers'
        # text work (which would take 45 x 1 s / workers); it tolerates a busy host.
        assert p99 < 5.0, f"ordinary p99 {p99:.2f} s during the attack ({len(latencies)} requests)"

        # The attackers are gone: no sandbox child left, threads back, CPU idle.
        deadline = time.monotonic() + TEXT_TIMEOUT + 10
        while _sandbox_children(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _sandbox_children(pid) == [], "a sandbox child outlived its deadline"
        # Threads: the ones that ran the requests' cheap checks stay in anyio's pool (at most 40) and asyncio's
        # executor, idle (before, 40 of them stayed busy rendering): the CPU reading below shows none runs.
        assert _threads(pid) <= idle_threads + 46, (idle_threads, _thread_names(pid))
        zygotes = _children(pid)
        before = sum(map(_cpu_seconds, [pid, *zygotes]))
        time.sleep(2.0)
        busy = sum(map(_cpu_seconds, [pid, *zygotes])) - before
        assert busy < 0.5, f"the server used {busy:.2f} s of CPU in 2 idle seconds after the attack"
        assert _chat(c, "hello").status_code == 200

        # SIGTERM during an attack: the server stops within its drain time and leaves no sandbox process.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for i in range(8):
                pool.submit(attack, i)
            time.sleep(0.5)
            t0 = time.monotonic()
            boom_server.proc.send_signal(signal.SIGTERM)
            out = boom_server.proc.communicate(timeout=30)[0]
            stopped = time.monotonic() - t0
    assert stopped < 5 + 10, f"SIGTERM took {stopped:.1f} s (drain 5 s)"
    assert "Traceback" not in out, out[-3000:]
    for z in zygotes:
        assert not Path(f"/proc/{z}").exists() or "zombie" in Path(f"/proc/{z}/status").read_text(), z


def test_a_doubling_template_is_refused_within_its_memory(llm_artifact, tmp_path):
    art = _hostile(llm_artifact, tmp_path / "double", template=DOUBLING)
    server = _Server(art, "--text-memory", "64MiB")
    try:
        with httpx.Client(base_url=server.url) as c:
            before = _rss(server.proc.pid)
            for _ in range(3):
                r = _chat(c, "hi")
                assert r.status_code == 400, r.text
                assert "--text-memory 64 MiB" in r.json()["error"]["message"], r.text
            grew = _rss(server.proc.pid) - before
            assert grew < 64 << 20, f"the server's RSS grew by {grew >> 20} MiB"
    finally:
        out = server.stop()
    assert "Traceback" not in out, out[-3000:]


def test_a_backtracking_pre_tokenizer_regex_is_a_json_error(llm_artifact, tmp_path):
    def evil(tok):
        tok["pre_tokenizer"] = {
            "type": "Split",
            "pattern": {"Regex": "(a+)+b"},
            "behavior": "Isolated",
            "invert": False,
        }

    art = _hostile(llm_artifact, tmp_path / "regex", tokenizer_edit=evil)
    server = _Server(art, "--text-timeout", str(TEXT_TIMEOUT))
    try:
        with httpx.Client(base_url=server.url) as c:
            for route, body in (
                ("/v1/completions", {"prompt": "a" * 5000 + "c", "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 5000 + "c"}]}),
            ):
                for _ in range(3):
                    r = c.post(route, json=body, timeout=60)
                    assert r.status_code in (400, 504), r.text
                    assert r.headers["content-type"].startswith("application/json"), r.text
                    assert r.json()["error"]["message"], r.text
            assert c.post("/v1/completions", json={"prompt": "def", "max_tokens": 2}).status_code == 200
    finally:
        out = server.stop()
    assert "Traceback" not in out and "panicked" not in out, out[-3000:]


def test_a_decoder_regex_is_refused_at_load(llm_artifact, tmp_path):
    def evil(tok):
        tok["decoder"] = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"Regex": "(a+)+b"}, "content": "x"},
                tok.get("decoder") or {"type": "ByteLevel"},
            ],
        }

    proc = _serve_refused(_hostile(llm_artifact, tmp_path / "decoder", tokenizer_edit=evil))
    assert proc.returncode == 3, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "decoder.decoders[0].pattern" in lines[0], proc.stderr


def test_a_huge_vocabulary_piece_is_refused_at_load(llm_artifact, tmp_path):
    def evil(tok):
        tok["added_tokens"].append(
            {
                "id": 10**6,
                "content": "x" * 100_000,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )

    proc = _serve_refused(_hostile(llm_artifact, tmp_path / "piece", tokenizer_edit=evil))
    assert proc.returncode == 3 and "added_tokens" in proc.stderr and "100000 characters" in proc.stderr, (
        proc.stderr[-2000:]
    )


SLOW = (  # ~0.3-1 s of rendering for every request (mid-render during a reload); FOREVER renders until killed
    "{% for a in range(3000) %}{% for b in range(100) %}{% endfor %}{% endfor %}"
    "{% if messages[0]['content'] == 'FOREVER' %}"
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_a_reload_or_a_killed_worker_does_not_fail_requests_as_bad_input(llm_artifact, tmp_path):
    """A hot reload drains requests that are still rendering (they finish on the old model); a sandbox worker
    killed from outside takes its children with it, its in-flight requests get a 503 (retry), and the next
    request restarts it."""
    art = _hostile(llm_artifact, tmp_path / "slow", template=SLOW)
    server = _Server(art, "--text-timeout", "20")
    try:
        url, pid = server.url, server.proc.pid
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            chats = [pool.submit(lambda: _chat(httpx.Client(base_url=url), "hi")) for _ in range(6)]
            time.sleep(0.2)
            assert httpx.post(f"{url}/admin/reload", timeout=120).status_code == 200
            codes = [f.result().status_code for f in chats]
        assert set(codes) <= {200, 429}, codes  # 429: it reached the retired model after its drain began

        deadline = time.monotonic() + 30
        while len(_children(pid)) != 1 and time.monotonic() < deadline:  # the old model's worker goes
            time.sleep(0.1)
        (zygote,) = _children(pid)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            chats = [pool.submit(lambda: _chat(httpx.Client(base_url=url), "FOREVER")) for _ in range(4)]
            deadline = time.monotonic() + 30
            while len(_children(zygote)) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            orphans = _children(zygote)
            os.kill(zygote, signal.SIGKILL)
            answers = [f.result() for f in chats]
        assert all(r.status_code == 503 and r.headers.get("retry-after") for r in answers), [
            r.text for r in answers
        ]
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{c}").exists() for c in orphans) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in orphans if Path(f"/proc/{c}").exists()], "children outlived their zygote"
        with httpx.Client(base_url=url) as c:
            assert _chat(c, "hi").status_code == 200  # a new worker
    finally:
        out = server.stop()
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize(
    "decoder,field",
    [
        ({"type": "Replace", "pattern": {"String": "e"}, "content": "e" * 1000}, "at most 16 characters"),
        ({"type": "Replace", "pattern": {"String": ""}, "content": "xx"}, "non-empty string"),
        (
            {
                "type": "Sequence",
                "decoders": [{"type": "Replace", "pattern": {"String": "e"}, "content": "eeee"}] * 2,
            },
            "16-fold",
        ),
    ],
    ids=["long-content", "empty-pattern", "chain-growth"],
)
def test_a_decoder_that_grows_text_is_refused_at_load(tmp_path, decoder, field):
    """Each generated token's text is decoded in the engine's loop: a chain of replacements that multiplies it
    (4 x 'e' -> 1000 x 'e' was 10^12 characters per token: the server aborted) is refused when it loads."""
    from precast.errors import ArtifactError
    from precast.runtime.llm.tokenizer import check_decode_bounded

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"e": 0}}, "decoder": decoder}))
    with pytest.raises(ArtifactError, match=field):
        check_decode_bounded(path)


def test_a_template_message_with_a_lone_surrogate_is_a_400(llm_artifact, tmp_path):
    art = _hostile(llm_artifact, tmp_path / "sur", template="{{ raise_exception('bad \\ud800 x') }}")
    server = _Server(art)
    try:
        with httpx.Client(base_url=server.url) as c:
            r = _chat(c, "hi")
            assert r.status_code == 400 and "bad" in r.json()["error"]["message"], r.text
    finally:
        out = server.stop()
    assert "Traceback" not in out, out[-3000:]
