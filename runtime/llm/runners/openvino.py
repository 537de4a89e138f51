"""OVStepRunner: the engine's steps on an OpenVINO step graph whose attention is PagedAttention (numpy + openvino).

The graph (kv_layout "ov-paged", compiler/decoder/ov_decoder.py) takes every scheduled token of a step back to back,
no padding, and per request its past length and its blocks:

    input_ids, positions [1,T]       tokens of row 0, then row 1, ...
    past_lens [B] i32                rows' cached tokens (num_computed)
    subsequence_begins [B+1] i32     where each row's tokens start in T
    block_indices [N] i32            each row's blocks (the engine's block tables, trimmed to the tokens)
    block_indices_begins [B+1] i32   where each row's blocks start in N
    max_context_len [] i32           the longest row, past + new
    logits_indices [N] i64           each row's last token in T (speculative verification: its last Q_b)
    key_cache.i / value_cache.i      the pool, [NB, KV, block, D] as the compiled model lays it out
  -> logits [N, V]

So a mixed step (prefill chunks among decodes) is one call, and the kernel writes the new tokens' K/V into the
pool blocks itself: no gather, no scatter, no padding. The pool tensors are allocated once at the compiled
model's cache shapes (KV precision f32 / f16 / u8 with per-block scales: the plugin's layout) and bound with
``set_tensor`` once; ``key_cache[i]`` / ``value_cache[i]`` are numpy views of them, so copy-on-write block
copies (RunnerBase.execute) are numpy assignments on the pool. A steady decode run only refills its ids,
positions and lengths in place (the bound step tensors share their memory).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.errors import ArtifactError, InputError
from precast.runtime.llm.runners.base import RunnerBase
from precast.runtime.llm.scheduler import SchedulerOutput

__all__ = ["OV_STEP_INPUTS", "OVStepRunner", "step_feeds"]

OV_STEP_INPUTS = (
    "input_ids",
    "positions",
    "past_lens",
    "subsequence_begins",
    "block_indices",
    "block_indices_begins",
    "max_context_len",
    "logits_indices",
)


def step_feeds(
    tokens: list[list[int]],
    pasts: list[int],
    tables: list[list[int]],
    block_size: int,
    logit_rows: list[int] | None = None,
) -> dict[str, np.ndarray]:
    """The step arrays of rows computing ``tokens[b]`` after ``pasts[b]`` cached ones over ``tables[b]``;
    ``logit_rows``: the logits of row b's last logit_rows[b] tokens (speculative verification), else its last."""
    new = [len(t) for t in tokens]
    if logit_rows is None:
        last = np.cumsum(new, dtype=np.int64) - 1
    else:
        ends = np.cumsum(new).tolist()
        last = np.array([e - q + j for e, q in zip(ends, logit_rows) for j in range(q)], dtype=np.int64)
    ends = [p + n for p, n in zip(pasts, new)]
    blocks = [table[: -(-e // block_size)] for table, e in zip(tables, ends)]
    flat = [tok for row in tokens for tok in row]
    pos = [p + j for p, n in zip(pasts, new) for j in range(n)]
    return {
        "input_ids": np.array(flat, dtype=np.int64).reshape(1, -1),
        "positions": np.array(pos, dtype=np.int64).reshape(1, -1),
        "past_lens": np.array(pasts, dtype=np.int32),
        "subsequence_begins": np.cumsum([0, *new], dtype=np.int32),
        "block_indices": np.array([b for row in blocks for b in row], dtype=np.int32),
        "block_indices_begins": np.cumsum([0, *map(len, blocks)], dtype=np.int32),
        "max_context_len": np.array(max(ends), dtype=np.int32),
        "logits_indices": last,
    }


class OVStepRunner(RunnerBase):
    """One OpenVINO infer request over the compiled step; owns the pool tensors (``num_blocks`` blocks)."""

    TAKES_LAST_INDEX = True  # (logits_indices lists any tokens of the step: out.logit_rows)

    def __init__(self, compiled, spec: LLMSpec, num_blocks: int, path: Path | None = None):
        import openvino as ov

        if num_blocks < 1:
            raise InputError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec, self.path, self.num_blocks = spec, path, int(num_blocks)
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        check_compiled_matches_spec(compiled, spec, path)
        self._pool: dict[str, ov.Tensor] = {}
        self._memory: list[np.ndarray] = []
        for k_name, v_name in spec.kv_inputs:
            for name in (k_name, v_name):
                port = compiled.input(name)
                dims = port.get_partial_shape()
                shape = [self.num_blocks] + [dims[j].get_length() for j in range(1, dims.rank.get_length())]
                tensor, memory = _lazy_zero_tensor(port.get_element_type(), shape)
                self._memory.append(memory)  # (the tensor does not own it: kept alive with the runner)
                self._request.set_tensor(name, tensor)
                self._pool[name] = tensor
        self.key_cache = [self._pool[k].data for k, _ in spec.kv_inputs]
        self.value_cache = [self._pool[v].data for _, v in spec.kv_inputs]
        self._steady: dict[str, np.ndarray] | None = None  # the bound arrays of the current decode run

    @property
    def kv_bytes(self) -> int:
        """Bytes the pools reserve (all layers, K and V, scales included); see kv_resident_bytes."""
        return sum(int(t.byte_size) for t in self._pool.values())

    def run_step(self, feeds: dict[str, np.ndarray] | None, copy: bool = False) -> np.ndarray:
        """Logits [B, V]: a view of the request's output (execute's contract: valid until the next step; a
        32-row copy is 4 MB a step), or a copy."""
        import openvino as ov

        if feeds is not None:
            for name, arr in feeds.items():
                self._request.set_tensor(name, ov.Tensor(arr, shared_memory=True))
        self._request.infer()
        logits = self._request.get_tensor("logits").data
        return logits.copy() if copy else logits

    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        """ModelRunner.step's checked call (perplexity, benchmarks): right-padded [B, S] ids, each row's
        past and new lengths and block table -> logits [B, V] of each row's last new token. Positions are
        past_lens + 0.. (the graph's rotary reads the ones given; these are the engine's)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        past = [int(p) for p in np.asarray(past_lens).reshape(-1)]
        new = [int(n) for n in np.asarray(new_lens).reshape(-1)]
        tables = [list(map(int, t)) for t in np.asarray(block_tables).reshape(len(past), -1)]
        if ids.ndim != 2 or ids.shape[0] != len(past) or len(new) != len(past):
            raise InputError(
                f"input_ids [B, S] with B = len(past_lens); got {ids.shape} and {len(past)} rows"
            )
        bs = self.spec.block_size
        for b, (p, n, table) in enumerate(zip(past, new, tables)):
            if not 1 <= n <= ids.shape[1] or p < 0 or p + n > self.spec.max_context:
                raise InputError(f"row {b}: {n} new tokens after {p} do not fit [1, {self.spec.max_context}]")
            if p + n > len(table) * bs or any(not 0 <= x < self.num_blocks for x in table):
                raise InputError(
                    f"row {b}: its block table does not hold {p + n} tokens in [0, {self.num_blocks})"
                )
        tokens = [ids[b, :n].tolist() for b, n in enumerate(new)]
        if min(min(t) for t in tokens) < 0 or max(max(t) for t in tokens) >= self.spec.vocab:
            raise InputError(f"input_ids hold token ids outside [0, {self.spec.vocab})")
        self._steady = None
        self._note_written(past, new, tables)
        return self.run_step(step_feeds(tokens, past, tables, bs), copy=True)

    # -- the engine's entry points (runner.RunnerBase.execute) --------------------------------------
    def _mixed(self, out: SchedulerOutput) -> np.ndarray:
        self._steady = None
        tokens = [r.token_ids[r.num_computed : r.num_computed + n] for r, n in zip(out.rows, out.num_new)]
        pasts = [r.num_computed for r in out.rows]
        feeds = step_feeds(tokens, pasts, out.block_tables, self.spec.block_size, out.logit_rows)
        return self.run_step(feeds)

    def _decode_rows(self, out: SchedulerOutput) -> np.ndarray:
        rows = out.rows
        tokens = [[r.token_ids[r.num_computed]] for r in rows]
        feeds = step_feeds(tokens, [r.num_computed for r in rows], out.block_tables, self.spec.block_size)
        self._steady = feeds  # bound below with shared memory: a steady step refills these in place
        return self.run_step(feeds)

    def _decode_steady(self, out: SchedulerOutput) -> np.ndarray:
        feeds = self._steady
        if feeds is None or len(feeds["past_lens"]) != len(out.rows):
            return self._decode_rows(out)
        # The same rows, one token further, every row inside the blocks it had: ids, positions, lengths.
        rows = out.rows
        feeds["input_ids"][0] = [r.token_ids[-1] for r in rows]
        past = [r.num_computed for r in rows]
        feeds["positions"][0] = past
        feeds["past_lens"][:] = past
        feeds["max_context_len"][...] = max(past) + 1
        return self.run_step(None)


def _lazy_zero_tensor(element_type, shape: list[int]):
    """An ov.Tensor over fresh anonymous memory: the kernel hands out zero pages as they are first written,
    so a pool holds memory for the blocks the engine has used, not for all it reserves (an unwritten
    block, a u8 block's scales too, reads as zeros). Page-aligned, so OpenVINO computes in it in place
    (set_tensor binds it; a step writes through it into our numpy views) instead of copying it."""
    import mmap

    import openvino as ov

    nbytes = -(-element_type.bitwidth * int(np.prod(shape)) // 8)
    raw = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]  # (the array keeps the map)
    return ov.Tensor(raw, ov.Shape(shape), element_type), raw


def check_compiled_matches_spec(compiled, spec: LLMSpec, path) -> None:
    """The manifest's llm block is untrusted: the step inputs and every KV name must be the graph's, and the
    pool's KV-head and block dims the block's, or the first step would fail inside OpenVINO."""
    where = f"{path}/manifest.json: llm block"
    names = {n for port in compiled.inputs for n in port.get_names()}
    fed = (*OV_STEP_INPUTS, *(n for pair in spec.kv_inputs for n in pair))
    for name in fed:
        if name not in names:
            raise ArtifactError(
                f"{where} does not match the model: {name!r} is not an input of the step graph"
            )
    extra = sorted(port.get_any_name() for port in compiled.inputs if not port.get_names() & set(fed))
    if extra:  # (the first step would fail inside OpenVINO on the missing tensor)
        raise ArtifactError(
            f"{where} does not match the model: the step graph's input {extra[0]!r} is not among the "
            f"block's kv_inputs (layers={spec.layers})"
        )
    if "logits" not in {n for port in compiled.outputs for n in port.get_names()}:
        raise ArtifactError(f"{where} does not match the model: 'logits' is not an output of the step graph")
    logits = compiled.output("logits").get_partial_shape()
    spec.check_logits_shape([d.get_length() if d.is_static else None for d in logits], where)
    for k_name, v_name in spec.kv_inputs:
        # values: [NB, KV, block, D(+ scales)], keys: [NB, KV, block(+ scales), D] in every precision
        dims = compiled.input(v_name).get_partial_shape()
        got = (dims[1].get_length(), dims[2].get_length()) if _static(dims, 1, 2) else None
        if got != (spec.kv_heads, spec.block_size):
            raise ArtifactError(
                f"{where} does not match the model: {v_name!r} is {dims} once compiled, the block says "
                f"kv_heads={spec.kv_heads}, block_size={spec.block_size}"
            )
        dims = compiled.input(k_name).get_partial_shape()
        if not _static(dims, 3) or dims[3].get_length() != spec.head_size:
            raise ArtifactError(
                f"{where} does not match the model: {k_name!r} is {dims} once compiled, the block says "
                f"head_size={spec.head_size}"
            )


def _static(dims, *axes: int) -> bool:
    """A rank-4 shape whose ``axes`` are static (a compiled pool's KV-head, block and head dims are)."""
    return dims.rank.is_static and dims.rank.get_length() == 4 and all(dims[a].is_static for a in axes)
