"""The staged runner of ``kv_layout: "paged"`` step graphs (GPT-2, the generic decoder path, other head sizes).

Same pipeline as the mapped staged runner (runners/stage_workers.py: one worker + session per stage, bounded queues,
a step's rows in micro-batches), over ModelRunner's pools: stage k's graph reads the step inputs it needs
(input_ids, positions, past_lens, new_lens, block_tables), the pools of its own layers (``key_cache.i`` /
``value_cache.i``, read only) and the tensors crossing its cut, and returns its layers' new K/V, which its
worker scatters into those layers' pools right after the run. Only stage k's worker touches stage k's layers,
and a step's micro-batches are disjoint requests whose written blocks are their own (copy on write), so the
micro-batches in different stages never touch the same memory.

A step's rows go into ``micro_batches`` runs of contiguous rows; a prefill the graph takes only one request
at a time (``batched_prefill`` false) is a micro-batch per row, unpadded, as ModelRunner runs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.stages_spec import StageEntry
from precast.errors import InputError
from precast.runtime.llm.runners.gather import ModelRunner
from precast.runtime.llm.runners.stage_workers import (
    Countdown,
    Job,
    StageWorkers,
    StageWorkersOwner,
)
from precast.runtime.llm.runners.stage_workers import chunks as split_rows

__all__ = ["PAGED_STEP_INPUTS", "StagedPagedRunner", "checked_micro_batches"]

PAGED_STEP_INPUTS = ("input_ids", "positions", "past_lens", "new_lens", "block_tables")


def checked_micro_batches(sessions: list, stages: list[StageEntry], micro_batches: int | None) -> int:
    """A staged runner's micro-batches a step is split into (default: one per stage), once its sessions are
    one per stage, two or more (both staged runners check the same)."""
    if len(sessions) != len(stages) or len(sessions) < 2:
        raise InputError(
            f"a staged runner needs one session per stage (>= 2), got {len(sessions)} for {len(stages)}"
        )
    n = int(micro_batches or len(stages))
    if n < 1:
        raise InputError(f"micro_batches must be >= 1, got {micro_batches}")
    return n


class _PagedStage:
    """One stage's session: its step inputs, its layers' pools, what crosses its cuts."""

    def __init__(self, index: int, session, entry: StageEntry, runner: ModelRunner, last: bool):
        spec = runner.spec
        self.index, self.session, self.last = index, session, last
        names = [i.name for i in session.get_inputs()]
        self.layers = list(entry.kv_layers or [])
        kv_names = {n for i in self.layers for n in (*spec.kv_inputs[i], *spec.kv_outputs[i])}
        step = (*PAGED_STEP_INPUTS, "last_index")  # (a generic graph's last_index reaches its last stage)
        self.step_inputs = [n for n in names if n in step]
        self.boundary_in = [n for n in names if n not in step and n not in kv_names]
        outs = [o.name for o in session.get_outputs()]
        self.boundary_out = [n for n in outs if n not in kv_names and n != "logits"]
        self.pools = {}
        for i in self.layers:
            self.pools[spec.kv_inputs[i][0]] = runner.key_cache[i]
            self.pools[spec.kv_inputs[i][1]] = runner.value_cache[i]
        self.outputs = [
            *self.boundary_out,
            *(n for i in self.layers for n in spec.kv_outputs[i]),
            *(["logits"] if last else []),
        ]
        self.key_cache, self.value_cache = runner.key_cache, runner.value_cache
        self.busy_seconds = 0.0

    def run(self, job: Job) -> None:
        import time

        a = job.arrays
        feeds = {n: a[n] for n in self.step_inputs}
        feeds.update(self.pools)
        feeds.update({n: job.boundary[n] for n in self.boundary_in})
        t0 = time.perf_counter()
        out = self.session.run(self.outputs, feeds)
        self.busy_seconds += time.perf_counter() - t0
        nb = len(self.boundary_out)
        job.boundary.update(zip(self.boundary_out, out[:nb]))
        b_idx, s_idx, blocks, offsets = a["_b_idx"], a["_s_idx"], a["_blocks"], a["_offsets"]
        for j, i in enumerate(self.layers):  # this stage's layers' new K/V -> their pools
            self.key_cache[i][blocks, :, offsets] = out[nb + 2 * j][b_idx, :, s_idx]
            self.value_cache[i][blocks, :, offsets] = out[nb + 2 * j + 1][b_idx, :, s_idx]
        if self.last:
            job.logits = out[-1]


class StagedPagedRunner(StageWorkersOwner, ModelRunner):
    """ModelRunner over a staged paged step graph (same execute() / step() contract as the unsplit one)."""

    def __init__(
        self,
        sessions: list,
        stages: list[StageEntry],
        spec: LLMSpec,
        num_blocks: int,
        path: Path | None = None,
        micro_batches: int | None = None,
        queue_depth: int = 4,
    ):
        self.micro_batches = checked_micro_batches(sessions, stages, micro_batches)
        super().__init__(sessions[0], spec, num_blocks, path)
        n = len(stages)
        self.stages = [
            _PagedStage(k, s, e, self, k == n - 1) for k, (s, e) in enumerate(zip(sessions, stages))
        ]
        self._pipe = StageWorkers([stage.run for stage in self.stages], queue_depth)

    def close(self) -> None:
        self.shutdown()

    TAKES_LAST_INDEX = False  # (one logits row per request: no speculative verification)

    def _step(self, ids, pos, past, new, tables) -> np.ndarray:
        b, s = ids.shape
        if s > 1 and (b == 1 or not self.spec.batched_prefill):  # one request at a time, unpadded
            parts = [(r, 1, int(new[r])) for r in range(b)]
        else:
            # (each micro-batch right-padded to its own longest row only: the generic graph sizes its rotary
            # tables from the batch's positions, which must cover the padded width)
            parts = [
                (lo, rows, int(new[lo : lo + rows].max())) for lo, rows in split_rows(b, self.micro_batches)
            ]
        done = Countdown(len(parts))
        jobs = [
            Job(lo, rows, self._job_arrays(ids, pos, past, new, tables, lo, rows, w), done)
            for lo, rows, w in parts
        ]
        self._pipe.run_jobs(jobs)
        if len(jobs) == 1:
            return jobs[0].logits
        return np.concatenate([job.logits for job in jobs], axis=0)

    def _job_arrays(
        self, ids, pos, past, new, tables, lo: int, rows: int, width: int
    ) -> dict[str, np.ndarray]:
        """One micro-batch's step inputs (its tables cut to the blocks it uses) and the pool slots of its new
        tokens (as ModelRunner._run's scatter: request b, token s -> block, offset of position past[b] + s)."""
        sl = slice(lo, lo + rows)
        p, n = past[sl], new[sl]
        t = tables[sl, : self.spec.blocks_for(int((p + n).max()))]
        b_idx, s_idx = np.nonzero(np.arange(width)[None, :] < n[:, None])
        slot = p[b_idx] + s_idx
        return {
            "input_ids": np.ascontiguousarray(ids[sl, :width]),
            "positions": np.ascontiguousarray(pos[sl, :width]),
            "past_lens": np.ascontiguousarray(p),
            "new_lens": np.ascontiguousarray(n),
            "block_tables": np.ascontiguousarray(t),
            "last_index": (n - 1)[:, None],  # (each request's last real token: one logits row per request)
            "_b_idx": b_idx,
            "_s_idx": s_idx,
            "_blocks": t[b_idx, slot // self.spec.block_size],
            "_offsets": slot % self.spec.block_size,
        }
