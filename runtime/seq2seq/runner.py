"""Seq2SeqRunner: the encoder and the decoder step of a seq2seq artifact over numpy pools.

    encode(feeds)  -> per request: each layer's cross K and V [H, E_b, D] (its own source length E_b)
    step(ids, positions, past_lens, new_lens, block_tables, cross) -> logits [B, V]
        self-attention K/V: the paged pools ``[L, NB, H, block_size, D]`` (blocks from the engine's BlockPool);
        the graph gathers each row's blocks and returns the new tokens' K/V, scattered here into their slots.
        cross: a CrossBatch (every layer's [B, H, E, D] K and V, and encoder_mask [B, E]) of the rows.

Both parts are ordinary precast artifacts loaded through the HAL (runtime.load: sha256 of every file, the
best target this host runs). The decoder graph's inputs must be exactly the step contract's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.artifact.seq2seq_spec import SEQ2SEQ_FILE, Seq2SeqSpec
from precast.errors import ArtifactError
from precast.runtime.llm.runners.gather import new_slots

__all__ = ["CrossBatch", "Seq2SeqRunner", "decoder_inputs"]


def decoder_inputs(layers: int) -> list[str]:
    head = ["input_ids", "positions", "past_lens", "new_lens", "block_tables"]
    pools = [f"key_cache.{i}" for i in range(layers)] + [f"value_cache.{i}" for i in range(layers)]
    cross = [f"cross_key.{i}" for i in range(layers)] + [f"cross_value.{i}" for i in range(layers)]
    return [*head, *pools, *cross, "encoder_mask"]


@dataclass
class CrossBatch:
    """The cross-attention inputs of one step's rows (stacked from each request's CrossState)."""

    keys: list  # per layer [B, H, E, D]
    values: list
    mask: np.ndarray  # [B, E] int64


class Seq2SeqRunner:
    def __init__(
        self, root: Path, spec: Seq2SeqSpec, num_blocks: int, threads: int | None = None, verify: bool = True
    ):
        from precast.runtime.model import load

        self.spec = spec
        # The encoder's threads do not spin after a run: they would take the cores from the decoder steps that
        # follow it (Whisper-tiny, 30 s, 64 tokens: 0.52 s a transcription instead of 0.61). The decoder's spin:
        # its many short steps would each pay a thread wake-up (0.56 s without).
        self.encoder = load(root / "encoder", threads=threads, verify=verify, spinning=False)
        self.decoder = load(root / "decoder", threads=threads, verify=verify)
        self._check(root)
        self.num_blocks = int(num_blocks)
        shape = (spec.layers, self.num_blocks, spec.heads, spec.block_size, spec.head_size)
        self.k_pool = np.zeros(shape, dtype=np.float32)  # lazily backed: pages appear when written
        self.v_pool = np.zeros(shape, dtype=np.float32)
        self._outputs = ["logits"] + [f"new_{kv}.{i}" for i in range(spec.layers) for kv in ("key", "value")]

    def _check(self, root: Path) -> None:
        where = f"{root}/decoder"
        names = {
            i.name for i in self.decoder.inputs
        }  # (the manifest's io, checked against the session at load)
        want = set(decoder_inputs(self.spec.layers))
        if names != want:
            extra = sorted(names ^ want)[0]
            raise ArtifactError(
                f"{where}: the step graph does not match seq2seq.json (layers={self.spec.layers}): input {extra!r}"
            )
        outs = {o.name for o in self.encoder.outputs}
        for i in range(self.spec.layers):
            for name in (f"cross_key.{i}", f"cross_value.{i}"):
                if name not in outs:
                    raise ArtifactError(f"{root}/encoder: the encoder has no output {name!r}")
        # every size the engine allocates by must be the graphs' (seq2seq.json is untrusted data)
        spec, dec = self.spec, {t.name: t.shape for t in (*self.decoder.inputs, *self.decoder.outputs)}
        enc = {t.name: t.shape for t in (*self.encoder.inputs, *self.encoder.outputs)}
        want = {
            ("decoder", "key_cache.0", 1): ("heads", spec.heads),
            ("decoder", "key_cache.0", 2): ("block_size", spec.block_size),
            ("decoder", "key_cache.0", 3): ("head_size", spec.head_size),
            ("decoder", "logits", 1): ("vocab", spec.vocab),
            ("encoder", "cross_key.0", 1): ("heads", spec.heads),
            ("encoder", "cross_key.0", 3): ("head_size", spec.head_size),
        }
        if spec.input == "speech":
            want[("encoder", "input_features", 2)] = ("max_source", spec.max_source)
        elif "input_ids" not in enc:
            raise ArtifactError(f"{root}/{SEQ2SEQ_FILE}: input 'text', but the encoder takes no input_ids")
        for (part, name, axis), (key, value) in want.items():
            shape = (dec if part == "decoder" else enc).get(name)
            dim = shape[axis] if shape is not None and len(shape) > axis else None
            if not isinstance(dim, int) or dim != value:
                raise ArtifactError(
                    f"{root}/{SEQ2SEQ_FILE} does not match the {part} graph: {key}={value}, but its {name!r} "
                    f"has {dim} at axis {axis}"
                )

    @property
    def kv_bytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes

    def encode(self, feeds: dict[str, np.ndarray], lengths: list[int]) -> list[tuple[list, list]]:
        """The encoder on a batch; -> per request (keys, values): each layer's [H, E_b, D], E_b = lengths[b]."""
        names = [f"cross_{kv}.{i}" for i in range(self.spec.layers) for kv in ("key", "value")]
        out = _run(self.encoder.session, names, feeds, "the encoder")
        keys, values = out[0::2], out[1::2]
        return [
            (
                [np.ascontiguousarray(k[b, :, :n]) for k in keys],
                [np.ascontiguousarray(v[b, :, :n]) for v in values],
            )
            for b, n in enumerate(lengths)
        ]

    def copy_block(self, src: int, dst: int) -> None:
        self.k_pool[:, dst] = self.k_pool[:, src]
        self.v_pool[:, dst] = self.v_pool[:, src]

    def step(self, ids, pos, past, new, tables, cross: CrossBatch) -> np.ndarray:
        layers = self.spec.layers
        feeds = {
            "input_ids": ids,
            "positions": pos,
            "past_lens": past,
            "new_lens": new,
            "block_tables": tables,
        }
        for i in range(layers):
            feeds[f"key_cache.{i}"] = self.k_pool[i]
            feeds[f"value_cache.{i}"] = self.v_pool[i]
            feeds[f"cross_key.{i}"] = cross.keys[i]
            feeds[f"cross_value.{i}"] = cross.values[i]
        feeds["encoder_mask"] = cross.mask
        out = _run(self.decoder.session, self._outputs, feeds, "the decoder step")
        b_idx, s_idx, blocks, offsets = new_slots(ids.shape[1], past, new, tables, self.spec.block_size)
        self.k_pool[:, blocks, :, offsets] = np.stack(out[1::2])[:, b_idx, :, s_idx]
        self.v_pool[:, blocks, :, offsets] = np.stack(out[2::2])[:, b_idx, :, s_idx]
        return out[0]


def _run(session, names: list[str], feeds: dict, what: str) -> list:
    """A backend run; its failure (an input the graph cannot take: a source longer than the encoder's position
    table, say) is the request's error, one line, not the engine's crash."""
    from precast.errors import InputError, PrecastError, first_line

    try:
        return session.run(names, feeds)
    except PrecastError:
        raise
    except Exception as e:
        raise InputError(f"{what} failed on this input: {first_line(e)}") from e
