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

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, when its piece spells them (byte-level BPE, or a SentencePiece
        byte-fallback piece like <0xE2>); None otherwise. Alone, such a token may be part of a character."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        table = _byte_level_table()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None


_BYTE_LEVEL: dict[str, int] | None = None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> that byte."""
    global _BYTE_LEVEL
    if _BYTE_LEVEL is None:
        keep = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), 256),
        ]
        chars, extra = {}, 0
        for b in range(256):
            if b in keep:
                chars[chr(b)] = b
            else:
                chars[chr(256 + extra)] = b
                extra += 1
        _BYTE_LEVEL = chars
    return _BYTE_LEVEL
