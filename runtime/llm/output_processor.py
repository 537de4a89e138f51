"""What a sampled token becomes for its caller: text, stop strings, logprobs, the handle's event.

    Engine._step:   logits = runner.execute(out); sampled = sample(...)     the Engine: schedule, run, sample
                    scheduler.update_from_output(out, sampled)             tokens appended; EOS / stop ids /
                                                                           length finish the request
                    output.stream(out, sampled, logits)                    here, per sampled row:
                      text = visible_text(req)      incremental detokenization; a stop string in the new
                                                    text cuts it there and finishes the request ("stop")
                      counters                      generation tokens, TTFT; a finished request leaves
                      handle.push(event, text)      the new text less a hold-back, logprobs if asked
                      a raising on_token callback fails its own request (finish_reason "error")

vLLM v1 splits its engine the same way (EngineCore schedules and samples; the OutputProcessor, with an
IncrementalDetokenizer per request, turns token ids into what the caller streams), so text, stop strings
and logprobs change here without touching the step loop. ``plain_token`` is the same for a plain request
(greedy, no text, stop strings or logprobs: only the counters and a bare event); the engine's steady tail
and batch-1 burst call it once per token, so it stays as short as the path it replaced.

The processor also keeps the registry of unfinished requests' handles (vLLM's request states): a request
leaves it when it finishes, fails or is cancelled, so a long-running server keeps no finished handle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from precast.errors import LLMRequestError
from precast.runtime.llm.handle import RequestHandle, TokenEvent
from precast.runtime.llm.metrics import EngineCounters
from precast.runtime.llm.request import Request
from precast.runtime.llm.sampler import token_logprobs
from precast.runtime.llm.scheduler import SchedulerOutput

__all__ = ["MAX_UNCOMMITTED", "IncrementalDetokenizer", "LogprobEvent", "OutputProcessor"]

MAX_UNCOMMITTED = 16  # tokens of a trailing unfinished character held back before they are committed anyway
_RECENT_IDS = 4096  # finished request ids remembered (a cancel of one says False, not "unknown id")


class LogprobEvent(TokenEvent):
    """A TokenEvent carrying ``logprobs`` (only requests that ask for them pay for the attribute)."""


class IncrementalDetokenizer:
    """One request's output text, decoded a few tokens per step (as vLLM and TGI do): the tokens since the
    last complete piece are decoded together with the piece before them (so leading-space rules see their
    context) and the difference is appended. A trailing unfinished UTF-8 sequence is shown but not committed,
    for at most MAX_UNCOMMITTED tokens (tokens that never complete a character would make every step decode
    a longer window). Two decodes of a few tokens per step instead of the whole output."""

    __slots__ = ("committed", "emitted", "_prefix", "_read")

    def __init__(self) -> None:
        self.committed = ""  # the text up to the last complete piece (stop strings in it were searched)
        self.emitted = 0  # chars of the visible text already streamed (the rest is held back)
        self._prefix = 0  # output offset of the piece before the uncommitted tokens
        self._read = 0  # output offset of the first uncommitted token

    def decode(self, tokenizer, token_ids: list[int], base: int) -> str:
        """The output text so far (``token_ids[base:]`` is the output): committed text + the pending tail."""
        prefix = base + self._prefix
        before = tokenizer.decode(token_ids[prefix : base + self._read])
        now = tokenizer.decode(token_ids[prefix:])
        if now.endswith("\ufffd") and len(token_ids) - prefix < MAX_UNCOMMITTED:
            return self.committed + now[len(before) :]
        self.committed += now[len(before) :]
        self._prefix, self._read = self._read, len(token_ids) - base
        return self.committed


class OutputProcessor:
    """Sampled tokens -> handles' events (see the module docstring). ``finish`` is the scheduler's (a stop
    string or a failure ends a request there); ``counters`` are the engine's, shared."""

    def __init__(self, tokenizer, counters: EngineCounters, finish: Callable[[Request, str], None]):
        self.tokenizer = tokenizer
        self.counters = counters
        self._finish = finish
        self.handles: dict[str, RequestHandle] = {}  # unfinished requests (a finished one is the caller's)
        self._finished_ids: OrderedDict[str, None] = OrderedDict()

    # -- the registry ----------------------------------------------------------------------------
    def add(self, handle: RequestHandle) -> None:
        self.handles[handle.request_id] = handle

    def forget(self, request_id: str) -> None:
        """A finished request leaves the registry (a long-running server must not keep every handle)."""
        self.handles.pop(request_id, None)
        self._finished_ids[request_id] = None
        if len(self._finished_ids) > _RECENT_IDS:
            self._finished_ids.popitem(last=False)

    def recently_finished(self, request_id: str) -> bool:
        return request_id in self._finished_ids

    def is_plain(self, req: Request) -> bool:
        """Nothing to do for its tokens but count and stream their ids: greedy without penalties, no text
        (no tokenizer or detokenize=False), no stop strings, no logprobs."""
        p = req.params
        text = self.tokenizer is not None and p.detokenize
        return req.argmax and p.logprobs is None and not p.stop and not text

    # -- tokens ----------------------------------------------------------------------------------
    def stream(self, out: SchedulerOutput, sampled: list[int | None], logits: np.ndarray) -> int:
        """Stream each row's sampled token (None: nothing sampled); returns how many were streamed."""
        produced = 0
        for i, (req, tok) in enumerate(zip(out.rows, sampled)):
            if tok is not None:
                handle = self.handles.get(req.request_id)
                if handle is not None:  # (None: an earlier row's callback cancelled it)
                    self.emit(handle, req, tok, logits, i)
                    produced += 1
        return produced

    def stream_plain(self, rows: list[Request], sampled: list[int]) -> int:
        """``stream`` for rows that are all plain (the engine's steady tail): counters and bare events."""
        handles, plain_token, produced = self.handles, self.plain_token, 0
        for req, tok in zip(rows, sampled):
            handle = handles.get(req.request_id)
            if handle is None:  # an earlier row's callback cancelled it
                continue
            produced += 1
            plain_token(handle, req, tok)
        return produced

    def emit(self, handle: RequestHandle, req: Request, tok: int, logits: np.ndarray, row: int) -> None:
        """Stream one sampled token (the scheduler appended it, and finished the request if it ended there)."""
        p = req.params
        text = self.visible_text(req) if self.tokenizer is not None and p.detokenize else None
        self._count_token(handle, req)  # (after the text: a stop string in it finishes the request)
        delta = "" if text is None else self._new_text(req, text)
        index = len(req.token_ids) - len(req.prompt_ids) - 1
        if p.logprobs is None:
            ev = TokenEvent(tok, delta, index, req.finish_reason)
        else:  # (opt-in: costs a softmax)
            ev = LogprobEvent(tok, delta, index, req.finish_reason)
            ev.logprobs = token_logprobs(logits[row], tok, p.logprobs)
        handle.push(ev, text)
        if handle.error is not None:  # its on_token callback raised
            self.fail(req)

    def plain_token(self, handle: RequestHandle, req: Request, tok: int) -> None:
        """Stream a plain request's token (the scheduler appended it): counters, then its bare event."""
        self._count_token(handle, req)
        handle.push(TokenEvent(tok, "", len(req.token_ids) - len(req.prompt_ids) - 1, req.finish_reason))
        if handle.error is not None:  # its on_token callback raised
            self.fail(req)

    def fail_unsampled(self, req: Request, error: LLMRequestError) -> None:
        """A request whose logits could not be sampled (NaN) fails alone, and its stream hears the end."""
        handle = self.handles[req.request_id]
        handle.fail(str(error), error)
        self.fail(req)
        handle.end()  # so that an on_token stream hears the end too

    def fail(self, req: Request) -> None:
        """Finish a failed request (its handle says why): its blocks are freed, the others go on."""
        if req.finish_reason == "cancelled":  # its callback cancelled it, then raised: cancelled it stays
            return
        if req.finished:  # it finished on this very token, but its callback failed
            self.counters.requests_finished -= 1
        else:
            self.forget(req.request_id)
        self._finish(req, "error")
        self.counters.requests_failed += 1

    def _count_token(self, handle: RequestHandle, req: Request) -> None:
        """The counters of one streamed token (first token: TTFT); a request it finished leaves."""
        c = self.counters
        c.generation_tokens += 1
        if handle.t_first_token is None:
            c.observe_ttft(handle)
        if req.finished:
            c.requests_finished += 1
            self.forget(req.request_id)

    # -- text ------------------------------------------------------------------------------------
    def visible_text(self, req: Request) -> str:
        """The output text so far, cut at the first stop string (which finishes the request). Stop strings
        are searched only where they can end in text new since the last committed piece."""
        detok = req.detokenizer
        if detok is None:
            detok = req.detokenizer = IncrementalDetokenizer()
        searched = len(detok.committed)  # committed before this token: searched by the earlier steps
        text = detok.decode(self.tokenizer, req.token_ids, len(req.prompt_ids))
        if req.params.stop:
            hits = [
                i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in req.params.stop) if i >= 0
            ]
            if hits:
                text = text[: min(hits)]
                self._finish(req, "stop")
        return text

    @staticmethod
    def _new_text(req: Request, text: str) -> str:
        """The part of ``text`` (the visible output) to stream now: all of it once the request finished,
        else up to what could still be the start of a stop string (the longest one less a char) and no
        trailing unfinished UTF-8 sequence."""
        detok = req.detokenizer
        emitted, end = detok.emitted, len(text)
        if not req.finished:
            end -= max(map(len, req.params.stop)) - 1 if req.params.stop else 0
            while end > emitted and text[end - 1] == "\ufffd":
                end -= 1
        detok.emitted = max(end, emitted)
        return text[emitted : detok.emitted]
