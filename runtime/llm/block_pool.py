"""A pool of fixed-size KV blocks: reference counts, a free list, and the prefix-cache index.

A block is only an id here; the K/V tensors live in the model runner's pools ([NB, KV, block_size, D]).

    allocate(n) -> [ids] | None      None when the pool cannot give n blocks (the caller preempts or waits)
    share(ids)                       one more owner for each block (prefix reuse)
    free(ids)                        one owner less; at zero the block goes back to the free list

A full block may carry a content hash. When freed it stays in the hash index (its K/V are still valid)
until the free list hands it out again, so a later request with the same prefix can revive it: the free
list is kept in LRU order and cached blocks are evicted last-freed-last.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockPool"]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"BlockPool needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        # Free blocks in eviction order (oldest freed first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    # -- accounting ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """n fresh blocks (refcount 1, no hash), or None when fewer than n are free.

        ``after``: the caller's last block. Its successors are taken first when they are free and hold no
        cached prefix, so a sequence's blocks tend to be consecutive ids (the mapped KV layout then maps
        them with one call, and ahead of need).
        """
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            nxt = out[-1] if out else after
            if nxt is not None and nxt + 1 in self._free and nxt + 1 not in self._hash_of:
                block = nxt + 1
                del self._free[block]
            else:
                block, _ = self._free.popitem(last=False)
            self._forget_hash(block)  # evict: its old contents are about to be overwritten
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, blocks: list[int]) -> None:
        """Add one owner to each block (a live block, or a cached free one being revived)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each block; blocks reaching zero return to the free list.

        Blocks are released in reverse so that a sequence's tail (least likely to be shared by a
        later prompt) is evicted before its head.
        """
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed more times than allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    # -- prefix-cache index ----------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> int:
        """Record that a full block holds the tokens of block_hash; returns the block cached for it
        (an earlier block with the same contents keeps its place)."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"register: block {block} is not allocated")
        known = self._block_of.get(block_hash)
        if known is not None:
            return known
        if block in self._hash_of:
            return block
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return block

    def _forget_hash(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None and self._block_of.get(h) == block:
            del self._block_of[h]

    def check(self) -> None:
        """Internal consistency (tests): free list == blocks with refcount 0."""
        free = {b for b, r in enumerate(self._refs) if r == 0}
        assert free == set(self._free), "free list out of sync with refcounts"
        assert all(r >= 0 for r in self._refs)
        for h, b in self._block_of.items():
            assert self._hash_of.get(b) == h
