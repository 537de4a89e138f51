"""The ort-cpu step contract computed by an OpenVINO PagedAttention step IR: a compile's sample step and the
parity feeds ``precast verify`` re-runs are that contract (paged: pool + tables + padded rows; mapped: per-request
views), not the IR's own inputs.

``ContractStep`` copies each row's past K/V into an OVStepRunner pool, runs the row's S tokens (padding included,
at the positions given, as the reference does) and reads the new K/V back out of the pool, so logits and every
new K/V row compare with the torch reference. The pool is f32 here whatever the artifact's KV_CACHE_PRECISION
(past K/V must be written exactly): a u8 / f16 pool's own effect is its top-1 on text. bf16 compute on a CPU
that has it needs a bf16 pool (OpenVINO's PagedAttention refuses f32 there): past K/V are then rounded to
bf16 on the way in, and the budget, not fp32 tolerances, holds such an artifact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from precast.artifact.llm_spec import LLMSpec
from precast.runtime.llm.runners.openvino import OVStepRunner, step_feeds

__all__ = ["ContractStep"]


class ContractStep:
    """``feeds -> outputs`` of the ort-cpu step contract, computed by the artifact's IR (see the docstring)."""

    def __init__(self, root: Path, block, spec: LLMSpec, threads: int | None = None):
        """``block``: the artifact's OpenVINOBlock (its IR and config; the KV precision is set to f32)."""
        import openvino as ov

        from precast.runtime.backends.openvino import (
            _checked_config,
            restore_paged_attention_info,
        )

        core = ov.Core()
        core.get_property("CPU", "FULL_DEVICE_NAME")  # registers PagedAttentionExtension for read_model
        xml = Path(root) / block.model_file
        model = core.read_model(str(xml))
        restore_paged_attention_info(model, str(xml))
        config = _checked_config(Path(root), block.config)
        self.bf16 = config.get("INFERENCE_PRECISION_HINT") == "bf16" and "BF16" in core.get_property(
            "CPU", "OPTIMIZATION_CAPABILITIES"
        )
        config["KV_CACHE_PRECISION"] = "bf16" if self.bf16 else "f32"
        if threads:
            config["INFERENCE_NUM_THREADS"] = str(threads)
        self.compiled = core.compile_model(model, "CPU", config)
        self.spec, self.root = spec, Path(root)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec = self.spec
        ids, pos = np.asarray(feeds["input_ids"]), np.asarray(feeds["positions"])
        b, s = ids.shape
        mapped = "seqlens_k" in feeds
        if mapped:
            past = (np.asarray(feeds["seqlens_k"]).astype(np.int64) - s + 1).tolist()
        else:
            past = np.asarray(feeds["past_lens"]).tolist()
        if "last_index" in feeds:  # [B,Q]: the rows whose logits come back (several: a multi-logits graph)
            last = np.asarray(feeds["last_index"]).reshape(b, -1).tolist()
        else:
            last = (np.asarray(feeds["new_lens"]) - 1)[:, None].tolist()
        names = ("past_key", "past_value") if mapped else ("key_cache", "value_cache")
        bs = spec.block_size
        per_row = [-(-(p + s) // bs) for p in past]
        tables, start = [], 0
        for n in per_row:
            tables.append(list(range(start, start + n)))
            start += n
        runner = OVStepRunner(self.compiled, spec, max(start, 1), self.root)
        pools = (runner.key_cache, runner.value_cache)
        if self.bf16:  # (ov.Tensor.data shows bf16 as float16: the bits are bf16's)
            pools = tuple([p.view(np.uint16) for p in kind] for kind in pools)
        put = _to_bf16 if self.bf16 else (lambda x: x)
        get = _from_bf16 if self.bf16 else (lambda x: x)
        for i in range(spec.layers):
            for kind, name in enumerate(names):
                pasts = self._pasts(feeds, f"{name}.{i}", past, mapped)
                for r, (p, table) in enumerate(zip(past, tables)):
                    _write_rows(pools[kind][i], table, bs, 0, put(pasts[r][:, :p]))
        step = step_feeds([ids[r].tolist() for r in range(b)], past, tables, bs)
        step["positions"] = np.ascontiguousarray(pos.reshape(1, -1), dtype=np.int64)  # pads at 0, as given
        step["logits_indices"] = np.array([r * s + j for r in range(b) for j in last[r]], dtype=np.int64)
        out = {"logits": runner.run_step(step)}
        for i in range(spec.layers):
            for kind, name in enumerate(("key", "value")):
                new = np.stack([get(_read_rows(pools[kind][i], t, bs, p, s)) for t, p in zip(tables, past)])
                if mapped:  # present = the view with the new rows written in (rows past them: don't care)
                    view = np.array(feeds[f"{names[kind]}.{i}"], dtype=np.float32, copy=True)
                    for r, p in enumerate(past):
                        view[r][:, p : p + s] = new[r]
                    out[f"present_{name}.{i}"] = view
                else:
                    out[f"new_{name}.{i}"] = new
        return out

    @staticmethod
    def _pasts(feeds, name: str, past: list[int], mapped: bool) -> list[np.ndarray]:
        """Each row's past K or V [KV, P, D] as the feeds hold it (views, or the pool through the tables)."""
        pool = np.asarray(feeds[name], dtype=np.float32)
        if mapped:
            return [pool[r] for r in range(len(past))]
        tables = np.asarray(feeds["block_tables"])
        rows = []
        for r in range(len(past)):
            blocks = pool[tables[r]]  # [MAXB, KV, bs, D]
            rows.append(blocks.transpose(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[3]))
        return rows


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _write_rows(pool: np.ndarray, table: list[int], bs: int, start: int, rows: np.ndarray) -> None:
    """rows [KV, n, D] into positions start.. of the request whose blocks are ``table``."""
    for t in range(rows.shape[1]):
        p = start + t
        pool[table[p // bs], :, p % bs] = rows[:, t]


def _read_rows(pool: np.ndarray, table: list[int], bs: int, start: int, n: int) -> np.ndarray:
    return np.stack([pool[table[(start + t) // bs], :, (start + t) % bs] for t in range(n)], axis=1)
