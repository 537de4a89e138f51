"""The model runner of a staged causal-LM artifact: one worker per stage, micro-batches in flight at once.

A staged step graph (``split-stages`` on ``--task causal-lm``) is cut at layer boundaries: stage k holds a
consecutive range of decoder layers and reads only its own layers' KV (``kv_layers`` in the manifest's
``stages`` block), the step inputs it needs (input_ids on the first stage, GroupQueryAttention's lengths on
every stage, last_index on the last) and the hidden state the stage before it produced. Each stage has its
own ONNX Runtime session (one intra-op thread by default) run by its own worker thread:

    engine thread: step rows -> micro-batches (contiguous slot ranges)  ->  queue 0 (bounded)
    worker 0: stage 0 of micro-batch A, then B, ...   --hidden-->        queue 1 (bounded)
    worker 1:              stage 1 of micro-batch A, then B, ...  -> logits rows; step done when all are

so stage 1 runs micro-batch A while stage 0 runs micro-batch B (vLLM's pipeline-parallel micro-batches,
within one engine step: the next step needs this step's tokens). A step's decode rows are split into
``micro_batches`` contiguous slot runs; each prefill row is a micro-batch of its own (the mapped graph
prefills one request at a time anyway), so the prefills of a mixed step pipeline too.

The KV pool is the mapped runner's (one shared-memory pool, a view per slot and layer): a stage's IO
binding binds its own layers' slot views as past and present, so stages write disjoint memory and
micro-batches (disjoint slots) never touch each other's KV. Tensors crossing a cut go from one stage's
binding to the next as ONNX Runtime values (no copy). A binding runs once per step (each micro-batch has
its own (slot, rows) binding), and a step returns only when every micro-batch is through the last stage.

This module runs the mapped KV layout (what ort-cpu compiles Llama-family models to); ``open_staged_runner`` of a
staged paged step graph (GPT-2, the generic decoders) returns staged_paged.StagedPagedRunner.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import Manifest
from precast.artifact.stages_spec import StageEntry, StagesSpec
from precast.errors import ArtifactError, InputError
from precast.runtime.llm.runners.mapped import (
    MAPPED_STEP_INPUTS,
    MappedModelRunner,
    NativeLookup,
    gqa_lengths,
)
from precast.runtime.llm.runners.stage_workers import (
    Countdown,
    Job,
    StageWorkers,
    StageWorkersOwner,
)
from precast.runtime.llm.runners.stage_workers import chunks as split_rows
from precast.runtime.llm.runners.staged_paged import (
    StagedPagedRunner,
    checked_micro_batches,
)

__all__ = ["StagedRunner", "check_stages_match_spec", "open_staged_runner", "staged_llm_block"]

_STEP_INPUTS = ("input_ids", "positions", *MAPPED_STEP_INPUTS)
# the step inputs of either layout (paged: staged_paged.PAGED_STEP_INPUTS)
_ANY_STEP_INPUT = (*_STEP_INPUTS, "past_lens", "new_lens", "block_tables")


class _Stage:
    """One stage's session and its IO bindings, one per (first slot, rows)."""

    def __init__(self, index: int, session, entry: StageEntry, spec: LLMSpec, kv, last: bool):
        self.index, self.session, self.entry, self.spec, self.kv, self.last = (
            index,
            session,
            entry,
            spec,
            kv,
            last,
        )
        names = [i.name for i in session.get_inputs()]
        self.step_inputs = [n for n in names if n in _STEP_INPUTS]
        layers = entry.kv_layers or []
        self.kv_pairs = [(spec.kv_inputs[i], spec.kv_outputs[i], i) for i in layers]
        kv_names = {n for pair_in, pair_out, _ in self.kv_pairs for n in (*pair_in, *pair_out)}
        self.boundary_in = [n for n in names if n not in _STEP_INPUTS and n not in kv_names]
        self.boundary_out = [
            o.name for o in session.get_outputs() if o.name not in kv_names and o.name != "logits"
        ]
        self._bindings: dict[tuple[int, int], tuple] = {}
        self._native = NativeLookup()
        self.busy_seconds = 0.0  # time inside the session (benchmarks: busy / wall per stage)

    def run(self, job: Job) -> None:
        io, logits, bound = self._bindings.get((job.slot, job.rows)) or self._bind(job.slot, job.rows)
        arrays = job.arrays
        if bound[0] is not arrays:  # (a decode binding's own arrays stay bound from step to step)
            for name in self.step_inputs:
                io.bind_cpu_input(name, arrays[name])
            bound[0] = arrays
        for name in self.boundary_in:
            io.bind_ortvalue_input(name, job.boundary[name])
        for name in self.boundary_out:  # unallocated again: ONNX Runtime allocates this run's (own) tensors
            io.bind_output(name, "cpu")
        t0 = time.perf_counter()
        sess = self._native(self.session)  # ORT's C++ session (mapped.NativeLookup)
        if sess is not None:
            sess.run_with_iobinding(io.native, None)
        else:  # a session wrapping ORT's (a stand-in, a timer)
            self.session.run_with_iobinding(io)
        self.busy_seconds += time.perf_counter() - t0
        if self.last:
            job.logits = logits
        else:
            job.boundary.update(zip(self.boundary_out, io.get_outputs()[: len(self.boundary_out)]))

    def _bind(self, slot: int, rows: int) -> tuple:
        if len(self._bindings) >= 256:
            self._bindings.clear()
        io = self.session.io_binding()
        shape = [rows, self.spec.kv_heads, self.kv.context, self.spec.head_size]
        for name in self.boundary_out:  # first: get_outputs() lists them first, in this order
            io.bind_output(name, "cpu")
        for pair_in, pair_out, layer in self.kv_pairs:
            for kind in (0, 1):
                addr = self.kv.view_address(layer, kind, slot)
                io.bind_input(pair_in[kind], "cpu", 0, np.float32, shape, addr)
                io.bind_output(pair_out[kind], "cpu", 0, np.float32, shape, addr)  # same buffer: in place
        logits = None
        if self.last:
            logits = np.empty((rows, self.spec.vocab), dtype=np.float32)
            io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        entry = self._bindings[(slot, rows)] = (io, logits, [None])
        return entry


class StagedRunner(StageWorkersOwner, MappedModelRunner):
    """The mapped runner over a staged step graph (same execute() / step() contract as the unsplit one).

    ``sessions``: one ONNX Runtime session per stage, in order; ``stages``: the manifest's stage entries.
    ``micro_batches``: how many micro-batches a step's decode rows are split into (default: one per stage).
    """

    def __init__(
        self,
        sessions: list,
        stages: list[StageEntry],
        spec: LLMSpec,
        num_blocks: int,
        path: Path | None = None,
        slots: int = 64,
        micro_batches: int | None = None,
        queue_depth: int = 4,
    ):
        if spec.kv_layout != "mapped":
            raise InputError(
                f"{path or 'artifact'}: StagedRunner runs the mapped layout (paged: StagedPagedRunner)"
            )
        self.micro_batches = checked_micro_batches(sessions, stages, micro_batches)
        super().__init__(sessions[0], spec, num_blocks, path, slots)
        n = len(stages)
        self.stages = [
            _Stage(k, s, e, self.spec, self.kv, k == n - 1) for k, (s, e) in enumerate(zip(sessions, stages))
        ]
        self._decode_arrays: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._pipe = StageWorkers([stage.run for stage in self.stages], queue_depth)

    def close(self) -> None:
        self.shutdown()
        super().close()

    # -- steps: micro-batches instead of one session run ---------------------------------------------
    def _decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> np.ndarray:
        """The decode rows in ``slots`` (exactly 0 .. n-1, any order) as micro-batches of contiguous slots."""
        n = len(tokens)
        order = sorted(range(n), key=slots.__getitem__)  # the row in slot 0, 1, ...
        chunks = split_rows(n, self.micro_batches)
        done = Countdown(len(chunks))
        jobs = []
        for lo, rows in chunks:
            arrays = self._decode_arrays.get((lo, rows)) or self._new_decode_arrays(lo, rows)
            ids = [tokens[order[r]] for r in range(lo, lo + rows)]
            pos = [positions[order[r]] for r in range(lo, lo + rows)]
            arrays["input_ids"][:, 0] = ids
            arrays["positions"][:, 0] = pos
            arrays["seqlens_k"][:] = pos  # S = 1: seqlens_k = past_lens
            arrays["total_sequence_length"][()] = max(pos) + 1
            jobs.append(Job(lo, rows, arrays, done))
        self._pipe.run_jobs(jobs)
        logits = np.empty((n, self.spec.vocab), dtype=np.float32)
        for job, (lo, rows) in zip(jobs, chunks):
            logits[order[lo : lo + rows]] = job.logits
        return logits

    def _new_decode_arrays(self, lo: int, rows: int) -> dict[str, np.ndarray]:
        arrays = self._decode_arrays[(lo, rows)] = {
            "input_ids": np.zeros((rows, 1), np.int64),
            "positions": np.zeros((rows, 1), np.int64),
            "seqlens_k": np.zeros(rows, np.int32),
            "total_sequence_length": np.zeros((), np.int32),
            "last_index": np.zeros((rows, 1), np.int64),
        }
        return arrays

    TAKES_LAST_INDEX = False  # (one logits row per request: no speculative verification)

    def _step(self, ids, pos, past, new, tables) -> np.ndarray:
        self._again = None
        b = ids.shape[0]
        if b > self.kv.slots:
            raise InputError(f"a step of {b} requests exceeds the runner's {self.kv.slots} slots")
        past_l, new_l = past.tolist(), new.tolist()
        decode = [r for r in range(b) if new_l[r] == 1]
        prefill = [r for r in range(b) if new_l[r] > 1]
        slot_of = self._assign(past_l, new_l, tables.tolist(), decode, prefill)
        if not prefill:
            return self._decode(
                [slot_of[r] for r in decode], ids[decode, 0].tolist(), [past_l[r] for r in decode]
            )
        # decode micro-batches and one job per prefill row, all in the pipeline at once
        order = sorted(decode, key=slot_of.__getitem__)
        chunks = split_rows(len(decode), self.micro_batches) if decode else []
        done = Countdown(len(chunks) + len(prefill))
        jobs, targets = [], []
        for lo, rows in chunks:
            sel = order[lo : lo + rows]
            p = past[sel]
            arrays = {"input_ids": np.ascontiguousarray(ids[sel, :1]), "positions": p[:, None].copy()}
            arrays.update(gqa_lengths(p, new[sel], 1))
            jobs.append(Job(lo, rows, arrays, done))
            targets.append(sel)
        for r in prefill:
            n = new_l[r]
            arrays = {
                "input_ids": np.ascontiguousarray(ids[r : r + 1, :n]),
                "positions": np.ascontiguousarray(pos[r : r + 1, :n]),
            }
            arrays.update(gqa_lengths(past[r : r + 1], new[r : r + 1], n))
            jobs.append(Job(slot_of[r], 1, arrays, done))
            targets.append([r])
        self._pipe.run_jobs(jobs)
        logits = np.empty((b, self.spec.vocab), dtype=np.float32)
        for job, rows in zip(jobs, targets):
            logits[rows] = job.logits
        return logits


def open_staged_runner(
    root: Path,
    manifest: Manifest,
    num_blocks: int | None = None,
    threads: int | None = None,
    spinning: bool | str = False,
    micro_batches: int | None = None,
) -> StagedRunner | StagedPagedRunner:
    """The runner of a staged causal-lm artifact (open_runner's, once the HAL resolved and checked it): one
    session per stage with ``threads`` intra-op threads each (default 1: the stages' workers are the
    parallelism); ``spinning`` as ModelRunner's. A paged step graph (GPT-2, the generic decoders) runs on
    StagedPagedRunner (ModelRunner's pools and scatter), a mapped one on StagedRunner."""
    from precast.runtime.backends import check_threads, create_session

    check_threads(threads)
    spec = LLMSpec.from_manifest(manifest, str(root))
    if manifest.stages is None:
        raise ArtifactError(f"{root}: not a staged artifact (manifest has no 'stages' block)")
    entries = [_with_kv_layers(e, spec) for e in manifest.stages.stages]
    sessions = [
        create_session(
            root,
            dataclasses.replace(manifest.target, model=e.model),
            threads=threads or 1,
            spinning=spinning,
        )
        for e in entries
    ]
    check_stages_match_spec(sessions, entries, spec, root)
    if num_blocks is None:
        num_blocks = spec.default_num_blocks()
    if spec.kv_layout == "paged":
        return StagedPagedRunner(sessions, entries, spec, num_blocks, root, micro_batches=micro_batches)
    return StagedRunner(sessions, entries, spec, num_blocks, root, micro_batches=micro_batches)


def _with_kv_layers(entry: StageEntry, spec: LLMSpec) -> StageEntry:
    """The entry with its ``kv_layers`` (when the manifest leaves them out: the layers whose KV inputs it reads)."""
    if entry.kv_layers is not None:
        return entry
    reads = set(entry.inputs)
    owned = [i for i, pair in enumerate(spec.kv_inputs) if reads & set(pair)]
    return dataclasses.replace(entry, kv_layers=owned)


def staged_llm_block(stages: StagesSpec, spec: LLMSpec) -> StagesSpec:
    """The compiler's ``stages`` block of a causal LM: each stage's ``kv_layers`` filled in (the layers whose
    KV it reads)."""
    return dataclasses.replace(stages, stages=[_with_kv_layers(e, spec) for e in stages.stages])


def check_stages_match_spec(sessions, stages: list[StageEntry], spec: LLMSpec, path) -> None:
    """Untrusted manifest: each stage's kv_layers must be a consecutive, disjoint cover of the layers, each
    stage's graph must take exactly its layers' KV views, and only the last stage may produce logits."""
    where = f"{path}/manifest.json: stages block"
    owned = [i for e in stages for i in (e.kv_layers or [])]
    if owned != list(range(spec.layers)):
        raise ArtifactError(
            f"{where}: kv_layers must cover layers 0..{spec.layers - 1} once, in order; got {owned}"
        )
    all_kv = {
        n: i for i, (pin, pout) in enumerate(zip(spec.kv_inputs, spec.kv_outputs)) for n in (*pin, *pout)
    }
    produced: set[str] = set()
    for k, (session, entry) in enumerate(zip(sessions, stages)):
        mine = set(entry.kv_layers or [])
        ins = [i.name for i in session.get_inputs()]
        outs = [o.name for o in session.get_outputs()]
        for name in (*ins, *outs):
            if name in all_kv and all_kv[name] not in mine:
                raise ArtifactError(
                    f"{where}: stage {k} reads or writes {name!r}, KV of a layer it does not own"
                )
        for i in mine:
            for name in (*spec.kv_inputs[i], *spec.kv_outputs[i]):
                if name not in ins and name not in outs:
                    raise ArtifactError(f"{where}: stage {k} owns layer {i} but its graph lacks {name!r}")
        for name in ins:
            if name not in all_kv and name not in _ANY_STEP_INPUT and name not in produced:
                raise ArtifactError(f"{where}: stage {k} reads {name!r}, which no earlier stage produces")
        if ("logits" in outs) != (k == len(stages) - 1):
            raise ArtifactError(f"{where}: only the last stage produces 'logits' (stage {k} does not fit)")
        produced |= set(outs)
    logits = {o.name: o.shape for o in sessions[-1].get_outputs()}["logits"]
    spec.check_logits_shape(logits, f"{path}/manifest.json: llm block")
