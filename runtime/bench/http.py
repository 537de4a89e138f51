"""``precast bench --url``: the same requests, sent to a running ``precast serve`` on this host.

Loopback only (127.0.0.0/8, ::1, localhost): a benchmark floods its target, and this one is for measuring
your own server, not someone else's. Proxies from the environment are ignored for the same reason. Each
client thread holds one keep-alive connection (httpx, imported here only) reused across warm-up and the
measured window, so connecting is not timed. Request bodies are encoded once: the client's JSON encoding is
not what is measured.

- v2: POST /v2/models/NAME/infer with the generated feeds as KServe v2 JSON
- embeddings: POST /v1/embeddings with ``batch`` texts of ``sequence - 2`` common words (about one token each)
- completions (LLMs): POST /v1/completions, ``stream: true``, prompt as token ids, ``ignore_eos``; a token's
  time is when its server-sent event arrived (one event per token).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.errors import UsageError, first_line

__all__ = ["HttpClients", "completion_clients", "loopback_url", "model_clients"]

_V2_TYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
_WORDS = "the model runs on one small host and we time each request it serves here now".split()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, or UsageError unless it is http(s) to a loopback address.
    'localhost' must resolve to loopback addresses only (nothing else is looked up)."""
    try:
        parts = urllib.parse.urlsplit(str(url).strip())
        host, _port = parts.hostname, parts.port
    except ValueError as e:
        raise UsageError(f"bad --url '{url}': {first_line(e)}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise UsageError(f"bad --url '{url}': expected http://127.0.0.1:PORT")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise UsageError(f"bad --url '{url}': give the server's base URL only, e.g. http://127.0.0.1:8000")
    if host.lower() == "localhost":
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)}
        except OSError as e:
            raise UsageError(f"--url {url}: cannot resolve localhost ({first_line(e)})") from None
        if not addrs or not all(_is_loopback(a.split("%")[0]) for a in addrs):
            raise UsageError(
                f"--url {url}: localhost resolves to {', '.join(sorted(addrs))}, not loopback only"
            )
    elif not _is_loopback(host):
        raise UsageError(
            f"--url host '{host}' is not a loopback address: bench drives a server on this host only "
            "(127.0.0.1, ::1 or localhost)"
        )
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _httpx():
    try:
        import httpx
    except ImportError:
        raise UsageError("--url needs httpx: pip install httpx") from None
    return httpx


def _server_message(resp) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200].strip() or resp.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        err = err.get("message")
    return str(err if err is not None else body)[:300]


class HttpClients:
    """One httpx client (one keep-alive connection) per client index, made on first use; close() them all."""

    def __init__(self, url: str, timeout_s: float):
        self.httpx = _httpx()
        self.url, self.timeout_s = url, timeout_s
        self._clients: dict[int, object] = {}
        self._lock = threading.Lock()

    def get(self, i: int):
        with self._lock:
            if i not in self._clients:
                self._clients[i] = self.httpx.Client(
                    base_url=self.url, timeout=self.timeout_s, trust_env=False, follow_redirects=False
                )
            return self._clients[i]

    def request(self, method: str, path: str, **kw):
        """A setup request (model list, metadata, probe); an unreachable server is a one-line UsageError."""
        try:
            return self.get(-1).request(method, path, **kw)
        except self.httpx.HTTPError as e:
            raise UsageError(
                f"cannot reach {self.url}: {first_line(e, with_type=True)} (is `precast serve` running there?)"
            ) from None

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def __enter__(self) -> HttpClients:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _served_name(http: HttpClients, given: str | None) -> str:
    if given:
        return given
    r = http.request("GET", "/v1/models")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise UsageError(
            f"{http.url}/v1/models did not list a model (HTTP {r.status_code}); is this `precast serve`? "
            "Name the model with --model-name"
        ) from None


def _probe(http: HttpClients, path: str, body: bytes, what: str) -> None:
    r = http.request("POST", path, content=body, headers={"content-type": "application/json"})
    if r.status_code != 200:
        raise UsageError(
            f"{http.url}{path} refused the {what} request: HTTP {r.status_code}: {_server_message(r)}"
        )


def _poster(http: HttpClients, i: int, path: str, body: bytes):
    from precast.runtime.bench import RequestFailed

    client, headers = http.get(i), {"content-type": "application/json"}

    def call() -> None:
        r = client.post(path, content=body, headers=headers)
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {_server_message(r)}")

    return call


def model_clients(
    http: HttpClients,
    artifact: Path,
    specs: Sequence[TensorSpec],
    feeds: Mapping[str, np.ndarray],
    dims: Mapping[str, int],
    items: int,
    options,
):
    """(endpoint, model name, make_client(i), items per request) for a non-LLM artifact's server."""
    name = _served_name(http, options.model_name)
    endpoint = "v2" if options.endpoint == "auto" else options.endpoint
    if endpoint == "completions":
        raise UsageError(f"{artifact} is not a causal-lm artifact: bench it with --endpoint v2 or embeddings")
    if endpoint == "v2":
        r = http.request("GET", f"/v2/models/{name}")
        if r.status_code != 200:
            raise UsageError(f"{http.url}/v2/models/{name}: HTTP {r.status_code}: {_server_message(r)}")
        served = sorted(str(t.get("name")) for t in (r.json().get("inputs") or []) if isinstance(t, dict))
        mine = sorted(s.name for s in specs)
        if served != mine:
            raise UsageError(
                f"the server at {http.url} serves '{name}' with inputs {', '.join(served)}; {artifact} has "
                f"{', '.join(mine)}: bench the artifact the server serves"
            )
        inputs = []
        for s in specs:
            a = feeds[s.name]
            kind = _V2_TYPES.get(a.dtype.name)
            if kind is None:
                raise UsageError(f"input '{s.name}': {a.dtype.name} has no KServe v2 JSON datatype")
            inputs.append(
                {"name": s.name, "shape": list(a.shape), "datatype": kind, "data": a.ravel().tolist()}
            )
        path, body = f"/v2/models/{name}/infer", json.dumps({"inputs": inputs}).encode()
    else:  # embeddings
        ids = next((s for s in specs if s.name == "input_ids"), None)
        seq = 16
        if ids is not None and ids.shape is not None and len(ids.shape) >= 2:
            from precast.runtime.bench.inputs import dim_key

            d = ids.shape[1]
            seq = d if isinstance(d, int) else dims[dim_key(ids, 1)]
        words = [_WORDS[i % len(_WORDS)] for i in range(max(1, seq - 2))]
        text = " ".join(words)
        path, body = "/v1/embeddings", json.dumps({"model": name, "input": [text] * items}).encode()
    _probe(http, path, body, endpoint)
    return endpoint, name, lambda i: _poster(http, i, path, body), items


def completion_clients(http: HttpClients, prompts, options):
    """(model name, make_client(i)) for an LLM server: each call streams one completion, returns token times."""
    from precast.runtime.bench import RequestFailed

    name = _served_name(http, options.model_name)
    probe = {"model": name, "prompt": prompts(), "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    _probe(http, "/v1/completions", json.dumps(probe).encode(), "completions")
    headers = {"content-type": "application/json"}

    def make(i: int):
        client = http.get(i)

        def call() -> list[float]:
            body = {
                "model": name,
                "prompt": prompts(),
                "max_tokens": options.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            times: list[float] = []
            with client.stream(
                "POST", "/v1/completions", content=json.dumps(body).encode(), headers=headers
            ) as r:
                if r.status_code != 200:
                    r.read()
                    raise RequestFailed(f"HTTP {r.status_code}: {_server_message(r)}")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        raise RequestFailed(f"stream error: {_server_message_of(event)}")
                    if event.get("choices"):
                        times.append(now)
            return times

        return call

    return name, make


def _server_message_of(event: dict) -> str:
    err = event.get("error")
    return str(err.get("message") if isinstance(err, dict) else err)[:300]
