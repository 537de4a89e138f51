"""Speculative decoding: propose a few tokens cheaply, verify them in one target step, keep the agreeing prefix.

    proposals = speculator.propose(rows)       per decoding request, up to k draft tokens (a draft model's
                                               greedy or sampled tokens, or the continuation of the longest
                                               recent n-gram match in its prompt + output: prompt lookup)
    (the engine appends them to the request and schedules it as a row of 1 + k tokens; the step graph returns
     the logits of all 1 + k positions: out.logit_rows)
    tokens = verify(req, drafts, logits, ...)   the accepted drafts plus one token of the target's own
    speculator.accepted(req, m)                 the proposer forgets what was rejected

Greedy requests accept a draft token while it is the target's argmax, so the output is exactly the
non-speculative engine's. Sampling requests use the standard rejection rule (Leviathan et al. 2023, Chen et
al. 2023): draft token d drawn from the draft's distribution q is kept with probability min(1, p(d) / q(d))
under the target's p; on rejection the token is drawn from normalize(max(0, p - q)); after k kept drafts one
more token is drawn from p. Both p and q are the request's processed distributions (penalties over the
history so far, temperature, top-k / top-p / min-p: sampler.filtered_probs), so the output distribution is the
target's. Prompt lookup's proposals are deterministic (q one-hot on d): keep d with probability p(d).

Adaptive (``SpecState``): each request's k follows its acceptance (all kept: k + 1; fewer than half: k - 1);
a request whose proposals keep failing stops speculating for a while (k = 0: plain decode steps, the batch-1
burst included) and retries later with k = 1. The engine also stops speculating while more requests decode
at once than ``max_batch``: there, one step of the batch already reads each weight once for many tokens,
and verification rows cost more than they save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from precast.errors import UsageError
from precast.runtime.llm.sampler import SamplingParams, draw, filtered_probs, is_int, sample

__all__ = [
    "DraftProposer",
    "NgramProposer",
    "SpecGovernor",
    "SpecState",
    "SpeculativeConfig",
    "verify",
]

METHODS = ("draft", "ngram")
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "draft" (a second, smaller causal-lm artifact with the same tokenizer: ``draft``) or
    "ngram" (prompt lookup). ``num_tokens``: the most tokens proposed per step (K). ``adaptive``: each
    request's k follows its acceptance (SpecState). ``max_batch``: no speculation while more requests
    decode at once (None: the engine's default for its runner). ``ngram_max`` / ``ngram_min``: the
    n-gram lengths prompt lookup tries, longest first."""

    method: str = "draft"
    num_tokens: int = 4
    draft: str | None = None
    adaptive: bool = True
    max_batch: int | None = None
    ngram_max: int = 4
    ngram_min: int = 2

    def validate(self) -> SpeculativeConfig:
        if self.method not in METHODS:
            raise UsageError(
                f"unknown speculative method {self.method!r} (choose from: {', '.join(METHODS)})"
            )
        if not is_int(self.num_tokens) or not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise UsageError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPEC_TOKENS}], got {self.num_tokens!r}"
            )
        if self.method == "draft" and not self.draft:
            raise UsageError("speculative method 'draft' needs a draft artifact (--draft DIR)")
        if self.method == "ngram" and self.draft:
            raise UsageError(
                "--draft and --speculative ngram exclude each other (prompt lookup uses no model)"
            )
        if self.max_batch is not None and (not is_int(self.max_batch) or self.max_batch < 0):
            raise UsageError(f"speculative max_batch must be an integer >= 0, got {self.max_batch!r}")
        if not (is_int(self.ngram_min) and is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max):
            raise UsageError(
                f"ngram lengths must satisfy 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        return self


# -- adaptive k per request -------------------------------------------------------------------------------
_OFF_TOKENS = (
    16  # tokens a request decodes plainly before it speculates again after its proposals kept failing
)
_EMPTY_RUN = 8  # empty proposals in a row (no n-gram match) that pause prompt lookup, for as many tokens


@dataclass
class SpecState:
    """One request's speculation: its current k, and its own proposer state (the draft's KV position,
    prompt lookup's n-gram index). Lives on the Request (``req.spec``)."""

    k: int
    k_max: int
    adaptive: bool = True
    off: int = 0  # tokens left to decode without speculation (k = 0; the batch-1 burst may run them)
    seen: int = 0  # the request's length when wanted() last looked (off counts down by the tokens since)
    misses: int = 0  # consecutive verifications that kept nothing
    empty: int = 0  # consecutive steps the proposer found nothing to propose
    # prompt lookup: n-gram -> the position right after its latest occurrence; indexed up to `indexed`
    grams: dict = field(default_factory=dict)
    indexed: int = 0
    draft_computed: int = 0  # tokens the draft has in its KV (DraftProposer)
    draft_id: str = ""  # the draft's KV-manager id of this request

    def wanted(self, length: int) -> int:
        """Tokens to propose this step for a request of ``length`` tokens (0: none)."""
        if self.off > 0:
            if self.seen >= 0:  # (-1: it just turned off; count from here)
                self.off = max(0, self.off - max(1, length - self.seen))
            self.seen = length
            if self.off == 0:
                self.k = 1
            return 0
        self.seen = length
        return self.k

    def nothing(self) -> None:
        """The proposer had nothing to propose (prompt lookup found no match). A lookup costs microseconds,
        so only a long run of them pauses it (for _EMPTY_RUN tokens: the batch-1 burst may run them)."""
        if self.adaptive:
            self.empty += 1
            if self.empty >= _EMPTY_RUN:
                self.off, self.empty, self.seen = _EMPTY_RUN, 0, -1

    def update(self, proposed: int, kept: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        self.empty = 0
        if kept == proposed:
            self.k = min(self.k_max, self.k + 1)
            self.misses = 0
        elif kept * 2 < proposed:
            self.k = max(1, self.k - 1)
            self.misses = self.misses + 1 if kept == 0 else 0
            if self.misses >= 3:  # its proposals keep failing: plain steps for a while
                self.off, self.misses, self.seen = _OFF_TOKENS, 0, -1
        else:
            self.misses = 0


# -- does it pay? -----------------------------------------------------------------------------------------
class SpecGovernor:
    """Whether speculating pays at the current batch size, measured: the engine reports each pure decode step
    (speculative or plain: its seconds and tokens, batch-1 bursts included) and speculates while its
    speculative steps' seconds per token stay below its plain steps'. Each mode's rate is decayed sums of
    seconds over tokens (a step that kept 6 drafts weighs 7 tokens, one that kept none 1). Where verification
    and drafting cost more than they save (a target small enough to run from cache, a batch whose rows the
    graph cannot batch), speculation turns itself off; it re-measures the other mode now and then (PROBE of
    every PERIOD steps). ``clock`` is injectable (tests)."""

    MIN_STEPS = {True: 8, False: 4}  # steps of a mode before its rate is trusted (speculation varies more)
    PERIOD = 64
    PROBE = 6
    DECAY = 0.05  # each step weighs the older ones down by this

    def __init__(self, clock):
        self.clock = clock
        self.sums: dict[tuple[bool, int], list[float]] = {}  # (speculative, batch) -> [seconds, tokens]
        self.samples: dict[tuple[bool, int], int] = {}
        self._since: dict[int, int] = {}  # batch -> steps since the other mode was measured

    def rate(self, speculative: bool, batch: int) -> float | None:
        """Seconds per token of that mode at that batch size (None: not measured enough)."""
        key = (speculative, batch)
        if self.samples.get(key, 0) < self.MIN_STEPS[speculative]:
            return None
        seconds, tokens = self.sums[key]
        return seconds / tokens

    def speculate(self, batch: int) -> bool:
        """Speculate in the next step of ``batch`` decoding requests?"""
        spec, plain = self.rate(True, batch), self.rate(False, batch)
        if spec is None:
            return True  # (measure speculation first: it is what was asked for)
        if plain is None:
            return False
        better = spec <= plain
        n = self._since.get(batch, 0) + 1
        self._since[batch] = n
        if n > self.PERIOD:  # re-measure the mode not taken
            if n >= self.PERIOD + self.PROBE:
                self._since[batch] = 0
            return not better
        return better

    def plain_wins(self, batch: int) -> bool:
        """Measured: plain steps are faster at this batch size."""
        spec, plain = self.rate(True, batch), self.rate(False, batch)
        return spec is not None and plain is not None and spec > plain

    def observe(self, speculative: bool, batch: int, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds < 0:
            return
        key = (speculative, batch)
        sums = self.sums.setdefault(key, [0.0, 0.0])
        keep = 1.0 - self.DECAY
        sums[0] = sums[0] * keep + seconds
        sums[1] = sums[1] * keep + tokens
        self.samples[key] = self.samples.get(key, 0) + 1


# -- prompt lookup ----------------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n tokens
    (n from ngram_max down to ngram_min), in its prompt + output. An index of n-gram -> end position grows
    with the request (O(1) per step), so a request whose text never repeats costs a few dict lookups."""

    probs: dict = {}  # (deterministic proposals: no draft distribution q; see DraftProposer.probs)

    def __init__(self, config: SpeculativeConfig):
        self.n_max, self.n_min = int(config.ngram_max), int(config.ngram_min)

    def reads_prompt(self, reqs: list, ks: list[int]) -> bool:
        return False

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        return [self._one(r, k) for r, k in zip(reqs, ks)]

    def _one(self, req, k: int) -> list[int]:
        st, toks = req.spec, req.token_ids
        end = len(toks)
        # index every n-gram ending before the last token (an occurrence must have a continuation)
        grams = st.grams
        for e in range(max(st.indexed, self.n_min), end):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                grams[tuple(toks[e - n : e])] = e
        st.indexed = max(st.indexed, end)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            at = grams.get(tuple(toks[end - n :]))
            if at is not None and at < end:
                # the continuation, extended periodically past the end (a loop of period end - at repeats)
                period = end - at
                return [toks[at + j % period] for j in range(k)]
        return []

    def accepted(self, req) -> None:
        pass

    def sweep(self, alive: set) -> None:
        pass

    def drop(self, req) -> None:
        pass

    def close(self) -> None:
        pass


# -- draft model ------------------------------------------------------------------------------------------
class _DraftRow:
    """What a runner reads of a request (token_ids, num_computed): the draft's view of a target request."""

    __slots__ = ("num_computed", "request_id", "token_ids")

    def __init__(self, request_id: str, token_ids: list[int], num_computed: int):
        self.request_id, self.token_ids, self.num_computed = request_id, token_ids, num_computed


class DraftProposer:
    """A draft model's runner over its own KV pool (a BlockPool and KVCacheManager of its own, no prefix
    caching): per step, each speculating request's draft catches up with the tokens it has not seen (one
    batched row each), then decodes k - 1 more tokens in batched decode steps. Greedy requests take the
    draft's argmax; sampling ones draw from the draft's processed distribution q and keep q for verify."""

    def __init__(self, runner, vocab: int):
        from precast.runtime.llm.block_pool import BlockPool
        from precast.runtime.llm.kv_cache_manager import KVCacheManager

        self.runner = runner
        self.vocab = int(vocab)
        self.draft_vocab = int(runner.spec.vocab)
        self.block_size = int(runner.spec.block_size)
        self.pool = BlockPool(int(runner.num_blocks), self.block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=False)
        self.max_context = int(runner.spec.max_context)
        self.probs: dict[str, list[np.ndarray]] = {}  # request id -> q of each proposed token (sampling)

    def reads_prompt(self, reqs: list, ks: list[int]) -> bool:
        """Whether proposing for these requests first runs the draft over more than a verify row's tokens
        (a prompt it has not read: a prefill, no step to judge speculation's speed by)."""
        return any(len(r.token_ids) - r.spec.draft_computed > 1 + k for r, k in zip(reqs, ks))

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        from precast.runtime.llm.scheduler import SchedulerOutput, StepKind

        drafts: list[list[int]] = [[] for _ in reqs]
        wanted = [0] * len(reqs)
        live: list[int] = []
        out = SchedulerOutput()
        for i, (req, k) in enumerate(zip(reqs, ks)):
            st = req.spec
            if not st.draft_id:
                st.draft_id, st.draft_computed = req.request_id, 0
            toks = list(req.token_ids)
            c = min(st.draft_computed, len(toks) - 1)
            k = min(k, self.max_context - len(toks))
            if k <= 0:
                continue
            n = len(toks) - c
            if max(toks[c:]) >= self.draft_vocab:  # (a target token the draft has no embedding for)
                continue
            if self.kv.allocate_slots(st.draft_id, c, n + k - 1) is None:  # the draft's pool is full
                continue
            wanted[i] = k
            out.add_row(_DraftRow(st.draft_id, toks, c), n, self.kv.block_table(st.draft_id), [])
            live.append(i)
        self.probs = {}
        fast, fast_block, bs = None, -1, self.block_size
        while out.rows:  # the catch-up rows (MIXED), then one batched decode step per further draft token
            row0 = out.rows[0]
            if fast is not None and len(out.rows) == 1 and row0.num_computed // bs == fast_block:
                # one row decoding inside the block its last decode mapped: the runner's single-row decoder
                # (bound buffers, no step around it), as the engine's batch-1 burst
                logits = fast(row0.token_ids[row0.num_computed], row0.num_computed)[None]
            else:
                out.kind = StepKind.DECODE if all(n == 1 for n in out.num_new) else StepKind.MIXED
                logits = self.runner.execute(out)
                fast = None
                if out.kind is StepKind.DECODE and len(out.rows) == 1:
                    fast, fast_block = self.runner.single_decoder(), row0.num_computed // bs
            nxt, still = SchedulerOutput(), []
            for j, (row, n) in enumerate(zip(out.rows, out.num_new)):
                i = live[j]
                tok = self._pick(reqs[i], logits[j], row.token_ids)
                row.num_computed += n
                row.token_ids.append(tok)
                drafts[i].append(tok)
                if len(drafts[i]) < wanted[i]:
                    nxt.add_row(row, 1, out.block_tables[j], [])
                    still.append(i)
            out, live = nxt, still
        for req, d in zip(reqs, drafts):
            if d:  # (its KV holds the request's tokens and every draft but the last)
                req.spec.draft_computed = len(req.token_ids) + len(d) - 1
        return drafts

    def _pick(self, req, logits: np.ndarray, history: list[int]) -> int:
        """The draft's token: its argmax for a plain greedy request, the penalized argmax for a greedy one
        with penalties (what verify's target picks), else a draw from its processed distribution q (kept,
        padded to the target's vocabulary, for the rejection rule)."""
        row = logits[: self.vocab]
        if req.argmax:
            return int(row.argmax())
        if req.params.greedy:
            return sample(row, req.params, history, req.rng, len(req.prompt_ids))
        q = filtered_probs(row, req.params, history, len(req.prompt_ids))
        if len(q) < self.vocab:  # (a draft with fewer tokens: none of the rest is ever proposed)
            q = np.concatenate([q, np.zeros(self.vocab - len(q))])
        self.probs.setdefault(req.request_id, []).append(q)
        return draw(q, req.rng)

    def accepted(self, req) -> None:
        """After its step (drafts verified, or dropped unverified): the draft's KV holds the request's tokens
        up to the last kept draft (what followed was rejected); blocks past them go back to the pool."""
        st = req.spec
        st.draft_computed = min(st.draft_computed, len(req.token_ids) - 1)
        self.kv.trim(st.draft_id, st.draft_computed)

    def sweep(self, alive: set) -> None:
        """Release the draft KV of requests no longer queued or running (cancelled between steps)."""
        for rid in [r for r in self.kv.request_ids() if r not in alive]:
            self.kv.free(rid)

    def drop(self, req) -> None:
        st = req.spec
        if st is not None and st.draft_id:
            self.kv.free(st.draft_id)
            st.draft_id, st.draft_computed = "", 0

    def close(self) -> None:
        self.runner.shutdown()


# -- verification -----------------------------------------------------------------------------------------
def verify(
    req,
    drafts: list[int],
    logits: np.ndarray,
    q: list[np.ndarray] | None,
    vocab: int,
) -> list[int]:
    """The tokens a verified row yields: its kept drafts and one token of the target's own.
    ``logits`` [len(drafts) + 1, V]: the target's at the row's last token and at each draft. ``q``: the draft's
    distribution of each draft token (sampling with a draft model), None: deterministic proposals."""
    p_params: SamplingParams = req.params
    history = req.token_ids  # prompt + output so far (drafts not included)
    if req.argmax:  # greedy without penalties: keep while the draft is the target's argmax
        targets = logits[: len(drafts) + 1, :vocab].argmax(axis=1).tolist()
        out = []
        for d, t in zip(drafts, targets):
            out.append(t)
            if t != d:
                return out
        out.append(targets[len(drafts)])
        return out
    out: list[int] = []
    hist = list(history)
    num_prompt = len(req.prompt_ids)
    for j, d in enumerate(drafts):
        row = logits[j, :vocab]
        if p_params.greedy:  # greedy with penalties: the penalized argmax
            t = sample(row, p_params, hist, req.rng, num_prompt)
            out.append(t)
            if t != d:
                return out
            hist.append(t)
            continue
        p = filtered_probs(row, p_params, hist, num_prompt)
        qd = 1.0 if q is None else float(q[j][d])
        if req.rng.random() * qd < p[d]:  # accept with probability min(1, p(d) / q(d))
            out.append(d)
            hist.append(d)
            continue
        if q is None:
            resid = p.copy()
            resid[d] = 0.0
        else:
            resid = np.maximum(p - q[j], 0.0)
        total = resid.sum()
        if total <= 0:  # (p == q: no residual mass; any draw from p is exact)
            resid, total = p, p.sum()
        out.append(draw(resid, req.rng))
        return out
    out.append(sample(logits[len(drafts), :vocab], p_params, hist, req.rng, num_prompt))
    return out
