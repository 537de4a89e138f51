"""KV cache memory as a size (``--kv-cache-memory 2GiB``) -> blocks of the artifact's KV pool.

One block holds ``block_size`` tokens of K and V for every layer and KV head, in float32 (what both model
runners allocate):  layers x kv_heads x block_size x (K + V head size) x 4 bytes (V 0 for latent attention).
A hybrid model's recurrent state slots come out of the same size first. A ``mapped`` pool may round
the block size up to whole pages on this host (mapped_kv.page_block_size), and is sized with that.
"""

from __future__ import annotations

import mmap
import re

from precast.errors import UsageError

__all__ = ["KV_ITEMSIZE", "block_bytes", "blocks_for_memory", "parse_size"]

KV_ITEMSIZE = 4  # float32 K/V pools
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '4096B' -> bytes; anything else (no unit, negative, 'lots') -> UsageError."""
    m = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise UsageError(
            f"not a memory size: {text!r} (write a number and a unit: 512MiB, 2GiB, 1.5GB; units B, KB, MB, "
            "GB, TB, KiB, MiB, GiB, TiB)"
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise UsageError(f"memory size must be at least 1 byte, got {text!r}")
    return n


def block_bytes(spec) -> int:
    """Bytes of one KV block of ``spec`` (an LLMSpec) on this host."""
    block_size = spec.block_size
    if spec.kv_layout == "mapped" and (block_size * spec.head_size * KV_ITEMSIZE) % mmap.PAGESIZE:
        from precast.runtime.llm.runners.mapped_kv import page_block_size

        block_size = page_block_size(spec.head_size, at_least=block_size)
    value = getattr(spec, "value_head_size", spec.head_size)  # (latent attention: 0, no V pool)
    return spec.layers * spec.kv_heads * block_size * (spec.head_size + value) * KV_ITEMSIZE


def blocks_for_memory(spec, nbytes: int, max_num_seqs: int = 64) -> int:
    """The most KV blocks that fit in ``nbytes`` (at least one, else UsageError) beside a hybrid model's
    recurrent state slots (one per request at once: ``max_num_seqs`` x its state bytes). A pool smaller than
    the context still serves short requests; a prompt too long for it is a 400."""
    per_block = block_bytes(spec)
    states = max_num_seqs * int(getattr(spec, "state_bytes", 0) or 0)
    if per_block == 0:  # a state-space model: no K/V to size
        raise UsageError(
            f"--kv-cache-memory sizes a K/V cache and '{spec.model_type}' has none: each running request holds "
            f"{spec.state_bytes} bytes of recurrent state (--max-num-seqs {max_num_seqs}: {states} bytes)"
        )
    if states and nbytes - states < per_block:
        raise UsageError(
            f"--kv-cache-memory {nbytes} bytes holds the recurrent state slots ({max_num_seqs} requests x "
            f"{spec.state_bytes} bytes = {states}) and no KV block of {per_block} bytes beside them"
        )
    blocks = (nbytes - states) // per_block
    if blocks < 1:
        raise UsageError(
            f"--kv-cache-memory {nbytes} bytes holds no KV block (one block is {per_block} bytes: "
            f"{spec.layers} layers x {spec.kv_heads} KV heads x block {spec.block_size} x (K head {spec.head_size} "
            f"+ V head {getattr(spec, 'value_head_size', spec.head_size)}) x {KV_ITEMSIZE} bytes)"
        )
    return int(blocks)
