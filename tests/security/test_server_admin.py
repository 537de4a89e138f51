"""Who may reload the model: without a token only direct requests from this host's own processes; with
one, whoever has it. Requests a proxy relays, a web page sends, or another host makes are refused."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

from precast.errors import UsageError
from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server, metric_value

# (headers, body, status): what a reverse proxy in front forwards, and what a browser page can send.
REFUSED = [
    ({"X-Forwarded-For": "203.0.113.7"}, None, 403),
    ({"Forwarded": "for=203.0.113.7;proto=https"}, None, 403),
    ({"X-Real-IP": "203.0.113.7"}, None, 403),
    ({"Via": "1.1 proxy.example"}, None, 403),
    ({"Host": "evil.example"}, None, 403),  # DNS rebinding: a page on evil.example resolved to 127.0.0.1
    ({"Host": "127.0.0.1:80@evil.com"}, None, 403),  # not a host[:port]: was read as 127.0.0.1
    ({"Host": "[::1]evil.com"}, None, 403),
    ({"X-Original-Forwarded-For": "203.0.113.7"}, None, 403),
    ({"X-Forwarded-Prefix": "/app"}, None, 403),
    ({"Origin": "http://evil.example", "Content-Type": "text/plain"}, b"{}", 403),  # cross-origin form POST
    ({"Origin": "null"}, None, 403),  # a sandboxed page or a file:// one
    ({"Sec-Fetch-Site": "cross-site"}, None, 403),
    ({"Content-Type": "text/plain"}, b'{"path": ""}', 415),  # a simple request: no CORS preflight
    ({"Content-Type": "application/x-www-form-urlencoded"}, b"path=", 415),
]


def test_tokenless_admin_refuses_relayed_and_cross_origin_requests(mlp_a):
    with live_server(ServerConfig(mlp_a, model_name="mlp")) as (url, state), httpx.Client(base_url=url) as c:
        for headers, body, status in REFUSED:
            for path, method in (("/admin/reload", "POST"), ("/admin/status", "GET")):
                if method == "GET" and status == 415:
                    continue
                r = c.request(method, path, headers=headers, content=body if method == "POST" else None)
                assert r.status_code == status, (path, headers, r.status_code, r.text)
                assert "\n" not in r.json()["error"]
        assert state.host.current.version == 1, "a refused request reloaded the model"
        # The plain, direct local request still works (also with a JSON body, and its own Origin).
        assert c.post("/admin/reload").status_code == 200
        r = c.post("/admin/reload", json={}, headers={"Origin": url, "Sec-Fetch-Site": "same-origin"})
        assert r.status_code == 200, r.text
        assert c.get("/admin/status").json()["version"] == 3
        assert metric_value(c.get("/metrics").text, "precast_reloads_total", result="ok") == 2


def test_refusals_name_what_gave_the_request_away(mlp_a):
    with live_server(ServerConfig(mlp_a, model_name="mlp")) as (url, _), httpx.Client(base_url=url) as c:
        msg = c.post("/admin/reload", headers={"X-Forwarded-For": "203.0.113.7"}).json()["error"]
        assert "x-forwarded-for" in msg and "--admin-token" in msg, msg
        msg = c.post("/admin/reload", headers={"Host": "evil.example"}).json()["error"]
        assert "'evil.example'" in msg, msg
        msg = c.post("/admin/reload", content=b"{}", headers={"Content-Type": "text/plain"}).json()["error"]
        assert "application/json" in msg and "text/plain" in msg, msg


def test_admin_is_decided_from_the_socket_peer(mlp_a):
    from fastapi.testclient import TestClient

    from precast.runtime.server.app import create_app

    app = create_app(ServerConfig(mlp_a, model_name="mlp"))  # bound to loopback, no token
    with TestClient(app, base_url="http://127.0.0.1:8000", client=("192.0.2.10", 41000)) as c:
        r = c.post("/admin/reload")
        assert r.status_code == 403 and "192.0.2.10" in r.json()["error"], r.text
    with TestClient(app, base_url="http://127.0.0.1:8000", client=("127.0.0.1", 41000)) as c:
        assert c.post("/admin/reload").status_code == 200


def test_a_token_admits_relayed_requests_and_only_with_it(mlp_a):
    cfg = ServerConfig(mlp_a, model_name="mlp", admin_token="s3cret")
    with live_server(cfg) as (url, _), httpx.Client(base_url=url) as c:
        relayed = {"X-Forwarded-For": "203.0.113.7", "Host": "models.example"}
        assert c.post("/admin/reload", headers=relayed).status_code == 401
        assert (
            c.post("/admin/reload", headers={**relayed, "Authorization": "Bearer s3cre"}).status_code == 401
        )
        r = c.post("/admin/reload", headers={**relayed, "Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
        assert c.get("/admin/status", headers={"X-Admin-Token": "s3cret"}).json()["version"] == 2


def test_an_empty_admin_token_is_refused(mlp_a, monkeypatch):
    for token in ("", "   "):
        with pytest.raises(UsageError, match="--admin-token must not be empty"):
            ServerConfig(mlp_a, host="0.0.0.0", admin_token=token)
    # An empty environment variable means "not set" (deploy/k8s ships an empty Secret): admin stays closed.
    monkeypatch.setenv("PRECAST_ADMIN_TOKEN", "")
    assert ServerConfig(mlp_a, host="0.0.0.0").admin_token is None


def test_serve_with_an_empty_admin_token_exits_1_with_one_line(mlp_a):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from precast.cli.main import main; main()", "serve", str(mlp_a)]
    try:
        r = subprocess.run(
            [*cmd, "--port", str(port), "--admin-token", ""], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("serve --admin-token '' started a server")
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --admin-token must not be empty"), r.stderr
