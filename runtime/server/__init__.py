"""`precast serve`: an HTTP server for precast artifacts (FastAPI + uvicorn, the ``serve`` extra).

Imported lazily: nothing here loads fastapi until a server is created.
"""

from __future__ import annotations

import errno
import socket
import sys

from precast.runtime.server.config import ServerConfig, is_loopback

__all__ = ["ServerConfig", "create_app", "serve", "startup_line", "uvicorn_config"]


def create_app(config: ServerConfig):
    """The ASGI app for one artifact (loads, verifies and warms up the model)."""
    _require_serve_extra()
    from precast.runtime.server.app import create_app as _create

    return _create(config)


def serve(config: ServerConfig) -> None:
    """Load the artifact and serve it until SIGINT/SIGTERM (which drain in-flight requests first)."""
    _require_serve_extra()
    import uvicorn

    with _bind(config.host, config.port) as sock:  # before the model loads: a taken port fails at once
        app = create_app(config)
        print(startup_line(config, app.state.precast), file=sys.stderr, flush=True)
        try:
            uvicorn.Server(uvicorn_config(app, config)).run(sockets=[sock])
        finally:  # the lifespan's shutdown closes the models; this covers a server that never started
            app.state.precast.close()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g}MiB"


def startup_line(config: ServerConfig, state) -> str:
    """One line saying what is served, where, from which build, and the limits in force."""
    served = state.host.current
    manifest = served.manifest
    source = (manifest.source or {}).get("sha256") or "?"
    target = manifest.target.name
    host = f"[{config.host}]" if ":" in config.host else config.host
    admin = "token" if config.admin_token else ("loopback only" if is_loopback(config.host) else "off")
    limits = [
        f"max_batch_size={config.max_batch_size}",
        f"max_queue={config.max_queue}",
        f"request_timeout={config.request_timeout:g}s",
        f"max_request_bytes={_mib(config.max_request_bytes)}",
        f"max_connections={config.max_connections}",
    ]
    if served.kind == "embeddings":
        limits += [
            f"max_embedding_inputs={config.max_embedding_inputs}",
            f"max_embedding_tokens={config.max_embedding_tokens}",
        ]
    if served.kind == "seq2seq":
        if served.seq2seq.speech:
            limits.append(f"max_audio_bytes={_mib(config.max_audio_bytes)}")
        else:
            limits.append(f"max_text_chars={config.max_text_chars}")
    if served.kind == "llm":
        limits += [f"max_text_chars={config.max_text_chars}", f"max_stop_strings={config.max_stop_strings}"]
        limits += [f"{k}={v}" for k, v in sorted(config.llm.items())]
    return (
        f"precast serve: http://{host}:{config.port} model '{config.name}' ({served.kind}) from {config.artifact} "
        f"(version {served.version}, build {served.digest[:12]}, source {str(source)[:12]}, target {target}); "
        f"admin {admin}; limits {' '.join(limits)}"
    )


def uvicorn_config(app, config: ServerConfig, **overrides):
    """uvicorn's settings for ``app``: the limits that belong to the HTTP layer are uvicorn's own."""
    import uvicorn

    from precast.runtime.server.header_timeout import header_timeout_protocol

    settings = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(max(1, config.drain_timeout)),
        lifespan="on",
        # request.client must be the socket peer: admin access is decided from it (admin.py). uvicorn would
        # otherwise take X-Forwarded-For from a proxy on 127.0.0.1 as the client.
        proxy_headers=False,
        limit_concurrency=config.max_connections,  # 503 beyond this many connections + tasks
        h11_max_incomplete_event_size=16 * 1024,  # request line + headers (h11's default, stated)
        http=header_timeout_protocol(config.header_timeout),  # slow headers cannot hold connections
    )
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound here (as uvicorn would) so a bad address is one line, not a traceback."""
    from precast.errors import UsageError

    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the listening socket
    # says it is TCP. Without it Nagle held every keep-alive response body until the client's delayed ACK:
    # +40 ms per request after the first on a connection (tiny MLP p50 48 ms -> 4.5 ms).
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} is already in use on {host}") from e
        raise UsageError(f"cannot bind {host}:{port}: {e.strerror or e}") from e
    return sock


def _require_serve_extra() -> None:
    from precast.errors import TargetUnavailableError

    missing = []
    for mod in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise TargetUnavailableError(
            f"precast serve needs {', '.join(missing)}: pip install 'precast[serve]'"
        )
