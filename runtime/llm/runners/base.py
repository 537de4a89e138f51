"""The engine's contract with a model runner (``StepRunner``), and the base the runners share (``RunnerBase``).

``StepRunner`` is everything the Engine and the perplexity scorer call, and nothing they probe for: a runner
declares its capabilities (``single_decoder()`` returns None where it has no batch-1 burst; ``shutdown()``
is a no-op where it owns no threads) instead of the caller asking ``getattr``. ``open_runner``
(runtime/llm/runners/factory.py) picks the implementation from the manifest.

``RunnerBase.execute(SchedulerOutput) -> logits`` (one row per scheduled request) dispatches:

    execute(out)      block copies (copy on write) first, then by ``out.kind``:
      STEADY          _decode_steady(out): the last decode's rows, one token further, tables unchanged
      DECODE          _decode_rows(out):   one token per row, tables as the scheduler gives them
      MIXED           _mixed(out):         prefill chunks among the rows

A runner subclasses RunnerBase and implements ``_step(ids, pos, past, new, tables)`` (valid int64 arrays:
the step graph's inputs); the defaults here build those arrays (the decode ones once per steady run, then
only refilled) and split a mixed step so right-padding stays small. The mapped runner overrides the three
(its decodes run from Python lists over slot views it keeps mapped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from precast.runtime.llm.scheduler import SchedulerOutput, StepKind

__all__ = ["RunnerBase", "SingleDecoder", "StepRunner", "group_by_length", "last_indices"]

# run(token, position) -> the logits row of the one request a batch-1 burst decodes (runner-owned buffer)
SingleDecoder = Callable[[int, int], np.ndarray]


@runtime_checkable
class StepRunner(Protocol):
    """What the Engine and the perplexity scorer call on a runner (all of it; runners declare the rest).

    ``spec``: the manifest's llm block (block_size, vocab, max_context, eos_ids, pad_id). ``num_blocks``:
    the KV pool's blocks, which the engine's BlockPool hands out. ``kv_bytes`` / ``kv_resident_bytes``:
    what the pools reserve / hold (metrics)."""

    spec: Any
    num_blocks: int

    @property
    def kv_bytes(self) -> int: ...

    @property
    def kv_resident_bytes(self) -> int: ...

    @property
    def multi_logits(self) -> bool:
        """Whether ``execute`` takes a step with ``out.logit_rows`` (speculative verification)."""
        ...

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Logits [len(out.rows), V] of each scheduled row's last new token (valid until the next step); with
        ``out.logit_rows`` (Q_i per row): [sum(Q_i), V], each row's last Q_i new tokens, rows back to back."""
        ...

    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        """The checked low-level step (perplexity, benchmarks): right-padded [B, S] ids -> logits [B, V]."""
        ...

    def single_decoder(self) -> SingleDecoder | None:
        """The batch-1 burst's decoder of the row the last decode ran, or None where the runner has none."""
        ...

    def shutdown(self) -> None:
        """Join the threads the runner owns (staged runners' stage workers); its pools stay. Idempotent."""
        ...

    def close(self) -> None:
        """Release the pools too (after shutdown); the runner is not used again."""
        ...


class RunnerBase:
    """Base of the model runners: ``spec`` (block_size, vocab, pad_id), ``key_cache`` / ``value_cache`` pools of
    ``num_blocks`` blocks; ``execute`` dispatches on the step's kind (module doc). Defaults for StepRunner's
    capabilities: no burst, no threads, nothing to release, nothing reserved.

    A runner's pools are lazily backed (pages appear when first written), so ``kv_bytes`` is what it reserves
    and ``kv_resident_bytes`` what it holds: the blocks below the highest one any step wrote, which the
    engine's high-water-mark BlockPool keeps near the peak of blocks in use.
    """

    _steady_arrays: tuple | None = None  # (ids, past, tables, new) of the last DECODE step
    # Whether the runner's _step takes ``last`` (last_index [B,Q]) when its graph does (spec.multi_logits)
    TAKES_LAST_INDEX = False
    kv_blocks_touched = 0  # 1 + the highest block id a step has written (or copied into)
    num_state_slots = 0  # recurrent state slots (runners/recurrent.py); the engine gives each request one
    kv_bytes = 0  # (a property of the runners that own pools)
    spin_switch = (
        None  # a SpinSwitch (ONNX Runtime runners with spinning="auto"): the session each step runs on
    )

    def attach_spin_switch(self, switch) -> None:
        """Run each step on the session ``switch`` picks (spinning or not; runners/spin_switch.py)."""
        self.spin_switch = switch

    @property
    def kv_resident_bytes(self) -> int:
        """Bytes of the pools' touched blocks (kv_blocks_touched x bytes per block): what the pools hold."""
        return self.kv_blocks_touched * (self.kv_bytes // self.num_blocks)

    @classmethod
    def from_artifact(
        cls,
        path,
        num_blocks: int | None = None,
        threads: int | None = None,
        verify: bool = True,
        spinning: bool | str | None = None,
        *,
        micro_batches: int | None = None,
    ) -> StepRunner:
        """The runner open_runner picks for the causal-lm artifact at ``path``, whichever class this is called
        on (ModelRunner.from_artifact of a mapped artifact is a MappedModelRunner). ``num_blocks`` defaults to
        LLMSpec.default_num_blocks(); the rest are factory.RunnerOptions' fields (positional as before)."""
        from precast.runtime.llm.runners.factory import RunnerOptions, open_artifact_runner

        options = RunnerOptions(
            threads=threads, verify=verify, spinning=spinning, micro_batches=micro_batches
        )
        return open_artifact_runner(path, num_blocks, options)

    def single_decoder(self) -> SingleDecoder | None:
        return None

    @property
    def multi_logits(self) -> bool:
        return self.TAKES_LAST_INDEX and bool(getattr(self.spec, "multi_logits", False))

    def shutdown(self) -> None:
        pass

    def close(self) -> None:
        self.shutdown()

    def _note_written(self, past, new, tables) -> None:
        """Record the blocks of a checked step() (rows write positions past .. past+new-1)."""
        bs, top = self.spec.block_size, self.kv_blocks_touched - 1
        lists = (a.tolist() if isinstance(a, np.ndarray) else a for a in (past, new, tables))
        for p, n, t in zip(*lists):
            top = max(top, max(t[p // bs : (p + n - 1) // bs + 1], default=top))
        self.kv_blocks_touched = top + 1

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Run one scheduled step; logits [len(out.rows), V] of each row's last new token (for a runner
        that keeps its own buffer, valid until its next step)."""
        kind = out.kind
        if kind is StepKind.STEADY:  # (no copies in a steady step, and every row inside its tables' blocks)
            return self._decode_steady(out)
        # Touched blocks: each row writes from its block of num_computed on (a steady run stays inside them).
        bs, top = self.spec.block_size, self.kv_blocks_touched - 1
        for r, t in zip(out.rows, out.block_tables):
            top = max(top, max(t[r.num_computed // bs :], default=top))
        for src, dst in out.copies:
            top = max(top, dst)
            for pool in (*self.key_cache, *self.value_cache):
                pool[dst] = pool[src]
        self.kv_blocks_touched = top + 1
        if kind is StepKind.DECODE:
            return self._decode_rows(out)
        return self._mixed(out)

    def _step(self, ids, pos, past, new, tables, last=None) -> np.ndarray:
        """Logits of the rows [B, S]: [B, V] of each row's last new token, or with ``last`` (int64 [B,Q],
        runners with TAKES_LAST_INDEX) [B*Q, V] of the tokens it indexes."""
        raise NotImplementedError

    def _decode_rows(self, out: SchedulerOutput) -> np.ndarray:
        rows, b = out.rows, len(out.rows)
        past = np.array([r.num_computed for r in rows], dtype=np.int64)
        ids = np.array([r.token_ids[r.num_computed] for r in rows], dtype=np.int64).reshape(b, 1)
        tables = _table_array(out.block_tables)
        new = np.ones(b, dtype=np.int64)
        self._steady_arrays = (ids, past, tables, new)
        return self._step(ids, past.reshape(b, 1), past, new, tables)

    def _decode_steady(self, out: SchedulerOutput) -> np.ndarray:
        cached = self._steady_arrays
        if cached is None or len(cached[1]) != len(out.rows):
            return self._decode_rows(out)
        ids, past, tables, new = cached
        # (the same rows as the DECODE step that built the arrays, one token further: refill, nothing else)
        ids[:, 0] = [r.token_ids[-1] for r in out.rows]
        past[:] = [r.num_computed for r in out.rows]
        return self._step(ids, past.reshape(-1, 1), past, new, tables)

    def _row_groups(self, out: SchedulerOutput) -> list[list[int]]:
        """A mixed step's rows split into _step calls (right-padding kept small)."""
        return group_by_length(out.num_new)

    def _mixed(self, out: SchedulerOutput) -> np.ndarray:
        if out.logit_rows is not None:
            return self._mixed_rows(out)
        logits = np.empty((len(out.rows), self.spec.vocab), dtype=np.float32)
        for group in group_by_length(out.num_new):
            logits[group] = self._step(*self._arrays(out, group))
        return logits

    def _mixed_rows(self, out: SchedulerOutput) -> np.ndarray:
        """A step whose rows return their last Q_i tokens' logits (out.logit_rows): [sum(Q_i), V]."""
        q = out.logit_rows
        starts = np.cumsum([0, *q]).tolist()
        logits = np.empty((starts[-1], self.spec.vocab), dtype=np.float32)
        for group in self._row_groups(out):
            arrays = self._arrays(out, group)
            qs = np.array([q[i] for i in group], dtype=np.int64)
            width = int(qs.max())
            got = self._step(*arrays, last_indices(arrays[3], qs, width))
            got = got.reshape(len(group), width, self.spec.vocab)
            for j, i in enumerate(group):
                logits[starts[i] : starts[i + 1]] = got[j, : q[i]]
        return logits

    def _arrays(self, out: SchedulerOutput, rows: Sequence[int]) -> tuple[np.ndarray, ...]:
        """The step inputs of the given rows of ``out``, right-padded to the longest."""
        n = [out.num_new[i] for i in rows]
        b, s = len(rows), max(n)
        ids = np.full((b, s), self.spec.pad_id, dtype=np.int64)
        pos = np.zeros((b, s), dtype=np.int64)
        past = np.array([out.rows[i].num_computed for i in rows], dtype=np.int64)
        for j, i in enumerate(rows):
            c, k = int(past[j]), n[j]
            ids[j, :k] = out.rows[i].token_ids[c : c + k]
            pos[j, :k] = np.arange(c, c + k)
        tables = _table_array([out.block_tables[i] for i in rows])
        return ids, pos, past, np.array(n, dtype=np.int64), tables


def last_indices(new, q, width: int) -> np.ndarray:
    """last_index [B, width]: row b's last q[b] new tokens (of new[b]), padded with its last one."""
    new, q = np.asarray(new, dtype=np.int64), np.asarray(q, dtype=np.int64)
    idx = (new - q)[:, None] + np.arange(width, dtype=np.int64)[None, :]
    return np.minimum(idx, (new - 1)[:, None])


def _table_array(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def group_by_length(num_new: Sequence[int], max_waste: float = 0.25) -> list[list[int]]:
    """Row indices of one step split into runner calls so right-padding stays small: all decodes together,
    prefill chunks merged while padded tokens stay within max_waste of the real ones."""
    decodes = [i for i, n in enumerate(num_new) if n == 1]
    groups: list[list[int]] = [decodes] if decodes else []
    current: list[int] = []
    for i in sorted((i for i, n in enumerate(num_new) if n > 1), key=lambda i: -num_new[i]):
        trial = [*current, i]
        real = sum(num_new[x] for x in trial)
        if current and len(trial) * num_new[trial[0]] > (1 + max_waste) * real:
            groups.append(current)
            trial = [i]
        current = trial
    if current:
        groups.append(current)
    return groups
