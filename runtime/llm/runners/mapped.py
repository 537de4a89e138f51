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

from precast.errors import InputError
from precast.runtime.llm.runners.gather import LLMSpec, ModelRunner
from precast.runtime.llm.runners.mapped_kv import MappedKV, page_block_size
from precast.runtime.llm.scheduler import SchedulerOutput

__all__ = ["MAPPED_STEP_INPUTS", "MappedModelRunner", "NativeLookup", "gqa_lengths"]

# The mapped step graph's inputs besides input_ids/positions and the KV views: GroupQueryAttention's own
# lengths (so the graph spends no nodes deriving them) and the row whose logits the step returns.
MAPPED_STEP_INPUTS = ("seqlens_k", "total_sequence_length", "last_index")


def gqa_lengths(past_lens, new_lens, s: int) -> dict[str, np.ndarray]:
    """past_lens/new_lens [B] of a step with S new-token columns -> the mapped graph's length inputs."""
    past = np.asarray(past_lens, dtype=np.int64)
    new = np.asarray(new_lens, dtype=np.int64)
    return {
        "seqlens_k": (past + (s - 1)).astype(np.int32),  # row b attends to [0, past_b + s] for query s
        "total_sequence_length": np.array(int(past.max()) + s, dtype=np.int32),
        "last_index": (new - 1)[:, None],
    }


_AHEAD = 8  # blocks mapped past a table's end, on the guess that the sequence gets them next


class _Binding:
    """One IO binding: KV views of slots slot .. slot+rows-1 (past = present), logits buffer, input arrays."""

    def __init__(self, io, logits: np.ndarray, decode: dict[str, np.ndarray]):
        self.io, self.logits, self.decode = io, logits, decode
        self.inputs: dict[str, np.ndarray] | None = None  # the arrays bound now (kept alive here)

    def bind_inputs(self, arrays: dict[str, np.ndarray]) -> None:
        for name, arr in arrays.items():
            self.io.bind_cpu_input(name, arr)
        self.inputs = arrays

    def fill_one(self, token: int, position: int) -> None:
        """The one-row decode inputs, in place (S = 1: seqlens_k = past_lens; element writes: a third of the
        cost of list-to-array slice writes)."""
        d = self.decode
        d["input_ids"][0, 0] = token
        d["positions"][0, 0] = d["seqlens_k"][0] = position
        d["total_sequence_length"][()] = position + 1


class NativeLookup:
    """ORT's C++ session under the session a step runs on (ort_session.native_session), looked up again only
    when that session changes (a spin switch's pick, a stage session a caller replaced). ORT's Python
    run_with_iobinding spends ~6 us a call on WebGPU graph-capture checks, as long as a whole small-model
    decode step's Python: the runners call the C++ one directly; a session that wraps ORT's (a stand-in,
    a timer) is None here, and its own run_with_iobinding runs."""

    __slots__ = ("native", "session")

    def __init__(self):
        self.session, self.native = _NOT_LOOKED_UP, None

    def __call__(self, session):
        if session is not self.session:
            from precast.runtime.backends.ort_session import native_session

            self.session, self.native = session, native_session(session)
        return self.native


_NOT_LOOKED_UP = object()


class MappedModelRunner(ModelRunner):
    """ModelRunner over a MappedKV pool (same step() / execute() contract; ``key_cache[i]`` views [NB, KV, bs, D])."""

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
        self._mapped = [[] for _ in range(slots)]  # kv.mapped as Python lists (the per-step check)
        self._bindings: dict[tuple[int, int], _Binding] = {}  # (first slot, rows) -> its IO binding
        self._io = hasattr(session, "io_binding")
        self._native = NativeLookup()
        self._again: list[int] | None = None  # slots of the last _decode_rows rows (for _decode_steady)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the pool file (its pages appear when first written: kv_resident_bytes)."""
        return self.kv.nbytes

    def close(self) -> None:
        self._bindings.clear()
        self.kv.close()

    # -- step ---------------------------------------------------------------------------------------------
    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        ids, pos, past, new, tables = self._check(input_ids, positions, past_lens, new_lens, block_tables)
        self._note_written(past, new, tables)
        return self._step(ids, pos, past, new, tables).copy()

    def _step(self, ids, pos, past, new, tables, last=None) -> np.ndarray:
        self._again = None
        b = ids.shape[0]
        if b > self.kv.slots:
            raise InputError(f"a step of {b} requests exceeds the runner's {self.kv.slots} slots")
        past_l, new_l = past.tolist(), new.tolist()  # Python ints: cheaper than numpy scalars at small B
        decode = [r for r in range(b) if new_l[r] == 1]
        prefill = [r for r in range(b) if new_l[r] > 1]
        slot_of = self._assign(past_l, new_l, tables.tolist(), decode, prefill)
        if decode:
            rows = self._decode(
                [slot_of[r] for r in decode], ids[decode, 0].tolist(), [past_l[r] for r in decode]
            )
            if len(decode) == b and last is None:  # the steady state: one batched decode run, no prefill
                return rows
        q = (
            1 if last is None else last.shape[1]
        )  # logits rows per request (a decode row's: its one, repeated)
        logits = np.empty((b, q, self.spec.vocab), dtype=np.float32)
        if decode:
            logits[decode] = rows[:, None]
        for r in prefill:
            n = new_l[r]
            logits[r] = self._run(
                slot_of[r],
                ids[r : r + 1, :n],
                pos[r : r + 1, :n],
                past[r : r + 1],
                new[r : r + 1],
                None if last is None else last[r : r + 1],
            )
        return logits.reshape(b * q, self.spec.vocab)

    # -- the engine's entry point (StepRunner.execute, by the step's kind) ------------------------------
    def _decode_rows(self, out: SchedulerOutput) -> np.ndarray:
        """Decode rows only, from Python lists: each row's token at its position, slots assigned and mapped
        to the rows' tables. Trusted input; logits valid until the next step."""
        b = len(out.rows)
        if b > self.kv.slots:
            raise InputError(f"a step of {b} requests exceeds the runner's {self.kv.slots} slots")
        positions = [r.num_computed for r in out.rows]
        tokens = [r.token_ids[p] for r, p in zip(out.rows, positions)]
        slot_of = self._assign(positions, [1] * b, out.block_tables, list(range(b)), [])
        self._again = slot_of
        return self._decode(slot_of, tokens, positions)

    def _decode_steady(self, out: SchedulerOutput) -> np.ndarray:
        """The last _decode_rows' rows again, each one token further, no table changed (the scheduler's
        STEADY delta): the slots and their mappings are reused as they are, without re-deriving them."""
        if self._again is None or len(self._again) != len(out.rows):  # (a step() ran in between)
            return self._decode_rows(out)
        rows = out.rows
        return self._decode(self._again, [r.token_ids[-1] for r in rows], [r.num_computed for r in rows])

    def single_decoder(self):
        """For the engine's batch-1 steady burst: ``run(token, position) -> logits row`` of the one row the
        last decode ran (slot 0, its views mapped through the current block), bound buffers filled in
        place; None when that run was not a one-row decode in slot 0 or the session has no IO binding.
        Valid while the row stays inside its mapped blocks (the scheduler's STEADY steps)."""
        if self._again != [0] or not self._io:
            return None
        bound = self._bindings.get((0, 1))
        if bound is None or bound.inputs is not bound.decode:
            return None
        sess = self._native(self._active_session())  # (once per burst: the spin switch's pick of this step)
        if sess is None:
            return None
        fill, binding, row = bound.fill_one, bound.io.native, bound.logits[0]

        def run(token: int, position: int) -> np.ndarray:
            fill(token, position)
            sess.run_with_iobinding(binding, None)
            return row

        return run

    def _row_groups(self, out: SchedulerOutput) -> list[list[int]]:
        # One call for all rows: decode rows batched in slots 0 .. n-1, each prefill row alone past them
        # (split calls would hand prefill rows the decode rows' slots and remap them every step).
        return [list(range(len(out.rows)))]

    def _mixed(self, out: SchedulerOutput) -> np.ndarray:
        if out.logit_rows is not None:
            return self._mixed_rows(out)
        return self._step(*self._arrays(out, range(len(out.rows))))

    def _decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> np.ndarray:
        """One batched decode run of the rows in ``slots`` (exactly 0 .. n-1, any order); logits in row order."""
        n = len(tokens)
        identity = slots == list(range(n))
        if not identity:
            order = sorted(range(n), key=slots.__getitem__)  # the row in slot 0, 1, ...
            tokens, positions = [tokens[r] for r in order], [positions[r] for r in order]
        if self._io:
            bound = self._bindings.get((0, n)) or self._bind(0, n)
            d = bound.decode  # the binding's own input buffers, filled in place (bound once)
            if bound.inputs is not d:
                bound.bind_inputs(d)
            if n == 1:
                bound.fill_one(tokens[0], positions[0])
            else:
                d["input_ids"][:, 0] = tokens
                d["positions"][:, 0] = positions
                d["seqlens_k"][:] = positions
                d["total_sequence_length"][()] = max(positions) + 1
            self._run_bound(bound.io)
            out = bound.logits
        else:
            past, ones = np.array(positions, dtype=np.int64), np.ones(n, dtype=np.int64)
            out = self._run(0, np.array(tokens, dtype=np.int64)[:, None], past[:, None], past, ones)
        if identity:
            return out
        logits = np.empty_like(out)
        logits[order] = out
        return logits

    def _assign(self, past: list, new: list, tables: list, decode: list, prefill: list) -> list[int]:
        """Slot of every row (decode rows in 0 .. len(decode)-1, prefill rows after), views mapped to tables."""
        bs = self.spec.block_size
        slot_of = [-1] * len(past)
        nd = len(decode)
        taken = set()
        for rows, lo, hi in ((decode, 0, nd), (prefill, nd, self.kv.slots)):
            rest = []
            for r in rows:
                s = self._owner.get(tables[r][(past[r] - 1) // bs]) if past[r] else None
                if s is not None and lo <= s < hi and s not in taken:
                    slot_of[r] = s
                    taken.add(s)
                else:
                    rest.append(r)
            free = (s for s in range(lo, hi) if s not in taken)
            for r in rest:
                s = next(free, None)
                if s is None:
                    raise InputError(
                        f"a step of {len(past)} requests exceeds the runner's {self.kv.slots} slots"
                    )
                slot_of[r] = s
                taken.add(s)
        for r, s in enumerate(slot_of):
            end = past[r] + new[r]
            table = tables[r][: -(-end // bs)]
            if table != self._mapped[s][: len(table)]:  # (a Python list compare: the common no-change case)
                self.kv.map_table(s, table, ahead=_AHEAD)
                self._mapped[s] = self.kv.mapped[s].tolist()
            self._owner[table[-1]] = s
        return slot_of

    def _run(self, slot: int, ids, pos, past, new, last=None) -> np.ndarray:
        """Rows ``ids`` [rows, S] in slots slot .. slot+rows-1: logits [rows, V] of each one's last new token,
        or with ``last`` (last_index [rows, Q]) [rows*Q, V] of the tokens it indexes."""
        rows, s = ids.shape
        lengths = gqa_lengths(past, new, s)
        if last is not None:
            lengths["last_index"] = np.ascontiguousarray(last, dtype=np.int64)
        if not self._io:  # a session without IO binding (a stand-in): run, then copy the new rows in
            feeds = {"input_ids": ids, "positions": pos, **lengths}
            return self._run_copying(slot, feeds, past, new)
        bound = self._bindings.get((slot, rows)) or self._bind(slot, rows)
        # (a prefill row; decode runs through _decode) ORT's binding does not own a numpy input: keep the
        # arrays alive while they are bound
        bound.bind_inputs(
            {"input_ids": np.ascontiguousarray(ids), "positions": np.ascontiguousarray(pos), **lengths}
        )
        q = lengths["last_index"].shape[1]
        if q == 1:
            self._run_bound(bound.io)
            return bound.logits
        # several logits rows per request (speculative verification): a buffer of that size for this run
        logits = np.empty((rows * q, self.spec.vocab), dtype=np.float32)
        bound.io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        try:
            self._run_bound(bound.io)
        finally:
            shape = list(bound.logits.shape)
            bound.io.bind_output("logits", "cpu", 0, np.float32, shape, bound.logits.ctypes.data)
        return logits

    def _run_bound(self, io) -> None:
        # The binding's C++ session directly (NativeLookup); a wrapper keeps its run_with_iobinding.
        # With a spin switch the binding (made on the calm session) runs on the session it picks: a CPU
        # binding is its names and bound buffers, which both sessions of the one graph take alike.
        session = self._active_session()
        sess = self._native(session)
        if sess is not None:
            sess.run_with_iobinding(io.native, None)
        else:
            session.run_with_iobinding(io)

    def _bind(self, slot: int, rows: int) -> _Binding:
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
        decode = {  # S = 1: seqlens_k = past_lens, last_index = 0
            "input_ids": np.zeros((rows, 1), np.int64),
            "positions": np.zeros((rows, 1), np.int64),
            "seqlens_k": np.zeros(rows, np.int32),
            "total_sequence_length": np.zeros((), np.int32),
            "last_index": np.zeros((rows, 1), np.int64),
        }
        bound = self._bindings[(slot, rows)] = _Binding(io, logits, decode)
        return bound

    def _run_copying(self, slot: int, feeds: dict, past, new) -> np.ndarray:
        rows = feeds["input_ids"].shape[0]
        views = {}
        for i, pair in enumerate(self.spec.kv_inputs):
            for kind in (0, 1):
                views[pair[kind]] = self.kv.view(i, kind, slot, rows)
        names = ["logits"] + [n for pair in self.spec.kv_outputs for n in pair]
        out = dict(zip(names, self._session.run(names, {**feeds, **views})))
        for pair_in, pair_out in zip(self.spec.kv_inputs, self.spec.kv_outputs):
            for kind in (0, 1):
                view, present = views[pair_in[kind]], out[pair_out[kind]]
                for r in range(rows):
                    lo, hi = int(past[r]), int(past[r] + new[r])
                    view[r, :, lo:hi] = present[r, :, lo:hi]
        return out["logits"]
