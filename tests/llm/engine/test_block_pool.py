import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precast.runtime.llm.block_pool import BlockPool
from precast.runtime.llm.kv_cache_manager import KVCacheManager, block_hashes


def test_allocate_free_refcounts():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1 and all(pool.refcount(b) == 1 for b in a)
    assert pool.allocate(2) is None and pool.num_free == 1  # full: nothing taken
    pool.share(a[:1])
    assert pool.refcount(a[0]) == 2
    pool.free(a)
    assert pool.refcount(a[0]) == 1 and pool.num_free == 3
    pool.free(a[:1])
    assert pool.num_free == 4 and pool.num_used == 0
    with pytest.raises(RuntimeError):
        pool.free(a[:1])
    pool.check()


def test_cached_free_block_is_revived_then_evicted():
    pool = BlockPool(2, 4)
    (b,) = pool.allocate(1)
    pool.register(b, b"h")
    pool.free([b])
    assert pool.lookup(b"h") == b and pool.num_free == 2  # free but still cached
    pool.share([b])  # revive
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.free([b])
    pool.allocate(2)  # reuse evicts the hash
    assert pool.lookup(b"h") is None
    pool.check()


def test_prefix_blocks_shared_and_hashes_chained():
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool)
    a = list(range(1, 11))  # 2 full blocks + 2
    assert kv.match_prefix("a", a) == 0
    assert kv.allocate_slots("a", 0, len(a)) == []
    kv.commit("a", a, len(a))
    b = a[:8] + [40, 41, 42]
    assert kv.match_prefix("b", b) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert all(pool.refcount(x) == 2 for x in kv.block_table("a")[:2])
    # same second block after a different first block: chained hash does not match
    c = [9, 9, 9, 9] + a[4:8]
    assert kv.match_prefix("c", c) == 0
    assert block_hashes(c, 4)[1] != block_hashes(a, 4)[1]


def test_copy_on_write_when_whole_prompt_is_cached():
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool)
    p = list(range(8))
    kv.match_prefix("a", p)
    kv.allocate_slots("a", 0, 8)
    kv.commit("a", p, 8)
    # the whole prompt is cached: the last token is recomputed, into a private copy of the shared block
    assert kv.match_prefix("b", p) == 7
    shared_last = kv.block_table("b")[1]
    copies = kv.allocate_slots("b", 7, 1)
    assert copies == [(shared_last, kv.block_table("b")[1])] and copies[0][0] != copies[0][1]
    assert pool.refcount(shared_last) == 1 and kv.block_table("b")[0] == kv.block_table("a")[0]
    kv.free("a")
    kv.free("b")
    assert pool.num_free == 16
    pool.check()


def test_memory_grows_with_tokens():
    pool = BlockPool(100, 4)
    kv = KVCacheManager(pool)
    kv.match_prefix("a", [1, 2, 3])
    kv.allocate_slots("a", 0, 3)
    assert kv.num_blocks_held("a") == 1
    kv.allocate_slots("a", 3, 1)
    assert kv.num_blocks_held("a") == 1
    kv.allocate_slots("a", 4, 1)
    assert kv.num_blocks_held("a") == 2 and pool.num_used == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 2), st.integers(1, 9)), max_size=60))
def test_randomized_accounting_never_leaks(ops):
    """Random admit / grow / commit / free: refcounts match owners and everything is free at the end."""
    pool = BlockPool(12, 4)
    kv = KVCacheManager(pool)
    toks: dict[str, list[int]] = {}
    done: dict[str, int] = {}
    for rid, op, n in ops:
        if op == 0 and rid not in toks:
            toks[rid] = [n % 3] * (n + 4)  # few distinct prompts -> prefix hits
            done[rid] = kv.match_prefix(rid, toks[rid])
        elif op == 1 and rid in toks:
            start = done[rid]
            if kv.allocate_slots(rid, start, n) is None:
                kv.free(rid)
                del toks[rid]
                continue
            toks[rid] += [7] * max(0, start + n - len(toks[rid]))
            done[rid] = start + n
            kv.commit(rid, toks[rid], done[rid])
        elif op == 2 and rid in toks:
            kv.free(rid)
            del toks[rid]
        pool.check()
        owners = {}
        for r in toks:
            for blk in kv.block_table(r):
                owners[blk] = owners.get(blk, 0) + 1
        assert all(pool.refcount(b) == owners.get(b, 0) for b in range(pool.num_blocks))
    for r in list(toks):
        kv.free(r)
    assert pool.num_free == pool.num_blocks
