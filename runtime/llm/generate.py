"""One prompt through the LLM engine: what `precast generate` runs (load, submit, stream, measure)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from precast.runtime.llm.metrics import SpecStats

__all__ = ["Generation", "generate"]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None
    seconds: float  # submit to the last token
    metrics: dict  # the engine's counters after the request
    note: str | None = None  # why fewer tokens than asked can come (the context or the KV pool caps them)
    target: str | None = None  # the artifact's target that ran (a multi-target index: the one opened)
    speculative: dict | None = None  # speculative decoding: its method and counters (None: not speculating)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids)
        return (n - 1) / (self.seconds - self.ttft_s) if n > 1 and self.ttft_s else 0.0

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "target": self.target,
            "metrics": self.metrics,
            **({"speculative": self.speculative} if self.speculative is not None else {}),
        }


def generate(
    artifact,
    prompt: str,
    params,
    *,
    num_blocks: int | None = None,
    threads: int | None = None,
    on_text: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    speculative=None,
) -> Generation:
    """Generate a continuation of ``prompt`` with ``params`` (SamplingParams, checked before the model loads);
    ``on_text`` gets each piece of text as it comes, ``on_note`` the cap note before the first token.
    ``speculative``: speculative decoding (speculative.SpeculativeConfig), or None."""
    from precast.runtime.llm import Engine

    params.validate()
    runner_kwargs = {"threads": threads} if threads is not None else {}
    # one request: a multi-target artifact opens the target measured fastest alone (runtime/hal.py)
    engine = Engine.load(
        artifact, num_blocks=num_blocks, concurrency=1, speculative=speculative, **runner_kwargs
    )
    handle = engine.submit(prompt, params)
    req, cap = handle.request, handle.request.max_total_tokens
    note = None
    if (
        req.num_prompt + params.max_tokens > cap
    ):  # the engine stops there (finish "length"), for the server too
        limit = "the context length" if cap == engine.max_context else "the KV pool (--num-blocks)"
        note = (
            f"--max-tokens {params.max_tokens} capped at {cap - req.num_prompt}: {limit} is {cap} tokens "
            f"and the prompt has {req.num_prompt}"
        )
        if on_note is not None:
            on_note(note)
    if on_text is not None:
        for ev in handle:
            on_text(ev.text)
    out = handle.result()
    seconds = time.perf_counter() - handle.t_submit
    snapshot = engine.metrics()
    spec = None
    if speculative is not None:
        cfg = engine.speculative
        spec = {
            "method": cfg.method,
            "num_tokens": cfg.num_tokens,
            "draft": cfg.draft,
            **SpecStats.of(snapshot).as_dict(),
        }
    return Generation(
        out.text,
        out.token_ids,
        out.finish_reason,
        out.ttft_s,
        seconds,
        snapshot.as_dict(),
        note,
        engine.target,
        spec,
    )
