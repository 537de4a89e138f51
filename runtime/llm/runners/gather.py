"""ModelRunner: one forward step of a compiled causal-LM artifact over a paged KV pool (numpy + onnxruntime).

The graph reads past K/V from the pool through block tables (see the LLM contract); after each step
the runner scatters the step's new K/V into the pool slots of positions past_lens .. past_lens+new_lens-1.
Everything above (which blocks a request owns, scheduling, sampling) belongs to the engine.
"""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import (
    LLMSpec,  # the manifest's llm block (re-exported here)
)
from precast.errors import ArtifactError, InputError, UsageError
from precast.runtime.llm.runners.base import RunnerBase

__all__ = ["AUTO_SPIN_MAX_BYTES", "LLMSpec", "ModelRunner", "new_slots"]

# spinning="auto" holds a second (spinning) session, so a second copy of the weights: only up to this size.
# Bigger models' steps last long enough that waking the pool's threads costs little of them.
AUTO_SPIN_MAX_BYTES = 1 << 30


class ModelRunner(RunnerBase):
    """Runs the step graph; owns the KV pools (``key_cache[i]``/``value_cache[i]``: [NB, KV, block_size, D]).

    This class runs the ``"paged"`` layout, whose graph gathers blocks itself and returns the new K/V; a
    ``"mapped"`` one is MappedModelRunner's (runners/mapped.py: the pool mapped into per-request views, read
    and written in place by the graph). runners/factory.py picks between them from the manifest. The engine's
    entry point is ``execute(SchedulerOutput)`` (runner.StepRunner); ``step`` is the checked low-level call
    (benchmarks, perplexity).
    """

    def __init__(self, session, spec: LLMSpec, num_blocks: int, path: Path | None = None):
        if num_blocks < 1:
            raise InputError(f"num_blocks must be >= 1, got {num_blocks}")
        if spec.kv_layout == "mapped":  # (its graph reads views bound in place: no pools to feed it)
            raise UsageError(
                f"{path or 'artifact'}: a 'mapped' step graph runs on MappedModelRunner (open_runner.runner_on)"
            )
        self.path = path
        self.spec = spec
        self.num_blocks = int(num_blocks)
        self._session = session
        shape = (spec.layers, self.num_blocks, spec.kv_heads, spec.block_size, spec.head_size)
        v_shape = (*shape[:-1], spec.value_head_size)  # (0: a latent-attention model has no V pool)
        # One array per K/V holding every layer's pool; key_cache[i] / value_cache[i] are its views, so
        # the step's scatter is one indexed write for all layers instead of one per layer.
        self._k_all, self._v_all = np.zeros(shape, dtype=np.float32), np.zeros(v_shape, dtype=np.float32)
        self.key_cache = list(self._k_all)
        self.value_cache = list(self._v_all)
        self._views = (tuple(self.key_cache), tuple(self.value_cache))
        # The pool inputs of every step (numpy views: ORT reads them in place, no copy).
        self._pool_feeds = {k: pool for (k, _), pool in zip(spec.kv_inputs, self.key_cache)}
        self._pool_feeds.update({v: pool for (_, v), pool in zip(spec.kv_inputs, self.value_cache)})
        self._outputs = ["logits"] + [n for pair in spec.kv_outputs for n in pair]

    def _active_session(self):
        """The session this step runs on (the spin switch's pick, when there is one)."""
        switch = self.spin_switch
        return self._session if switch is None else switch.session()

    @property
    def kv_bytes(self) -> int:
        """Bytes the pools reserve (all layers, K and V). np.zeros maps them lazily: what they hold is
        kv_resident_bytes (runner.StepRunner)."""
        return sum(a.nbytes for a in self.key_cache) + sum(a.nbytes for a in self.value_cache)

    def _check(self, input_ids, positions, past_lens, new_lens, block_tables):
        arrays = [
            np.ascontiguousarray(a, dtype=np.int64)
            for a in (input_ids, positions, past_lens, new_lens, block_tables)
        ]
        ids, pos, past, new, tables = arrays
        if ids.ndim != 2 or pos.shape != ids.shape:
            raise InputError(f"input_ids and positions must both be [B, S]; got {ids.shape} and {pos.shape}")
        b, s = ids.shape
        if past.shape != (b,) or new.shape != (b,):
            raise InputError(f"past_lens and new_lens must be [B]=[{b}]; got {past.shape} and {new.shape}")
        if tables.ndim != 2 or tables.shape[0] != b:
            raise InputError(f"block_tables must be [B, MAXB] with B={b}; got {tables.shape}")
        if b == 0 or s == 0:
            raise InputError(f"empty step: input_ids has shape {ids.shape}")
        past_l, new_l = past.tolist(), new.tolist()  # Python ints: cheaper than reductions at small B
        if min(new_l) < 1 or max(new_l) > s:
            raise InputError(f"new_lens must be within [1, S={s}]; got {new_l}")
        if min(past_l) < 0:
            raise InputError(f"past_lens must be >= 0; got {past_l}")
        end = [p + n for p, n in zip(past_l, new_l)]
        for i, e in enumerate(end):
            if e > self.spec.max_context:
                raise InputError(
                    f"request {i}: {e} tokens exceed the model's max context {self.spec.max_context}"
                )
            if e > tables.shape[1] * self.spec.block_size:
                raise InputError(
                    f"request {i}: {e} tokens need more than the {tables.shape[1]} blocks in its table"
                )
        if tables.size and (tables.min() < 0 or tables.max() >= self.num_blocks):
            raise InputError(f"block_tables hold ids outside [0, {self.num_blocks})")
        if ids.min() < 0 or ids.max() >= self.spec.vocab:
            raise InputError(f"input_ids hold token ids outside [0, {self.spec.vocab})")
        return arrays

    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        """Run one step; write the new tokens' K/V into the pools; return logits [B, V] of each last real token.
        (The engine calls ``execute(SchedulerOutput)``, which builds valid inputs and skips these checks.)"""
        ids, pos, past, new, tables = self._check(input_ids, positions, past_lens, new_lens, block_tables)
        self._note_written(past, new, tables)
        return self._step(ids, pos, past, new, tables)

    TAKES_LAST_INDEX = True

    def _step(self, ids, pos, past, new, tables, last=None) -> np.ndarray:
        if ids.shape[1] > 1 and (ids.shape[0] == 1 or not self.spec.batched_prefill):
            # One request at a time (what a fused-attention graph needs for S > 1), without padding.
            rows = [
                self._run(
                    ids[r : r + 1, : new[r]],
                    pos[r : r + 1, : new[r]],
                    past[r : r + 1],
                    new[r : r + 1],
                    tables[r : r + 1],
                    None if last is None else last[r : r + 1],
                )
                for r in range(ids.shape[0])
            ]
            return np.concatenate(rows, axis=0)
        return self._run(ids, pos, past, new, tables, last)

    def _run(self, ids, pos, past, new, tables, last=None) -> np.ndarray:
        feeds, tables, intact = self._graph_feeds(ids, pos, past, new, tables, last)
        out = self._active_session().run(self._outputs, feeds)
        self._store_kv(out[1:], ids, past, new, tables, intact)
        return out[0]

    def _graph_feeds(self, ids, pos, past, new, tables, last=None) -> tuple[dict, np.ndarray, bool]:
        """The step graph's feeds (the pools included), the block tables trimmed to the blocks the rows use,
        and whether the pools are still the views of the one K and one V array (``_store_kv``'s fast paths)."""
        # The graph gathers every block of the table: hand it only the blocks this step's requests use.
        used = self.spec.blocks_for(int((past + new).max()))
        if tables.shape[1] > used:
            tables = np.ascontiguousarray(tables[:, :used])
        feeds = {
            "input_ids": ids,
            "positions": pos,
            "past_lens": past,
            "new_lens": new,
            "block_tables": tables,
        }
        if self.spec.multi_logits:  # (last_index [B,Q]: the rows whose logits come back)
            feeds["last_index"] = (new - 1)[:, None] if last is None else last
        intact = all(map(operator.is_, self.key_cache, self._views[0])) and all(
            map(operator.is_, self.value_cache, self._views[1])
        )  # the pools are still the views of _k_all/_v_all (a caller may have replaced one)
        if intact:
            feeds.update(self._pool_feeds)
        else:
            for i, (k_name, v_name) in enumerate(self.spec.kv_inputs):
                feeds[k_name] = self.key_cache[i]
                feeds[v_name] = self.value_cache[i]
        return feeds, tables, intact

    def _store_kv(self, kv: list, ids, past, new, tables, intact: bool) -> None:
        """Write the step's new K/V (``kv``: new_key.0, new_value.0, new_key.1, ...) into the pools."""
        if not kv:  # (a state-space model: no K/V layers)
            return
        if intact and ids.shape == (1, 1):  # batch-1 decode: one slot, basic indexing (no fancy scatter)
            slot = int(past[0])
            block, offset = int(tables[0, slot // self.spec.block_size]), slot % self.spec.block_size
            # new_key.i [1, KV, 1, D] of every layer -> [L, KV, D] into the slot [L, KV, D] of [L, NB, KV, bs, D]
            self._k_all[:, block, :, offset] = np.concatenate(kv[0::2], axis=2)[0].transpose(1, 0, 2)
            self._v_all[:, block, :, offset] = np.concatenate(kv[1::2], axis=2)[0].transpose(1, 0, 2)
            return
        b_idx, s_idx, blocks, offsets = new_slots(ids.shape[1], past, new, tables, self.spec.block_size)
        if intact:  # all layers at once: [L, n, KV, D] into [L, NB, KV, bs, D]
            self._k_all[:, blocks, :, offsets] = np.stack(kv[0::2])[:, b_idx, :, s_idx]
            self._v_all[:, blocks, :, offsets] = np.stack(kv[1::2])[:, b_idx, :, s_idx]
            return
        for i in range(self.spec.layers):  # a caller replaced a pool array: write layer by layer
            self.key_cache[i][blocks, :, offsets] = kv[2 * i][b_idx, :, s_idx]
            self.value_cache[i][blocks, :, offsets] = kv[2 * i + 1][b_idx, :, s_idx]


def new_slots(width: int, past, new, tables, block_size: int) -> tuple[np.ndarray, ...]:
    """Where a step's new K/V go: the real new tokens of right-padded rows [B, width] as (request b, token s),
    and the (block, offset) of each one's position past[b] + s in the pool."""
    b_idx, s_idx = np.nonzero(np.arange(width)[None, :] < new[:, None])
    slot = past[b_idx] + s_idx
    return b_idx, s_idx, tables[b_idx, slot // block_size], slot % block_size


# What each KV layout's step graph takes besides the pools, and where a pool's KV-head / head-size dims sit.
_LAYOUT_INPUTS = {
    "paged": ("input_ids", "positions", "past_lens", "new_lens", "block_tables"),
    "mapped": ("input_ids", "positions", "seqlens_k", "total_sequence_length", "last_index"),
}


def check_graph_matches_spec(session, spec: LLMSpec, path) -> None:
    """The manifest's llm block is untrusted: its KV names, layout and sizes must be the graph's, or the
    runner would fail inside ONNX Runtime (an internal error) instead of refusing the artifact (exit 3)."""
    ins = {i.name: i.shape for i in session.get_inputs()}
    outs = {o.name: o.shape for o in session.get_outputs()}
    where = f"{path}/manifest.json: llm block"
    if spec.kv_layout not in _LAYOUT_INPUTS:
        raise ArtifactError(f"{where}: kv_layout {spec.kv_layout!r} needs an OpenVINO artifact")
    step_inputs = _LAYOUT_INPUTS[spec.kv_layout]
    if spec.multi_logits and "last_index" not in step_inputs:  # (a paged graph's own last_index, last)
        step_inputs = (*step_inputs, "last_index")
    states = tuple(st.name for st in spec.states)
    for name in (*step_inputs, *(n for pair in spec.kv_inputs for n in pair), *states):
        if name not in ins:
            raise ArtifactError(
                f"{where} does not match the model: {name!r} is not an input of the step graph "
                f"(kv_layout {spec.kv_layout!r})"
            )
    for name in (
        "logits",
        *(n for pair in spec.kv_outputs for n in pair),
        *(st.output for st in spec.states),
    ):
        if name not in outs:
            raise ArtifactError(
                f"{where} does not match the model: {name!r} is not an output of the step graph"
            )
    for st in spec.states:  # [B, *shape], static: the runner's slots are sized by the block
        for dims in (ins[st.name], outs[st.output]):
            if len(dims) != 1 + len(st.shape) or any(g != w for g, w in zip(dims[1:], st.shape)):
                raise ArtifactError(
                    f"{where} does not match the model: state {st.name!r} is {dims} in the graph, the block "
                    f"says [B, {', '.join(map(str, st.shape))}]"
                )
    fed = {*step_inputs, *(n for pair in spec.kv_inputs for n in pair), *states}
    extra = sorted(set(ins) - fed)
    if extra:  # (the first step would fail inside ONNX Runtime on the missing feed)
        raise ArtifactError(
            f"{where} does not match the model: the step graph's input {extra[0]!r} is not among the "
            f"block's kv_inputs (layers={spec.layers})" + (" or states" if spec.states else "")
        )
    spec.check_logits_shape(outs["logits"], where)
    for pair in spec.kv_inputs:
        for name, size in zip(pair, (spec.head_size, spec.value_head_size)):
            dims = ins[name]
            graph = (dims[1], dims[3]) if len(dims) == 4 else None
            if graph is None or any(
                isinstance(g, int) and g != w for g, w in zip(graph, (spec.kv_heads, size))
            ):
                raise ArtifactError(
                    f"{where} does not match the model: {name!r} is {dims} in the graph, the block says "
                    f"kv_heads={spec.kv_heads}, head size {size}"
                )
