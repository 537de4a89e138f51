"""Continuous batching: which requests run this step, how many of their tokens, and what became of them.

    out = scheduler.schedule()                      # what changed since the last step (a SchedulerOutput)
    logits = runner.execute(out)                    # one row per scheduled request
    scheduler.update_from_output(out, sampled)      # tokens appended; EOS / stop ids / length finish; blocks freed

Every step has one token budget. Running requests go first, decodes before prefill chunks, so a long prompt
is cut into chunks and never stalls decoding. Then waiting requests are admitted in priority order
(lower `priority` value = more urgent; each `aging_steps` steps of waiting moves a request up one class, so
nothing starves). When the block pool runs dry, the least urgent running request is preempted: its blocks
are freed and it goes back to the waiting queue to be recomputed later (its prefix may still be cached).

The steady state is a cheap delta (vLLM's cached-request data with nothing new): when nobody waits and the
last step decoded every running request one token into room left in its own block, the next step is "the
same batch, one token further" (StepKind.STEADY) and schedule() returns the same output object again
without sorting, allocating or checking anything per request. Any change (an arrival, a finish, a cancel, a
request reaching the end of its block) ends that run; the next step takes the general path.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from precast.errors import UsageError
from precast.options import fields_of, opt
from precast.runtime.llm.kv_cache_manager import KVCacheManager
from precast.runtime.llm.request import Request, Status
from precast.runtime.llm.sampler import is_int

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "StepKind", "checked_config"]


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's knobs; `precast serve` takes the first two as flags (--max-num-seqs, ...), generated
    from these fields (precast/options.py), so their defaults and help are written here only."""

    max_num_batched_tokens: int = opt(512, "token budget of one engine step", min=1)
    max_num_seqs: int = opt(64, "requests in the running batch at once", min=1)
    aging_steps: int = opt(64, "waiting steps that promote a request by one priority class", min=1)


class StepKind(enum.Enum):
    MIXED = "mixed"  # prefill chunks among the rows (or a request first scheduled with several tokens)
    DECODE = "decode"  # one token per row; block tables may have grown or the batch changed
    STEADY = "steady"  # the previous step's rows again, one token further, no block table changed


@dataclass(eq=False)
class SchedulerOutput:
    """One step. Row i computes ``rows[i].token_ids[c : c + num_new[i]]`` with c = ``rows[i].num_computed``
    (the scheduler advances it in update_from_output), over ``block_tables[i]`` (the cache manager's own
    lists: read them, do not keep or change them). A STEADY output is the previous output object again."""

    kind: StepKind = StepKind.MIXED
    rows: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    new_requests: list[Request] = field(default_factory=list)  # first scheduled since (re)admission
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies before the step
    preempted: list[str] = field(default_factory=list)
    total_tokens: int = 0  # sum(num_new)
    # Speculative verification (engine): Q_i logits rows per row, its last Q_i new tokens (None: one per row)
    logit_rows: list[int] | None = None
    # Each row's recurrent state slot (KVCacheManager.state_slot; -1 for a model without recurrent states)
    state_slots: list[int] = field(default_factory=list)

    def add_row(
        self, req: Request, n: int, table: list[int], copies: list[tuple[int, int]], slot: int = -1
    ) -> None:
        """Schedule ``n`` tokens of ``req`` over ``table`` (and state ``slot``), after the block ``copies`` its
        allocation made."""
        self.rows.append(req)
        self.num_new.append(n)
        self.block_tables.append(table)
        self.state_slots.append(slot)
        self.copies.extend(copies)
        self.total_tokens += n


def drop_drafts(req: Request) -> None:
    """Take a request's unverified draft tokens off its token_ids (speculation skipped this step)."""
    if req.num_draft:
        del req.token_ids[-req.num_draft :]
        req.num_draft = 0


def checked_config(config: SchedulerConfig | None) -> SchedulerConfig:
    """``config`` (None: the defaults), or UsageError naming what is wrong with it. Engine.load calls it
    before loading a model, the Scheduler on construction."""
    config = SchedulerConfig() if config is None else config
    if not isinstance(config, SchedulerConfig):
        raise UsageError(f"config must be a SchedulerConfig, got {type(config).__name__}")
    for f in fields_of(SchedulerConfig):  # every one a count of at least 1
        v = getattr(config, f.name)
        if not is_int(v) or v < f.low:
            raise UsageError(f"SchedulerConfig.{f.name} must be a positive integer, got {v!r}")
    return config


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, config: SchedulerConfig | None = None, eos_ids: Iterable[int] = ()
    ):
        self.kv = kv
        self.config = checked_config(config)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0  # tokens looked up in the prefix cache (hits / queries = hit rate)
        self._seq = 0
        # A decode run: the last step decoded every running request and nothing changed since.
        self._run: SchedulerOutput | None = None  # its DECODE output (rows, tables: the manager's own lists)
        self._steady: SchedulerOutput | None = None  # its STEADY output
        self._steady_left = 0  # STEADY steps left before a row leaves its block

    # -- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.seq, self._seq = self._seq, self._seq + 1
        req.arrival_step = self.step_count
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        req.end_len = min(len(req.prompt_ids) + p.max_tokens, req.max_total_tokens)
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Finish a request (stop, length, cancelled, error): out of its queue, blocks freed. A request that
        has finished already only takes the new reason (a stop string found on the token that hit the length)."""
        self._end_run()
        if req.status is not Status.FINISHED:
            if req.status is Status.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.kv.free(req.request_id)
            req.status = Status.FINISHED
        req.finish_reason = reason

    def priority_key(self, req: Request) -> tuple[int, int]:
        age = (self.step_count - req.arrival_step) // max(1, self.config.aging_steps)
        return (req.priority - age, req.seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        if self._run is not None and not self.waiting:
            if self._steady_left > 0:
                return self._steady  # type: ignore[return-value]  (set with _steady_left)
            out = self._next_block(self._run)
            if out is not None:
                return out
        self._end_run()
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # (no admission in a step that had to preempt: the pool is tight)
            self._schedule_waiting(out, budget)
        if out.rows and all(n == 1 for n in out.num_new):
            out.kind = StepKind.DECODE
        return out

    def _next_block(self, run: SchedulerOutput) -> SchedulerOutput | None:
        """The decode run one token further, where some rows start a new block: just those rows allocate
        (what the general path would do: every row fits the budget, nobody waits), or None when the pool is
        dry (the general path preempts). The tables grow in place, so the run's lists stay valid."""
        bs, kv = self.kv.block_size, self.kv
        for req in run.rows:
            if req.num_computed % bs == 0 and kv.allocate_slots(req.request_id, req.num_computed, 1) != []:
                return None  # (no room; a fresh block is never shared, so never a copy)
        return run

    def _end_run(self) -> None:
        self._run, self._steady_left = None, 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests: decodes first, then prefill chunks; urgent first within each. Returns the budget left."""
        todo = sorted(self.running, key=lambda r: (r.num_pending - r.num_draft > 1, self.priority_key(r)))
        while todo and budget > 0:
            req = todo.pop(0)
            if req.num_draft and req.num_pending > budget:
                drop_drafts(req)  # (a speculative row runs whole or not at all)
            n = min(req.num_pending, budget)
            while (copies := self.kv.allocate_slots(req.request_id, req.num_computed, n)) is None:
                if req.num_draft:  # speculation never preempts anyone: no room, no drafts
                    drop_drafts(req)
                    n = 1
                    continue
                victim = max([req, *todo], key=self.priority_key)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
                todo.remove(victim)
            if copies is None:
                continue
            rid = req.request_id
            out.add_row(req, n, self.kv.block_table(rid), copies, self.kv.state_slot(rid))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=self.priority_key)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.match_prefix(req.request_id, req.token_ids)
            n = min(len(req.token_ids) - cached, budget)
            copies = self.kv.allocate_slots(req.request_id, cached, n)
            if copies is None:
                self.kv.free(req.request_id)
                break  # head-of-line waits: letting smaller ones pass would starve it
            self.waiting.pop(0)
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = cached
            if req.t_scheduled is None:
                req.t_scheduled = time.perf_counter()
            if self.kv.enable_prefix_caching:  # (off: nothing is looked up)
                self.prefix_hit_tokens += cached
                self.prefix_query_tokens += len(req.token_ids)
            req.num_computed = cached
            req.status = Status.RUNNING
            self.running.append(req)
            rid = req.request_id
            out.add_row(req, n, self.kv.block_table(rid), copies, self.kv.state_slot(rid))
            out.new_requests.append(req)
            budget -= n

    def _preempt(self, req: Request) -> None:
        drop_drafts(req)
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    # -- after the step ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: Sequence[int | None]) -> list[Request]:
        """Advance each row by its computed tokens and append its sampled token (None: a prefill chunk that
        samples nothing, or a request the engine finished meanwhile); finish requests on EOS, a stop token id,
        max_tokens or the context cap, freeing their blocks. Returns the requests finished here."""
        finished: list[Request] = []
        intact = True
        for req, n, tok in zip(out.rows, out.num_new, sampled):
            if req.status is not Status.RUNNING:
                intact = False  # cancelled or failed during the step
                continue
            if tok is None:
                intact = False  # (a prefill chunk: this is no steady decode)
            if self._advance(req, n, tok):
                finished.append(req)
        if finished or not intact or out.kind is StepKind.MIXED or self.waiting:
            self._end_run()
        elif out.kind is StepKind.DECODE:
            self._start_run(out)
        else:
            self._steady_left -= 1
        return finished

    def _advance(self, req: Request, n: int, tok: int | None) -> bool:
        """A running row computed ``n`` tokens and sampled ``tok`` (None: nothing): its blocks just filled are
        committed, the token appended; True when that finished it (EOS / stop token id, max_tokens, context)."""
        req.num_computed += n
        if n > 1 or req.num_computed % self.kv.block_size == 0:
            self.kv.commit(req.request_id, req.token_ids, req.num_computed)  # blocks just filled
        if tok is None:
            return False
        req.token_ids.append(tok)
        if tok in req.stop_ids:
            reason = "stop"
        elif len(req.token_ids) >= req.end_len:
            reason = "length"
        else:
            return False
        self.finish(req, reason)
        return True

    # -- speculative steps (runtime/llm/speculative.py) -----------------------------------------------
    # The engine appends a decoding request's draft tokens to its token_ids (req.num_draft) before
    # schedule(), which runs the row whole (or drops the drafts: budget, pool), and verifies the row's
    # logits; then each token it keeps goes through advance_token, as one decode step each would.
    def end_run(self) -> None:
        """The next schedule() takes the general path (the engine changed rows: draft tokens appended)."""
        self._end_run()

    def advance_token(self, req: Request, n: int, tok: int | None) -> bool:
        """A row's next token after ``n`` more computed (update_from_output's per-row advance); True when
        the request is finished (now or before)."""
        if req.status is not Status.RUNNING:
            return True
        return self._advance(req, n, tok)

    def end_speculative_step(self, out: SchedulerOutput) -> None:
        """After a verified step: blocks past each row's computed tokens (rejected drafts) go back to the
        pool, and the decode run (if any) ends."""
        self._end_run()
        for req in out.rows:
            if req.status is Status.RUNNING:
                self.kv.trim(req.request_id, req.num_computed)

    # -- the batch-1 burst (docs/llm-step-contract.md, "The batch-1 burst") ---------------------------
    # The one scheduling path besides schedule() -> update_from_output(): while a one-row decode run stays
    # inside its block and nobody waits, the engine may run the run's STEADY steps back to back with the
    # runner's single-row decoder (Engine._burst), each token through steady_step() instead of a step.
    def burst_steps(self, out: SchedulerOutput) -> int:
        """How many steps after ``out`` (already through update_from_output) may run as a burst: the
        STEADY steps its decode run has left when ``out`` is a one-row STEADY step, else 0."""
        if out.kind is not StepKind.STEADY or len(out.rows) != 1:
            return 0
        return self.steady_steps_left()

    def steady_steps_left(self) -> int:
        """STEADY steps the current decode run has left before a row needs a new block (0: no run, or the
        next schedule() must do more than repeat it, e.g. a request is waiting)."""
        return self._steady_left if self._run is not None and not self.waiting else 0

    def steady_step(self, req: Request, tok: int) -> None:
        """What schedule() -> (the step) -> update_from_output() do for a one-row run's STEADY step, without
        building or returning its output: the step counted, the row one token further (a finish ends the
        run). Only while steady_steps_left() > 0."""
        self.step_count += 1
        if self._advance(req, 1, tok):
            self._end_run()
        else:
            self._steady_left -= 1

    def _start_run(self, out: SchedulerOutput) -> None:
        """After a decode of every running request: the run goes on; count the next steps that stay in
        each row's own block (STEADY)."""
        if len(out.rows) != len(self.running):  # (the budget left some out)
            self._end_run()
            return
        if out is not self._run:  # (the delta of the run: no copies, preemptions or admissions again)
            rows, num_new, tables, total = out.rows, out.num_new, out.block_tables, out.total_tokens
            slots = out.state_slots
            self._run = SchedulerOutput(
                StepKind.DECODE, rows, num_new, tables, total_tokens=total, state_slots=slots
            )
            self._steady = SchedulerOutput(
                StepKind.STEADY, rows, num_new, tables, total_tokens=total, state_slots=slots
            )
        # Row r wrote position num_computed-1 in a private block (allocate_slots copied a shared one):
        # positions up to the block's end need no allocation.
        self._steady_left = min(-r.num_computed % self.kv.block_size for r in out.rows)
