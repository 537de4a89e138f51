"""The manifest's ``llm`` block: the contract between the causal-LM compiler and the runtime engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from precast.artifact.schema import Record
from precast.errors import ArtifactError

if TYPE_CHECKING:
    from precast.artifact.manifest import Manifest

__all__ = ["LLMSpec", "KV_LAYOUTS", "LIMITS", "DEFAULT_POOL_BYTES", "StateSpec"]

# "ov-paged": OpenVINO's PagedAttention reads and writes the pool itself (runtime/llm/runners/openvino.py): no KV outputs.
KV_LAYOUTS = ("paged", "mapped", "ov-paged")
_INT32_MAX = 2**31 - 1
_SIZES = ("layers", "heads", "kv_heads", "head_size", "hidden", "vocab", "max_context", "block_size")
# The most each size may be (the block is untrusted data; every model precast compiles is far inside these).
# What the runtime sizes from them: the mapped layout reserves slots x max_context rows of address space per
# layer and a [slots, max_context / block_size] table; a runner's logits buffer is [rows, vocab].
LIMITS = {
    "layers": 1024,
    "heads": 1024,
    "kv_heads": 1024,
    "head_size": 1024,
    "hidden": 1 << 17,
    "vocab": 1 << 22,
    "max_context": 1 << 20,
    "block_size": 4096,
}
# The KV pool when the caller sizes none (Engine.load / the runners' num_blocks=None; `precast serve` without
# --num-blocks or --kv-cache-memory): 4 full-context requests, but at most this many bytes of float32 K/V.
DEFAULT_POOL_REQUESTS = 4
DEFAULT_POOL_BYTES = 4 << 30


STATE_KINDS = ("conv", "ssm")
# The most float32 elements one request's recurrent state of one layer may hold (Falcon-H1-34B's SSM state is
# 1.3 M; the runner reserves slots x this per state)
STATE_MAX_ELEMENTS = 1 << 24
STATE_MAX_BYTES = 1 << 30  # all of one request's states


@dataclass(frozen=True)
class StateSpec(Record):
    """One recurrent state of the step graph (a hybrid or state-space model): input ``name`` [B, *shape]
    float32, output ``new_`` + name, held per request in a slot (docs/llm-step-contract.md)."""

    name: str
    layer: int
    kind: str
    shape: tuple[int, ...]

    def validate(self, where: str) -> None:
        if self.kind not in STATE_KINDS:
            raise ArtifactError(f"{where}: state {self.name!r}: kind must be one of {', '.join(STATE_KINDS)}")
        if not self.shape or any(d < 1 for d in self.shape):
            raise ArtifactError(
                f"{where}: state {self.name!r}: shape must be positive sizes, got {list(self.shape)}"
            )
        if self.elements > STATE_MAX_ELEMENTS:
            raise ArtifactError(
                f"{where}: state {self.name!r}: {self.elements} elements per request, at most {STATE_MAX_ELEMENTS}"
            )
        if not 0 <= self.layer <= LIMITS["layers"]:
            raise ArtifactError(f"{where}: state {self.name!r}: layer must be in [0, {LIMITS['layers']}]")

    @property
    def output(self) -> str:
        return f"new_{self.name}"

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LLMSpec(Record):
    """The ``llm`` block: model sizes, the KV layout and its per-layer (key, value) input/output names,
    token ids and the tokenizer file. Every key is always written (``bos_id`` / ``model_type`` may be null)."""

    architecture: str
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    hidden: int
    vocab: int
    max_context: int
    block_size: int
    kv_layout: str
    kv_inputs: tuple[tuple[str, str], ...]
    kv_outputs: tuple[tuple[str, str], ...]
    bos_id: int | None
    pad_id: int
    tokenizer: str
    eos_ids: tuple[int, ...] = ()
    model_type: str | None = None
    batched_prefill: bool = True  # False: the graph takes S > 1 only with B == 1 (fused GroupQueryAttention)
    # True: the graph returns logits for several tokens of a row (last_index [B,Q] -> logits [B*Q,V]; OpenVINO:
    # logits_indices lists them): speculative decoding verifies its draft tokens in one step. Older artifacts:
    # one row per request.
    multi_logits: bool = False
    # Recurrent states (Mamba / Mamba2 mixers, short convolutions, gated delta nets): per request a slot, not
    # blocks. A state-space model has none of the K/V above: ``layers`` 0, no kv_inputs / kv_outputs.
    states: tuple[StateSpec, ...] = ()
    # V's head size when it differs from K's (None: head_size). 0: no V pool: multi-head latent attention
    # (DeepSeek) stores each token's compressed latent and rotary key as its one K head, and the attention
    # reads its values from that latent (docs/llm-step-contract.md)
    value_size: int | None = None

    WRITE_NONE: ClassVar[bool] = True

    @classmethod
    def from_json(cls, obj: object, where: str = "artifact", path: str = "") -> LLMSpec:
        """``where``: the file; errors say "<where>: llm block: ..."."""
        return super().from_json(obj, f"{where}: llm block", path)

    @classmethod
    def from_manifest(cls, manifest: Manifest, where: str = "artifact") -> LLMSpec:
        """The manifest's ``llm`` block (read and checked with the manifest), or exit 3 when it has none."""
        if manifest.llm is None:
            raise ArtifactError(f"{where}: manifest has no 'llm' block (compile with --task causal-lm)")
        return manifest.llm

    def to_json(self) -> dict:
        out = super().to_json()
        if not self.multi_logits:  # (left out: a manifest written before it reads and writes back the same)
            out.pop("multi_logits")
        if not self.states:
            out.pop("states")
        if self.value_size is None:
            out.pop("value_size")
        return out

    @property
    def value_head_size(self) -> int:
        """The V pool's head size (0: none)."""
        return self.head_size if self.value_size is None else self.value_size

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's recurrent states (all layers; 0 without any)."""
        return 4 * sum(st.elements for st in self.states)

    def validate(self, where: str) -> None:
        for name in _SIZES:  # (a 0 block_size would divide by zero later)
            if name == "layers" and self.layers == 0 and self.states:
                continue  # a state-space model: no K/V layers
            if getattr(self, name) < 1:
                raise ArtifactError(
                    f"{where}: {name} must be a positive integer, got {getattr(self, name)!r}"
                )
        # sizes and ids go into int32/int64 arrays: a larger JSON integer was an OverflowError at load
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id or 0}
        ids.update({f"eos_ids[{i}]": e for i, e in enumerate(self.eos_ids)})
        for name, value in [*((n, getattr(self, n)) for n in _SIZES), *ids.items()]:
            if abs(value) > _INT32_MAX:
                raise ArtifactError(f"{where}: {name} must be at most {_INT32_MAX}, got {value}")
        for name, limit in LIMITS.items():  # (the runners size memory from these: absurd ones were an OOM)
            if getattr(self, name) > limit:
                raise ArtifactError(f"{where}: {name} must be at most {limit}, got {getattr(self, name)}")
        if self.kv_heads > self.heads:
            raise ArtifactError(f"{where}: kv_heads ({self.kv_heads}) must be at most heads ({self.heads})")
        for name in ("pad_id", "bos_id"):  # token ids the runners feed the graph
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab:
                raise ArtifactError(
                    f"{where}: {name} must be a token id in [0, vocab={self.vocab}), got {value}"
                )
        outputs = 0 if self.kv_layout == "ov-paged" else self.layers
        if (
            self.kv_layout not in KV_LAYOUTS
            or len(self.kv_inputs) != self.layers
            or len(self.kv_outputs) != outputs
        ):
            raise ArtifactError(
                f"{where}: expected a KV layout of {', '.join(KV_LAYOUTS)} with {self.layers} layers of KV "
                f"input names and {outputs} of KV output names"
            )
        if self.value_size is not None and not 0 <= self.value_size <= self.head_size:
            raise ArtifactError(
                f"{where}: value_size must be in [0, head_size={self.head_size}], got {self.value_size}"
            )
        if self.value_size is not None and self.kv_layout != "paged":
            raise ArtifactError(f"{where}: value_size needs kv_layout 'paged', got {self.kv_layout!r}")
        if self.states:
            names = [st.name for st in self.states]
            kv = {n for pair in (*self.kv_inputs, *self.kv_outputs) for n in pair}
            if len(set(names)) != len(names) or kv & {*names, *(st.output for st in self.states)}:
                raise ArtifactError(f"{where}: state names must be distinct and not K/V names, got {names}")
            if self.kv_layout != "paged":
                raise ArtifactError(
                    f"{where}: recurrent states need kv_layout 'paged', got {self.kv_layout!r}"
                )
            if self.state_bytes > STATE_MAX_BYTES:
                raise ArtifactError(
                    f"{where}: {self.state_bytes} bytes of recurrent state per request, at most {STATE_MAX_BYTES}"
                )

    def check_logits_shape(self, shape, where: str) -> None:
        """The step graph's logits shape (ints static, anything else dynamic): its last dim, where the graph
        fixes it, must be ``vocab`` (the runners size their logits buffers and check token ids by it)."""
        dim = shape[-1] if shape else None
        if isinstance(dim, int) and not isinstance(dim, bool) and dim != self.vocab:
            dims = ", ".join("?" if d is None else str(d) for d in shape)
            raise ArtifactError(
                f"{where} does not match the model: vocab={self.vocab}, but the step graph's logits are "
                f"[{dims}]"
            )

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def default_num_blocks(self) -> int:
        """The KV pool's blocks when the caller sizes none: DEFAULT_POOL_REQUESTS full-context requests,
        capped at DEFAULT_POOL_BYTES of float32 K/V (at least one block). A pool smaller than the context
        still serves shorter requests (the engine caps each request at the pool); size it with num_blocks,
        or `precast serve --num-blocks` / `--kv-cache-memory`."""
        block_bytes = (
            self.layers * self.kv_heads * self.block_size * (self.head_size + self.value_head_size) * 4
        )
        wanted = DEFAULT_POOL_REQUESTS * self.blocks_for(self.max_context)
        if block_bytes == 0:  # a state-space model: blocks only count tokens (64 full-context requests)
            return 64 * self.blocks_for(self.max_context)
        return max(1, min(wanted, DEFAULT_POOL_BYTES // block_bytes))
