"""bench_llm.py's requests and the arithmetic of its ratios (pure Python + numpy, no engine needed).

Requests are token ids drawn fresh for every measurement (engines that cache prefixes, as OpenVINO GenAI's
LLMPipeline does by default, never hit), the same ids for every engine within one round. A concurrent row's
prompt lengths are spread evenly over [lo, hi] and shuffled, so each round holds the same number of prompt
tokens and only the ids and the order change.
"""

from __future__ import annotations

import statistics

import numpy as np

__all__ = ["TOKENS", "mixed_lengths", "mixed_prompts", "round_ratios", "summary"]

TOKENS = (5, 500)  # ids the benchmark models' 512-token tokenizer has (below 5: its special tokens)


def mixed_lengths(n: int, lo: int = 32, hi: int = 512) -> list[int]:
    """n prompt lengths spread evenly from lo to hi inclusive (sorted; mixed_prompts shuffles them)."""
    if n < 1 or lo < 1 or hi < lo:
        raise ValueError(f"mixed_lengths needs n >= 1 and 1 <= lo <= hi, got n={n}, lo={lo}, hi={hi}")
    if n == 1:
        return [(lo + hi) // 2]
    return [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def mixed_prompts(rng: np.random.Generator, n: int, lo: int = 32, hi: int = 512) -> list[list[int]]:
    """n fresh prompts of mixed lengths (mixed_lengths, shuffled), ids uniform in TOKENS."""
    lengths = mixed_lengths(n, lo, hi)
    rng.shuffle(lengths)
    return [rng.integers(*TOKENS, size=k).tolist() for k in lengths]


def round_ratios(values: dict[str, list[float]], base: str, name: str) -> list[float]:
    """name's value over base's, round by round (rounds where either is missing are left out)."""
    return [a / b for a, b in zip(values.get(name, []), values.get(base, [])) if a is not None and b]


def summary(xs: list[float]) -> str:
    """'median (min-max)' of a list of ratios, or '-' when empty."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}x"
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"
