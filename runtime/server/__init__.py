"""`precast serve`: an HTTP server for precast artifacts (FastAPI + uvicorn, the ``serve`` extra).

Imported lazily: nothing here loads fastapi until a server is created.
"""

from __future__ import annotations

import errno
import socket

from precast.runtime.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve", "uvicorn_config"]


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
        try:
            uvicorn.Server(uvicorn_config(app, config)).run(sockets=[sock])
        finally:  # the lifespan's shutdown closes the models; this covers a server that never started
            app.state.precast.close()


def uvicorn_config(app, config: ServerConfig, **overrides):
    """uvicorn's settings for ``app``: the limits that belong to the HTTP layer are uvicorn's own."""
    import uvicorn

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
    )
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound here (as uvicorn would) so a bad address is one line, not a traceback."""
    from precast.runtime.errors import UsageError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
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
    from precast.runtime.errors import TargetUnavailableError

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
