"""The routes of every artifact: health, metrics, KServe v2, /v1/models and /v1/embeddings.

Thin: each route finds the app's ``ServerState`` and calls serving.py; errors are raised and answered by
http_errors.py's handlers. LLM artifacts add llm_api.py's router.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from precast.runtime.server import serving

__all__ = ["router"]

router = APIRouter()


def _state(request: Request):
    return request.app.state.precast


# -- health ----------------------------------------------------------------------------------------------
@router.get("/health")
@router.get("/v2/health/live")
async def live():
    return {"status": "ok"}


@router.get("/ready")
@router.get("/v2/health/ready")
async def ready(request: Request):
    state = _state(request)
    ok = state.ready()
    body = {"ready": ok, "model": state.name, "version": state.host.current.version}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    data, ctype = _state(request).render_metrics()
    return Response(data, media_type=ctype)


# -- KServe v2 -------------------------------------------------------------------------------------------
@router.get("/v2")
async def server_metadata():
    return serving.server_metadata()


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def metadata(name: str, request: Request, version: str | None = None):
    return serving.metadata(_state(request), name)


@router.get("/v2/models/{name}/ready")
async def model_ready(name: str, request: Request):
    state = _state(request)
    serving.check_model(state, name)
    ok = state.ready()
    return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)


@router.post("/v2/models/{name}/infer")
@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer(name: str, request: Request, version: str | None = None):
    return await serving.infer(_state(request), name, version, request)


# -- OpenAI-style ----------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request):
    return serving.list_models(_state(request))


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    return await serving.create_embeddings(_state(request), request)
