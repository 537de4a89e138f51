"""A tiny deterministic numpy "model" with the ModelRunner.step contract, for engine tests.

Each token's K holds (token id, position + 1) in every layer; V holds a per-layer variant. The logits of a
request's last token are a pseudo-random function of everything read back for it: the past gathered from
the pools through its block table, plus the new tokens. A paging, prefix-sharing or copy-on-write bug
(wrong block, stale slot, another request's data) changes what is read, hence the tokens.
`reference_greedy` runs the same function on the plain token list, with no cache at all.

It is a RunnerBase, so the engine drives it through the real ``execute(SchedulerOutput)`` dispatch: a steady
step reuses the block tables of the decode step before it (as the real runners reuse their arrays and slot
mappings), so a steady delta sent when a table changed reads the wrong blocks and changes the tokens.
``kinds`` records each executed step's kind.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from precast.runtime.llm.runners.base import RunnerBase

__all__ = ["FakeRunner", "FakeSpec", "reference_greedy", "reference_logits"]


@dataclass(frozen=True)
class FakeSpec:
    vocab: int = 64
    block_size: int = 4
    max_context: int = 128
    layers: int = 2
    kv_heads: int = 1
    head_size: int = 2
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    bos_id: int | None = None


def _logits_of(rows: np.ndarray, vocab: int) -> np.ndarray:
    """rows: [T, 2] (token, position + 1) of the whole history -> logits [V]."""
    digest = hashlib.blake2b(np.ascontiguousarray(rows, dtype=np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return (3.0 * rng.standard_normal(vocab)).astype(np.float32)


def reference_logits(tokens: list[int], vocab: int) -> np.ndarray:
    rows = np.stack([np.asarray(tokens), np.arange(1, len(tokens) + 1)], axis=1)
    return _logits_of(rows, vocab)


def reference_greedy(prompt: list[int], n: int, vocab: int = 64) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(np.argmax(reference_logits(toks, vocab))))
    return toks[len(prompt) :]


class FakeRunner(RunnerBase):
    def __init__(self, spec: FakeSpec | None = None, num_blocks: int = 64):
        self.spec = spec or FakeSpec()
        self.num_blocks = num_blocks
        s = self.spec
        shape = (num_blocks, s.kv_heads, s.block_size, s.head_size)
        self.key_cache = [np.zeros(shape, np.float32) for _ in range(s.layers)]
        self.value_cache = [np.zeros(shape, np.float32) for _ in range(s.layers)]
        self.calls: list[tuple[int, int]] = []  # (B, S) of every step
        self.steps: list[dict] = []  # feeds of every step (tests inspect batching)
        self.kinds: list[str] = []  # StepKind value of every execute()

    def execute(self, out):
        self.kinds.append(out.kind.value)
        return super().execute(out)

    def step(self, input_ids, positions, past_lens, new_lens, block_tables) -> np.ndarray:
        return self._step(
            *(
                np.asarray(a, dtype=np.int64)
                for a in (input_ids, positions, past_lens, new_lens, block_tables)
            )
        )

    def _step(self, ids, pos, past, new, tables) -> np.ndarray:
        b, s = ids.shape
        bs, nb = self.spec.block_size, self.key_cache[0].shape[0]
        assert pos.shape == (b, s) and past.shape == (b,) and new.shape == (b,) and tables.shape[0] == b
        assert ((new >= 1) & (new <= s)).all(), new
        assert ((tables >= 0) & (tables < nb)).all()
        assert (past + new <= tables.shape[1] * bs).all(), "block table too short"
        assert (past + new <= self.spec.max_context).all()
        self.calls.append((b, s))
        self.steps.append({"past": past.tolist(), "new": new.tolist()})
        logits = np.zeros((b, self.spec.vocab), np.float32)
        for i in range(b):
            n, p = int(new[i]), int(past[i])
            assert (pos[i, :n] == np.arange(p, p + n)).all(), "positions must follow the cache"
            slots = np.arange(p)
            blk, off = tables[i, slots // bs], slots % bs
            past_rows = self.key_cache[0][blk, 0, off].astype(np.int64)
            # every layer must hold the same history (CoW copies all layers)
            for layer in range(1, self.spec.layers):
                other = self.key_cache[layer][blk, 0, off].astype(np.int64)
                vals = self.value_cache[layer][blk, 0, off].astype(np.int64)
                past_rows = np.where(
                    (other == past_rows) & (vals[:, :1] == past_rows[:, :1] * (layer + 1)), past_rows, -1
                )
            new_rows = np.stack([ids[i, :n], pos[i, :n] + 1], axis=1)
            logits[i] = _logits_of(np.concatenate([past_rows, new_rows]), self.spec.vocab)
            # scatter the new K/V (the real ModelRunner does this after its session run)
            wslots = np.arange(p, p + n)
            wblk, woff = tables[i, wslots // bs], wslots % bs
            for layer in range(self.spec.layers):
                self.key_cache[layer][wblk, 0, woff] = new_rows
                self.value_cache[layer][wblk, 0, woff] = new_rows * np.array([layer + 1, 1])
        return logits
