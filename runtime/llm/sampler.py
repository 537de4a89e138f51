"""Sampling parameters and the sampler: one request's logits -> one token id.

Order (as in Hugging Face's logits processors): repetition penalty, OpenAI's presence / frequency penalties,
temperature, top-k, top-p, min-p, then a draw from the request's own numpy Generator (seeded per request, so a
request's tokens do not depend on what else runs in the batch). temperature == 0 means greedy.

Log-probabilities (``logprobs``, opt-in per request) are the model's own: the log-softmax of the raw logits,
before any penalty, temperature or top-k/top-p (what OpenAI reports, and vLLM's default). So a greedy token
without penalties always has the largest logprob.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from precast.errors import LLMRequestError

__all__ = ["SamplingParams", "draw", "filtered_probs", "is_int", "sample", "token_logprobs"]

MAX_LOGPROBS = 20  # top alternatives one token may report (OpenAI's top_logprobs cap)
MAX_TEMPERATURE = 2.0  # OpenAI's range: above it the draw is close to uniform noise


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: logit - (count > 0) * presence, over the generated tokens
    frequency_penalty: float = 0.0  # OpenAI's: logit - count * frequency, over the generated tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    detokenize: bool = True  # False: token ids only (no text, no stop strings), less work per token
    logprobs: int | None = None  # k >= 0: each token's logprob and the top k (TokenEvent.logprobs)
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's (0 = off)
    # structured.Constraint: the output must match it (a JSON schema, regex, choice, Lark grammar); None = free
    constraint: object = None
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
        for name in ("max_tokens", "top_k", "seed", "logprobs"):
            if is_int(getattr(self, name)):
                object.__setattr__(self, name, int(getattr(self, name)))

    def validate(self) -> None:
        """Raise LLMRequestError naming the first bad option."""
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise LLMRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise LLMRequestError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature!r}"
            )
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise LLMRequestError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.constraint is not None:
            from precast.runtime.llm.structured import Constraint

            if not isinstance(self.constraint, Constraint):
                raise LLMRequestError(
                    f"constraint must be a structured.Constraint, got {type(self.constraint).__name__}"
                )
            self.constraint.validate()
            if self.ignore_eos:
                raise LLMRequestError(
                    "ignore_eos cannot be combined with a constraint (the grammar ends the output)"
                )
        if not is_int(self.top_k) or self.top_k < 0:
            raise LLMRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise LLMRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not (rp > 0 and np.isfinite(rp)):
            raise LLMRequestError(f"repetition_penalty must be a number > 0, got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise LLMRequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        lp = self.logprobs
        if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise LLMRequestError(f"logprobs must be None or an integer 0-{MAX_LOGPROBS}, got {lp!r}")
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

    @property
    def plain(self) -> bool:
        """No penalty changes the logits."""
        return (
            self.repetition_penalty == 1.0 and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
        )


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


def _apply_openai_penalties(
    logits: np.ndarray, generated: Sequence[int], params: SamplingParams
) -> np.ndarray:
    """logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty (OpenAI's definition)."""
    if (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0) or not len(generated):
        return logits
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    logits = np.array(logits, dtype=np.float64)
    logits[ids] -= counts * params.frequency_penalty + params.presence_penalty
    return logits


def _penalized(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int], num_prompt: int
) -> np.ndarray:
    x = _apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
        return x
    return _apply_openai_penalties(x, history[num_prompt:], params)


def filtered_probs(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int] = (), num_prompt: int = 0
) -> np.ndarray:
    """The distribution a non-greedy draw samples from (zeros outside the top-k / top-p support).
    ``history[num_prompt:]`` are the generated tokens (presence / frequency penalties count those)."""
    x = _penalized(np.asarray(logits, dtype=np.float64), params, history, num_prompt)
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
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    history: Sequence[int],
    rng: np.random.Generator,
    num_prompt: int = 0,
) -> int:
    """Pick the next token of one request. history = prompt + generated ids (for the penalties; the first
    ``num_prompt`` are the prompt's, which presence / frequency penalties leave out)."""
    if params.greedy:
        if params.plain:
            return int(np.asarray(logits).argmax())
        return int(np.argmax(_penalized(np.asarray(logits), params, history, num_prompt)))
    p = filtered_probs(logits, params, history, num_prompt)
    if not np.isfinite(p).all():  # NaN logits from the model: no distribution to draw from
        raise LLMRequestError(f"cannot sample: the logits are not finite (temperature {params.temperature})")
    return draw(p, rng)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """A token from the (not necessarily normalized) weights ``p``: an inverse-CDF draw, one uniform per token,
    so the stream of draws is reproducible from the seed."""
    c = np.cumsum(p)
    idx = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return idx if idx < p.shape[-1] else int(np.flatnonzero(p)[-1])


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(logprob of ``token``, the top ``k`` (id, logprob) by descending logprob) under the model's raw logits."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, lp.shape[-1])
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = tuple((int(i), float(lp[i])) for i in idx)
    return float(lp[token]), top
