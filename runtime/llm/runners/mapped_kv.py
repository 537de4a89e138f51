"""A paged KV pool whose block tables are applied by the MMU: GroupQueryAttention reads it in place.

    pool (one shared-memory file, the physical blocks)       slot views (virtual, one per running request)
    [L, K/V, KV heads, NB blocks, block_size, D]             layer l, K:  [slots, KV, C, D]  (C = max context)
                                                              slot s, head h, rows j*bs .. j*bs+bs-1
       block 7 of (l, K, h)  <------- mmap(MAP_FIXED) -------  = block table[s][j]

ONNX Runtime's CPU GroupQueryAttention reads a request's past as one contiguous [KV, C, D] run, and it
writes the new tokens' K/V in place when its past and present are the same buffer (what
onnxruntime-genai does, with one max-length buffer per request). A paged pool needs neither a gather
nor a scatter if each request's virtual view maps, block by block, onto the pool's pages: the step
binds slot views as both past and present, attention reads the blocks where they lie, and the new
K/V land in the request's own blocks. This is vAttention's idea (Prabhu et al., 2024: paging through
virtual memory so unmodified attention kernels read paged KV) on a CPU: the page table is the block table.

Memory: the pool file holds NB blocks (what the engine hands out); slot views are address space only
(read-only zero pages until a block is mapped there), so memory grows with blocks, not slots x C.
A block's bytes per (layer, K/V, head) are ``block_size * D * itemsize``, which must be a whole number
of pages (``page_block_size`` picks the block size). Prefix sharing needs nothing new: two requests'
views simply map the same pool block.

Linux only (memfd_create, mmap through libc); numpy + the standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import weakref

import numpy as np

from precast.errors import InputError, PrecastError, TargetUnavailableError

__all__ = ["MappedKV", "mapped_kv_supported", "page_block_size"]

_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_libc = None


def mapped_kv_supported() -> str | None:
    """None when this host can map KV blocks, else why not."""
    if not sys.platform.startswith("linux"):
        return f"the mapped KV pool needs Linux (memfd + mmap), this host is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "the mapped KV pool needs os.memfd_create"
    return None


def _c():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def page_block_size(head_size: int, itemsize: int = 4, at_least: int = 16) -> int:
    """The smallest block size >= ``at_least`` whose per-head K (or V) bytes fill whole pages."""
    row = head_size * itemsize
    step = mmap.PAGESIZE // np.gcd(row, mmap.PAGESIZE)  # tokens per page boundary
    return int(-(-at_least // step) * step)


def _mmap(addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _c().mmap(addr, length, prot, flags, fd, offset)
    if got is None or got == ctypes.c_void_p(-1).value or (flags & _MAP_FIXED and got != addr):
        err = ctypes.get_errno()
        hint = " (too many mappings? raise vm.max_map_count)" if err == 12 else ""
        raise PrecastError(f"mapping KV memory failed: {os.strerror(err)}{hint}")
    return got


class MappedKV:
    """The pool file and the slot views of every layer's K and V (see the module docstring)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_size: int,
        block_size: int,
        num_blocks: int,
        max_context: int,
        slots: int,
        dtype=np.float32,
    ):
        why = mapped_kv_supported()
        if why:
            raise TargetUnavailableError(why)
        self.dtype = np.dtype(dtype)
        self.layers, self.kv_heads, self.head_size = layers, kv_heads, head_size
        self.block_size, self.num_blocks, self.slots = block_size, num_blocks, slots
        self.chunk = block_size * head_size * self.dtype.itemsize  # bytes of one (layer, K/V, head, block)
        if self.chunk % mmap.PAGESIZE:
            raise InputError(
                f"block_size {block_size} x head_size {head_size} is not a whole number of {mmap.PAGESIZE}-byte pages"
            )
        self.blocks_per_slot = -(-max_context // block_size)
        self.context = self.blocks_per_slot * block_size  # C: the views' sequence length
        pool_bytes = layers * 2 * kv_heads * num_blocks * self.chunk
        self._fd = os.memfd_create("precast-kv", getattr(os, "MFD_CLOEXEC", 1))
        os.ftruncate(self._fd, pool_bytes)
        self._pool_map = mmap.mmap(self._fd, pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.pool = np.frombuffer(self._pool_map, dtype=self.dtype).reshape(
            layers, 2, kv_heads, num_blocks, block_size, head_size
        )
        # Address space for every slot view: read-only zero pages until blocks are mapped in.
        self.view_bytes = slots * kv_heads * self.context * head_size * self.dtype.itemsize  # one layer's K
        total = layers * 2 * self.view_bytes
        self._base = _mmap(0, total, _PROT_READ, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        self._finalizer = weakref.finalize(self, _release, self._base, total, self._fd)
        self._head_stride = self.context * head_size * self.dtype.itemsize
        self._slot_stride = kv_heads * self._head_stride
        # mapped[s][j]: pool block mapped at block position j of slot s (-1: none)
        self.mapped = np.full((slots, self.blocks_per_slot), -1, dtype=np.int64)
        self.mmap_calls = 0

    # -- addresses --------------------------------------------------------------------------------------
    def view_address(self, layer: int, kind: int, slot: int) -> int:
        """Address of slot ``slot`` in the [slots, KV, C, D] view of layer ``layer``'s K (kind 0) or V (1)."""
        return self._base + (layer * 2 + kind) * self.view_bytes + slot * self._slot_stride

    def view(self, layer: int, kind: int, slot: int, rows: int = 1) -> np.ndarray:
        """numpy view [rows, KV, C, D] of slots slot .. slot+rows-1 (what the graph sees)."""
        n = rows * self.kv_heads * self.context * self.head_size
        buf = (ctypes.c_char * (n * self.dtype.itemsize)).from_address(self.view_address(layer, kind, slot))
        return np.frombuffer(buf, dtype=self.dtype).reshape(rows, self.kv_heads, self.context, self.head_size)

    # -- block tables -> page tables --------------------------------------------------------------------
    def map_table(self, slot: int, table, ahead: int = 0) -> int:
        """Make block positions 0 .. len(table)-1 of ``slot`` map ``table``; returns mmap calls made.

        Only positions whose block changed are remapped, and runs of consecutive pool blocks go in one
        call per (layer, K/V, head). ``ahead``: a run that ends the table also maps up to that many next
        blocks at the next positions (the blocks a sequence is likely to get next, see
        BlockPool.allocate): nothing reads or writes a view past its table, and a guess that turns out
        wrong is remapped when the table gets there.
        """
        table = np.asarray(table, dtype=np.int64)
        n_tab = len(table)
        changed = np.flatnonzero(self.mapped[slot, :n_tab] != table)
        if changed.size == 0:
            return 0
        calls = 0
        i = 0
        while i < changed.size:  # group into runs: consecutive positions holding consecutive blocks
            j0 = int(changed[i])
            n = 1
            while i + n < changed.size and changed[i + n] == j0 + n and table[j0 + n] == table[j0] + n:
                n += 1
            first = int(table[j0])
            extra = 0
            if j0 + n == n_tab:  # the table's tail: map the likely next blocks too
                extra = max(0, min(ahead, self.blocks_per_slot - n_tab, self.num_blocks - first - n))
            calls += self._map_run(slot, j0, first, n + extra)
            self.mapped[slot, j0 : j0 + n + extra] = np.arange(first, first + n + extra)
            i += n
        return calls

    def _map_run(self, slot: int, pos: int, block: int, n: int) -> int:
        if block < 0 or block + n > self.num_blocks:
            raise InputError(
                f"block ids {block}..{block + n - 1} outside the pool's {self.num_blocks} blocks"
            )
        length = n * self.chunk
        flags = _MAP_SHARED | _MAP_FIXED
        prot = _PROT_READ | _PROT_WRITE
        for layer in range(self.layers):
            for kind in (0, 1):
                base = self.view_address(layer, kind, slot) + pos * self.chunk
                fbase = ((layer * 2 + kind) * self.kv_heads * self.num_blocks + block) * self.chunk
                for h in range(self.kv_heads):
                    _mmap(
                        base + h * self._head_stride,
                        length,
                        prot,
                        flags,
                        self._fd,
                        fbase + h * self.num_blocks * self.chunk,
                    )
        calls = self.layers * 2 * self.kv_heads
        self.mmap_calls += calls
        return calls

    def close(self) -> None:
        self._finalizer()

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (the blocks); the slot views add address space, not memory."""
        return self.pool.nbytes


def _release(base: int, total: int, fd: int) -> None:
    _c().munmap(base, total)
    os.close(fd)
