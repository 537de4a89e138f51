"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has one token budget. Running requests go first, decodes before prefill chunks, so a long prompt
is cut into chunks and never stalls decoding. Then waiting requests are admitted in priority order
(lower `priority` value = more urgent; each `aging_steps` steps of waiting moves a request up one class, so
nothing starves). When the block pool runs dry, the least urgent running request is preempted: its blocks
are freed and it goes back to the waiting queue to be recomputed later (its prefix may still be cached).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from precast.runtime.errors import UsageError
from precast.runtime.llm.kv_cache_manager import KVCacheManager
from precast.runtime.llm.request import Request, Status
from precast.runtime.llm.sampler import is_int

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "checked_config"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget per step
    max_num_seqs: int = 64  # requests in the running batch
    aging_steps: int = 64  # waiting steps that promote a request by one priority class


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # position of the first new token (= tokens already cached)
    num_new: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies before the step
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)


def checked_config(config: SchedulerConfig | None) -> SchedulerConfig:
    """``config`` (None: the defaults), or UsageError naming what is wrong with it. Engine.load calls it
    before loading a model, the Scheduler on construction."""
    config = SchedulerConfig() if config is None else config
    if not isinstance(config, SchedulerConfig):
        raise UsageError(f"config must be a SchedulerConfig, got {type(config).__name__}")
    for name in ("max_num_batched_tokens", "max_num_seqs", "aging_steps"):
        v = getattr(config, name)
        if not is_int(v) or v <= 0:
            raise UsageError(f"SchedulerConfig.{name} must be a positive integer, got {v!r}")
    return config


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig | None = None):
        self.kv = kv
        self.config = checked_config(config)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0  # tokens looked up in the prefix cache (hits / queries = hit rate)
        self._seq = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.seq, self._seq = self._seq, self._seq + 1
        req.arrival_step = self.step_count
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or cancelled) and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)

    def priority_key(self, req: Request) -> tuple[int, int]:
        age = (self.step_count - req.arrival_step) // max(1, self.config.aging_steps)
        return (req.priority - age, req.seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        # Running requests: decodes first, then prefill chunks; urgent first within each.
        todo = sorted(self.running, key=lambda r: (r.num_pending > 1, self.priority_key(r)))
        while todo and budget > 0:
            req = todo.pop(0)
            n = min(req.num_pending, budget)
            while (copies := self.kv.allocate_slots(req.request_id, req.num_computed, n)) is None:
                victim = max([req, *todo], key=self.priority_key)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
                todo.remove(victim)
            if copies is None:
                continue
            out.chunks.append(ScheduledChunk(req, req.num_computed, n))
            out.copies.extend(copies)
            scheduled.add(id(req))
            budget -= n

        # Waiting requests (no admission in a step that had to preempt: the pool is tight).
        if out.preempted:
            return out
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
            self.prefix_hit_tokens += cached
            self.prefix_query_tokens += len(req.token_ids)
            req.num_computed = cached
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, cached, n))
            out.copies.extend(copies)
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
