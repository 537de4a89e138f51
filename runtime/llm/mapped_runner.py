"""The model runner of ``kv_layout: "mapped"`` artifacts: block tables become page mappings, no KV copies.

Each request of a step runs in a *slot*: a virtual [KV, C, D] view per layer whose block positions map
the pool blocks of the request's block table (mapped_kv.MappedKV). The step graph's past and present
K/V are bound (ONNX Runtime IO binding) to the same slot views, so GroupQueryAttention reads the past
where it lies and writes the new tokens into the request's blocks: no gather before, no scatter after.

Slots: the decode rows of a step (one new token each) run as one batch over slots 0 .. n-1 (a batch must
be one contiguous run of views); each prefill row runs alone in a slot past those. A request keeps its slot
from step to step (found again through the block holding its last cached token), so a slot is remapped
only for the blocks that changed: one new block every block_size tokens, or a whole table when the batch
changes. Correctness never depends on that guess: every row's view is made to match its table before
the run.
"""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from precast.runtime.errors import InputError
from precast.runtime.llm.mapped_kv import MappedKV, page_block_size
from precast.runtime.llm.model_runner import LLMSpec, ModelRunner

__all__ = ["MappedModelRunner"]


class MappedModelRunner(ModelRunner):
    """ModelRunner over a MappedKV pool (same step() contract; ``key_cache[i]`` views [NB, KV, bs, D])."""

    def __init__(self, session, spec: LLMSpec, num_blocks: int, path=None, slots: int = 64):
        if num_blocks < 1:
            raise InputError(f"num_blocks must be >= 1, got {num_blocks}")
        if slots < 1:
            raise InputError(f"slots must be >= 1, got {slots}")
        if (spec.block_size * spec.head_size * 4) % mmap.PAGESIZE:  # another page size than the compile's
            spec = dataclasses.replace(
                spec, block_size=page_block_size(spec.head_size, at_least=spec.block_size)
            )
        self.path = path
        self.spec = spec
        self.num_blocks = int(num_blocks)
        self._session = session
        self.kv = MappedKV(
            spec.layers,
            spec.kv_heads,
            spec.head_size,
            spec.block_size,
            self.num_blocks,
            spec.max_context,
            slots,
        )
        pool = self.kv.pool  # [L, 2, KV, NB, bs, D]
        self.key_cache = [pool[i, 0].transpose(1, 0, 2, 3) for i in range(spec.layers)]
        self.value_cache = [pool[i, 1].transpose(1, 0, 2, 3) for i in range(spec.layers)]
        self._owner: dict[int, int] = {}  # block holding a request's last written token -> its slot
        self._bindings: dict[tuple[int, int], tuple] = {}  # (first slot, rows) -> (io binding, logits buffer)
        self._io = hasattr(session, "io_binding")

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes

    def close(self) -> None:
        self._bindings.clear()
        self.kv.close()

    # -- step ---------------------------------------------------------------------------------------------
    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        ids, pos, past, new, tables = self._check(input_ids, positions, past_lens, new_lens, block_tables)
        b = ids.shape[0]
        if b > self.kv.slots:
            raise InputError(f"a step of {b} requests exceeds the runner's {self.kv.slots} slots")
        decode = np.flatnonzero(new == 1)
        prefill = np.flatnonzero(new > 1)
        slot_of = self._assign(past, new, tables, decode, prefill)
        logits = np.empty((b, self.spec.vocab), dtype=np.float32)
        if decode.size:
            order = decode[np.argsort(slot_of[decode])]  # slots 0 .. n-1
            logits[order] = self._run(0, ids[order, :1], pos[order, :1], past[order], new[order])
        for r in prefill:
            n = int(new[r])
            logits[r] = self._run(
                int(slot_of[r]), ids[r : r + 1, :n], pos[r : r + 1, :n], past[r : r + 1], new[r : r + 1]
            )[0]
        return logits

    def _assign(self, past, new, tables, decode, prefill) -> np.ndarray:
        """Slot of every row (decode rows in 0 .. len(decode)-1, prefill rows after), views mapped to tables."""
        bs = self.spec.block_size
        slot_of = np.full(len(past), -1, dtype=np.int64)
        nd = len(decode)
        taken = set()

        def prefer(r: int) -> int | None:
            if past[r] == 0:
                return None
            return self._owner.get(int(tables[r, (int(past[r]) - 1) // bs]))

        for rows, lo, hi in ((decode, 0, nd), (prefill, nd, self.kv.slots)):
            rest = []
            for r in rows:
                s = prefer(int(r))
                if s is not None and lo <= s < hi and s not in taken:
                    slot_of[r] = s
                    taken.add(s)
                else:
                    rest.append(int(r))
            free = (s for s in range(lo, hi) if s not in taken)
            for r in rest:
                s = next(free, None)
                if s is None:
                    raise InputError(
                        f"a step of {len(past)} requests exceeds the runner's {self.kv.slots} slots"
                    )
                slot_of[r] = s
                taken.add(s)
        for r in range(len(past)):
            end = int(past[r] + new[r])
            s = int(slot_of[r])
            self.kv.map_table(s, tables[r, : self.spec.blocks_for(end)])
            self._owner[int(tables[r, (end - 1) // bs])] = s
        return slot_of

    def _run(self, slot: int, ids, pos, past, new) -> np.ndarray:
        feeds = {"input_ids": ids, "positions": pos, "past_lens": past, "new_lens": new}
        rows = ids.shape[0]
        if not self._io:  # a session without IO binding (a stand-in): run, then copy the new rows in
            return self._run_copying(slot, feeds)
        key = (slot, rows)
        bound = self._bindings.get(key)
        if bound is None:
            bound = self._bind(slot, rows)
        io, logits = bound
        for name, arr in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(arr))
        self._session.run_with_iobinding(io)
        return logits.copy()

    def _bind(self, slot: int, rows: int):
        if len(self._bindings) >= 256:
            self._bindings.clear()
        io = self._session.io_binding()
        shape = [rows, self.spec.kv_heads, self.kv.context, self.spec.head_size]
        for i, (pair_in, pair_out) in enumerate(zip(self.spec.kv_inputs, self.spec.kv_outputs)):
            for kind in (0, 1):
                addr = self.kv.view_address(i, kind, slot)
                io.bind_input(pair_in[kind], "cpu", 0, np.float32, shape, addr)
                io.bind_output(pair_out[kind], "cpu", 0, np.float32, shape, addr)  # same buffer: in place
        logits = np.empty((rows, self.spec.vocab), dtype=np.float32)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self._bindings[(slot, rows)] = (io, logits)
        return io, logits

    def _run_copying(self, slot: int, feeds: dict) -> np.ndarray:
        rows = feeds["input_ids"].shape[0]
        views = {}
        for i, pair in enumerate(self.spec.kv_inputs):
            for kind in (0, 1):
                views[pair[kind]] = self.kv.view(i, kind, slot, rows)
        names = ["logits"] + [n for pair in self.spec.kv_outputs for n in pair]
        out = dict(zip(names, self._session.run(names, {**feeds, **views})))
        past, new = feeds["past_lens"], feeds["new_lens"]
        for pair_in, pair_out in zip(self.spec.kv_inputs, self.spec.kv_outputs):
            for kind in (0, 1):
                view, present = views[pair_in[kind]], out[pair_out[kind]]
                for r in range(rows):
                    lo, hi = int(past[r]), int(past[r] + new[r])
                    view[r, :, lo:hi] = present[r, :, lo:hi]
        return out["logits"]
