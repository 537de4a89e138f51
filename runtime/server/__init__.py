"""`precast serve`: an HTTP server for precast artifacts (FastAPI + uvicorn, the ``serve`` extra).

Imported lazily: nothing here loads fastapi until a server is created.
"""

from __future__ import annotations

from precast.runtime.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]


def create_app(config: ServerConfig):
    """The ASGI app for one artifact (loads, verifies and warms up the model)."""
    _require_serve_extra()
    from precast.runtime.server.app import create_app as _create

    return _create(config)


def serve(config: ServerConfig) -> None:
    """Load the artifact and serve it until SIGINT/SIGTERM (which drain in-flight requests first)."""
    _require_serve_extra()
    import uvicorn

    app = create_app(config)
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(max(1, config.drain_timeout)),
        lifespan="on",
    )
    uvicorn.Server(uv).run()


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
