"""A pool of fixed-size KV blocks: reference counts, free lists, and the prefix-cache index.

A block is only an id here; the K/V tensors live in the model runner's pools ([NB, KV, block_size, D]).

    allocate(n) -> [ids] | None      None when the pool cannot give n blocks (the caller preempts or waits)
    share(ids)                       one more owner for each block (prefix reuse)
    free(ids)                        one owner less; at zero the block goes back to a free list

The pool is a high-water-mark allocator, so KV memory grows on demand: the runners' pools are lazily backed
(pages appear when first written), and blocks at or above ``num_touched`` have never been handed out, so
their pages were never touched. allocate() takes, for each block, the first of

    1. the caller's successor (``after + 1``), when it is a freed block caching nothing: consecutive ids
       (the mapped KV layout maps a run with one call, and ahead of need)
    2. a freed block caching nothing (most recently freed first: its pages are resident and warm)
    3. a fresh block (the mark advances: new memory). Only here, so a fresh block is taken only while no
       freed plain block is left; it is the successor anyway when the caller's last block is the newest.
    4. a freed block that still caches a prefix, oldest freed first (LRU eviction of the prefix cache)

so ``num_touched`` never exceeds the peak of blocks in use plus cached free ones: resident KV memory follows
the load (and the prefixes kept), not the pool's size.

A full block may carry a content hash. When freed it stays in the hash index (its K/V are still valid)
until it is evicted, so a later request with the same prefix can revive it.
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
        self._next_fresh = 0  # blocks >= this were never handed out (their memory is untouched)
        self._free_plain: dict[int, None] = {}  # freed, caching nothing (insertion order: LIFO pops)
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # freed, hash kept: oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    # -- accounting ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached) + self.num_blocks - self._next_fresh

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_touched(self) -> int:
        """Blocks ever handed out (the high-water mark): the runners' pools hold memory for these only."""
        return self._next_fresh

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """n blocks (refcount 1, no hash), or None when fewer than n are free.

        ``after``: the caller's last block. Its successors are taken first when they are free and hold no
        cached prefix, so a sequence's blocks tend to be consecutive ids (the mapped KV layout then maps
        them with one call, and ahead of need). Then come freed blocks caching nothing, fresh ones, and
        last cached free blocks, least recently freed first (module docstring).
        """
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            nxt = out[-1] if out else after
            succ = -1 if nxt is None else nxt + 1
            if succ in self._free_plain:
                del self._free_plain[succ]
                block = succ
            elif self._free_plain:
                block, _ = self._free_plain.popitem()
            elif self._next_fresh < self.num_blocks:
                block = self._next_fresh
                self._next_fresh += 1
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._forget_hash(block)  # evict: its old contents are about to be overwritten
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, blocks: list[int]) -> None:
        """Add one owner to each block (a live block, or a cached free one being revived)."""
        for b in blocks:
            if self._refs[b] == 0:
                if b in self._free_cached:
                    del self._free_cached[b]
                elif b in self._free_plain:
                    del self._free_plain[b]
                else:
                    raise RuntimeError(f"share: block {b} was never allocated (it holds no K/V)")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each block; blocks reaching zero return to a free list.

        Blocks are released in reverse so that a sequence's tail (least likely to be shared by a
        later prompt) is evicted before its head, and its head is the first plain block reused.
        """
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed more times than allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._free_cached[b] = None
                else:
                    self._free_plain[b] = None

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
        """Internal consistency (tests): the free lists and the fresh range == blocks with refcount 0."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        fresh = set(range(self._next_fresh, self.num_blocks))
        free = {b for b, r in enumerate(self._refs) if r == 0}
        assert not (plain & cached) and not ((plain | cached) & fresh), "a block is on two free lists"
        assert free == plain | cached | fresh, "free lists out of sync with refcounts"
        assert all(r >= 0 for r in self._refs)
        assert cached <= set(self._hash_of) and not plain & set(self._hash_of), "free list vs hash index"
        assert not fresh & set(self._hash_of), "a never-allocated block holds a hash"
        for h, b in self._block_of.items():
            assert self._hash_of.get(b) == h
