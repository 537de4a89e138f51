"""A prompt -> its token ids, checked against the model (vocabulary, context, KV pool).

The engine does this before it takes its lock: a long prompt is tokenized (and a long id list checked)
while the step loop keeps running the other requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from precast.errors import LLMRequestError
from precast.runtime.llm.sampler import is_int

__all__ = ["prompt_ids", "prompt_list", "token_ids"]


def prompt_list(prompts) -> Sequence:
    """Engine.generate's prompts: one prompt (text, or a sequence / 1-D array of token ids) -> [it];
    a list of prompts as it is."""
    if isinstance(prompts, (str, np.ndarray)) and np.ndim(prompts) <= 1:
        return [prompts]
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise LLMRequestError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    if len(prompts) and is_int(prompts[0]):
        return [prompts]
    return prompts


def prompt_ids(
    prompt, tokenizer, *, vocab: int, max_context: int, num_blocks: int, block_size: int
) -> list[int]:
    """The prompt's token ids, or LLMRequestError naming what is wrong with it."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise LLMRequestError("this engine has no tokenizer: pass token ids, not text")
        ids = tokenizer.encode(prompt)
    else:
        ids = token_ids(prompt, max_context)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise LLMRequestError(f"unknown token id {bad[0]} in prompt (vocab size {vocab})")
    if not ids:
        raise LLMRequestError("empty prompt")
    _check_context(len(ids), max_context)
    need = -(-(len(ids) + 1) // block_size)
    if need > num_blocks:
        raise LLMRequestError(
            f"prompt needs {need} KV blocks but the pool has {num_blocks}; load with more num_blocks"
        )
    return ids


def _check_context(n: int, max_context: int) -> None:
    if n >= max_context:
        raise LLMRequestError(f"prompt has {n} tokens; the model's context is {max_context}")


def token_ids(prompt, max_context: int | None = None) -> list[int]:
    """A prompt of token ids (a sequence or 1-D array of integers) -> list of int; anything else is refused.
    A sequence of ``max_context`` or more is refused by its length, before each item is looked at."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise LLMRequestError(
                f"a prompt array must be 1-D of integer token ids, got {prompt.ndim}-D {prompt.dtype}"
            )
        if max_context is not None:
            _check_context(len(prompt), max_context)
        return prompt.tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
        raise LLMRequestError(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
    if max_context is not None:
        _check_context(len(prompt), max_context)
    for i, t in enumerate(prompt):
        if not is_int(t):
            raise LLMRequestError(f"prompt token ids must be integers; item {i} is {t!r}")
    return [int(t) for t in prompt]
