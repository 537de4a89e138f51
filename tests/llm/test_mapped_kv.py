"""The mapped KV pool (block tables as page mappings) and the runner that binds it in place."""

from __future__ import annotations

import numpy as np
import pytest

from precast.errors import InputError
from precast.runtime.llm import ModelRunner
from precast.runtime.llm.runners.mapped import MappedModelRunner
from precast.runtime.llm.runners.mapped_kv import (
    MappedKV,
    mapped_kv_supported,
    page_block_size,
)

pytestmark = pytest.mark.skipif(mapped_kv_supported() is not None, reason=str(mapped_kv_supported()))


@pytest.fixture
def kv():
    pool = MappedKV(layers=2, kv_heads=2, head_size=64, block_size=16, num_blocks=8, max_context=80, slots=3)
    yield pool
    pool.close()


def test_page_block_size_fills_whole_pages():
    assert page_block_size(64) == 16  # 16 x 64 x 4 B = 4 KiB
    assert page_block_size(128) == 16 and page_block_size(16) == 64 and page_block_size(24) == 128
    for d in (16, 24, 40, 64, 80, 96, 128):
        assert (page_block_size(d) * d * 4) % 4096 == 0


def test_views_read_and_write_the_mapped_pool_blocks(kv):
    kv.pool[1, 0, 1, 6] = 3.0  # layer 1, K, head 1, block 6
    kv.map_table(2, np.array([5, 6]))
    view = kv.view(1, 0, 2)  # layer 1 K of slot 2: [1, KV, C, D]
    assert view.shape == (1, 2, 80, 64)
    assert (view[0, 1, 16:32] == 3.0).all() and not view[0, 1, :16].any() and not view[0, 0, 16:32].any()
    view[0, 0, 3] = 7.0  # a write through the view lands in block 5 of head 0, offset 3
    assert (kv.pool[1, 0, 0, 5, 3] == 7.0).all() and np.count_nonzero(kv.pool[1, 0, 0]) == 64
    assert not view[0, 0, 32:].any()  # past the table: zero pages, no block


def test_shared_block_is_one_memory_and_remapping_moves_only_changes(kv):
    kv.map_table(0, np.array([1, 2, 3]))
    kv.map_table(1, np.array([1, 2, 7]))  # a shared 2-block prefix, then its own block
    a, b = kv.view(0, 1, 0), kv.view(0, 1, 1)
    a[0, :, 20] = 2.5  # block 2 (shared)
    assert (b[0, :, 20] == 2.5).all()
    a[0, :, 40] = 1.0  # block 3 (slot 0 only)
    assert not b[0, :, 40].any()
    calls = kv.mmap_calls
    # one new block: one call per (layer, K/V, head)
    assert kv.map_table(1, np.array([1, 2, 7, 4])) == 2 * 2 * 2
    assert kv.map_table(1, np.array([1, 2, 7, 4])) == 0 and kv.mmap_calls == calls + 8
    # consecutive blocks at consecutive positions go in one call per (layer, K/V, head)
    assert kv.map_table(2, np.array([4, 5, 6, 7, 0])) == 2 * 8


def test_lookahead_maps_the_next_blocks_and_a_wrong_guess_is_remapped(kv):
    kv.map_table(0, np.array([2, 3]), ahead=3)  # also maps blocks 4, 5, 6 at positions 2, 3, 4
    assert kv.mapped[0, :5].tolist() == [2, 3, 4, 5, 6]
    assert kv.map_table(0, np.array([2, 3, 4]), ahead=3) == 0  # the guess was right: no call
    kv.pool[0, 1, 1, 0] = 5.0
    assert kv.map_table(0, np.array([2, 3, 4, 0]), ahead=3) > 0  # wrong guess: block 0 replaces 5
    assert (kv.view(0, 1, 0)[0, 1, 48:64] == 5.0).all()


def test_block_pool_hands_out_a_sequences_next_block():
    from precast.runtime.llm.block_pool import BlockPool

    pool = BlockPool(8, 16)
    a, b = pool.allocate(2), pool.allocate(1)
    assert a == [0, 1] and b == [2]
    pool.free([2])
    assert pool.allocate(1, after=a[-1]) == [2]  # free and the successor of a's last block
    c = pool.allocate(3)  # [3, 4, 5]: fresh blocks
    pool.free(c[1:])
    assert pool.allocate(2, after=c[0]) == [4, 5]  # freed successors of c's last block
    assert pool.allocate(1, after=5) == [6]  # none freed left: the next fresh block (block_pool.py)
    pool.check()


def test_bad_block_ids_and_page_misfits_are_input_errors(kv):
    with pytest.raises(InputError, match="outside the pool"):
        kv.map_table(0, np.array([8]))
    with pytest.raises(InputError, match="pages"):
        MappedKV(layers=1, kv_heads=1, head_size=64, block_size=8, num_blocks=2, max_context=16, slots=1)


class _NoBinding:
    """An ORT session without io_binding: the runner's copying path (run, then write the new rows in)."""

    def __init__(self, session):
        self._s = session

    def run(self, names, feeds):
        return self._s.run(names, feeds)


def _mixed_schedule(runner, seed: int = 0):
    """Requests join (whole-prompt prefill) and leave while others decode greedily; each request's logits."""
    rng = np.random.default_rng(seed)
    bs = runner.spec.block_size
    free = list(rng.permutation(runner.num_blocks))
    prompts = {r: list(rng.integers(3, runner.spec.vocab, n)) for r, n in enumerate((40, 9, 70, 25))}
    joins, leaves = {0: [0, 1], 2: [2], 4: [3]}, {6: [1]}
    live, done, tables, logs = [], {}, {}, {r: [] for r in prompts}
    for step in range(9):
        for r in joins.get(step, []):
            live.append(r)
            done[r], tables[r] = 0, []
        for r in leaves.get(step, []):
            live.remove(r)  # leaves mid-flight: the others may move slots
        rows = [(r, prompts[r] if done[r] == 0 else [int(np.argmax(logs[r][-1]))]) for r in live]
        for r, new in rows:
            while len(tables[r]) * bs < done[r] + len(new):
                tables[r].append(int(free.pop()))
        s = max(len(n) for _, n in rows)
        ids, pos = np.zeros((len(rows), s), np.int64), np.zeros((len(rows), s), np.int64)
        bt = np.zeros((len(rows), max(len(tables[r]) for r, _ in rows)), np.int64)
        for i, (r, new) in enumerate(rows):
            ids[i, : len(new)] = new
            pos[i, : len(new)] = np.arange(done[r], done[r] + len(new))
            bt[i, : len(tables[r])] = tables[r]
        out = runner.step(ids, pos, [done[r] for r, _ in rows], [len(n) for _, n in rows], bt)
        for i, (r, new) in enumerate(rows):
            done[r] += len(new)
            logs[r].append(out[i])
    return logs


@pytest.mark.slow
def test_in_place_steps_match_the_copying_path_under_a_changing_batch(llm_artifact):
    """IO-bound shared past/present (in place) == run + copy the new rows, while requests join and leave."""
    from precast.runtime.model import load

    fast = ModelRunner.from_artifact(llm_artifact, num_blocks=24)
    model = load(llm_artifact, verify=False)
    slow = MappedModelRunner(_NoBinding(model.session), fast.spec, 24, slots=8)
    assert type(fast).__name__ == "MappedModelRunner" and fast.kv_bytes == fast.kv.pool.nbytes
    a, b = _mixed_schedule(fast), _mixed_schedule(slow)
    for r in a:
        assert len(a[r]) == len(b[r]) > 1
        for x, y in zip(a[r], b[r]):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fast.kv.pool, slow.kv.pool)  # the same K/V in the same blocks


class _Counting:
    """Counts run_with_iobinding calls of what it wraps (ORT's Python session, or its C++ ``_sess``)."""

    def __init__(self, inner):
        self._inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def run_with_iobinding(self, *args):
        self.calls += 1
        return self._inner.run_with_iobinding(*args)


@pytest.mark.slow
def test_steps_run_ort_binding_directly_and_a_wrapped_session_through_its_own_run(llm_artifact):
    """ORT's Python run_with_iobinding is skipped for its C++ session (~6 us a step); a session wrapping
    ORT's (no own _sess) still has its run_with_iobinding called. Same logits either way."""
    from precast.runtime.model import load

    direct = ModelRunner.from_artifact(llm_artifact, num_blocks=24, spinning=False)
    inner = direct._session._sess = _Counting(direct._session._sess)
    wrapper = _Counting(load(llm_artifact, verify=False).session)
    wrapped = MappedModelRunner(wrapper, direct.spec, 24)
    a, b = _mixed_schedule(direct), _mixed_schedule(wrapped)
    assert inner.calls == wrapper.calls > 9  # every run of both (prefill rows alone, decodes batched)
    for r in a:
        for x, y in zip(a[r], b[r]):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_batched_decode_equals_each_request_alone(llm_artifact):
    runner = ModelRunner.from_artifact(llm_artifact, num_blocks=24, spinning=False)
    bs = runner.spec.block_size
    pasts = [5, 70, 33]
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, runner.spec.vocab, p)) for p in pasts]
    tables = [[0, 1], [2, 3], [4, 5]]
    for p, t in zip(prompts, tables):
        runner.step([p], [list(range(len(p)))], [0], [len(p)], [t])
    ids = [[7], [8], [9]]
    together = runner.step(ids, [[p] for p in pasts], pasts, [1, 1, 1], tables)
    for i, (p, t) in enumerate(zip(pasts, tables)):  # rerun alone: same cache rows (rewritten identically)
        alone = runner.step([ids[i]], [[p]], [p], [1], [t])
        np.testing.assert_allclose(alone[0], together[i], rtol=1e-5, atol=1e-5)
    assert max(pasts) + 1 <= 2 * bs


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_slot_views_are_address_space_not_memory():
    """64 slots x 32k context of views (17 GB of address space) cost the pool's blocks, not their size."""
    before = _rss_bytes()
    kv = MappedKV(
        layers=4, kv_heads=4, head_size=64, block_size=16, num_blocks=8, max_context=32768, slots=64
    )
    try:
        assert 4 * 2 * kv.view_bytes >= 16 * 2**30 and kv.nbytes == 4 * 2 * 4 * 8 * 16 * 64 * 4
        for slot in (0, 63):
            kv.map_table(slot, np.arange(8))
            kv.view(3, 1, slot)[0, :, :128] = 1.0  # write every block through the views
        assert kv.pool[3, 1].min() == 1.0 and not kv.pool[3, 0].any()
        assert _rss_bytes() - before < 32 * 2**20
    finally:
        kv.close()
