"""``seq2seq.json``: the contract between the encoder-decoder compiler and the runtime's Seq2SeqEngine.

    out/seq2seq.json        this block (typed, strict: an unknown key is exit 3 naming it)
    out/encoder/            a complete precast artifact (its own manifest, sha256 of each file, parity)
    out/decoder/            the decoder step graph's artifact (the engine's paged self-attention K/V)
    out/tokenizer/...       tokenizer.json, generation_config.json, preprocessor_config.json (Whisper)

The part folders have fixed names (nothing in the file chooses a path); ``files`` holds the sha256 of every
top-level file and of each part's manifest.json, checked before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from precast.artifact.schema import Record
from precast.errors import ArtifactError

__all__ = ["PARTS", "SEQ2SEQ_FILE", "SEQ2SEQ_SCHEMA", "Seq2SeqSpec"]

SEQ2SEQ_FILE = "seq2seq.json"
SEQ2SEQ_SCHEMA = "precast.seq2seq/1"
PARTS = ("encoder", "decoder")
TASKS = ("text2text-generation", "automatic-speech-recognition")
_LIMITS = {
    "layers": 1024,
    "heads": 1024,
    "head_size": 1024,
    "vocab": 1 << 22,
    "block_size": 4096,
    "max_target": 1 << 16,
    "max_source": 1 << 20,
}


@dataclass(frozen=True)
class Seq2SeqSpec(Record):
    schema: str
    precast_version: str
    task: str
    model_type: str
    input: str  # "text" (token ids + attention mask) | "speech" (log-mel features)
    layers: int
    heads: int
    head_size: int
    vocab: int
    block_size: int
    pad_id: int
    max_target: int
    max_source: int
    files: dict  # artifact-relative path -> sha256 (top-level files and each part's manifest.json)
    parity: dict  # the end-to-end check: tokens generated vs transformers' generate()

    WRITE_NONE: ClassVar[bool] = False

    @classmethod
    def from_json(cls, obj: object, where: str = "artifact", path: str = "") -> Seq2SeqSpec:
        return super().from_json(obj, f"{where}/{SEQ2SEQ_FILE}", path)

    def validate(self, where: str) -> None:
        if self.schema != SEQ2SEQ_SCHEMA:
            raise ArtifactError(f"{where}: schema must be '{SEQ2SEQ_SCHEMA}', got {self.schema!r}")
        if self.task not in TASKS:
            raise ArtifactError(f"{where}: task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.input not in ("text", "speech"):
            raise ArtifactError(f"{where}: input must be 'text' or 'speech', got {self.input!r}")
        if (self.input == "speech") != (self.task == "automatic-speech-recognition"):
            raise ArtifactError(f"{where}: task {self.task!r} does not take input {self.input!r}")
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if not 1 <= value <= limit:
                raise ArtifactError(f"{where}: {name} must be in [1, {limit}], got {value}")
        if not 0 <= self.pad_id < self.vocab:
            raise ArtifactError(f"{where}: pad_id must be a token id in [0, {self.vocab}), got {self.pad_id}")
        for rel, digest in self.files.items():
            if not isinstance(rel, str) or not isinstance(digest, str) or len(digest) != 64:
                raise ArtifactError(f"{where}: files[{rel!r}] must map a path to a sha256 hex digest")
