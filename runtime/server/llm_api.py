"""OpenAI-compatible /v1/completions and /v1/chat/completions (JSON or server-sent events) for LLM artifacts.

Supported request fields: model, prompt | messages (roles system, user, assistant), max_tokens
(max_completion_tokens), temperature, top_p, top_k, seed, stop, repetition_penalty, ignore_eos, stream,
stream_options.include_usage, n == 1, priority (also the ``X-Priority`` header). Anything else OpenAI defines
is ignored. A client that disconnects cancels its request in the engine, which frees its KV blocks.

Everything a request is checked for happens before a response starts (a 400, never a cut stream), and
off the event loop: the chat template, the prompt's checks and its tokenization run in a worker thread,
outside the engine's lock, so one large prompt does not stall the other requests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from precast.runtime.errors import LLMRequestError, PrecastError
from precast.runtime.server.app import read_openai_body
from precast.runtime.server.batcher import QueueFullError
from precast.runtime.server.bodies import openai_error
from precast.runtime.server.llm_service import parse_priority

__all__ = ["add_llm_routes", "sampling_params"]


def sampling_params(body: dict, max_stop_strings: int | None = None, max_stop_chars: int | None = None):
    """SamplingParams from an OpenAI body; stop strings bounded (every step searches the output for each)."""
    from precast.runtime.llm.sampler import SamplingParams

    def num(key, default, kind=float):
        v = body.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise LLMRequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}")
        return kind(v)

    n = body.get("n", 1)
    if n != 1:
        raise LLMRequestError(f"'n' must be 1 (one choice per request), got {n!r}")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):  # "" is kept: validate() rejects it, as the CLI's --stop ''
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise LLMRequestError("'stop' must be a string or a list of strings")
    if max_stop_strings is not None and len(stop) > max_stop_strings:
        raise LLMRequestError(f"'stop' has {len(stop)} strings; this server takes at most {max_stop_strings}")
    if not all(isinstance(s, str) for s in stop):
        raise LLMRequestError("'stop' must be a string or a list of strings")
    if max_stop_chars is not None:
        longest = max(map(len, stop), default=0)
        if longest > max_stop_chars:
            raise LLMRequestError(
                f"'stop' has a string of {longest} characters; this server takes at most {max_stop_chars}"
            )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = SamplingParams(
        max_tokens=16 if max_tokens is None else _int("max_tokens", max_tokens),
        temperature=num("temperature", 1.0),
        top_p=num("top_p", 1.0),
        top_k=num("top_k", 0, int),
        repetition_penalty=num("repetition_penalty", 1.0),
        seed=num("seed", None, int),
        stop=tuple(stop),
        ignore_eos=bool(body.get("ignore_eos", False)),  # vLLM's extension, handy for benchmarks
    )
    params.validate()
    return params


def _int(key, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise LLMRequestError(f"'{key}' must be an integer, got {v!r}")
    return v


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage), checked before anything is sent: a wrong type found while streaming
    could only cut the stream."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise LLMRequestError(f"'stream' must be true or false, got {stream!r}")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not isinstance(opts, dict):
        raise LLMRequestError(f"'stream_options' must be an object, got {type(opts).__name__}")
    usage = opts.get("include_usage", False)
    if usage is not None and not isinstance(usage, bool):
        raise LLMRequestError(f"'stream_options.include_usage' must be true or false, got {usage!r}")
    return bool(stream), bool(usage)


def _prepare(svc, body: dict, chat: bool, header_priority, config):
    """(prompt, params, priority, stream, include_usage) of one request, or LLMRequestError (worker thread)."""
    if chat:
        prompt = svc.chat_prompt(body.get("messages"), config.max_text_chars)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and len(prompt) >= svc.max_context:  # before looking at each id
            raise LLMRequestError(
                f"prompt has {len(prompt)} tokens; the model's context is {svc.max_context}"
            )
        ok_ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise LLMRequestError("'prompt' must be a non-empty string or a list of token ids")
    if isinstance(prompt, str) and len(prompt) > config.max_text_chars:  # tokenizing costs time and memory
        what = "the rendered chat prompt" if chat else "'prompt'"
        raise LLMRequestError(
            f"{what} has {len(prompt)} characters; this server tokenizes at most {config.max_text_chars} "
            "per request (--max-text-chars)"
        )
    params = sampling_params(body, config.max_stop_strings, config.max_stop_chars)
    priority = parse_priority(body.get("priority", header_priority))
    stream, include_usage = _stream_options(body)
    return prompt, params, priority, stream, include_usage


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def add_llm_routes(app, state) -> None:
    async def handle(request: Request, chat: bool):
        served = state.host.current
        svc = served.llm
        if svc is None:
            return openai_error(400, f"model '{state.name}' is not an LLM; use /v2/models/{state.name}/infer")
        try:
            body = await read_openai_body(request, state.name, LLMRequestError)
            if isinstance(body, JSONResponse):
                return body
            prompt, params, priority, streaming, include_usage = await run_in_threadpool(
                _prepare, svc, body, chat, request.headers.get("x-priority"), state.config
            )
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            stream = await svc.start(prompt, params, priority, rid)
        except QueueFullError as e:
            return openai_error(
                429, str(e), kind="rate_limit_error", headers={"Retry-After": str(int(e.retry_after))}
            )
        except PrecastError as e:
            return openai_error(400, str(e))
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        timeout = state.config.request_timeout

        def usage() -> dict:
            return {
                "prompt_tokens": stream.prompt_tokens,
                "completion_tokens": stream.n_out,
                "total_tokens": stream.prompt_tokens + stream.n_out,
            }

        if streaming:

            async def events():
                deadline = time.monotonic() + timeout
                try:
                    if chat:
                        yield _sse(
                            _chunk(rid, created, state.name, {"role": "assistant", "content": ""}, None, chat)
                        )
                    while True:
                        try:
                            ev = await asyncio.wait_for(
                                stream.__anext__(), max(0.0, deadline - time.monotonic())
                            )
                        except StopAsyncIteration:
                            break
                        except asyncio.TimeoutError:
                            yield _sse(
                                {
                                    "error": {
                                        "message": f"request timed out after {timeout:g} s",
                                        "type": "timeout",
                                        "code": 504,
                                    }
                                }
                            )
                            break
                        delta = {"content": ev.text} if chat else ev.text
                        yield _sse(_chunk(rid, created, state.name, delta, ev.finish_reason, chat))
                        if ev.finish_reason is not None:
                            break
                    if include_usage:
                        yield _sse(
                            {
                                "id": rid,
                                "object": obj + ".chunk" if chat else obj,
                                "created": created,
                                "model": state.name,
                                "choices": [],
                                "usage": usage(),
                            }
                        )
                    yield b"data: [DONE]\n\n"
                finally:
                    stream.close()  # a disconnect lands here too: the engine drops the request

            return StreamingResponse(
                events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )

        # Non-streaming: collect, but watch for the client going away and for the timeout.
        deadline = time.monotonic() + timeout
        text, finish = [], None
        try:
            while finish is None:
                try:
                    ev = await asyncio.wait_for(stream.__anext__(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return openai_error(499, "client disconnected")
                    if time.monotonic() > deadline:
                        return openai_error(504, f"request timed out after {timeout:g} s", kind="timeout")
                    continue
                except StopAsyncIteration:
                    finish = "cancelled"
                    break
                text.append(ev.text)
                finish = ev.finish_reason
        finally:
            stream.close()
        out = "".join(text)
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": out},
                "finish_reason": finish,
                "logprobs": None,
            }
            if chat
            else {"index": 0, "text": out, "finish_reason": finish, "logprobs": None}
        )
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": state.name,
            "choices": [choice],
            "usage": usage(),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)


def _chunk(rid: str, created: int, model: str, delta, finish: str | None, chat: bool) -> dict:
    if chat:
        choice = {
            "index": 0,
            "delta": delta if finish is None or delta.get("content") else {},
            "finish_reason": finish,
            "logprobs": None,
        }
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}],
    }
