"""The token streams of one OpenAI request's choices, and their logprobs in OpenAI's two shapes."""

from __future__ import annotations

import asyncio

__all__ = ["Choices", "Logprobs"]


class Choices:
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


class Logprobs:
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
