"""The FastAPI app of `precast serve`: the state it owns, its middlewares, error handler and routers.

Laid out like vLLM's entrypoints: protocol.py (request models, response bodies), serving.py and
serving_llm.py (what each route does), routes.py / llm_api.py / admin.py (thin routers), http_errors.py
(the one mapping from exceptions to statuses). LLM artifacts add llm_api.py's routes, encoder-decoder
(seq2seq) artifacts seq2seq_api.py's. Every bad request gets a 4xx with a one-line message naming the
culprit; nothing a client sends can stop the server.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI
from starlette.requests import ClientDisconnect

from precast.errors import PrecastError
from precast.runtime.server.admin import add_admin_routes
from precast.runtime.server.batcher import BatchConfig, Batcher
from precast.runtime.server.bodies import openai_error, read_json, v2_error
from precast.runtime.server.body_limit import BodyLimitMiddleware
from precast.runtime.server.config import ServerConfig
from precast.runtime.server.host import ModelHost, ReloadBusyError, ReloadError
from precast.runtime.server.http_errors import install_error_handlers
from precast.runtime.server.metrics import ServerMetrics
from precast.runtime.server.pipelined import PipelinedModel
from precast.runtime.server.routes import router

__all__ = ["ServerState", "create_app", "openai_error", "read_json", "v2_error"]

# The status a request is counted under when its client went away before an answer (nginx's code).
CLIENT_CLOSED = 499


class ServerState:
    """Everything one app owns: the model host, the batcher, the metrics, and the shutdown flag."""

    def __init__(self, config: ServerConfig, host: ModelHost | None = None):
        self.config = config
        self.metrics = ServerMetrics()
        self.host = host or ModelHost(
            config.artifact,
            threads=config.threads,
            verify=config.verify,
            llm_options=config.llm,
            text_limits=config.text_limits,
            policy=config.signature_policy,
        )
        self.batcher = Batcher(
            self._lease_model,
            BatchConfig(config.max_batch_size, config.max_queue_delay_ms / 1000.0, config.max_queue),
            on_batch=self.metrics.on_batch,
            # a staged artifact: one batch in flight per stage, so the stages work on different batches at once
            instances=max(config.instances, _stages(self.host.current.model)),
        )
        self.shutting_down = False
        self.metrics.model_version.set(self.host.current.version)
        self._bind_llm_metrics()

    @property
    def name(self) -> str:
        return self.config.name

    @contextmanager
    def _lease_model(self):
        """For the batcher: the current model, held until its batch is done (a reload closes it after)."""
        with self.host.lease() as served:
            yield served.model

    def ready(self) -> bool:
        """Serving works: not draining, and the served model's endpoints can answer."""
        return not self.shutting_down and self.host.ready()

    def reload(self, path: str | None = None):
        try:
            served = self.host.reload(path)
        except ReloadBusyError:
            raise
        except ReloadError:
            self.metrics.reloads.labels("failed").inc()
            raise
        self.metrics.reloads.labels("ok").inc()
        self.metrics.model_version.set(served.version)
        self._bind_llm_metrics()
        return served

    def _bind_llm_metrics(self) -> None:
        served = self.host.current
        if served.llm is not None:
            served.llm.bind_metrics(self.metrics)
        seq2seq = getattr(served, "seq2seq", None)  # (tests serve stand-ins without it)
        if seq2seq is not None:
            seq2seq.bind_metrics(self.metrics)

    def render_metrics(self) -> tuple[bytes, str]:
        """The /metrics page, with the gauges that are read at scrape time brought up to date."""
        self.metrics.queue_depth.set(self.batcher.depth)
        self.metrics.queue_capacity.set(self.config.max_queue)
        served = self.host.current
        if served.llm is not None:
            served.llm.export_gauges(self.metrics)
        seq2seq = getattr(served, "seq2seq", None)
        if seq2seq is not None:
            seq2seq.export_gauges(self.metrics)
        return self.metrics.render()

    def close(self) -> None:
        """Idempotent: drain the batcher, then close every model (which removes unpacked temp dirs)."""
        self.shutting_down = True
        self.batcher.stop(self.config.drain_timeout)
        self.host.close(drain=min(5.0, self.config.drain_timeout))


def _stages(model) -> int:
    return model.stages if isinstance(model, PipelinedModel) else 1


# -- the app -----------------------------------------------------------------------------------------
def create_app(config: ServerConfig, state: ServerState | None = None):
    """The app: middlewares (outermost first: metrics, API key, body limit), one error handler, the routers."""
    state = state or ServerState(config)

    @asynccontextmanager
    async def lifespan(app):
        _install_sighup(state)
        yield
        state.shutting_down = True
        await asyncio.to_thread(state.close)

    app = FastAPI(title="precast serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.precast = state
    seq2seq = getattr(state.host.current, "seq2seq", None)
    # Added first = innermost: the metrics middleware outside it counts the 413s and 503s it answers.
    app.add_middleware(
        BodyLimitMiddleware,
        max_request_bytes=config.max_request_bytes,
        max_inflight_bytes=config.max_inflight_bytes,
        path_limits=_upload_limits(config) if seq2seq is not None and seq2seq.speech else None,
    )
    if config.api_key is not None:  # outside the body limit: no key, no body read
        from precast.runtime.server.api_key import ApiKeyMiddleware

        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics)
    install_error_handlers(app, config.request_timeout)
    app.include_router(router)
    add_admin_routes(app, state)
    if state.host.current.llm is not None or config.llm.get("force_routes"):
        from precast.runtime.server.llm_api import add_llm_routes

        add_llm_routes(app)
    if seq2seq is not None:
        from precast.runtime.server.seq2seq_api import add_seq2seq_routes

        add_seq2seq_routes(app, seq2seq)
    return app


def _upload_limits(config: ServerConfig) -> dict:
    """The audio routes' body limit: one file of --max-audio-bytes and its form (seq2seq_api.py)."""
    from precast.runtime.server.seq2seq_api import AUDIO_PATHS, upload_limit

    return {p: (upload_limit(config), "--max-audio-bytes") for p in AUDIO_PATHS}


def _install_sighup(state: ServerState) -> None:
    """SIGHUP -> reload from the same path, in a thread (only possible when serving from the main thread)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        return
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        def work() -> None:
            try:
                served = state.reload()
                print(f"precast serve: SIGHUP reload ok, now version {served.version}", flush=True)
            except PrecastError as e:
                print(f"precast serve: SIGHUP reload failed: {e}", flush=True)

        threading.Thread(target=work, name="precast-sighup-reload", daemon=True).start()

    try:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    except (NotImplementedError, RuntimeError, ValueError):
        pass


class _MetricsMiddleware:
    """Pure ASGI (streaming- and disconnect-safe): counts requests by route and status, times them.

    A client that goes away before it is answered (a reset during the upload) is counted as 499, not as
    a server error, and its ClientDisconnect ends here instead of printing a traceback."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500, "started": False}
        t0 = time.perf_counter()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
            await send(message)

        scrape = scope.get("path") == "/metrics"  # the scrape must not count itself as a request in flight
        if not scrape:
            self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except ClientDisconnect:
            if not status["started"]:
                status["code"] = CLIENT_CLOSED
        finally:
            if not scrape:
                self.metrics.inflight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            if endpoint != "/metrics":
                self.metrics.requests.labels(endpoint, str(status["code"])).inc()
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
