"""The LLM engine: schedule -> run the compiled model over the paged KV cache -> sample -> update -> stream.

    engine = Engine.load("out/llm")
    h = engine.submit("Once upon a time", SamplingParams(max_tokens=64, temperature=0.8, seed=1), priority=0)
    for ev in h: print(ev.text, end="")

One step: ``out = scheduler.schedule()`` (what changed since the last step: in the steady state "the same
batch, one token further"), ``runner.execute(out)`` (logits of each row), sample, then
``scheduler.update_from_output(out, sampled)`` (tokens appended, finished requests out, their blocks freed),
then ``output.stream(out, sampled, logits)`` (output_processor.py: text, stop strings, logprobs, each
handle's event). All scheduling policy lives in the scheduler and the KV cache manager; the engine owns the
step loop, sampling, the lock and the metrics. Besides the step, one scheduling path: the batch-1 burst
(_burst; docs/llm-step-contract.md), STEADY steps of one plain request run back to back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import numpy as np

from precast.errors import ArtifactError, LLMRequestError, UsageError, first_line
from precast.runtime.llm.block_pool import BlockPool
from precast.runtime.llm.handle import Completion, RequestHandle, TokenEvent
from precast.runtime.llm.kv_cache_manager import KVCacheManager
from precast.runtime.llm.metrics import EngineCounters, EngineMetrics
from precast.runtime.llm.output_processor import OutputProcessor
from precast.runtime.llm.prompt import prompt_ids, prompt_list
from precast.runtime.llm.request import Request, Status, check_request_args
from precast.runtime.llm.sampler import SamplingParams, is_int, sample
from precast.runtime.llm.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepKind,
    checked_config,
    drop_drafts,
)
from precast.runtime.llm.speculative import (
    DraftProposer,
    NgramProposer,
    SpecGovernor,
    SpecState,
    SpeculativeConfig,
    verify,
)
from precast.runtime.llm.structured import FAILED as GRAMMAR_FAILED
from precast.runtime.llm.structured import Grammars, allows, mask_bias

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
        temp_dir: Path | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_runner=None,
        clock: Callable[[], float] | None = None,
    ):
        spec = runner.spec
        self.runner = runner  # a runner.StepRunner: execute(SchedulerOutput) -> logits
        self.tokenizer = tokenizer
        self.block_size = int(spec.block_size)
        self.max_context = int(spec.max_context)
        self.vocab = int(spec.vocab)
        num_blocks = int(runner.num_blocks)
        self.pool = BlockPool(num_blocks, self.block_size)
        # a hybrid or state-space model: a recurrent state slot per request, and no prefix caching (a slot
        # holds the state after all of a request's tokens; runners/recurrent.py)
        slots = int(getattr(runner, "num_state_slots", 0))
        self.prefix_caching = bool(enable_prefix_caching) and not slots
        self.kv = KVCacheManager(self.pool, self.prefix_caching, state_slots=slots)
        self.scheduler = Scheduler(self.kv, config, eos_ids=spec.eos_ids or ())
        self.counters = EngineCounters()
        self.output = OutputProcessor(tokenizer, self.counters, self.scheduler.finish)
        self.grammars = Grammars(tokenizer, self.vocab, spec.eos_ids or ())  # structured outputs
        self._mask_pool: ThreadPoolExecutor | None = None  # computes grammar masks while the backend runs
        # Whether grammar masks overlap the backend's step (a core to spare: Engine.load decides); else serial
        self.grammar_thread = False
        self.target: str | None = None  # the target it runs (Engine.load: a multi-target index's pick)
        self._handles = self.output.handles  # unfinished requests (the output processor's registry)
        self._ids = itertools.count()
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._stop = False
        self._cleanup: weakref.finalize | None = None  # removes the temp dir a packed artifact went into
        if temp_dir is not None:  # (Engine.load's: the HAL unpacked a packed artifact there)
            from precast.artifact.archive import remove_temp

            self._cleanup = weakref.finalize(self, remove_temp, temp_dir)
        self._plain: SchedulerOutput | None = None  # the steady output whose rows are all plain (_all_plain)
        # Other threads about to take the lock, or waiting on it for a token (deque append/pop are atomic):
        # a burst stops at once when one knocks, so a submit, cancel or reader waits one step as before.
        self._knocks: deque = deque()
        # Speculative decoding (runtime/llm/speculative.py): the proposer, or None
        self.speculative: SpeculativeConfig | None = None
        self._proposer = None
        self._spec_max_batch = 0
        self._drafting: list[Request] = []  # the requests this step proposed drafts for
        self._draft_cleanup: weakref.finalize | None = None  # removes a packed draft's unpacked copy
        # measures whether speculating pays (speculative.SpecGovernor); the clock is injectable (tests)
        self._governor = SpecGovernor(clock or time.perf_counter)
        self._decoding = 0  # requests decoding at this step's proposal (the governor's batch size)
        self._unmeasured = False  # this step's draft read a prompt (a prefill): the governor skips it
        if speculative is not None:
            self._start_speculation(speculative, draft_runner)

    def _start_speculation(self, config: SpeculativeConfig, draft_runner) -> None:
        config = config.validate()
        for role, r in (("target", self.runner), ("draft", draft_runner)):
            if r is not None and getattr(r, "num_state_slots", 0):
                raise UsageError(
                    f"speculative decoding: the {role} {r.spec.model_type or 'model'!r} has recurrent-state "
                    "layers (a rejected draft token cannot be taken back out of a recurrent state); serve it "
                    "without speculation"
                )
        if not self.runner.multi_logits:
            raise UsageError(
                "speculative decoding needs a step graph that returns several logits rows per request; this "
                "target's does not: an artifact compiled before precast had speculative decoding (recompile "
                "it), GPT-2's paged graph, or pipeline stages (these cannot be speculative targets; any of them "
                "can be a draft)"
            )
        if config.method == "draft":
            if draft_runner is None:
                raise UsageError(
                    "speculative method 'draft' needs the draft's runner (Engine.load(draft=...))"
                )
            self._proposer = DraftProposer(draft_runner, self.vocab)
        else:
            self._proposer = NgramProposer(config)
        self.speculative = config
        # Verification rows of the mapped layout run one request at a time: beyond one decoding request a
        # step of them reads the weights once per request, so speculation stops there by default.
        default = 1 if getattr(self.runner.spec, "kv_layout", "") == "mapped" else 4
        self._spec_max_batch = default if config.max_batch is None else int(config.max_batch)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        num_blocks: int | None = None,
        *,
        config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = True,
        prefer: str | None = None,
        pubkey: str | os.PathLike | None = None,
        expect_name: str | None = None,
        min_version: str | None = None,
        now: datetime | None = None,
        concurrency: int | None = None,
        speculative: SpeculativeConfig | None = None,
        **runner_kwargs,
    ) -> Engine:
        """Open a causal-lm artifact (a directory, or a file packed by ``precast pack``, as
        precast.runtime.load takes it, signature policy included: ``pubkey``, ``expect_name``,
        ``min_version``, ``now``): its step runner (K/V pools of num_blocks blocks) and tokenizer.
        ``runner_kwargs``: open_runner.RunnerOptions' ``threads``, ``verify``, ``spinning`` and a staged
        artifact's ``micro_batches`` (its ``threads`` is per stage, default 1). A packed artifact is unpacked
        into a temp dir the engine owns: ``close()`` removes it (else garbage collection or exit). A
        multi-target index (a causal LM compiled for ort-cpu and openvino) opens its first target this host
        can run in the index's order, which the compile measured (the faster first); ``prefer`` names one
        to put first (runtime/hal.py, as load's). ``concurrency``: the requests it will run at once (default:
        ``config.max_num_seqs`` when a config is given, else unknown): an index's targets are then ranked by the
        rate each recorded at the compile nearest that load (1, 8, 32 requests), not by its overall order
        (a speculating engine alone also by the rate of its 8-token verify rows: hal.rate_at).
        ``speculative``: speculative decoding (speculative.SpeculativeConfig: a draft artifact with the same
        tokenizer, or prompt lookup), for requests that are not grammar-constrained."""
        from precast.runtime.hal import resolve
        from precast.runtime.llm.runners.factory import RunnerOptions

        if num_blocks is not None and (not is_int(num_blocks) or num_blocks < 1):
            raise UsageError(f"num_blocks must be a positive integer (or None), got {num_blocks!r}")
        checked_config(config)  # before a model is loaded for nothing
        options = RunnerOptions.from_kwargs(runner_kwargs, "Engine.load")
        if concurrency is not None and (not is_int(concurrency) or concurrency < 1):
            raise UsageError(f"concurrency must be a positive integer (or None), got {concurrency!r}")
        if concurrency is None and config is not None:
            concurrency = config.max_num_seqs
        if options.state_slots is None:  # (a recurrent model's slots: one per request the scheduler runs)
            slots = (config or SchedulerConfig()).max_num_seqs
            options = dataclasses.replace(options, state_slots=slots)

        def open_target(root: Path, manifest) -> tuple:
            return _open_llm_target(root, manifest, num_blocks, options, where=path)

        found = resolve(
            path,
            open_target,
            prefer=prefer,
            pubkey=pubkey,
            expect_name=expect_name,
            min_version=min_version,
            now=now,
            verify=options.verify,
            concurrency=concurrency,
            speculative=speculative is not None,
        )
        runner, tokenizer = found.opened
        draft = draft_temp = None
        try:
            if speculative is not None:
                if not isinstance(speculative, SpeculativeConfig):
                    raise UsageError(
                        f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}"
                    )
                speculative.validate()
                if speculative.method == "draft":  # (under the target's signature key, when one is given)
                    draft, draft_temp = _open_draft(
                        speculative.draft, runner, tokenizer, num_blocks, options, concurrency, pubkey, now
                    )
            engine = cls(
                runner,
                tokenizer,
                config=config,
                enable_prefix_caching=enable_prefix_caching,
                temp_dir=found.temp,
                speculative=speculative,
                draft_runner=draft,
            )
            engine.grammar_thread = _spare_core(options.threads)
            engine.target = found.manifest.target.name
            if draft_temp is not None:  # (a packed draft's unpacked copy goes with the engine)
                from precast.artifact.archive import remove_temp

                engine._draft_cleanup = weakref.finalize(engine, remove_temp, draft_temp)
            return engine
        except BaseException:
            if draft is not None:
                draft.close()
            if draft_temp is not None:
                from precast.artifact.archive import remove_temp

                remove_temp(draft_temp)
            if found.temp is not None:
                from precast.artifact.archive import remove_temp

                remove_temp(found.temp)
            raise

    def close(self) -> None:
        """Stop the step loop (and a staged runner's stage workers) and remove the temp dir a packed
        artifact was unpacked into. Idempotent."""
        self.stop()
        self.runner.shutdown()  # (a runner that owns threads joins them; its pools stay)
        if self._proposer is not None:
            self._proposer.close()
        if self._draft_cleanup is not None:
            self._draft_cleanup()
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=True)
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
        matcher = self._rejecting(self._matcher, params)
        with self._knocking():
            self._rejecting(self._check_id_free, request_id)
            return self._enqueue(ids, params, priority, request_id, on_token, matcher)

    def _matcher(self, params: SamplingParams):
        """The request's grammar matcher (compiled, or a copy of the cached one), outside the lock: a large
        schema compiles in the submitting thread, never in the step loop. None without a constraint."""
        return None if params.constraint is None else self.grammars.matcher(params.constraint)

    def _checked(self, prompt, params, priority, request_id, on_token) -> list[int]:
        """Outside the lock (pure checks of the request): tokenizing a long prompt, or checking a long list
        of ids or stop strings, must not stall the step loop that serves the other requests."""
        return self._rejecting(self._validate, prompt, params, priority, request_id, on_token)

    def _rejecting(self, check, *args):
        try:
            return check(*args)
        except LLMRequestError:
            with self._knocking():
                self.counters.requests_rejected += 1
            raise

    def _check_id_free(self, request_id) -> None:
        if request_id is not None and request_id in self._handles and not self._handles[request_id].finished:
            raise LLMRequestError(f"request id '{request_id}' is already in use")

    def _enqueue(self, ids, params, priority, request_id, on_token, matcher=None) -> RequestHandle:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        cap = min(self.max_context, self.pool.num_blocks * self.block_size)
        req = Request(rid, ids, params, priority=int(priority), max_total_tokens=cap, matcher=matcher)
        cfg = self.speculative
        if cfg is not None and matcher is None:  # (a constrained request never speculates)
            req.spec = SpecState(k=cfg.num_tokens, k_max=cfg.num_tokens, adaptive=cfg.adaptive)
        handle = RequestHandle(req, on_token, wait=self.wait_for)
        self.output.add(handle)
        self.scheduler.add(req)
        self.counters.requests_submitted += 1
        self.counters.prompt_tokens += len(ids)
        self._cond.notify_all()
        return handle

    def _validate(self, prompt: Prompt, params, priority, request_id, on_token) -> list[int]:
        check_request_args(params, priority, request_id, on_token, has_tokenizer=self.tokenizer is not None)
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
        with self._knocking():
            handle = self._handles.get(request_id)
            if handle is None or handle.finished:
                if self.output.recently_finished(request_id) or handle is not None:
                    return False
                raise LLMRequestError(f"unknown request id '{request_id}'")
            self.scheduler.finish(handle.request, "cancelled")
            handle.cancelled = True
            self.output.forget(request_id)
            self.counters.requests_cancelled += 1
            self._cond.notify_all()
            return True

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, priority: int = 0
    ) -> list[Completion]:
        """Submit all prompts, run until they finish, return their completions in order.
        One bad prompt rejects the whole call: all are checked before any is queued."""
        params = SamplingParams() if params is None else params
        checked = [self._checked(p, params, priority, None, None) for p in prompt_list(prompts)]
        matchers = [self._rejecting(self._matcher, params) for _ in checked]
        with self._knocking():
            handles = [
                self._enqueue(ids, params, priority, None, None, m) for ids, m in zip(checked, matchers)
            ]
        return [h.result() for h in handles]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def is_running(self) -> bool:
        """Whether the background step loop (start()) is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -- the step loop -------------------------------------------------------------------------
    def step(self) -> int:
        """One scheduler step: schedule -> run -> sample -> update -> stream. Returns the tokens sampled."""
        return self._step(burst=False)

    def _step(self, burst: bool) -> int:
        """step(); with ``burst``, a batch-1 steady decode of a plain request goes on to its block's end
        (_burst) unless another thread knocks. (The loops call this; step() stays one step for callers
        that interleave their own work.)"""
        with self._cond:
            t0 = self._governor.clock() if self._proposer is not None else 0.0
            drafting = self._proposer is not None and self._propose()
            out = self.scheduler.schedule()
            c = self.counters
            c.steps += 1
            c.computed_tokens += out.total_tokens
            if out.kind is not StepKind.STEADY:  # (a steady step has no copies, preemptions or admissions)
                self._count(out)
            produced = 0
            if drafting:
                rows = [1 + r.num_draft for r in out.rows]
                out.logit_rows = rows if any(q > 1 for q in rows) else None
            if out.rows:
                masks = None if out is self._plain else self._start_masks(out)
                logits = self.runner.execute(out)
                if out.logit_rows is not None:
                    produced = self._verified(out, logits, masks)
                elif out.kind is StepKind.STEADY and (out is self._plain or self._all_plain(out)):
                    produced = self._steady_tail(out, logits)
                    if (
                        burst
                        and not self._knocks
                        and self.scheduler.burst_steps(out) > 0
                        and self._may_burst()
                    ):
                        produced += self._burst(out.rows[0])
                else:
                    sampled = self._sample(out, logits, masks)
                    self.scheduler.update_from_output(out, sampled)
                    if masks is not None:
                        self._advance_grammars(out, sampled)
                    produced = self.output.stream(out, sampled, logits)
            if self._proposer is not None:
                self._after_drafts(out)
                rows = out.logit_rows or [1] * len(out.num_new)
                if out.rows and out.num_new == rows and not self._unmeasured:  # (a pure decode step)
                    seconds = self._governor.clock() - t0
                    self._governor.observe(out.logit_rows is not None, self._decoding, seconds, produced)
            self._cond.notify_all()
            return produced

    # -- the steady decode of plain requests -------------------------------------------------------
    # A STEADY step's rows all decode one token (the same rows as the step before). When every row is
    # "plain" (greedy without penalties, no text to detokenize, no stop strings, no logprobs) the general
    # sample -> stream path is a per-row dispatch whose every branch is known already: on a small model's
    # ~0.4 ms decode step it cost ~15 us (3-4%, benchmarks/README.md). The decision is made once per
    # steady output object (the scheduler returns the same one until the run ends); the tail below does
    # what _sample and output.stream do for such rows, nothing else.
    def _all_plain(self, out: SchedulerOutput) -> bool:
        if not all(map(self.output.is_plain, out.rows)):
            return False
        self._plain = out
        return True

    def _steady_tail(self, out: SchedulerOutput, logits: np.ndarray) -> int:
        rows = out.rows
        if len(rows) == 1:
            sampled = [int(logits[0].argmax())]
        else:
            sampled = logits[: len(rows)].argmax(axis=1).tolist()
        self.scheduler.update_from_output(out, sampled)
        return self.output.stream_plain(rows, sampled)

    def _burst(self, req: Request) -> int:
        """The batch-1 burst, the step contract's third path (docs/llm-step-contract.md): the steady decode
        of one plain request (greedy, no text, stop strings or logprobs), token after token to the end of
        its block, without the step loop around each: no schedule(), no lock round trip or notify, no
        dispatch on the step's kind. On a small model's ~0.5 ms step that loop is most of the per-step cost
        outside the kernels (benchmarks/README.md). The scheduler allows it (burst_steps), the runner runs
        it (its single-row decoder; a runner without one never bursts). Each token goes through the same
        code those steps would: the scheduler's steady_step (update_from_output's per-row advance), then the
        output processor's plain_token (_steady_tail's counters and event). It stops at the block's end (the
        next step allocates), when the request finishes, fails or is cancelled from a callback, when a
        request waits, and as soon as another thread knocks. Returns the tokens produced."""
        handle = self._handles.get(req.request_id)
        sched = self.scheduler
        if handle is None or handle.error is not None or sched.steady_steps_left() <= 0:
            return 0
        run_one = self.runner.single_decoder()  # (None: this runner has no batch-1 burst)
        if run_one is None:
            return 0
        c, tokens, knocks, plain_token = self.counters, req.token_ids, self._knocks, self.output.plain_token
        produced = 0
        # (steady_steps_left() turns 0 at the block's end, when the run ends, or when a request waits: one
        # submitted by this request's own callback is scheduled at the next step)
        while not knocks and sched.steady_steps_left() > 0 and req.status is Status.RUNNING:
            tok = int(run_one(tokens[-1], req.num_computed).argmax())
            c.steps += 1
            c.computed_tokens += 1
            sched.steady_step(req, tok)
            produced += 1
            plain_token(handle, req, tok)
            if handle.error is not None:
                break
        return produced

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self._step(burst=True)

    def _count(self, out: SchedulerOutput) -> None:
        c = self.counters
        c.preemptions += len(out.preempted)
        c.cow_copies += len(out.copies)
        c.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        c.prefix_query_tokens = self.scheduler.prefix_query_tokens

    def _sample(
        self, out: SchedulerOutput, logits: np.ndarray, masks=None, skip: frozenset = frozenset()
    ) -> list[int | None]:
        """The next token of each row that reached the end of its known tokens (None: a prefill chunk, or a
        request whose logits cannot be sampled: it fails alone, the others go on). ``masks``: the constrained
        rows' grammar masks, from _start_masks. Rows in ``skip`` (verified rows: _verified) are None."""
        sampled: list[int | None] = []
        masked = None if masks is None else self._masked_rows(out, logits, masks.result())
        for i, (req, n, row) in enumerate(zip(out.rows, out.num_new, logits)):
            if i in skip or req.num_computed + n < len(req.token_ids):
                sampled.append(None)  # a prefill chunk: nothing to sample yet
                continue
            if req.argmax:  # (the common case, without the sampler's dispatch)
                sampled.append(int(row.argmax()))
                continue
            if req.matcher is not None:
                row = "no grammar mask" if masked is None else masked.get(i, "no grammar mask")
                if isinstance(row, str):  # why its grammar failed
                    self.output.fail_unsampled(req, LLMRequestError(f"{GRAMMAR_FAILED}: {row}"))
                    sampled.append(None)
                    continue
            try:
                sampled.append(sample(row, req.params, req.token_ids, req.rng, len(req.prompt_ids)))
            except LLMRequestError as e:  # (NaN logits)
                sampled.append(None)
                self.output.fail_unsampled(req, e)
        return sampled

    # -- speculative decoding (runtime/llm/speculative.py) ---------------------------------------------
    def _propose(self) -> bool:
        """Before schedule(): append draft tokens to each decoding request that speculates this step
        (req.num_draft of them). True when any did (the step's rows then return 1 + k logits rows)."""
        sched = self.scheduler
        decoding = [r for r in sched.running if r.num_pending == 1]
        self._decoding, self._unmeasured = len(decoding), False
        # (a request cancelled or finished elsewhere)
        self._proposer.sweep({r.request_id for r in (*sched.running, *sched.waiting)})
        if not decoding or len(decoding) > self._spec_max_batch:
            return False
        if self.speculative.adaptive and not self._governor.speculate(len(decoding)):
            return False  # (measured: plain steps produce tokens faster at this batch size)
        reqs, ks = [], []
        for r in decoding:
            st = r.spec
            if st is None:
                continue
            k = min(st.wanted(len(r.token_ids)), r.end_len - len(r.token_ids) - 1)
            if k > 0:
                reqs.append(r)
                ks.append(k)
        if not reqs:
            return False
        # (a draft that first reads a request's prompt runs a prefill: no step to judge speculation by)
        self._unmeasured = self._proposer.reads_prompt(reqs, ks)
        proposals = self._proposer.propose(reqs, ks)
        any_drafts = False
        for r, d in zip(reqs, proposals):
            if not d:
                r.spec.nothing()  # (prompt lookup found no match: a miss)
            else:
                self._drafting.append(r)
                r.token_ids.extend(d)
                r.num_draft = len(d)
                any_drafts = True
        if any_drafts:
            sched.end_run()  # (the rows are no longer the last decode's, one token further)
        return any_drafts

    def _verified(self, out: SchedulerOutput, logits: np.ndarray, masks) -> int:
        """A step with verification rows (out.logit_rows): each row's drafts checked against its logits
        (speculative.verify: greedy exact, sampling by rejection), the kept tokens advanced and streamed one
        by one as decode steps would (stop ids, length and stop strings end a request mid-row)."""
        starts = np.cumsum([0, *out.logit_rows]).tolist()
        last = logits[np.array(starts[1:]) - 1]  # each row's last token's logits: the others' [B, V]
        spec_rows = [i for i, r in enumerate(out.rows) if r.num_draft]
        sampled = self._sample(out, last, masks, frozenset(spec_rows))
        c, sched = self.counters, self.scheduler
        # the other rows, as a step without speculation would: advance, grammars, stream
        for req, n, tok in zip(out.rows, out.num_new, sampled):
            if not req.num_draft:
                sched.advance_token(req, n, tok)
        if masks is not None:
            self._advance_grammars(out, sampled)
        produced = self.output.stream(out, sampled, last)
        for i in spec_rows:
            req = out.rows[i]
            k = req.num_draft
            drafts = req.token_ids[-k:]
            drop_drafts(req)
            if req.status is not Status.RUNNING:  # (an earlier row's callback cancelled it)
                continue
            rows = logits[starts[i] : starts[i + 1]]
            q = self._proposer.probs.get(req.request_id)  # (None: prompt lookup's deterministic drafts)
            tokens = verify(req, drafts, rows, q, self.vocab)
            kept = len(tokens) - 1
            c.spec_proposed_tokens += k
            c.spec_accepted_tokens += kept
            c.observe_acceptance(kept)
            req.spec.update(k, kept)
            handle = self._handles.get(req.request_id)
            for j, tok in enumerate(tokens):  # (the row's token j came from its logits row j)
                if req.status is not Status.RUNNING:  # (EOS, a stop id or string, the length, a callback)
                    break
                sched.advance_token(req, 1, tok)
                if handle is not None:
                    self.output.emit(handle, req, tok, rows, j)
                    produced += 1
        sched.end_speculative_step(out)
        return produced

    def _may_burst(self) -> bool:
        """A burst skips the steps where a request would speculate: only when none would (no speculation,
        every running request's is off for now, or it does not pay at this batch size)."""
        if self._proposer is None:
            return True
        if self.speculative.adaptive and self._governor.plain_wins(1):
            return True  # (plain is faster at batch 1: the burst is the plain step at its best)
        return all(r.spec is None or r.spec.off > 0 for r in self.scheduler.running)

    def _after_drafts(self, out: SchedulerOutput) -> None:
        """The proposer learns what each proposal kept (a dropped one: nothing); finished requests' draft
        state is released."""
        proposer = self._proposer
        for req in self._drafting:
            drop_drafts(req)  # (a request the step did not schedule still holds its drafts)
            if req.finished:
                proposer.drop(req)
            else:
                proposer.accepted(req)
        self._drafting.clear()
        for req in out.rows:
            if req.finished and req.spec is not None:
                proposer.drop(req)
        if not self.scheduler.has_work():
            proposer.sweep(set())  # (requests finished in a burst or cancelled between steps)

    # -- structured outputs (runtime/llm/structured.py) ------------------------------------------------
    def _start_masks(self, out: SchedulerOutput):
        """The grammar masks of the rows that sample this step: something whose ``result()`` is
        (rows, mask, why) (structured.Grammars.masks), or None when no row is constrained.
        With ``grammar_thread`` they are computed on a worker thread while the backend runs the step
        (llguidance releases the GIL); else after it, in the step loop. Overlap can pay only where the backend
        leaves a core free: on a 2-core host with 2 ONNX Runtime threads, on and off measured within each
        other's spread (benchmarks/README.md, bench_structured.py)."""
        rows = [
            i
            for i, (req, n) in enumerate(zip(out.rows, out.num_new))
            if req.matcher is not None and req.num_computed + n >= len(req.token_ids)
        ]
        if not rows:
            return None
        matchers = [out.rows[i].matcher for i in rows]
        if not self.grammar_thread:
            return _Later(lambda: (rows, *self.grammars.masks(matchers)))
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="precast-grammar")
        return self._mask_pool.submit(lambda: (rows, *self.grammars.masks(matchers)))

    def _masked_rows(self, out: SchedulerOutput, logits: np.ndarray, masks) -> dict:
        """row -> logits whose draw obeys the grammar, or why the row's grammar failed (a str: it fails alone).
        A greedy row (no penalties) whose own argmax the grammar allows keeps its logits (most steps inside a
        string); the others get the grammar's -inf bias, in one vectorized add."""
        rows, mask, why = masks
        masked: dict = {}
        biased = []
        for j, i in enumerate(rows):
            if why[j] is not None:
                masked[i] = why[j]
                continue
            p = out.rows[i].params
            if p.greedy and p.plain and allows(mask[j], int(logits[i].argmax())):
                masked[i] = logits[i]
            else:
                biased.append(j)
        if biased:
            vocab = self.grammars.vocab
            added = logits[[rows[j] for j in biased], :vocab] + mask_bias(mask[biased], vocab)
            for k, j in enumerate(biased):
                masked[rows[j]] = added[k]
        return masked

    def _advance_grammars(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        """Feed each constrained row's token to its matcher; a grammar that is complete ends the request
        ("stop": nothing else can follow, so the model is not asked for its end-of-sequence token)."""
        for req, tok in zip(out.rows, sampled):
            m = req.matcher
            if m is None or tok is None or req.finish_reason in ("cancelled", "error"):
                continue
            if not m.consume_token(tok):
                if not req.finished:
                    self.output.fail_unsampled(
                        req, LLMRequestError(f"{GRAMMAR_FAILED}: {first_line(m.get_error())}")
                    )
            elif m.is_stopped() and req.finish_reason != "stop":
                self.scheduler.finish(req, "stop")

    # -- waiting / background loop ---------------------------------------------------------------
    def wait_for(self, handle: RequestHandle) -> None:
        """Return once the handle has a new event or has finished: step the engine, or wait for the loop.
        (Each handle's iteration and result() call it: the engine gives it to the handle as ``wait``.)"""
        # Under the lock: another thread's step may finish this request between a caller's check and here.
        with self._knocking():
            if handle.has_events or handle.finished:
                return
            if self._thread is not None and self._thread.is_alive():
                # (a waiting reader knocks: the loop's steps stay single, each one notifies)
                self._knocks.append(None)
                try:
                    self._cond.wait(timeout=0.5)
                finally:
                    self._knocks.pop()
                return
            if not self.scheduler.has_work():
                raise RuntimeError(f"request '{handle.request_id}' is unfinished but the engine has no work")
            self._step(burst=True)

    def start(self) -> None:
        """Run the step loop in a background thread (handles then wait instead of stepping)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="precast-llm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._knocking():
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
            self._step(burst=True)

    @contextlib.contextmanager
    def _knocking(self):
        """The engine's lock, taken by a caller thread: knocking first stops a running burst."""
        self._knocks.append(None)
        try:
            self._cond.acquire()
        finally:
            self._knocks.pop()
        try:
            yield
        finally:
            self._cond.release()

    # -- metrics ---------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        with self._knocking():
            return self.counters.snapshot(
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_blocks_total=self.pool.num_blocks,
                kv_blocks_used=self.pool.num_used,
                kv_blocks_free=self.pool.num_free,
                kv_blocks_touched=self.pool.num_touched,
                kv_bytes_reserved=int(self.runner.kv_bytes),
                kv_bytes_resident=int(self.runner.kv_resident_bytes),
                block_size=self.block_size,
            )


class _Later:
    """A future's ``result()`` for work done when asked (the serial grammar masks)."""

    def __init__(self, work: Callable[[], object]):
        self.result = work


def _spare_core(threads: int | None) -> bool:
    """Whether the backend's intra-op threads (None: ONNX Runtime's default, one per core) leave a CPU of this
    process free for the grammar thread."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return threads is not None and threads < cpus


def llm_index_target(
    root: Path, prefer: str | None = None, concurrency: int | None = None, speculative: bool = False
) -> Path | None:
    """For a multi-target index of a causal LM: the sub-artifact Engine.load opens (else None), for
    ``concurrency`` requests at once when given, speculating or not (runtime/hal.py)."""
    from precast.artifact.manifest import read_manifest
    from precast.runtime.hal import resolve

    manifest = read_manifest(root)
    if not manifest.is_multi_target or not manifest.target_dirs():
        return None
    first = next(iter(manifest.target_dirs().values()))
    if read_manifest(root / first).llm is None:
        return None
    return resolve(
        root,
        lambda sub, m: _check_available(sub, m.target),
        prefer=prefer,
        verify=False,
        concurrency=concurrency,
        speculative=speculative,
    ).root


def _open_llm_target(root: Path, manifest, num_blocks: int | None, options, where) -> tuple:
    """Engine.load's opener of one target the HAL offers (runtime/hal.py): its backend present on this
    host (else TargetUnavailableError: the HAL tries the next), then its step runner and its tokenizer."""
    from precast.runtime.llm.runners.factory import open_runner
    from precast.runtime.llm.tokenizer import TextTokenizer

    if manifest.llm is None:  # (before the backend's question: this is no engine's artifact on any host)
        raise ArtifactError(f"{where}: not a causal-lm artifact (manifest has no 'llm' block)")
    _check_available(root, manifest.target)
    runner = open_runner(root, manifest, num_blocks, options, where=where)
    llm = manifest.llm
    tok_file = llm.tokenizer
    tokenizer = TextTokenizer.from_file(root / tok_file) if tok_file and (root / tok_file).is_file() else None
    # (a tokenizer id past the vocab would index past the logits, and past the embedding)
    if tokenizer is not None and tokenizer.vocab_size > llm.vocab:
        raise ArtifactError(
            f"{root}/manifest.json: llm block: vocab={llm.vocab} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens ({tok_file})"
        )
    return runner, tokenizer


def _open_draft(path, runner, tokenizer, num_blocks, options, concurrency, pubkey=None, now=None):
    """(runner, temp dir or None) of the draft artifact for speculative decoding: a causal LM with the
    target's tokenizer (the same vocabulary, token for token) and no larger vocabulary, opened under the same
    signature key as the target (``pubkey``: a signed pack, as the target must be), else an error naming the
    draft."""
    from precast.errors import PrecastError
    from precast.runtime.hal import resolve
    from precast.runtime.llm.tokenizer import TextTokenizer

    # One intra-op thread, no spinning: a draft's step is a fraction of a millisecond, which a thread pool's
    # wake-ups would dominate, and spinning threads of its own would compete with the target's for the cores.
    draft_options = dataclasses.replace(options, threads=1, spinning=False)

    def open_target(root: Path, manifest) -> tuple:
        return _open_llm_target(root, manifest, num_blocks, draft_options, where=path)

    try:
        found = resolve(
            path, open_target, pubkey=pubkey, now=now, verify=options.verify, concurrency=concurrency
        )
    except PrecastError as e:  # (say which of the two artifacts is at fault)
        try:
            named = type(e)(f"draft: {first_line(str(e))}")
        except TypeError:  # (an error class with more to it than a message)
            raise e from None
        raise named from e
    draft, draft_tok = found.opened
    try:
        if tokenizer is None or draft_tok is None:
            raise UsageError(
                f"draft {path}: the target and the draft must both ship a tokenizer to be compared"
            )
        if not isinstance(tokenizer, TextTokenizer) or tokenizer.vocab() != draft_tok.vocab():
            raise UsageError(
                f"draft {path}: its tokenizer differs from the target's (speculative decoding needs the same "
                "vocabulary, token for token)"
            )
        if draft.spec.vocab > runner.spec.vocab:
            raise UsageError(
                f"draft {path}: its vocab ({draft.spec.vocab}) is larger than the target's ({runner.spec.vocab})"
            )
    except BaseException:
        draft.close()
        if found.temp is not None:
            from precast.artifact.archive import remove_temp

            remove_temp(found.temp)
        raise
    return draft, found.temp


def _check_available(root: Path, block) -> None:
    """TargetUnavailableError when this host lacks the block's backend (checked before a model loads)."""
    from precast.errors import TargetUnavailableError

    why = _unavailable(block)
    if why is not None:  # (worded as the backend's own session factory words it)
        raise TargetUnavailableError(f"artifact {root}: {why}")


def _unavailable(block) -> str | None:
    """Why this host cannot run the target block's backend (None: it can), without loading the model."""
    import importlib.util

    if block.backend == "openvino":
        from precast.runtime.backends.openvino import openvino_available

        ok, why = openvino_available(block.device or "CPU")
        return None if ok else why
    if block.backend == "onnxruntime" and importlib.util.find_spec("onnxruntime") is None:
        return "python package 'onnxruntime' is not installed"
    return None
