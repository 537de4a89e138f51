"""The artifact's tokenizer (Hugging Face `tokenizers` file), behind a two-method interface."""

from __future__ import annotations

import os
from collections.abc import Sequence

from precast.runtime.errors import ArtifactError, first_line

__all__ = ["TextTokenizer"]


class TextTokenizer:
    """encode(text) -> ids, decode(ids) -> text. The engine needs nothing else from a tokenizer."""

    def __init__(self, tok):
        self._tok = tok

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TextTokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers is a runtime dependency of LLM artifacts
            raise ArtifactError("LLM artifacts need the 'tokenizers' package: pip install tokenizers") from e
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:
            raise ArtifactError(f"cannot read tokenizer {path}: {first_line(e)}") from e

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # A batch of one, not encode: the same ids, but it releases the GIL while it works (encode holds it:
        # a long prompt would freeze the engine loop and the event loop for seconds). The _fast variant
        # (tokenizers >= 0.20) skips the character offsets, which nothing here reads.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return list(batch([text], add_special_tokens=True)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
