"""The manifest's ``llm`` block: the contract between the causal-LM compiler and the runtime engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from precast.runtime.errors import ArtifactError
from precast.runtime.schema import Record

if TYPE_CHECKING:
    from precast.runtime.manifest import Manifest

__all__ = ["LLMSpec", "KV_LAYOUTS"]

# "ov-paged": OpenVINO's PagedAttention reads and writes the pool itself (runtime/llm/ov_runner.py): no KV outputs.
KV_LAYOUTS = ("paged", "mapped", "ov-paged")
_INT32_MAX = 2**31 - 1
_SIZES = ("layers", "heads", "kv_heads", "head_size", "hidden", "vocab", "max_context", "block_size")


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

    def validate(self, where: str) -> None:
        for name in _SIZES:  # (a 0 block_size would divide by zero later)
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

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
