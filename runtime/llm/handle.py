"""What a caller holds for one request: streamed tokens, text (with stop strings), the final result.

Iterating a handle yields TokenEvents as they are produced. With no background loop running, iteration
drives the engine itself (engine.step()), so a plain `for ev in engine.submit(...)` works single-threaded.

An on_token callback that raises fails its own request only: the engine finishes it (finish_reason "error",
blocks freed) and the handle's iteration / result() raise LLMRequestError carrying the callback's error.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from precast.errors import LLMRequestError, RequestCancelledError
from precast.runtime.llm.request import Request

__all__ = ["Completion", "RequestHandle", "TokenEvent"]


class TokenEvent(NamedTuple):  # (a NamedTuple: built once per token per request, 3x cheaper than a dataclass)
    token_id: int  # -1 on the last event of a request that failed before sampling (finish_reason "error")
    text: str  # new text this token made visible ('' while a stop string or a UTF-8 sequence is pending)
    index: int  # 0-based index among the output tokens
    finish_reason: str | None = None  # set on the last event
    # With SamplingParams.logprobs = k: (logprob of token_id, ((id, logprob) of the top k, best first)), on
    # an output_processor.LogprobEvent; a plain event says None (and stays the 4-tuple it always was).
    logprobs = None


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
    """One request as its caller sees it. The engine's side is ``push`` / ``fail`` / ``end`` (called by the
    engine and its output processor, under the engine's lock); ``wait`` is the engine's ``wait_for``, given
    here so that a handle needs nothing else of the engine."""

    def __init__(
        self,
        req: Request,
        on_token: Callable[[TokenEvent], None] | None = None,
        *,
        wait: Callable[[RequestHandle], None],
    ):
        self.request = req
        self.on_token = on_token
        self._wait = wait
        self._events: deque[TokenEvent] = deque()
        self.text = ""  # the visible output text so far (the output processor's; '' without text)
        self.t_submit = time.perf_counter()
        self.t_first_token: float | None = None
        self.cancelled = False
        self.error: str | None = None  # why the request failed (finish_reason "error"); None if it did not
        self._cause: BaseException | None = None

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

    @property
    def has_events(self) -> bool:
        """Events produced and not yet read (the engine's wait_for returns at once then)."""
        return bool(self._events)

    # -- engine side ---------------------------------------------------------------------------
    def push(self, ev: TokenEvent, text: str | None = None) -> None:
        """Record one new output token's event (built by the output processor); ``text``: the visible
        output so far (None: unchanged). Queued for the iterator and handed to the on_token callback."""
        if self.t_first_token is None:
            self.t_first_token = time.perf_counter()
        if text is not None:
            self.text = text
        self._events.append(ev)
        if self.on_token is not None:
            try:
                self.on_token(ev)
            except Exception as e:  # the caller's bug: the engine fails this request, the others go on
                self.fail(f"its on_token callback raised {type(e).__name__}: {e}", e)

    def fail(self, why: str, cause: BaseException) -> None:
        """Mark the request failed (the first reason stays); the engine finishes it with "error"."""
        if self.error is None:
            self.error, self._cause = why, cause

    def end(self) -> None:
        """The last event of a request that failed without a token: token_id -1, finish_reason "error"."""
        r = self.request
        ev = TokenEvent(-1, "", len(r.token_ids) - len(r.prompt_ids), r.finish_reason)
        self._events.append(ev)
        if self.on_token is not None:
            with contextlib.suppress(Exception):  # (the request has failed already)
                self.on_token(ev)

    # -- caller side ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            while self._events:
                yield self._events.popleft()
            self._raise_if_failed()
            if self.finished:
                return
            self._wait(self)

    def _raise_if_failed(self) -> None:
        if self.cancelled:
            raise RequestCancelledError(f"request '{self.request_id}' was cancelled")
        if self.error is not None:
            raise LLMRequestError(f"request '{self.request_id}' failed: {self.error}") from self._cause

    def result(self) -> Completion:
        """Run (or wait) until the request finishes; raise RequestCancelledError if it was cancelled,
        LLMRequestError if it failed (e.g. its on_token callback raised)."""
        while not self.finished:
            self._events.clear()  # (the result holds every token: wait_for returns on a new event)
            self._wait(self)
        self._events.clear()
        self._raise_if_failed()
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
