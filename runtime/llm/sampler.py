"""Sampling parameters and the sampler: one request's logits -> one token id.

Order (as in Hugging Face's logits processors): repetition penalty, temperature, top-k, top-p, then a draw
from the request's own numpy Generator (seeded per request, so a request's tokens do not depend on what
else runs in the batch). temperature == 0 means greedy.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from precast.runtime.errors import LLMRequestError

__all__ = ["SamplingParams", "filtered_probs", "is_int", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    detokenize: bool = True  # False: token ids only (no text, no stop strings), less work per token
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        # Normalize what is well-formed (None = none, one stop string, numpy integers -> int) and leave the
        # rest as given: validate() names it.
        stop, ids = self.stop, self.stop_token_ids
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        ids = () if ids is None else ids
        if isinstance(stop, Iterable) and not isinstance(stop, (bytes, dict)):
            object.__setattr__(self, "stop", tuple(stop))
        if isinstance(ids, Iterable) and not isinstance(ids, (str, bytes, dict)):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) if is_int(t) else t for t in ids))
        for name in ("max_tokens", "top_k", "seed"):
            if is_int(getattr(self, name)):
                object.__setattr__(self, name, int(getattr(self, name)))

    def validate(self) -> None:
        """Raise LLMRequestError naming the first bad option."""
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise LLMRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not np.isfinite(self.temperature) or self.temperature < 0:
            raise LLMRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise LLMRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise LLMRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not (rp > 0 and np.isfinite(rp)):
            raise LLMRequestError(f"repetition_penalty must be a number > 0, got {rp!r}")
        seed = self.seed
        if seed is not None and (not is_int(seed) or seed < 0):
            raise LLMRequestError(f"seed must be a non-negative integer, got {seed!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise LLMRequestError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or any(not is_int(t) or t < 0 for t in ids):
            raise LLMRequestError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
        for name in ("ignore_eos", "detokenize"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise LLMRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise LLMRequestError("stop strings need detokenize=True (they match the text)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def is_int(v) -> bool:
    """An integer option: Python or numpy integers, not bool (True is no count)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _apply_repetition_penalty(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    if penalty == 1.0 or not len(history):
        return logits
    ids = np.unique(np.asarray(history, dtype=np.int64))
    vals = logits[ids]
    logits = logits.copy()
    # CTRL / HF rule: shrink positive logits, push negative ones further down.
    logits[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def filtered_probs(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The distribution a non-greedy draw samples from (zeros outside the top-k / top-p support)."""
    x = _apply_repetition_penalty(np.asarray(logits, dtype=np.float64), history, params.repetition_penalty)
    # Shift before dividing: the max logit becomes 0, so a tiny temperature sends the others to -inf (one-hot on
    # the argmax) instead of overflowing everything to inf and the softmax to NaN.
    with np.errstate(over="ignore"):
        x = (x - x.max()) / params.temperature
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = np.partition(x, v - params.top_k)[v - params.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        # keep the smallest head whose mass reaches top_p (at least one token)
        keep = int(np.searchsorted(csum, params.top_p) + 1)
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int], rng: np.random.Generator
) -> int:
    """Pick the next token of one request. history = prompt + generated ids (for the repetition penalty)."""
    if params.greedy:
        if params.repetition_penalty == 1.0:
            return int(np.asarray(logits).argmax())
        x = _apply_repetition_penalty(np.asarray(logits), history, params.repetition_penalty)
        return int(np.argmax(x))
    p = filtered_probs(logits, params, history)
    if not np.isfinite(p).all():  # NaN logits from the model: no distribution to draw from
        raise LLMRequestError(f"cannot sample: the logits are not finite (temperature {params.temperature})")
    # inverse-CDF draw: one uniform per token, so the stream of draws is reproducible from the seed
    c = np.cumsum(p)
    idx = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return idx if idx < p.shape[-1] else int(np.flatnonzero(p)[-1])
