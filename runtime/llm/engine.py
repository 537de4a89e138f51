"""The LLM engine: schedule -> run the compiled model over the paged KV cache -> sample -> update -> stream.

    engine = Engine.load("out/llm")
    h = engine.submit("Once upon a time", SamplingParams(max_tokens=64, temperature=0.8, seed=1), priority=0)
    for ev in h: print(ev.text, end="")

One step: ``out = scheduler.schedule()`` (what changed since the last step: in the steady state "the same
batch, one token further"), ``runner.execute(out)`` (logits of each row), sample, then
``scheduler.update_from_output(out, sampled)`` (tokens appended, finished requests out, their blocks freed),
then each token is streamed to its handle. All scheduling policy lives in the scheduler and the KV cache
manager; the engine owns requests' handles, sampling, text and stop strings, and the metrics.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import threading
import weakref
from collections import OrderedDict, deque
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
from precast.runtime.llm.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepKind,
    checked_config,
)

__all__ = ["Engine"]

Prompt = str | Sequence[int]


_MAX_UNCOMMITTED = 16  # tokens of a trailing unfinished character held back before they are committed anyway


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
        self.runner = runner  # a runner.StepRunner: execute(SchedulerOutput) -> logits
        self.tokenizer = tokenizer
        self.block_size = int(spec.block_size)
        self.max_context = int(spec.max_context)
        self.vocab = int(spec.vocab)
        num_blocks = int(runner.key_cache[0].shape[0])
        self.pool = BlockPool(num_blocks, self.block_size)
        self.kv = KVCacheManager(self.pool, bool(enable_prefix_caching))
        self.scheduler = Scheduler(self.kv, config, eos_ids=spec.eos_ids or ())
        self.counters = EngineCounters()
        self._handles: dict[str, RequestHandle] = {}  # unfinished requests (a finished one is the caller's)
        self._finished_ids: OrderedDict[str, None] = OrderedDict()  # recent finished ids (cancel -> False)
        self._ids = itertools.count()
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._stop = False
        self._cleanup: weakref.finalize | None = None  # removes the temp dir load() unpacked into
        self._plain: SchedulerOutput | None = None  # the steady output whose rows are all plain (_all_plain)
        # Other threads about to take the lock, or waiting on it for a token (deque append/pop are atomic):
        # a burst stops at once when one knocks, so a submit, cancel or reader waits one step as before.
        self._knocks: deque = deque()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        num_blocks: int | None = None,
        *,
        config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = True,
        prefer: str | None = None,
        **runner_kwargs,
    ) -> Engine:
        """Open a causal-lm artifact (a directory, or a file packed by ``precast pack``, as
        precast.runtime.load takes it): its model runner (K/V pools of num_blocks blocks) and tokenizer.
        ``runner_kwargs``: ModelRunner.from_artifact's ``threads`` and ``verify`` (a staged artifact's
        StagedRunner also takes ``micro_batches``; its ``threads`` is per stage, default 1). A packed
        artifact is unpacked into a temp dir the engine owns: ``close()`` removes it (else garbage
        collection or exit). A multi-target index (a causal LM compiled for ort-cpu and openvino) opens its
        first target this host can run in the index's order, which the compile measured (the faster first);
        ``prefer`` names one to put first."""
        from precast.runtime.llm.model_runner import ModelRunner
        from precast.runtime.llm.tokenizer import TextTokenizer
        from precast.runtime.manifest import read_manifest

        if num_blocks is not None and (not is_int(num_blocks) or num_blocks < 1):
            raise UsageError(f"num_blocks must be a positive integer (or None), got {num_blocks!r}")
        checked_config(config)  # before a model is loaded for nothing
        known = sorted(
            {*inspect.signature(ModelRunner.from_artifact).parameters, "micro_batches"}
            - {"path", "num_blocks"}
        )
        unknown = sorted(set(runner_kwargs) - set(known))
        if unknown:
            raise UsageError(f"Engine.load got an unknown option '{unknown[0]}' (known: {', '.join(known)})")
        root = where = Path(path)
        unpacked = None
        if root.is_file():  # a packed artifact: unpacked (every checksum checked) into a private temp dir
            from precast.runtime.archive import remove_temp, unpack_to_temp

            root = unpacked = unpack_to_temp(root)
        try:
            root = _pick_target(root, prefer)  # an index's sub-artifact (else root itself)
            manifest = read_manifest(root)
            llm = manifest.llm
            if llm is None:
                raise ArtifactError(f"{where}: not a causal-lm artifact (manifest has no 'llm' block)")
            if manifest.stages is not None:  # one worker per stage, micro-batches pipelined through them
                from precast.runtime.llm.staged_runner import StagedRunner

                runner = StagedRunner.from_artifact(root, num_blocks=num_blocks, **runner_kwargs)
            elif llm.kv_layout == "ov-paged":  # OpenVINO's PagedAttention over the engine's block tables
                from precast.runtime.llm.ov_runner import OVStepRunner

                if runner_kwargs.pop("micro_batches", None) is not None:
                    raise UsageError(
                        f"{where}: micro_batches applies to staged artifacts; this one has no stages"
                    )
                runner = OVStepRunner.from_artifact(root, num_blocks=num_blocks, **runner_kwargs)
            elif runner_kwargs.get("micro_batches") is not None:
                raise UsageError(
                    f"{where}: micro_batches applies to staged artifacts; this one has no stages"
                )
            else:
                runner_kwargs.pop("micro_batches", None)
                runner = ModelRunner.from_artifact(root, num_blocks=num_blocks, **runner_kwargs)
            tok_file = llm.tokenizer
            tokenizer = (
                TextTokenizer.from_file(root / tok_file) if tok_file and (root / tok_file).is_file() else None
            )
            # (a tokenizer id past the vocab would index past the logits, and past the embedding)
            if tokenizer is not None and tokenizer.vocab_size > llm.vocab:
                raise ArtifactError(
                    f"{root}/manifest.json: llm block: vocab={llm.vocab} is smaller than the tokenizer's "
                    f"{tokenizer.vocab_size} tokens ({tok_file})"
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
        """Stop the step loop (and a staged runner's stage workers) and remove the temp dir a packed
        artifact was unpacked into. Idempotent."""
        self.stop()
        shutdown = getattr(self.runner, "shutdown", None)  # runners that own threads join them here
        if shutdown is not None:
            shutdown()
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
        with self._knocking():
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
            with self._knocking():
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
        with self._knocking():
            handle = self._handles.get(request_id)
            if handle is None or handle.finished:
                if request_id in self._finished_ids or handle is not None:
                    return False
                raise LLMRequestError(f"unknown request id '{request_id}'")
            self.scheduler.finish(handle.request, "cancelled")
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
        with self._knocking():
            handles = [self._enqueue(ids, params, priority, None, None) for ids in checked]
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
            out = self.scheduler.schedule()
            c = self.counters
            c.steps += 1
            c.computed_tokens += out.total_tokens
            if out.kind is not StepKind.STEADY:  # (a steady step has no copies, preemptions or admissions)
                self._count(out)
            produced = 0
            if out.rows:
                logits = self.runner.execute(out)
                if out.kind is StepKind.STEADY and (out is self._plain or self._all_plain(out)):
                    produced = self._steady_tail(out, logits)
                    if burst and len(out.rows) == 1 and not self._knocks:
                        produced += self._burst(out.rows[0])
                else:
                    sampled = self._sample(out, logits)
                    self.scheduler.update_from_output(out, sampled)
                    produced = self._stream(out, sampled, logits)
            self._cond.notify_all()
            return produced

    # -- the steady decode of plain requests -------------------------------------------------------
    # A STEADY step's rows all decode one token (the same rows as the step before). When every row is
    # "plain" (greedy without penalties, no text to detokenize, no stop strings, no logprobs) the general
    # sample -> stream path is a per-row dispatch whose every branch is known already: on a small model's
    # ~0.4 ms decode step it cost ~15 us (3-4%, benchmarks/README.md). The decision is made once per
    # steady output object (the scheduler returns the same one until the run ends); the tail below does
    # what _sample/_stream/_emit do for such rows, nothing else.
    def _all_plain(self, out: SchedulerOutput) -> bool:
        detok = self.tokenizer is not None
        for req in out.rows:
            p = req.params
            if not req.argmax or p.logprobs is not None or p.stop or (detok and p.detokenize):
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
        handles, produced = self._handles, 0
        for req, tok in zip(rows, sampled):
            handle = handles.get(req.request_id)
            if handle is None:  # an earlier row's callback cancelled it
                continue
            produced += 1
            self._plain_token(handle, req, tok)
        return produced

    def _plain_token(self, handle: RequestHandle, req: Request, tok: int) -> None:
        """Stream a plain request's token (the scheduler appended it): counters, then its bare event."""
        self._count_token(handle, req)
        handle._push_id(tok)
        if handle.error is not None:  # its on_token callback raised
            self._fail(req)

    def _burst(self, req: Request) -> int:
        """The steady decode of one plain request (greedy, no text, stop strings or logprobs), token after
        token to the end of its block, without the step loop around each: no schedule(), no lock round
        trip or notify, no dispatch on the step's kind. On a small model's ~0.5 ms step that loop is most of
        the per-step cost outside the kernels (benchmarks/README.md). Each token goes through the same code
        those steps would: the scheduler's steady_step (update_from_output's per-row advance), then
        _plain_token (_steady_tail's counters and event). It stops at the block's end (the next step
        allocates), when the request finishes, fails or is cancelled from a callback, when a request waits,
        and as soon as another thread knocks. Returns the tokens produced."""
        handle = self._handles.get(req.request_id)
        sched = self.scheduler
        if handle is None or handle.error is not None or sched.steady_steps_left() <= 0:
            return 0
        make = getattr(self.runner, "single_decoder", None)
        run_one = make() if make is not None else None
        if run_one is None:
            return 0
        c, tokens, knocks = self.counters, req.token_ids, self._knocks
        produced = 0
        # (steady_steps_left() turns 0 at the block's end, when the run ends, or when a request waits: one
        # submitted by this request's own callback is scheduled at the next step)
        while not knocks and sched.steady_steps_left() > 0 and req.status is Status.RUNNING:
            tok = int(run_one(tokens[-1], req.num_computed).argmax())
            c.steps += 1
            c.computed_tokens += 1
            sched.steady_step(req, tok)
            produced += 1
            self._plain_token(handle, req, tok)
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

    def _forget(self, request_id: str) -> None:
        """A finished request leaves the engine (a long-running server must not keep every handle)."""
        self._handles.pop(request_id, None)
        self._finished_ids[request_id] = None
        if len(self._finished_ids) > 4096:
            self._finished_ids.popitem(last=False)

    def _sample(self, out: SchedulerOutput, logits: np.ndarray) -> list[int | None]:
        """The next token of each row that reached the end of its known tokens (None: a prefill chunk, or a
        request whose logits cannot be sampled: it fails alone, the others go on)."""
        sampled: list[int | None] = []
        for req, n, row in zip(out.rows, out.num_new, logits):
            if req.num_computed + n < len(req.token_ids):
                sampled.append(None)  # a prefill chunk: nothing to sample yet
                continue
            if req.argmax:  # (the common case, without the sampler's dispatch)
                sampled.append(int(row.argmax()))
                continue
            try:
                sampled.append(sample(row, req.params, req.token_ids, req.rng, len(req.prompt_ids)))
            except LLMRequestError as e:  # (NaN logits)
                sampled.append(None)
                handle = self._handles[req.request_id]
                handle._fail(str(e), e)
                self._fail(req)
                handle._end()  # so that an on_token stream hears the end too
        return sampled

    def _stream(self, out: SchedulerOutput, sampled: list[int | None], logits: np.ndarray) -> int:
        produced = 0
        for i, (req, tok) in enumerate(zip(out.rows, sampled)):
            if tok is not None:
                handle = self._handles.get(req.request_id)
                if handle is not None:  # (None: an earlier row's callback cancelled it)
                    self._emit(handle, req, tok, logits, i)
                    produced += 1
        return produced

    def _emit(self, handle: RequestHandle, req: Request, tok: int, logits: np.ndarray, row: int) -> None:
        """Stream one sampled token (the scheduler appended it, and finished the request if it ended there)."""
        p = req.params
        text = self._visible_text(req) if self.tokenizer is not None and p.detokenize else None
        self._count_token(handle, req)  # (after the text: a stop string in it finishes the request)
        holdback = max(map(len, p.stop)) - 1 if p.stop else 0
        # (opt-in: costs a softmax)
        lp = None if p.logprobs is None else token_logprobs(logits[row], tok, p.logprobs)
        handle._push(tok, text, holdback, lp)
        if handle.error is not None:  # its on_token callback raised
            self._fail(req)

    def _count_token(self, handle: RequestHandle, req: Request) -> None:
        """The counters of one streamed token (first token: TTFT); a request it finished leaves the engine."""
        c = self.counters
        c.generation_tokens += 1
        if handle.t_first_token is None:
            c.observe_ttft(handle)
        if req.finished:
            c.requests_finished += 1
            self._forget(req.request_id)

    def _fail(self, req: Request) -> None:
        """Finish a failed request (its handle says why): its blocks are freed, the others go on."""
        if req.finish_reason == "cancelled":  # its callback cancelled it, then raised: cancelled it stays
            return
        if req.finished:  # it finished on this very token, but its callback failed
            self.counters.requests_finished -= 1
        else:
            self._forget(req.request_id)
        self.scheduler.finish(req, "error")
        self.counters.requests_failed += 1

    def _visible_text(self, req: Request) -> str:
        """The output text so far, cut at the first stop string (which finishes the request)."""
        searched = len(req.detok[0])  # committed before this token: searched by the earlier steps
        text = self._detokenize(req)
        if req.params.stop:
            hits = [
                i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in req.params.stop) if i >= 0
            ]
            if hits:
                text = text[: min(hits)]
                self.scheduler.finish(req, "stop")
        return text

    def _detokenize(self, req: Request) -> str:
        """The output decoded so far, incrementally (as vLLM and TGI do): decode the tokens since the last
        complete piece together with the piece before them (so leading-space rules see their context) and
        append the difference; a trailing unfinished UTF-8 sequence is shown but not committed (for at most
        _MAX_UNCOMMITTED tokens: tokens that never complete a character would make every step decode a longer
        window). Two decodes of a few tokens per step instead of the whole output."""
        text, prefix, read = req.detok
        base = len(req.prompt_ids)
        before = self.tokenizer.decode(req.token_ids[base + prefix : base + read])
        now = self.tokenizer.decode(req.token_ids[base + prefix :])
        if now.endswith("\ufffd") and len(req.token_ids) - base - prefix < _MAX_UNCOMMITTED:
            return text + now[len(before) :]
        text += now[len(before) :]
        req.detok = (text, read, len(req.token_ids) - base)
        return text

    # -- waiting / background loop ---------------------------------------------------------------
    def _wait_for(self, handle: RequestHandle) -> None:
        """Return once the handle has a new event or has finished: step the engine, or wait for the loop."""
        # Under the lock: another thread's step may finish this request between a caller's check and here.
        with self._knocking():
            if handle._events or handle.finished:
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
                kv_bytes_reserved=int(getattr(self.runner, "kv_bytes", 0)),
                kv_bytes_resident=int(getattr(self.runner, "kv_resident_bytes", 0)),
                block_size=self.block_size,
            )


def llm_index_target(root: Path, prefer: str | None = None) -> Path | None:
    """For a multi-target index of a causal LM: the sub-artifact Engine.load opens (else None)."""
    from precast.runtime.manifest import read_manifest

    manifest = read_manifest(root)
    if not manifest.is_multi_target or not manifest.target_dirs():
        return None
    first = next(iter(manifest.target_dirs().values()))
    if read_manifest(root / first).llm is None:
        return None
    return _pick_target(root, prefer)


def _pick_target(root: Path, prefer: str | None) -> Path:
    """``root``, or for a multi-target index the sub-artifact of its first target (runtime.model.target_order:
    ``prefer``, then the compile's measured order) whose backend this host has."""
    from precast.runtime.backends import check_target_name
    from precast.runtime.errors import TargetUnavailableError
    from precast.runtime.manifest import read_manifest
    from precast.runtime.model import target_order

    if prefer is not None:
        check_target_name(prefer)
    manifest = read_manifest(root)
    if not manifest.is_multi_target:
        if prefer is not None and prefer != manifest.target.name:
            raise ArtifactError(
                f"{root}: no target '{prefer}' in this artifact (has: {manifest.target.name})"
            )
        return root
    entries, skipped = manifest.target_dirs(), []
    for name in target_order(root, manifest, prefer):
        why = _unavailable(read_manifest(root / entries[name]).target)
        if why is None:
            return root / entries[name]
        skipped.append(f"{name}: {why}")
    raise TargetUnavailableError(
        f"{root}: no target of this artifact can run on this host ({'; '.join(skipped)})"
    )


def _unavailable(block) -> str | None:
    """Why this host cannot run the target block's backend (None: it can), without loading the model."""
    import importlib.util

    if block.backend == "openvino":
        from precast.runtime.openvino_backend import openvino_available

        ok, why = openvino_available(block.device or "CPU")
        return None if ok else why
    if block.backend == "onnxruntime" and importlib.util.find_spec("onnxruntime") is None:
        return "python package 'onnxruntime' is not installed"
    return None
