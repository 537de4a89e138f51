"""What a caller holds for one request: streamed tokens, text (with stop strings), the final result.

Iterating a handle yields TokenEvents as they are produced. With no background loop running, iteration
drives the engine itself (engine.step()), so a plain `for ev in engine.submit(...)` works single-threaded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from precast.runtime.errors import RequestCancelledError
from precast.runtime.llm.request import Request

if TYPE_CHECKING:
    from precast.runtime.llm.engine import Engine

__all__ = ["Completion", "RequestHandle", "TokenEvent"]


class TokenEvent(NamedTuple):  # (a NamedTuple: built once per token per request, 3x cheaper than a dataclass)
    token_id: int
    text: str  # new text this token made visible ('' while a stop string or a UTF-8 sequence is pending)
    index: int  # 0-based index among the output tokens
    finish_reason: str | None = None  # set on the last event


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float | None
    num_cached_prompt_tokens: int
    num_preemptions: int


class RequestHandle:
    def __init__(self, engine: Engine, req: Request, on_token: Callable[[TokenEvent], None] | None = None):
        self._engine = engine
        self.request = req
        self.on_token = on_token
        self._events: deque[TokenEvent] = deque()
        self.text = ""
        self._emitted = 0  # chars of self.text already streamed
        self.t_submit = time.perf_counter()
        self.t_first_token: float | None = None
        self.cancelled = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.output_ids

    @property
    def finished(self) -> bool:
        return self.request.finished

    @property
    def finish_reason(self) -> str | None:
        return self.request.finish_reason

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.t_submit

    # -- engine side ---------------------------------------------------------------------------
    def _push(self, token_id: int, visible_text: str | None, stop_holdback: int) -> None:
        """Record one new output token; visible_text = the decoded output so far (None: no tokenizer)."""
        if self.t_first_token is None:
            self.t_first_token = time.perf_counter()
        if visible_text is not None:
            self.text = visible_text
        end = len(self.text)
        if not self.finished:
            end -= stop_holdback
            while end > self._emitted and self.text[end - 1] == "\ufffd":  # an unfinished UTF-8 sequence
                end -= 1
        delta = self.text[self._emitted : max(end, self._emitted)]
        self._emitted = max(end, self._emitted)
        r = self.request  # (index without slicing the output list every token)
        ev = TokenEvent(token_id, delta, len(r.token_ids) - len(r.prompt_ids) - 1, r.finish_reason)
        self._events.append(ev)
        if self.on_token is not None:
            self.on_token(ev)

    # -- caller side ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            while self._events:
                yield self._events.popleft()
            if self.cancelled:
                raise RequestCancelledError(f"request '{self.request_id}' was cancelled")
            if self.finished:
                return
            self._engine._wait_for(self)

    def result(self) -> Completion:
        """Run (or wait) until the request finishes; raise RequestCancelledError if it was cancelled."""
        while not self.finished and not self.cancelled:
            self._engine._wait_for(self)
        self._events.clear()
        if self.cancelled:
            raise RequestCancelledError(f"request '{self.request_id}' was cancelled")
        r = self.request
        return Completion(
            r.request_id,
            list(r.prompt_ids),
            list(r.output_ids),
            self.text,
            r.finish_reason or "",
            self.ttft_s,
            r.num_cached_prompt_tokens,
            r.num_preemptions,
        )
