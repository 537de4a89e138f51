"""Per-request block tables over a BlockPool: on-demand growth, prefix reuse, copy on write.

    match_prefix(rid, tokens) -> n      share the cached blocks of the longest hashed prefix; n tokens are
                                        already computed (always < len(tokens): the last one must run to
                                        give logits)
    allocate_slots(rid, start, n)       blocks for positions [start, start+n); a shared block in that range
        -> [(src, dst)] | None          is copied first (the engine copies the K/V); None = no room, nothing changed
    commit(rid, tokens, n_computed)     hash the blocks that are now full, so later prompts can reuse them
    trim(rid, n)                        drop the blocks past position n (speculative tokens rejected)
    free(rid)                           drop the request's blocks (and its state slot)
    state_slot(rid) -> int              the request's recurrent state slot (hybrid / state-space models)

Block hashes are chained: hash(block i) covers block i's tokens and the hash of block i-1, so equal
hashes mean equal prefixes, not just equal blocks. Memory grows with the tokens a request holds.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence

import numpy as np

from precast.runtime.llm.block_pool import BlockPool

__all__ = ["KVCacheManager", "block_hashes"]


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of tokens, from block index `start` (parent = hash of block start-1)."""
    out = []
    for i in range(start, len(tokens) // block_size):
        parent = _chain(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


class KVCacheManager:
    """Block tables over ``pool``; with ``state_slots`` > 0 (a hybrid or state-space model) also one recurrent
    state slot per request, taken with its first blocks and given back with them (``free``): a request is
    admitted only when both a slot and its blocks are free. Slots go lowest first, so the slots ever used
    stay the peak of requests at once. Prefix caching cannot apply to such a model (a slot holds the state
    after all of a request's tokens, not after a shared prefix): the engine turns it off."""

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True, state_slots: int = 0):
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self.state_slots = int(state_slots)
        self._free_slots = list(range(self.state_slots))  # a heap
        self._slots: dict[str, int] = {}

    def state_slot(self, rid: str) -> int:
        """The request's state slot (-1: none; a model without recurrent states)."""
        return self._slots.get(rid, -1)

    @property
    def num_slots_used(self) -> int:
        return len(self._slots)

    def block_table(self, rid: str) -> list[int]:
        return self._tables.get(rid, [])

    def request_ids(self) -> list[str]:
        return list(self._tables)

    def num_blocks_held(self, rid: str) -> int:
        return len(self._tables.get(rid, ()))

    def match_prefix(self, rid: str, tokens: Sequence[int]) -> int:
        if self._tables.get(rid):
            raise RuntimeError(f"match_prefix: request {rid} already holds blocks")
        self._tables[rid], self._hashes[rid] = [], []
        if not self.enable_prefix_caching:
            return 0
        hits, hashes = [], []
        for h in block_hashes(tokens, self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
            hashes.append(h)
        self.pool.share(hits)
        self._tables[rid], self._hashes[rid] = hits, hashes
        return min(len(hits) * self.block_size, len(tokens) - 1)

    def allocate_slots(self, rid: str, start: int, n: int) -> list[tuple[int, int]] | None:
        if self.state_slots and rid not in self._slots:
            if not self._free_slots:
                return None  # (nothing taken: no blocks either)
            copies = self._allocate_blocks(rid, start, n)
            if copies is not None:
                self._slots[rid] = heapq.heappop(self._free_slots)
            return copies
        return self._allocate_blocks(rid, start, n)

    def _allocate_blocks(self, rid: str, start: int, n: int) -> list[tuple[int, int]] | None:
        table = self._tables.setdefault(rid, [])
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        if first == last < len(table) and self.pool.refcount(table[first]) == 1:
            return []  # the common decode step: room left in the request's own last block
        self._hashes.setdefault(rid, [])
        shared = [i for i in range(first, min(last + 1, len(table))) if self.pool.refcount(table[i]) > 1]
        grow = max(0, last + 1 - len(table))
        new = self.pool.allocate(grow + len(shared), after=table[-1] if table and not shared else None)
        if new is None:
            return None
        copies = []
        for i, dst in zip(shared, new[: len(shared)]):
            src = table[i]
            copies.append((src, dst))
            table[i] = dst
            self.pool.free([src])
            # The copy is private and about to change, so it no longer matches the shared block's hash.
            del self._hashes[rid][i:]
        table.extend(new[len(shared) :])
        return copies

    def commit(self, rid: str, tokens: Sequence[int], num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        table, hashes = self._tables[rid], self._hashes[rid]
        full = num_computed // self.block_size
        if full <= len(hashes):
            return
        parent = hashes[-1] if hashes else b""
        for h in block_hashes(tokens[: full * self.block_size], self.block_size, len(hashes), parent):
            self.pool.register(table[len(hashes)], h)
            hashes.append(h)

    def trim(self, rid: str, num_tokens: int) -> None:
        """Keep only the blocks of positions [0, num_tokens) (speculative decoding's rejected tokens): the
        blocks past them go back to the pool. Blocks past the computed tokens are never hashed."""
        table = self._tables.get(rid)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        if len(table) > keep:
            self.pool.free(table[keep:])
            del table[keep:]
            del self._hashes[rid][keep:]

    def free(self, rid: str) -> None:
        slot = self._slots.pop(rid, None)
        if slot is not None:
            heapq.heappush(self._free_slots, slot)
        table = self._tables.pop(rid, [])
        self._hashes.pop(rid, None)
        self.pool.free(table)
