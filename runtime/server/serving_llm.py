"""What /v1/completions and /v1/chat/completions do (JSON or server-sent events) for LLM artifacts.

Which request fields are supported, and which are a 400, is openai_params.py's docstring. ``n`` > 1 and a
list of prompts submit one engine request per choice (prefix caching shares the prompt's KV blocks);
streamed choices interleave, each chunk carrying its choice's ``index``. A client that disconnects
cancels its requests in the engine, which frees their KV blocks.

Logprobs are the model's own (log-softmax of the raw logits, before penalties and temperature: what
OpenAI reports). Token strings are each token decoded alone; one that is part of a multi-byte character is named
by its bytes ('bytes:\\xe2\\x80', OpenAI's habit); ``bytes`` are the token's bytes.

Everything a request is checked for happens before a response starts (a 400, never a cut stream), and
off the event loop and outside the engine's lock: the request's checks in a worker thread, the chat template and
the tokenization in the model's TextSandbox (a process per call, with the request's deadline and a memory limit,
stopped when the client goes away), so neither a large prompt nor an artifact's slow template stalls the other
requests.

``CompletionServing`` holds the flow (prepare -> start one stream per choice -> stream or collect);
``ChatServing`` changes only the wire shapes (ids, object names, deltas, messages, logprobs, tool calls).

Tool calls (tool_calls.py): with ``tools`` and a tool_choice other than "none", each choice's output is parsed
into ``tool_calls`` when it ends (finish_reason "tool_calls"; ``content`` is the text before the calls, or null).
Streamed, such a choice's text is held back until it ends, then sent as OpenAI streams calls: its content (if
any), per call a delta with its id and name and one with its arguments, a final chunk with the finish_reason;
its logprobs ride on the first of those chunks. Choices without tools stream token by token as before.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from precast.errors import LLMRequestError
from precast.runtime.server.http_errors import HTTPError
from precast.runtime.server.llm_stream import Choices, Logprobs
from precast.runtime.server.openai_params import ParamError, Prepared, prepare
from precast.runtime.server.protocol import (
    chat_choice,
    chunk_choice,
    completion_choice,
    tool_call_deltas,
    usage,
)
from precast.runtime.server.serving import read_openai_request

__all__ = ["ChatServing", "CompletionServing"]


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


@dataclass
class _Run:
    """One request in flight: its id, its choices' streams, and their logprobs so far."""

    rid: str
    req: Prepared
    choices: Choices
    logprobs: list[Logprobs | None]
    prompt_tokens: int
    created: int
    held: list[str] = field(default_factory=list)  # each choice's text held back (tool calls), or unused

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.choices.completion_tokens)

    def add_logprobs(self, k: int, ev) -> dict | None:
        return self.logprobs[k].add(ev) if self.logprobs[k] is not None else None


class CompletionServing:
    chat = False
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state):
        self.state = state

    # -- the wire shapes (ChatServing overrides these) -------------------------------------------------
    def delta(self, text: str):
        return text

    def opening_chunks(self, run: _Run) -> list[dict]:
        return []

    def choice(self, run: _Run, k: int, text: str, finish: str | None, lp: dict | None) -> dict:
        return completion_choice(k, text, finish, lp)

    def event_choices(self, run: _Run, k: int, ev) -> list[dict]:
        """The streamed choices one token event makes (ChatServing holds a tool-calling choice's back)."""
        lp = run.add_logprobs(k, ev)
        return [chunk_choice(k, self.delta(ev.text), ev.finish_reason, lp, self.chat)]

    # -- the flow -----------------------------------------------------------------------------------------
    async def __call__(self, request):
        state = self.state
        svc = state.host.current.llm
        if svc is None:
            raise HTTPError(400, f"model '{state.name}' is not an LLM; use /v2/models/{state.name}/infer")
        deadline = time.monotonic() + state.config.request_timeout
        body, _ = await read_openai_request(request, state, error_cls=LLMRequestError)
        req = await self._prepare(svc, body, request, deadline)
        run = await self._start(svc, req)
        if req.stream:
            return StreamingResponse(
                self._events(run, deadline),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": run.rid},
            )
        return await self._collect(run, request, deadline)

    async def _prepare(self, svc, body: dict, request, deadline: float) -> Prepared:
        """The request checked and tokenized; a client that goes away meanwhile stops its text work."""
        work = asyncio.ensure_future(
            prepare(
                svc,
                body,
                self.chat,
                request.headers.get("x-priority"),
                self.state.config,
                max(0.0, deadline - time.monotonic()),
            )
        )
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.25)
            if done:
                return work.result()
            if await request.is_disconnected():
                work.cancel()
                raise HTTPError(499, "client disconnected")

    async def _start(self, svc, req: Prepared) -> _Run:
        rid = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        streams: list = []
        try:
            for p, ids in enumerate(req.prompts):
                for j in range(req.n):
                    k = p * req.n + j
                    sub = rid if k == 0 else f"{rid}-{k}"
                    streams.append(await svc.start(ids, req.choice_params(k), req.priority, sub))
        except LLMRequestError as e:
            for s in streams:
                s.close()
            key = req.constraint_key
            if key is None or streams or getattr(e, "param", None) is not None:
                raise
            # the prompt and the params were checked before: what the first submit refuses is the constraint
            raise ParamError(f"'{key}': {e}", key) from None
        except BaseException:
            for s in streams:
                s.close()
            raise
        tokenizer = svc.engine.tokenizer
        logprobs = [Logprobs(tokenizer, self.chat) if req.logprobs is not None else None for _ in streams]
        prompt_tokens = sum(map(len, req.prompts))
        return _Run(
            rid, req, Choices(streams), logprobs, prompt_tokens, int(time.time()), [""] * len(streams)
        )

    def _chunk(self, run: _Run, choices: list[dict], **extra) -> dict:
        return {
            "id": run.rid,
            "object": self.chunk_object,
            "created": run.created,
            "model": self.state.name,
            "choices": choices,
            **extra,
        }

    async def _events(self, run: _Run, deadline: float):
        timeout = self.state.config.request_timeout
        try:
            for chunk in self.opening_chunks(run):
                yield _sse(chunk)
            while run.choices.live:
                got = await run.choices.next(max(0.0, deadline - time.monotonic()))
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
                failed = _grammar_failure(run, k, ev)
                if failed is not None:  # (OpenAI's in-stream error: the choice ends here)
                    yield _sse({"error": failed})
                for choice in self.event_choices(run, k, ev):
                    yield _sse(self._chunk(run, [choice]))
            if run.req.include_usage:
                yield _sse(self._chunk(run, [], usage=run.usage()))
            yield b"data: [DONE]\n\n"
        finally:
            run.choices.close()

    async def _collect(self, run: _Run, request, deadline: float) -> dict:
        """Non-streaming: collect, but watch for the client going away and for the timeout."""
        n = len(run.logprobs)
        texts: list[list[str]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        try:
            while run.choices.live:
                got = await run.choices.next(0.25)
                if got is None:
                    if await request.is_disconnected():
                        raise HTTPError(499, "client disconnected")
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    continue
                k, ev = got
                if ev is None:
                    finish[k] = "cancelled"
                    continue
                texts[k].append(ev.text)
                finish[k] = ev.finish_reason
                run.add_logprobs(k, ev)
        finally:
            run.choices.close()
        for k in range(n):
            if finish[k] == "error":
                failed = _grammar_failure(run, k, None)
                if failed is not None:  # the request's grammar failed it: the client's input, a 400
                    raise HTTPError(400, failed["message"], param=failed["param"])
        out = []
        for k, parts in enumerate(texts):
            lp = run.logprobs[k].result() if run.logprobs[k] is not None else None
            out.append(self.choice(run, k, "".join(parts), finish[k], lp))
        return {
            "id": run.rid,
            "object": self.object,
            "created": run.created,
            "model": self.state.name,
            "choices": out,
            "usage": run.usage(),
        }


def _grammar_failure(run: _Run, k: int, ev) -> dict | None:
    """OpenAI's error object for choice ``k`` when its structured output failed in the engine (the grammar
    went over its limits mid-way: the client's grammar, so a 400 naming the parameter), else None. ``ev``:
    the event just read (None: look at the choice's end)."""
    if ev is not None and ev.finish_reason != "error":
        return None
    handle = run.choices.streams[k].handle
    why = getattr(handle, "error", None) if handle is not None else None
    from precast.runtime.llm.structured import FAILED

    if not why or not why.startswith(FAILED):
        return None
    key = run.req.constraint_key
    return {
        "message": f"'{key}': {why}" if key else why,
        "type": "invalid_request_error",
        "param": key,
        "code": 400,
    }


class ChatServing(CompletionServing):
    chat = True
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def delta(self, text: str):
        return {"content": text}

    def opening_chunks(self, run: _Run) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk(run, [chunk_choice(k, role, None, None, True)]) for k in range(len(run.logprobs))]

    def choice(self, run: _Run, k: int, text: str, finish: str | None, lp: dict | None) -> dict:
        calls = _tool_calls(run, text)
        if calls is None:
            return chat_choice(k, text, finish, lp)
        content, found = calls
        return chat_choice(k, content, "tool_calls", lp, [c.wire() for c in found])

    def event_choices(self, run: _Run, k: int, ev) -> list[dict]:
        tools = run.req.tools
        if tools is None or tools.choice == "none":
            return super().event_choices(run, k, ev)
        run.add_logprobs(k, ev)
        run.held[k] += ev.text
        if ev.finish_reason is None:
            return []
        text, run.held[k] = run.held[k], ""
        lp = run.logprobs[k].result() if run.logprobs[k] is not None else None
        calls = _tool_calls(run, text)
        if calls is None:
            return [chunk_choice(k, {"content": text}, ev.finish_reason, lp, True)]
        content, found = calls
        deltas = ([{"content": content}] if content else []) + tool_call_deltas([c.wire() for c in found])
        out = [chunk_choice(k, d, None, lp if i == 0 else None, True) for i, d in enumerate(deltas)]
        return out + [chunk_choice(k, {}, "tool_calls", None, True)]


def _tool_calls(run: _Run, text: str):
    """(content, calls) the choice's text makes with the request's tools, or None: plain content."""
    return run.req.tools.parse(text) if run.req.tools is not None else None
