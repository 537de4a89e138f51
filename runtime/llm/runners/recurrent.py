"""RecurrentRunner: the paged step of a hybrid or state-space model (Mamba, Mamba2, Jamba, LFM2, Falcon-H1,
Qwen3-Next): attention layers over the block pool as ModelRunner, recurrent layers over state slots.

Each recurrent state of the graph (LLMSpec.states: a convolution's last inputs, a selective scan's or a
gated delta net's state) has a pool ``[slots, *shape]``; a request holds one slot from admission to its end
(KVCacheManager.state_slot, SchedulerOutput.state_slots). A step feeds each row its slot's states, zeros
for a row that starts at position 0 (a new request, or a preempted one being recomputed), and writes the
states the graph returns back into the slots. The state after a request's tokens is all the graph keeps of
them, so:
  - there is no prefix caching (the engine turns it off): a slot cannot be shared or resumed mid-prompt;
  - preemption recomputes (the slot is given back, the request starts again from position 0);
  - speculative decoding is refused (a rejected draft token cannot be taken back out of a state).
Memory: the block pool grows with tokens (attention layers), the slots with requests at once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from precast.errors import InputError
from precast.runtime.llm.runners.gather import ModelRunner
from precast.runtime.llm.scheduler import SchedulerOutput

__all__ = ["MAX_STATE_SLOTS", "RecurrentRunner"]

# State slots when the caller sizes none: one per request the scheduler may run at once (its default
# max_num_seqs is 64). Engine.load sizes them by its config's max_num_seqs.
MAX_STATE_SLOTS = 64
# The most address space the slot pools reserve (np.zeros maps them lazily; an untrusted manifest's state sizes
# cannot make the runner reserve more: the slots are cut to fit, at least one)
STATE_RESERVE_MAX = 64 << 30


class RecurrentRunner(ModelRunner):
    def __init__(
        self, session, spec, num_blocks: int, path: Path | None = None, num_slots: int | None = None
    ):
        super().__init__(session, spec, num_blocks, path)
        slots = MAX_STATE_SLOTS if num_slots is None else int(num_slots)
        if slots < 1:
            raise InputError(f"state slots must be >= 1, got {slots}")
        slots = max(1, min(slots, STATE_RESERVE_MAX // max(1, spec.state_bytes)))
        self.num_state_slots = slots
        # np.zeros maps lazily: a slot's pages appear when a request first writes it
        self._state_pools = [np.zeros((slots, *st.shape), dtype=np.float32) for st in spec.states]
        self._outputs = [
            "logits",
            *(n for pair in spec.kv_outputs for n in pair),
            *(st.output for st in spec.states),
        ]
        self.state_slots_touched = 0  # 1 + the highest slot a step has written
        self._row_slots = np.zeros(0, dtype=np.int64)  # the slots of the rows _step runs next
        self._steady_slots = self._row_slots

    # -- memory ---------------------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return super().kv_bytes + sum(p.nbytes for p in self._state_pools)

    @property
    def kv_resident_bytes(self) -> int:
        """Touched blocks x bytes per block (attention layers) + touched slots x one request's state."""
        block = super().kv_bytes // self.num_blocks
        return self.kv_blocks_touched * block + self.state_slots_touched * self.spec.state_bytes

    @property
    def state_bytes_resident(self) -> int:
        return self.state_slots_touched * self.spec.state_bytes

    # -- which slots the next _step's rows use ---------------------------------------------------------
    def _decode_rows(self, out: SchedulerOutput) -> np.ndarray:
        self._row_slots = self._steady_slots = np.asarray(out.state_slots, dtype=np.int64)
        return super()._decode_rows(out)

    def _decode_steady(self, out: SchedulerOutput) -> np.ndarray:
        if len(self._steady_slots) != len(out.rows):
            return self._decode_rows(out)
        self._row_slots = self._steady_slots  # (the same rows as the DECODE step before it)
        return super()._decode_steady(out)

    def _arrays(self, out: SchedulerOutput, rows) -> tuple[np.ndarray, ...]:
        self._row_slots = np.asarray([out.state_slots[i] for i in rows], dtype=np.int64)
        return super()._arrays(out, rows)

    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        """The checked low-level step: row b holds slot b (a row at past 0 starts from a zero state)."""
        b = np.asarray(input_ids).shape[0] if np.ndim(input_ids) == 2 else 0
        if b > self.num_state_slots:
            raise InputError(f"{b} rows need more than the {self.num_state_slots} state slots")
        self._row_slots = np.arange(b, dtype=np.int64)
        return super().step(input_ids, positions, past_lens, new_lens, block_tables)

    # -- the step --------------------------------------------------------------------------------------
    def _step(self, ids, pos, past, new, tables, last=None) -> np.ndarray:
        return self._run(ids, pos, past, new, tables, last)

    def _run(self, ids, pos, past, new, tables, last=None) -> np.ndarray:
        slots = self._row_slots
        if len(slots) != ids.shape[0] or (slots < 0).any() or (slots >= self.num_state_slots).any():
            raise InputError(f"rows without a state slot in [0, {self.num_state_slots}): {slots.tolist()}")
        spec = self.spec
        feeds, tables, intact = self._graph_feeds(ids, pos, past, new, tables, last)
        fresh = past == 0
        for st, pool in zip(spec.states, self._state_pools):
            state = pool[slots]  # (a copy: the rows' states, in row order)
            state[fresh] = 0.0
            feeds[st.name] = state
        out = self._active_session().run(self._outputs, feeds)
        layers = spec.layers
        self._store_kv(out[1 : 1 + 2 * layers], ids, past, new, tables, intact)
        for j, pool in enumerate(self._state_pools):
            pool[slots] = out[1 + 2 * layers + j]
        self.state_slots_touched = max(self.state_slots_touched, int(slots.max()) + 1)
        return out[0]
