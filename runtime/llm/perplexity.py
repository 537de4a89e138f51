"""Perplexity of a causal-lm artifact on raw text (WikiText style), through the paged step graph.

The step graph returns the logits of each request's LAST new token only, so every scored position needs
its own step. Each window of the text is one request; all windows of a group advance together, one token
per step (decode steps, S=1, B=windows), with their K/V in the runner's pool. A window's leading context
tokens that are not scored (stride < window) go in with one prefill step.

Sliding windows follow Hugging Face's recipe: windows of ``window`` tokens start every ``stride``
tokens; each scores only the tokens the previous window did not, with at most ``window - 1`` tokens of
context. With overlap (stride < window) every token after the first is scored once; without (the default,
stride = window) a window's first token has no context and is not scored, as in Hugging Face's recipe.

    ppl = exp( - mean over scored tokens t of log p(x_t | x_<t in its window) )
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from precast.errors import InputError
from precast.runtime.llm.runners.base import StepRunner
from precast.runtime.progress import SILENT, ProgressReporter, reporter

__all__ = [
    "PerplexityResult",
    "WindowScores",
    "make_windows",
    "perplexity",
    "perplexity_of_text",
    "score_windows",
]


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    windows: int
    window: int
    stride: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class WindowScores:
    """Per scored token, in text order: its log-probability and the model's argmax prediction for it."""

    logprobs: np.ndarray  # float64 [n]
    argmax: np.ndarray  # int64 [n]


def make_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) triples; tokens [first_scored, end) are scored, each token once."""
    if window < 2:
        raise InputError(f"perplexity window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise InputError(f"perplexity stride must be within [1, window={window}], got {stride}")
    if n_tokens < 2:
        raise InputError(f"perplexity needs at least 2 tokens of text, got {n_tokens}")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        first = max(prev_end, begin + 1)  # the window's first token has no context: never scored
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def score_windows(
    runner: StepRunner,
    tokens: Sequence[int] | np.ndarray,
    windows: Sequence[tuple[int, int, int]],
    batch: int = 16,
    on_step: Callable[[int], None] | None = None,
    progress: ProgressReporter = SILENT,
) -> WindowScores:
    """Score the windows with ``runner`` (its checked ``step``), ``batch`` windows per step.

    ``progress`` hears ``advance(steps done, steps in all, "windows a-b of n")`` after each step."""
    tokens = np.asarray(tokens, dtype=np.int64)
    spec = runner.spec
    if batch < 1:
        raise InputError(f"batch must be >= 1, got {batch}")
    longest = max(e - b for b, e, _ in windows)
    if longest > spec.max_context:
        raise InputError(
            f"perplexity window of {longest} tokens exceeds the model's max context {spec.max_context}"
        )
    maxb = spec.blocks_for(longest)
    batch = min(batch, len(windows), max(1, runner.num_blocks // maxb))
    slots = getattr(runner, "num_state_slots", 0)  # (a recurrent model: a state slot per window at once)
    if slots:
        batch = min(batch, slots)
    if runner.num_blocks < maxb:
        raise InputError(f"the runner's {runner.num_blocks} KV blocks cannot hold a {longest}-token window")
    logprobs, argmax = [], []
    steps = 0
    total = sum(_group_steps(windows[g : g + batch]) for g in range(0, len(windows), batch))

    def advanced(what: str) -> None:
        nonlocal steps
        steps += 1
        if on_step:
            on_step(steps)
        progress.advance(steps, total, what)

    for g in range(0, len(windows), batch):
        # Longest first: requests that run out drop off the end of the batch.
        group = sorted(windows[g : g + batch], key=lambda w: -(w[1] - w[0]))
        what = _windows_label(g + 1, g + len(group), len(windows))
        got_lp, got_am = _score_group(runner, [tokens[b:e] for b, e, _ in group], group, maxb, advanced, what)
        for r in sorted(range(len(group)), key=lambda r: group[r][0]):
            b, _, f = group[r]
            logprobs.append(got_lp[r][f - b - 1 :])
            argmax.append(got_am[r][f - b - 1 :])
    # Groups were scored in window order already; within a group the sort above restored text order.
    return WindowScores(np.concatenate(logprobs), np.concatenate(argmax))


def _score_group(runner: StepRunner, seqs: list, group: list, maxb: int, advanced, what: str) -> tuple:
    """One group of windows (longest first) as requests of the runner's pool: per window, entry t of its
    scores is log p(seq[t+1] | seq[:t+1]) and the argmax there. ``advanced(what)`` after each step."""
    lens = np.array([len(s) for s in seqs])
    tables = np.arange(len(group) * maxb, dtype=np.int64).reshape(len(group), maxb)
    got_lp = [np.zeros(n - 1) for n in lens]
    got_am = [np.zeros(n - 1, dtype=np.int64) for n in lens]
    # Unscored context (all but the first token before first_scored) goes in with one prefill step.
    ctx = min(f - b for b, _, f in group) - 1
    done = 0
    if ctx >= 2:
        ids = np.stack([s[:ctx] for s in seqs])
        pos = np.broadcast_to(np.arange(ctx, dtype=np.int64), ids.shape)
        runner.step(ids, pos, np.zeros(len(group), np.int64), np.full(len(group), ctx, np.int64), tables)
        done = ctx
        advanced(what)
    for t in range(done, int(lens.max()) - 1):
        live = int(np.count_nonzero(lens - 1 > t))
        ids = np.array([[s[t]] for s in seqs[:live]], dtype=np.int64)
        logits = runner.step(
            ids,
            np.full((live, 1), t, np.int64),
            np.full(live, t, np.int64),
            np.ones(live, np.int64),
            tables[:live],
        )
        lp = _log_softmax(logits)
        for r in range(live):
            got_lp[r][t] = lp[r, seqs[r][t + 1]]
            got_am[r][t] = int(np.argmax(logits[r]))
        advanced(what)
    return got_lp, got_am


def _windows_label(first: int, last: int, n: int) -> str:
    return f"window {first} of {n}" if first == last else f"windows {first}-{last} of {n}"


def _group_steps(group: Sequence[tuple[int, int, int]]) -> int:
    """How many runner steps score_windows takes for one group: one prefill of the shared context (when it is
    2 tokens or more), then one decode step per remaining position of the longest window."""
    ctx = min(f - b for b, _, f in group) - 1
    done = ctx if ctx >= 2 else 0
    return (1 if ctx >= 2 else 0) + max(0, max(e - b for b, e, _ in group) - 1 - done)


def perplexity(
    runner: StepRunner,
    tokens: Sequence[int],
    window: int | None = None,
    stride: int | None = None,
    batch: int = 16,
    progress: ProgressReporter = SILENT,
) -> tuple[PerplexityResult, WindowScores]:
    """Perplexity of ``tokens``; window defaults to the model's max context (at most 1024), stride to window."""
    t0 = time.perf_counter()
    window = int(window if window is not None else min(runner.spec.max_context, 1024))
    stride = int(stride if stride is not None else window)
    if window > runner.spec.max_context:
        raise InputError(f"--window {window} exceeds the model's max context {runner.spec.max_context}")
    windows = make_windows(len(tokens), window, stride)
    progress.step(f"scoring {len(tokens)} tokens in {len(windows)} windows of {window} (stride {stride})")
    scores = score_windows(runner, tokens, windows, batch, progress=progress)
    nll = float(-scores.logprobs.mean())
    result = PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        tokens=int(scores.logprobs.size),
        windows=len(windows),
        window=window,
        stride=stride,
        seconds=time.perf_counter() - t0,
    )
    return result, scores


def perplexity_of_text(
    artifact,
    text: str,
    window: int | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    batch: int = 16,
    threads: int | None = None,
    progress: ProgressReporter | Callable[[str], None] | None = None,
) -> PerplexityResult:
    """Load a causal-lm artifact, tokenize ``text`` with its tokenizer, and measure perplexity."""
    from precast.runtime.hal import resolve

    report = reporter(progress)
    report.step(f"loading {artifact}")

    def open_target(root, manifest) -> tuple:
        return _runner_for_text(root, manifest, text, window, stride, max_tokens, batch, threads, report)

    found = resolve(artifact, open_target)
    runner, ids = found.opened
    try:
        result, _ = perplexity(runner, ids, window, stride, batch, progress=report)
    finally:
        runner.close()
        if found.temp is not None:
            from precast.artifact.archive import remove_temp

            remove_temp(found.temp)
    return result


def _runner_for_text(root, manifest, text, window, stride, max_tokens, batch, threads, report) -> tuple:
    """(the artifact's runner with a pool sized for ``batch`` windows of the text, the text's token ids)."""
    from precast.artifact.llm_spec import LLMSpec
    from precast.runtime.llm.runners.factory import RunnerOptions, open_runner
    from precast.runtime.llm.tokenizer import TextTokenizer

    spec = LLMSpec.from_manifest(manifest, str(root))
    report.step(f"tokenizing {len(text)} characters")
    ids = TextTokenizer.from_file(root / spec.tokenizer).encode(text)
    if max_tokens is not None:
        if max_tokens < 2:
            raise InputError(f"--max-tokens must be >= 2, got {max_tokens}")
        ids = ids[:max_tokens]
    w = int(window if window is not None else min(spec.max_context, 1024))
    s = max(1, int(stride if stride is not None else w))
    nb = max(1, min(batch, -(-len(ids) // s))) * spec.blocks_for(max(2, min(w, len(ids))))
    # (spinning: ONNX Runtime's default, as a loaded Model runs; one session, no spin switch)
    slots = max(1, min(batch, -(-len(ids) // s)))  # (a recurrent model's state slots: one per window at once)
    options = RunnerOptions(threads=threads, spinning=True, state_slots=slots)
    return open_runner(root, manifest, nb, options), ids
