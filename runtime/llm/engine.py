"""The LLM engine: schedule -> run the compiled model over the paged KV cache -> sample -> update.

    engine = Engine.load("out/llm")
    h = engine.submit("Once upon a time", SamplingParams(max_tokens=64, temperature=0.8, seed=1), priority=0)
    for ev in h: print(ev.text, end="")

The model runner (ModelRunner.from_artifact) owns the session and the K/V pools and scatters new K/V into
them; the engine owns the block tables, so it only tells the runner where each request's blocks are.
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from precast.runtime.errors import ArtifactError, LLMRequestError, UsageError
from precast.runtime.llm.block_pool import BlockPool
from precast.runtime.llm.handle import Completion, RequestHandle, TokenEvent
from precast.runtime.llm.kv_cache_manager import KVCacheManager
from precast.runtime.llm.metrics import EngineCounters, EngineMetrics
from precast.runtime.llm.prompt import prompt_ids
from precast.runtime.llm.request import Request, Status
from precast.runtime.llm.sampler import SamplingParams, is_int, sample, token_logprobs
from precast.runtime.llm.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, checked_config

__all__ = ["Engine"]

Prompt = str | Sequence[int]


class Engine:
    def __init__(
        self,
        runner,
        tokenizer=None,
        *,
        config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = True,
    ):
        spec = runner.spec
        self.runner = runner
        # The engine builds valid steps itself: a runner's unchecked entry point skips re-validating them.
        self._runner_step = getattr(runner, "step_unchecked", runner.step)
        self._decode_rows = getattr(runner, "decode_unchecked", None)  # decode rows from lists (steady state)
        self._decode_again = getattr(runner, "decode_again", None)  # the same rows again, mapping as is
        self._plan: _Plan | None = None
        self._prefix_caching = bool(enable_prefix_caching)
        self.tokenizer = tokenizer
        self.block_size = int(spec.block_size)
        self.max_context = int(spec.max_context)
        self.vocab = int(spec.vocab)
        self.eos_ids = frozenset(int(t) for t in (getattr(spec, "eos_ids", None) or ()))
        self.pad_id = int(getattr(spec, "pad_id", 0) or 0)
        num_blocks = int(runner.key_cache[0].shape[0])
        self.pool = BlockPool(num_blocks, self.block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config)
        self.counters = EngineCounters()
        self._handles: dict[str, RequestHandle] = {}  # unfinished requests (a finished one is the caller's)
        self._finished_ids: OrderedDict[str, None] = OrderedDict()  # recent finished ids (cancel -> False)
        self._ids = itertools.count()
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._stop = False
        self._cleanup: weakref.finalize | None = None  # removes the temp dir load() unpacked into

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        num_blocks: int | None = None,
        *,
        config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = True,
        **runner_kwargs,
    ) -> Engine:
        """Open a causal-lm artifact (a directory, or a file packed by ``precast pack``, as
        precast.runtime.load takes it): its model runner (K/V pools of num_blocks blocks) and tokenizer.
        ``runner_kwargs``: ModelRunner.from_artifact's ``threads`` and ``verify``. A packed artifact is
        unpacked into a temp dir the engine owns: ``close()`` removes it (else garbage collection or exit)."""
        from precast.runtime.llm.model_runner import ModelRunner
        from precast.runtime.llm.tokenizer import TextTokenizer
        from precast.runtime.manifest import read_manifest

        if num_blocks is not None and (not is_int(num_blocks) or num_blocks < 1):
            raise UsageError(f"num_blocks must be a positive integer (or None), got {num_blocks!r}")
        checked_config(config)  # before a model is loaded for nothing
        known = sorted(set(inspect.signature(ModelRunner.from_artifact).parameters) - {"path", "num_blocks"})
        unknown = sorted(set(runner_kwargs) - set(known))
        if unknown:
            raise UsageError(f"Engine.load got an unknown option '{unknown[0]}' (known: {', '.join(known)})")
        root = where = Path(path)
        unpacked = None
        if root.is_file():  # a packed artifact: unpacked (every checksum checked) into a private temp dir
            from precast.runtime.archive import remove_temp, unpack_to_temp

            root = unpacked = unpack_to_temp(root)
        try:
            llm = read_manifest(root).llm
            if llm is None:
                raise ArtifactError(f"{where}: not a causal-lm artifact (manifest has no 'llm' block)")
            runner = ModelRunner.from_artifact(root, num_blocks=num_blocks, **runner_kwargs)
            tok_file = llm.tokenizer
            tokenizer = (
                TextTokenizer.from_file(root / tok_file) if tok_file and (root / tok_file).is_file() else None
            )
            engine = cls(runner, tokenizer, config=config, enable_prefix_caching=enable_prefix_caching)
        except BaseException:
            if unpacked is not None:
                remove_temp(unpacked)
            raise
        if unpacked is not None:
            engine._cleanup = weakref.finalize(engine, remove_temp, unpacked)
        return engine

    def close(self) -> None:
        """Stop the step loop and remove the temp dir a packed artifact was unpacked into. Idempotent."""
        self.stop()
        if self._cleanup is not None:
            self._cleanup()

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        request_id: str | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> RequestHandle:
        """Queue one request. Bad input raises LLMRequestError naming it; other requests are unaffected."""
        params = SamplingParams() if params is None else params
        ids = self._checked(prompt, params, priority, request_id, on_token)
        with self._cond:
            self._rejecting(self._check_id_free, request_id)
            return self._enqueue(ids, params, priority, request_id, on_token)

    def _checked(self, prompt, params, priority, request_id, on_token) -> list[int]:
        """Outside the lock (pure checks of the request): tokenizing a long prompt, or checking a long list
        of ids or stop strings, must not stall the step loop that serves the other requests."""
        return self._rejecting(self._validate, prompt, params, priority, request_id, on_token)

    def _rejecting(self, check, *args):
        try:
            return check(*args)
        except LLMRequestError:
            with self._cond:
                self.counters.requests_rejected += 1
            raise

    def _check_id_free(self, request_id) -> None:
        if request_id is not None and request_id in self._handles and not self._handles[request_id].finished:
            raise LLMRequestError(f"request id '{request_id}' is already in use")

    def _enqueue(self, ids, params, priority, request_id, on_token) -> RequestHandle:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        cap = min(self.max_context, self.pool.num_blocks * self.block_size)
        req = Request(rid, ids, params, priority=int(priority), max_total_tokens=cap)
        handle = RequestHandle(self, req, on_token)
        self._handles[rid] = handle
        self.scheduler.add(req)
        self.counters.requests_submitted += 1
        self.counters.prompt_tokens += len(ids)
        self._cond.notify_all()
        return handle

    def _validate(self, prompt: Prompt, params, priority, request_id, on_token) -> list[int]:
        if request_id is not None and not isinstance(request_id, str):
            raise LLMRequestError(f"request_id must be a string, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise LLMRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if not is_int(priority):
            raise LLMRequestError(f"priority must be an integer (lower = more urgent), got {priority!r}")
        if on_token is not None and not callable(on_token):
            raise LLMRequestError(f"on_token must be callable, got {type(on_token).__name__}")
        if params.stop and self.tokenizer is None:
            raise LLMRequestError("stop strings need a tokenizer")
        return prompt_ids(
            prompt,
            self.tokenizer,
            vocab=self.vocab,
            max_context=self.max_context,
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
        )

    def cancel(self, request_id: str) -> bool:
        """Cancel a request (its blocks are freed now). False if it had already finished."""
        with self._cond:
            handle = self._handles.get(request_id)
            if handle is None or handle.finished:
                if request_id in self._finished_ids or handle is not None:
                    return False
                raise LLMRequestError(f"unknown request id '{request_id}'")
            req = handle.request
            self.scheduler.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "cancelled"
            handle.cancelled = True
            self._forget(request_id)
            self.counters.requests_cancelled += 1
            self._cond.notify_all()
            return True

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, priority: int = 0
    ) -> list[Completion]:
        """Submit all prompts, run until they finish, return their completions in order.
        One bad prompt rejects the whole call: all are checked before any is queued."""
        if isinstance(prompts, (str, np.ndarray)) and np.ndim(prompts) <= 1:
            prompts = [prompts]
        elif not isinstance(prompts, (Sequence, np.ndarray)):
            raise LLMRequestError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        elif len(prompts) and is_int(prompts[0]):
            prompts = [prompts]
        params = SamplingParams() if params is None else params
        checked = [self._checked(p, params, priority, None, None) for p in prompts]
        with self._cond:
            handles = [self._enqueue(ids, params, priority, None, None) for ids in checked]
        return [h.result() for h in handles]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def is_running(self) -> bool:
        """Whether the background step loop (start()) is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -- the step loop -------------------------------------------------------------------------
    def step(self) -> int:
        """One scheduler step (possibly several runner calls). Returns the number of tokens sampled."""
        with self._cond:
            fast = self._steady_decode()
            if fast is not None:
                return fast
            out = self.scheduler.schedule()
            self.counters.steps += 1
            self.counters.preemptions += len(out.preempted)
            for src, dst in out.copies:
                self._copy_block(src, dst)
            produced = 0
            for group in _group_by_length(out.chunks):
                logits = self._run(group)
                for chunk, row in zip(group, logits):
                    produced += self._advance(chunk, row)
            self.counters.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
            self.counters.prefix_query_tokens = self.scheduler.prefix_query_tokens
            self._cond.notify_all()
            return produced

    def _forget(self, request_id: str) -> None:
        """A finished request leaves the engine (a long-running server must not keep every handle)."""
        self._handles.pop(request_id, None)
        self._finished_ids[request_id] = None
        if len(self._finished_ids) > 4096:
            self._finished_ids.popitem(last=False)

    def _steady_decode(self) -> int | None:
        """The steady state, without the scheduler's general path: nobody waiting, every running request
        decoding one token into room left in its own last block (no allocation, no copy-on-write, no
        preemption possible). Exactly what schedule() would return then; None when any condition fails.

        The checks hold for a whole *plan*: while the same requests keep running, no other step ran and
        none of them leaves its verified block, later steps reuse the plan (and the runner reuses its slot
        mapping as is: decode_again) instead of re-deriving both every token."""
        sch = self.scheduler
        running = sch.running
        if sch.waiting or not running:
            return None
        plan = self._plan
        fresh = plan is None or plan.step != sch.step_count or plan.budget <= 0 or plan.reqs != running
        if fresh:
            plan = self._plan = self._make_plan(running)
            if plan is None:
                return None
        sch.step_count += 1
        self.counters.steps += 1
        self.counters.computed_tokens += len(plan.reqs)
        tokens = [r.token_ids[-1] for r in plan.reqs]
        positions = [r.num_computed for r in plan.reqs]
        if self._decode_rows is None:  # a runner without list entry points: the general batch builder
            logits = self._run([ScheduledChunk(r, r.num_computed, 1) for r in plan.reqs])
        elif fresh or self._decode_again is None:
            logits = self._decode_rows(tokens, positions, plan.tables)
        else:
            logits = self._decode_again(tokens, positions)
        plan.step, plan.budget = sch.step_count, plan.budget - 1
        produced = 0
        for req, row in zip(plan.reqs, logits):  # (_emit may shrink running, never plan.reqs)
            req.num_computed += 1
            if self._prefix_caching and req.num_computed % self.block_size == 0:
                self.kv.commit(req.request_id, req.token_ids, req.num_computed)  # a block just filled
            produced += self._emit(req, row)
        self._cond.notify_all()
        return produced

    def _make_plan(self, running: list[Request]) -> _Plan | None:
        if len(running) > self.scheduler.config.max_num_batched_tokens:
            return None
        bs, refcount, tables, budget = self.block_size, self.pool.refcount, [], 1 << 30
        for r in running:
            t = self.kv.block_table(r.request_id)
            j = r.num_computed // bs
            if r.num_pending != 1:
                return None
            if j == len(t):  # r starts a new block: take it here (as schedule() would), if one is free
                if self.kv.allocate_slots(r.request_id, r.num_computed, 1) != []:
                    return None  # no room (the general path preempts) or a copy to make (it copies)
            elif j > len(t) or refcount(t[j]) != 1:
                return None
            tables.append(t)
            budget = min(budget, (j + 1) * bs - r.num_computed)  # steps until r leaves its verified block
        return _Plan(list(running), tables, budget, self.scheduler.step_count)

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def _copy_block(self, src: int, dst: int) -> None:
        for pool in (*self.runner.key_cache, *self.runner.value_cache):
            pool[dst] = pool[src]
        self.counters.cow_copies += 1

    def _run(self, chunks: list[ScheduledChunk]) -> np.ndarray:
        b, s = len(chunks), max(c.num_new for c in chunks)
        tables = [self.kv.block_table(c.request.request_id) for c in chunks]
        input_ids = np.full((b, s), self.pad_id, dtype=np.int64)
        positions = np.zeros((b, s), dtype=np.int64)
        block_tables = np.zeros((b, max(len(t) for t in tables)), dtype=np.int64)
        for i, (c, t) in enumerate(zip(chunks, tables)):
            input_ids[i, : c.num_new] = c.request.token_ids[c.start : c.start + c.num_new]
            positions[i, : c.num_new] = np.arange(c.start, c.start + c.num_new)
            block_tables[i, : len(t)] = t
        past_lens = np.array([c.start for c in chunks], dtype=np.int64)
        new_lens = np.array([c.num_new for c in chunks], dtype=np.int64)
        self.counters.computed_tokens += int(new_lens.sum())
        return self._runner_step(input_ids, positions, past_lens, new_lens, block_tables)

    def _advance(self, chunk: ScheduledChunk, logits: np.ndarray) -> int:
        req = chunk.request
        req.num_computed = chunk.start + chunk.num_new
        self.kv.commit(req.request_id, req.token_ids, req.num_computed)
        if req.num_computed < len(req.token_ids):
            return 0  # a prefill chunk: nothing to sample yet
        return self._emit(req, logits)

    def _emit(self, req: Request, logits: np.ndarray) -> int:
        """Sample the request's next token from its logits row, check stop conditions, stream it."""
        handle = self._handles[req.request_id]
        p = req.params
        try:
            tok = sample(logits, p, req.token_ids, req.rng, len(req.prompt_ids))
        except LLMRequestError as e:  # (NaN logits) this request fails, the others go on
            handle._fail(str(e), e)
            self._fail(req)
            handle._end()  # so that an on_token stream hears the end too
            return 0
        req.token_ids.append(tok)
        self.counters.generation_tokens += 1
        text, reason = self._check_stop(req, tok)
        if handle.t_first_token is None:
            self.counters.observe_ttft(handle)
        if reason is not None:
            req.status, req.finish_reason = Status.FINISHED, reason
            self.scheduler.remove(req)
            self.counters.requests_finished += 1
            self._forget(req.request_id)
        holdback = max(map(len, p.stop)) - 1 if p.stop else 0
        lp = None if p.logprobs is None else token_logprobs(logits, tok, p.logprobs)  # (opt-in: costs a softmax)
        handle._push(tok, text, holdback, lp)
        if handle.error is not None:  # its on_token callback raised
            self._fail(req)
        return 1

    def _fail(self, req: Request) -> None:
        """Finish a failed request (its handle says why): its blocks are freed, the others go on."""
        if req.finish_reason == "cancelled":  # its callback cancelled it, then raised: cancelled it stays
            return
        if req.finished:  # it finished on this very token, but its callback failed
            self.counters.requests_finished -= 1
        else:
            self.scheduler.remove(req)
            req.status = Status.FINISHED
            self._forget(req.request_id)
        req.finish_reason = "error"
        self.counters.requests_failed += 1

    def _check_stop(self, req: Request, tok: int) -> tuple[str | None, str | None]:
        p = req.params
        reason = None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif (
            len(req.token_ids) - len(req.prompt_ids) >= p.max_tokens
            or len(req.token_ids) >= req.max_total_tokens
        ):
            reason = "length"
        text = self._detokenize(req) if self.tokenizer is not None and p.detokenize else None
        if text is not None and p.stop:
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                text, reason = text[: min(hits)], "stop"
        return text, reason

    def _detokenize(self, req: Request) -> str:
        """The output decoded so far, incrementally (as vLLM and TGI do): decode the tokens since the last
        complete piece together with the piece before them (so leading-space rules see their context) and
        append the difference; a trailing unfinished UTF-8 sequence is shown but not committed. Two decodes
        of a few tokens per step instead of the whole output."""
        text, prefix, read = req.detok
        base = len(req.prompt_ids)
        before = self.tokenizer.decode(req.token_ids[base + prefix : base + read])
        now = self.tokenizer.decode(req.token_ids[base + prefix :])
        if now.endswith("\ufffd"):
            return text + now[len(before) :]
        text += now[len(before) :]
        req.detok = (text, read, len(req.token_ids) - base)
        return text

    # -- waiting / background loop ---------------------------------------------------------------
    def _wait_for(self, handle: RequestHandle) -> None:
        """Return once the handle has a new event or has finished: step the engine, or wait for the loop."""
        # Under the lock: another thread's step may finish this request between a caller's check and here.
        with self._cond:
            if handle._events or handle.finished:
                return
            if self._thread is not None and self._thread.is_alive():
                self._cond.wait(timeout=0.5)
                return
            if not self.scheduler.has_work():
                raise RuntimeError(f"request '{handle.request_id}' is unfinished but the engine has no work")
            self.step()

    def start(self) -> None:
        """Run the step loop in a background thread (handles then wait instead of stepping)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="precast-llm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.scheduler.has_work():
                    self._cond.wait()
                if self._stop:
                    return
            self.step()

    # -- metrics ---------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        with self._cond:
            return self.counters.snapshot(
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_blocks_total=self.pool.num_blocks,
                kv_blocks_used=self.pool.num_used,
                kv_blocks_free=self.pool.num_free,
                block_size=self.block_size,
            )


class _Plan:
    """Steady-state decode rows (see Engine._steady_decode): valid while ``step`` is the scheduler's step
    count, ``reqs`` is still the running list and ``budget`` (steps before a request leaves its block) > 0."""

    __slots__ = ("reqs", "tables", "budget", "step")

    def __init__(self, reqs: list[Request], tables: list[list[int]], budget: int, step: int):
        self.reqs, self.tables, self.budget, self.step = reqs, tables, budget, step


def _group_by_length(chunks: list[ScheduledChunk], max_waste: float = 0.25) -> list[list[ScheduledChunk]]:
    """Split one step into runner calls so right-padding stays small: all decodes together, prefill chunks
    merged while padded tokens stay within max_waste of the real ones."""
    decodes = [c for c in chunks if c.num_new == 1]
    groups: list[list[ScheduledChunk]] = [decodes] if decodes else []
    current: list[ScheduledChunk] = []
    for c in sorted((c for c in chunks if c.num_new > 1), key=lambda c: -c.num_new):
        trial = [*current, c]
        real = sum(x.num_new for x in trial)
        if current and len(trial) * trial[0].num_new > (1 + max_waste) * real:
            groups.append(current)
            trial = [c]
        current = trial
    if current:
        groups.append(current)
    return groups
