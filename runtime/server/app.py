"""The FastAPI app of `precast serve`: KServe v2 infer, /v1/embeddings, metrics, health, admin reload.

LLM artifacts add the OpenAI-compatible routes from ``llm_api``. Every bad request gets a 4xx with a
one-line message naming the culprit; nothing a client sends can stop the server.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import threading
import time
from contextlib import asynccontextmanager, contextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from precast.runtime.errors import InputError, PrecastError
from precast.runtime.server.admin import add_admin_routes
from precast.runtime.server.batcher import BatchConfig, Batcher, QueueFullError
from precast.runtime.server.bodies import json_response, openai_error, read_json, v2_error
from precast.runtime.server.body_limit import BodyLimitMiddleware
from precast.runtime.server.config import ServerConfig
from precast.runtime.server.embeddings import (
    check_dimensions,
    check_embedding_work,
    mean_pool_normalize,
    parse_inputs,
    tokenize,
)
from precast.runtime.server.host import ModelHost, ReloadBusyError, ReloadError
from precast.runtime.server.kserve import decode_request, encode_response, model_metadata, requested_outputs
from precast.runtime.server.metrics import ServerMetrics

__all__ = ["ServerState", "create_app", "openai_error", "read_json", "v2_error"]

# The status a request is counted under when its client went away before an answer (nginx's code).
CLIENT_CLOSED = 499


class ServerState:
    """Everything one app owns: the model host, the batcher, the metrics, and the shutdown flag."""

    def __init__(self, config: ServerConfig, host: ModelHost | None = None):
        self.config = config
        self.metrics = ServerMetrics()
        self.host = host or ModelHost(
            config.artifact, threads=config.threads, verify=config.verify, llm_options=config.llm
        )
        self.batcher = Batcher(
            self._lease_model,
            BatchConfig(config.max_batch_size, config.max_queue_delay_ms / 1000.0, config.max_queue),
            on_batch=self.metrics.on_batch,
            instances=config.instances,
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
        llm = self.host.current.llm
        if llm is not None:
            llm.bind_metrics(self.metrics)

    def close(self) -> None:
        """Idempotent: drain the batcher, then close every model (which removes unpacked temp dirs)."""
        self.shutting_down = True
        self.batcher.stop(self.config.drain_timeout)
        self.host.close(drain=min(5.0, self.config.drain_timeout))


# -- request bodies ---------------------------------------------------------------------------------
async def read_openai_body(request, served_name: str, error_cls: type[PrecastError] = InputError):
    """An OpenAI-style request body: a JSON object naming this server's model (or none).

    Returns the body, or a 404 response for another model; malformed bodies raise ``error_cls``.
    """
    body = await read_json(request)
    if not isinstance(body, dict):
        raise error_cls("request body must be a JSON object")
    model_name = body.get("model", served_name)
    if model_name != served_name:
        return openai_error(
            404, f"unknown model '{model_name}'; this server serves '{served_name}'", param="model"
        )
    return body


def _busy_headers(e: QueueFullError) -> dict:
    return {"Retry-After": str(int(e.retry_after))}


# -- the app -----------------------------------------------------------------------------------------
def create_app(config: ServerConfig, state: ServerState | None = None):
    state = state or ServerState(config)

    @asynccontextmanager
    async def lifespan(app):
        _install_sighup(state)
        yield
        state.shutting_down = True
        await asyncio.to_thread(state.close)

    app = FastAPI(title="precast serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.precast = state
    # Added first = innermost: the metrics middleware outside it counts the 413s and 503s it answers.
    app.add_middleware(
        BodyLimitMiddleware,
        max_request_bytes=config.max_request_bytes,
        max_inflight_bytes=config.max_inflight_bytes,
    )
    if config.api_key is not None:  # outside the body limit: no key, no body read
        from precast.runtime.server.api_key import ApiKeyMiddleware

        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics)

    def check_model(name: str):
        if name != state.name:
            return v2_error(404, f"unknown model '{name}'; this server serves '{state.name}'")
        return None

    # -- health ----------------------------------------------------------------------------------------
    @app.get("/health")
    @app.get("/v2/health/live")
    async def live():
        return {"status": "ok"}

    @app.get("/ready")
    @app.get("/v2/health/ready")
    async def ready():
        served = state.host.current
        body = {"ready": state.ready(), "model": state.name, "version": served.version}
        return JSONResponse(body, status_code=200 if state.ready() else 503)

    @app.get("/metrics")
    async def metrics():
        state.metrics.queue_depth.set(state.batcher.depth)
        state.metrics.queue_capacity.set(state.config.max_queue)
        llm = state.host.current.llm
        if llm is not None:
            llm.export_gauges(state.metrics)
        data, ctype = state.metrics.render()
        return Response(data, media_type=ctype)

    # -- KServe v2 -------------------------------------------------------------------------------------
    @app.get("/v2")
    async def server_metadata():
        import precast

        return {"name": "precast", "version": precast.__version__, "extensions": []}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def metadata(name: str, version: str | None = None):
        if (err := check_model(name)) is not None:
            return err
        served = state.host.current
        return model_metadata(state.name, str(served.version), served.model)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        if (err := check_model(name)) is not None:
            return err
        return JSONResponse({"name": name, "ready": state.ready()}, status_code=200 if state.ready() else 503)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        if (err := check_model(name)) is not None:
            return err
        served = state.host.current
        if served.llm is not None:
            return v2_error(400, f"model '{name}' is an LLM; use /v1/completions or /v1/chat/completions")
        if version is not None and version != str(served.version):
            return v2_error(404, f"model '{name}' has no version {version}; serving version {served.version}")
        try:
            body = await read_json(request)
            # Off the event loop: turning up to max_request_bytes of JSON numbers into arrays takes a while.
            feeds, wanted = await run_in_threadpool(_decode_infer, body, served.model)
            outputs = await state.batcher.submit(feeds, timeout=state.config.request_timeout)
        except QueueFullError as e:
            return v2_error(429, str(e), headers=_busy_headers(e))
        except asyncio.TimeoutError:
            return v2_error(504, f"request timed out after {state.config.request_timeout:g} s")
        except PrecastError as e:
            return v2_error(400, str(e))
        if wanted is not None:
            outputs = {n: outputs[n] for n in wanted}
        rid = body.get("id") if isinstance(body.get("id"), str) else None
        try:
            return await json_response(encode_response(state.name, str(served.version), outputs, rid))
        except ValueError:
            return v2_error(500, f"model '{name}' produced NaN or infinity, which JSON cannot carry")

    # -- OpenAI-style embeddings and model list ---------------------------------------------------------
    @app.get("/v1/models")
    async def list_models():
        served = state.host.current
        return {
            "object": "list",
            "data": [
                {"id": state.name, "object": "model", "created": int(served.loaded_at), "owned_by": "precast"}
            ],
        }

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        served = state.host.current
        try:
            body = await read_openai_body(request, state.name)
            if isinstance(body, JSONResponse):
                return body
            spec = served.encoder
            if spec is None:
                return openai_error(
                    400,
                    f"model '{state.name}' is not a text encoder (needs input_ids/attention_mask "
                    f"inputs and tokenizer/tokenizer.json); use /v2/models/{state.name}/infer",
                )
            texts = parse_inputs(body, state.config.max_embedding_inputs, state.config.max_text_chars)
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise InputError(f"encoding_format must be 'float' or 'base64', got {fmt!r}")
            check_dimensions(body, spec.dim)
            feeds, n_tokens = await run_in_threadpool(tokenize, spec, texts)  # GIL released: see tokenize
            check_embedding_work(feeds, state.config.max_embedding_tokens)
            pad = (
                None if spec.static else {"input_ids": spec.pad_id, "attention_mask": 0, "token_type_ids": 0}
            )
            outputs = await state.batcher.submit(feeds, pad=pad, timeout=state.config.request_timeout)
        except QueueFullError as e:
            return openai_error(429, str(e), kind="rate_limit_error", headers=_busy_headers(e))
        except asyncio.TimeoutError:
            return openai_error(
                504, f"request timed out after {state.config.request_timeout:g} s", kind="timeout"
            )
        except PrecastError as e:
            return openai_error(400, str(e))
        vectors = mean_pool_normalize(outputs[spec.output], feeds["attention_mask"])
        if spec.dim is None:  # a symbolic width: 'dimensions' is checked against the result
            try:
                check_dimensions(body, vectors.shape[1])
            except InputError as e:
                return openai_error(400, str(e))
        data = []
        for i, v in enumerate(vectors):
            emb = (
                base64.b64encode(v.astype(np.float32).tobytes()).decode()
                if fmt == "base64"
                else v.astype(np.float32).tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": emb})
        body = {
            "object": "list",
            "data": data,
            "model": state.name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
        try:
            return await json_response(body)
        except ValueError:
            return openai_error(
                500, "the model produced NaN or infinity, which JSON cannot carry", "server_error"
            )

    add_admin_routes(app, state)
    if state.host.current.llm is not None or config.llm.get("force_routes"):
        from precast.runtime.server.llm_api import add_llm_routes

        add_llm_routes(app, state)
    return app


def _decode_infer(body: object, model) -> tuple[dict, list[str] | None]:
    from precast.runtime.feeds import check_feeds

    feeds = check_feeds(decode_request(body), model.inputs)  # fail fast, before queueing
    return feeds, requested_outputs(body, [o.name for o in model.outputs])


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
