"""OpenAI-compatible /v1/completions and /v1/chat/completions (JSON or server-sent events) for LLM artifacts.

Which request fields are supported, and which are a 400, is openai_params.py's docstring. ``n`` > 1 and a
list of prompts submit one engine request per choice (prefix caching shares the prompt's KV blocks);
streamed choices interleave, each chunk carrying its choice's ``index``. A client that disconnects
cancels its requests in the engine, which frees their KV blocks.

Logprobs are the model's own (log-softmax of the raw logits, before penalties and temperature: what
OpenAI reports). Token strings are each token decoded alone; one that is part of a multi-byte character is named
by its bytes ('bytes:\\xe2\\x80', OpenAI's habit); ``bytes`` are the token's bytes.

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
from precast.runtime.server.openai_params import prepare, sampling_params

__all__ = ["add_llm_routes", "sampling_params"]


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class _Choices:
    """The token streams of one request's choices, merged: next() gives (index, TokenEvent) as they come."""

    def __init__(self, streams: list):
        self.streams = streams
        self.live = set(range(len(streams)))
        self._pending: dict[asyncio.Future, int] = {}

    async def next(self, timeout: float):
        """(index, event); (index, None) when that stream ended unfinished (cancelled); None on timeout."""
        waiting = set(self._pending.values())
        for i in self.live - waiting:
            self._pending[asyncio.ensure_future(self.streams[i].__anext__())] = i
        done, _ = await asyncio.wait(self._pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            return None
        task = next(iter(done))
        i = self._pending.pop(task)
        try:
            ev = task.result()
        except StopAsyncIteration:
            self.live.discard(i)
            return i, None
        if ev.finish_reason is not None:
            self.live.discard(i)
        return i, ev

    def close(self) -> None:
        for task in self._pending:
            task.cancel()
        self._pending.clear()
        for s in self.streams:
            s.close()  # a disconnect lands here too: the engine drops the request

    @property
    def completion_tokens(self) -> int:
        return sum(s.n_out for s in self.streams)


class _Logprobs:
    """One choice's logprobs in OpenAI's shape: chat ``{"content": [...]}`` or completions' four lists."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0  # completions' text_offset of the next token
        self.content: list = []
        self.legacy = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        """(token string, its bytes). A token that is part of a character alone is named by its bytes,
        'bytes:\\xe2\\x80' (OpenAI's habit), so that distinct tokens stay distinct."""
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        text = self.tokenizer.decode([token_id])
        if "\ufffd" in text:
            raw = self.tokenizer.token_bytes(token_id)
            if raw is not None:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
        return text, list(text.encode())

    def add(self, ev) -> dict | None:
        """Record ``ev``'s logprobs; returns the same for this event alone (a streamed chunk's)."""
        if ev.logprobs is None:
            return None
        lp, top = ev.logprobs
        token, raw = self._token(ev.token_id)
        if self.chat:
            alternatives = []
            for i, v in top:
                t, b = self._token(i)
                alternatives.append({"token": t, "logprob": v, "bytes": b})
            entry = {"token": token, "logprob": lp, "bytes": raw, "top_logprobs": alternatives}
            self.content.append(entry)
            return {"content": [entry], "refusal": None}
        alternatives = {self._token(i)[0]: v for i, v in top}
        alternatives.setdefault(token, lp)  # OpenAI: the sampled token is always among them
        one = {
            "tokens": [token],
            "token_logprobs": [lp],
            "top_logprobs": [alternatives],
            "text_offset": [self.offset],
        }
        for key, value in one.items():
            self.legacy[key].extend(value)
        self.offset += len(token)
        return one

    def result(self) -> dict:
        return {"content": self.content, "refusal": None} if self.chat else self.legacy


def add_llm_routes(app, state) -> None:
    async def handle(request: Request, chat: bool):
        served = state.host.current
        svc = served.llm
        if svc is None:
            return openai_error(400, f"model '{state.name}' is not an LLM; use /v2/models/{state.name}/infer")
        streams: list = []
        try:
            body = await read_openai_body(request, state.name, LLMRequestError)
            if isinstance(body, JSONResponse):
                return body
            req = await run_in_threadpool(
                prepare, svc, body, chat, request.headers.get("x-priority"), state.config
            )
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            for p, ids in enumerate(req.prompts):
                for j in range(req.n):
                    k = p * req.n + j
                    sub = rid if k == 0 else f"{rid}-{k}"
                    streams.append(await svc.start(ids, req.choice_params(k), req.priority, sub))
        except QueueFullError as e:
            for s in streams:
                s.close()
            return openai_error(
                429, str(e), kind="rate_limit_error", headers={"Retry-After": str(int(e.retry_after))}
            )
        except PrecastError as e:
            for s in streams:
                s.close()
            return openai_error(400, str(e), param=getattr(e, "param", None))
        choices = _Choices(streams)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        timeout = state.config.request_timeout
        tokenizer = svc.engine.tokenizer
        logprobs = [_Logprobs(tokenizer, chat) if req.logprobs is not None else None for _ in streams]
        prompt_tokens = sum(map(len, req.prompts))

        def usage() -> dict:
            done = choices.completion_tokens
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
            }

        def chunk(k: int, delta, finish, lp=None) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": state.name,
                "choices": [_choice_chunk(k, delta, finish, lp, chat)],
            }

        if req.stream:

            async def events():
                deadline = time.monotonic() + timeout
                try:
                    if chat:
                        for k in range(len(streams)):
                            yield _sse(chunk(k, {"role": "assistant", "content": ""}, None))
                    while choices.live:
                        got = await choices.next(max(0.0, deadline - time.monotonic()))
                        if got is None:
                            error = {
                                "message": f"request timed out after {timeout:g} s",
                                "type": "timeout",
                                "code": 504,
                            }
                            yield _sse({"error": error})
                            break
                        k, ev = got
                        if ev is None:
                            continue
                        lp = logprobs[k].add(ev) if logprobs[k] is not None else None
                        yield _sse(chunk(k, {"content": ev.text} if chat else ev.text, ev.finish_reason, lp))
                    if req.include_usage:
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
                    choices.close()

            return StreamingResponse(
                events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )

        # Non-streaming: collect, but watch for the client going away and for the timeout.
        deadline = time.monotonic() + timeout
        texts: list[list[str]] = [[] for _ in streams]
        finish: list[str | None] = [None] * len(streams)
        try:
            while choices.live:
                got = await choices.next(0.25)
                if got is None:
                    if await request.is_disconnected():
                        return openai_error(499, "client disconnected")
                    if time.monotonic() > deadline:
                        return openai_error(504, f"request timed out after {timeout:g} s", kind="timeout")
                    continue
                k, ev = got
                if ev is None:
                    finish[k] = "cancelled"
                    continue
                texts[k].append(ev.text)
                finish[k] = ev.finish_reason
                if logprobs[k] is not None:
                    logprobs[k].add(ev)
        finally:
            choices.close()
        out = []
        for k, parts in enumerate(texts):
            lp = logprobs[k].result() if logprobs[k] is not None else None
            text = "".join(parts)
            if chat:
                out.append(
                    {
                        "index": k,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish[k],
                        "logprobs": lp,
                    }
                )
            else:
                out.append({"index": k, "text": text, "finish_reason": finish[k], "logprobs": lp})
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": state.name,
            "choices": out,
            "usage": usage(),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)


def _choice_chunk(index: int, delta, finish: str | None, logprobs: dict | None, chat: bool) -> dict:
    if chat:
        return {
            "index": index,
            "delta": delta if finish is None or delta.get("content") else {},
            "finish_reason": finish,
            "logprobs": logprobs,
        }
    return {"index": index, "text": delta, "finish_reason": finish, "logprobs": logprobs}
