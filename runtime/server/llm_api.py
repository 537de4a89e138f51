"""The OpenAI-compatible routes of LLM artifacts: /v1/completions and /v1/chat/completions.

Thin: serving_llm.py does the work (its docstring says what is supported and how streaming, ``n`` and
disconnects behave); errors are answered by http_errors.py's handlers.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from precast.runtime.server.serving_llm import ChatServing, CompletionServing

__all__ = ["add_llm_routes", "router"]

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    return await CompletionServing(request.app.state.precast)(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await ChatServing(request.app.state.precast)(request)


def add_llm_routes(app, state=None) -> None:
    app.include_router(router)
